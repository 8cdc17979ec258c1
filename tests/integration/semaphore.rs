//! `Semaphore` on PostgreSQL (`PgLocker::semaphore`): what a try costs,
//! what waiters hold of the pool, the order they are served in, the
//! whole-call timeout, and the bound, checked on a history (with a broken
//! semaphore the checker must catch).

use crate::common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::proxy::Proxy;
use distlock::{Error, PgLocker, Semaphore};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// The semaphore under test: the PostgreSQL path.
pub(crate) fn semaphore(locker: &PgLocker, name: &str, permits: u32) -> Semaphore {
    locker.semaphore(name, permits).expect("a valid semaphore")
}

pub(crate) async fn pool_of(opts: &PgConnectOptions, size: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(2))
        // A health check would be one more round trip per checkout.
        .test_before_acquire(false)
        .connect_with(opts.clone())
        .await
        .expect("pool")
}

/// Takes every permit of `semaphore`.
async fn take_all(semaphore: &Semaphore) -> Vec<distlock::SemaphorePermit> {
    let mut permits = Vec::new();
    while let Some(permit) = semaphore.try_acquire().await.unwrap() {
        permits.push(permit);
    }
    assert_eq!(permits.len(), semaphore.permits() as usize);
    permits
}

/// How long a try of `name` (every permit held) takes through a proxy that
/// holds back every chunk, after a warm-up.
async fn busy_try(opts: &PgConnectOptions, name: &str, permits: u32) -> Duration {
    let proxy = Proxy::start(opts.get_host(), opts.get_port())
        .await
        .expect("proxy");
    let locker = PgLocker::new(pool_of(&proxy.options(opts), 1).await);
    let tried = semaphore(&locker, name, permits);
    // Warm up: the connection's statements are prepared, the pooler probe
    // has run.
    tried
        .try_acquire()
        .await
        .unwrap()
        .expect("free")
        .release()
        .await
        .unwrap();
    let holders = PgLocker::new(pool_of(opts, permits + 1).await);
    let permits = take_all(&semaphore(&holders, name, permits)).await;
    assert!(tried.try_acquire().await.unwrap().is_none(), "all held");
    proxy.delay(Duration::from_millis(60));
    let started = Instant::now();
    assert!(tried.try_acquire().await.unwrap().is_none(), "all held");
    let took = started.elapsed();
    proxy.pass();
    for permit in permits {
        permit.release().await.unwrap();
    }
    took
}

#[sqlx::test(migrations = false)]
async fn a_try_costs_one_round_trip_whatever_the_permits(
    _pool_opts: PgPoolOptions,
    opts: PgConnectOptions,
) {
    // A try of one slot is one lock attempt: the yardstick.
    let one = busy_try(&opts, "sem:rt:1", 1).await;
    let eight = busy_try(&opts, "sem:rt:8", 8).await;
    println!("a busy try: of 1 permit {one:?}, of 8 permits {eight:?}");
    assert!(
        eight < one + one / 2,
        "a try of 8 permits took {eight:?}, a try of 1 took {one:?}"
    );
}

#[sqlx::test(migrations = false)]
async fn waiters_leave_the_pool_to_others(_pool_opts: PgPoolOptions, opts: PgConnectOptions) {
    let pool = pool_of(&opts, 6).await;
    let locker = PgLocker::new(pool.clone());
    let sem = semaphore(&locker, "sem:pool", 2);
    let first = sem.acquire(Duration::from_secs(5)).await.unwrap();
    let second = sem.acquire(Duration::from_secs(5)).await.unwrap();
    let mut waiters = tokio::task::JoinSet::new();
    for _ in 0..3 {
        let sem = sem.clone();
        waiters.spawn(async move {
            let permit = sem.acquire(Duration::from_secs(20)).await?;
            tokio::time::sleep(Duration::from_millis(20)).await;
            permit.release().await
        });
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    // What they keep, not what a try borrows for a round trip (every
    // 200 ms): the fewest in use over a few samples.
    let mut in_use = u32::MAX;
    for _ in 0..10 {
        in_use = in_use.min(pool.size() - u32::try_from(pool.num_idle()).unwrap());
        tokio::time::sleep(Duration::from_millis(7)).await;
    }
    sqlx::query("SELECT 1")
        .execute(&pool)
        .await
        .expect("a plain statement on the pool while three waiters wait");
    // Two permits, and one connection for the process's waiters (the one
    // that holds the queue), however many they are.
    assert!(
        in_use <= 3,
        "two permits and three waiters hold {in_use} connections"
    );
    first.release().await.unwrap();
    second.release().await.unwrap();
    while let Some(done) = waiters.join_next().await {
        done.unwrap().expect("every waiter got its permit");
    }
}

#[sqlx::test(migrations = false)]
async fn waiters_are_served_in_arrival_order_across_pools(
    _pool_opts: PgPoolOptions,
    opts: PgConnectOptions,
) {
    const WAITERS: usize = 5;
    let holder = PgLocker::new(pool_of(&opts, 2).await);
    let held = semaphore(&holder, "sem:fifo", 2);
    let a = held.acquire(Duration::from_secs(5)).await.unwrap();
    let b = held.acquire(Duration::from_secs(5)).await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = tokio::task::JoinSet::new();
    for i in 0..WAITERS {
        // A pool and a locker each, as separate processes have.
        let locker = PgLocker::new(pool_of(&opts, 2).await);
        let order = Arc::clone(&order);
        waiters.spawn(async move {
            let sem = semaphore(&locker, "sem:fifo", 2);
            let permit = sem.acquire(Duration::from_secs(30)).await?;
            order.lock().unwrap().push(i);
            tokio::time::sleep(Duration::from_millis(100)).await;
            permit.release().await
        });
        // Long enough for waiter i to queue before waiter i + 1 arrives.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    a.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    b.release().await.unwrap();
    while let Some(done) = waiters.join_next().await {
        done.unwrap().expect("every waiter got its permit");
    }
    let order = order.lock().unwrap().clone();
    assert_eq!(
        order,
        (0..WAITERS).collect::<Vec<_>>(),
        "served out of order"
    );
}

#[sqlx::test(migrations = false)]
async fn the_timeout_covers_the_whole_call(_pool_opts: PgPoolOptions, opts: PgConnectOptions) {
    const PERMITS: u32 = 5;
    let holders = PgLocker::new(pool_of(&opts, PERMITS + 1).await);
    let permits = take_all(&semaphore(&holders, "sem:timeout", PERMITS)).await;
    let proxy = Proxy::start(opts.get_host(), opts.get_port())
        .await
        .expect("proxy");
    let slow = pool_of(&proxy.options(&opts), 1).await;
    let locker = PgLocker::new(slow);
    let sem = semaphore(&locker, "sem:timeout", PERMITS);
    // Every round trip now takes about 200 ms.
    proxy.delay(Duration::from_millis(100));
    let timeout = Duration::from_secs(1);
    let started = Instant::now();
    let err = sem
        .acquire(timeout)
        .await
        .expect_err("every permit is held");
    let took = started.elapsed();
    println!("acquire({timeout:?}) gave up after {took:?}: {err}");
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!(
        took < timeout + Duration::from_millis(700),
        "acquire({timeout:?}) took {took:?}"
    );
    proxy.pass();
    for permit in permits {
        permit.release().await.unwrap();
    }
}

#[sqlx::test(migrations = false)]
async fn available_permits_counts_the_free_slots(pool: PgPool) {
    let locker = PgLocker::new(pool);
    let sem = semaphore(&locker, "sem:available", 3);
    assert_eq!(sem.available_permits().await.unwrap(), Some(3));
    let one = sem.try_acquire().await.unwrap().expect("free");
    let two = sem.try_acquire().await.unwrap().expect("free");
    assert_eq!((one.slot(), two.slot()), (0, 1), "slots are tried in order");
    assert_eq!(sem.available_permits().await.unwrap(), Some(1));
    one.release().await.unwrap();
    assert_eq!(sem.available_permits().await.unwrap(), Some(2));
    two.release().await.unwrap();
}

/// One entry per permit held: which slot, from when to when (a sequence
/// number per event, so overlap is exact).
#[derive(Debug, Clone, Copy)]
struct Held {
    slot: u32,
    from: u64,
    to: u64,
}

/// What must hold of a history: never more than `permits` holders at once,
/// never one slot held twice at once. `Err` names the first violation.
fn check(history: &[Held], permits: u32) -> Result<usize, String> {
    let mut events: Vec<(u64, i32, u32)> = Vec::new();
    for held in history {
        events.push((held.from, 1, held.slot));
        events.push((held.to, -1, held.slot));
    }
    events.sort_unstable();
    let (mut inside, mut most) = (0_i32, 0_i32);
    let mut slots: HashMap<u32, i32> = HashMap::new();
    for (at, change, slot) in events {
        inside += change;
        most = most.max(inside);
        let on_slot = slots.entry(slot).or_default();
        *on_slot += change;
        if inside > i32::try_from(permits).unwrap() {
            return Err(format!(
                "{inside} holders of {permits} permits at event {at}"
            ));
        }
        if *on_slot > 1 {
            return Err(format!("slot {slot} held twice at event {at}"));
        }
    }
    Ok(usize::try_from(most).unwrap())
}

/// Many tasks on two pools take and release permits, recording a history;
/// `broken` tasks skip the semaphore and pretend they hold slot 0.
async fn history(opts: &PgConnectOptions, permits: u32, broken: bool) -> Vec<Held> {
    let clock = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let history = Arc::new(Mutex::new(Vec::new()));
    let lockers = [
        PgLocker::new(pool_of(opts, 8).await),
        PgLocker::new(pool_of(opts, 8).await),
    ];
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..24 {
        let sem = semaphore(&lockers[task % 2], "sem:history", permits);
        let (clock, history) = (Arc::clone(&clock), Arc::clone(&history));
        tasks.spawn(async move {
            for _ in 0..5 {
                let tick = || clock.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let permit = if broken {
                    None
                } else {
                    Some(sem.acquire(Duration::from_secs(60)).await?)
                };
                let from = tick();
                tokio::time::sleep(Duration::from_millis(3)).await;
                let to = tick();
                let slot = permit.as_ref().map_or(0, |p| p.slot());
                history.lock().unwrap().push(Held { slot, from, to });
                if let Some(permit) = permit {
                    permit.release().await?;
                }
            }
            Ok::<_, Error>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap().unwrap();
    }
    history.lock().unwrap().clone()
}

#[sqlx::test(migrations = false)]
async fn never_more_holders_than_permits(_pool_opts: PgPoolOptions, opts: PgConnectOptions) {
    const PERMITS: u32 = 3;
    let history = history(&opts, PERMITS, false).await;
    assert_eq!(history.len(), 24 * 5);
    let most = check(&history, PERMITS).expect("the bound holds");
    assert_eq!(most, PERMITS as usize, "every permit was used");
}

#[sqlx::test(migrations = false)]
async fn a_broken_semaphore_is_caught(_pool_opts: PgPoolOptions, opts: PgConnectOptions) {
    let history = history(&opts, 3, true).await;
    let caught = check(&history, 3).expect_err("a semaphore that takes no lock is caught");
    println!("caught: {caught}");
}

/// What holds the only slot while a waiter queues.
enum Blocker {
    /// A permit: its release announces the freed slot.
    Permit(distlock::SemaphorePermit),
    /// A plain lock of the slot's key: its release announces nothing.
    Plain(distlock::SessionLock),
}

impl Blocker {
    async fn release(self) {
        match self {
            Blocker::Permit(permit) => permit.release().await.unwrap(),
            Blocker::Plain(lock) => lock.release().await.unwrap(),
        }
    }
}

/// How long a queued waiter takes to get the slot that a [`Blocker`] frees,
/// over `rounds` rounds: the waiter queues behind the only permit, and the
/// blocker lets go of it once the waiter has waited a while, at a point
/// that moves across the waiter's fallback period from round to round.
async fn hand_off_times(pool: &PgPool, name: &str, rounds: u64, announced: bool) -> Vec<Duration> {
    let locker = PgLocker::new(pool.clone());
    let sem = semaphore(&locker, name, 1);
    // The blocker is another process's: a permit given up in the waiter's
    // own process would be handed over, with no unlock to announce.
    let elsewhere = semaphore(&PgLocker::new(pool.clone()), name, 1);
    let mut times = Vec::new();
    for round in 0..rounds {
        let blocker = if announced {
            Blocker::Permit(elsewhere.try_acquire().await.unwrap().expect("free"))
        } else {
            let slot =
                distlock::LockKey::namespaced(Semaphore::SLOT_NAMESPACE, &format!("{name}#0"));
            Blocker::Plain(locker.try_lock(slot).await.unwrap().expect("free"))
        };
        let waiter = tokio::spawn({
            let sem = sem.clone();
            async move {
                let permit = sem.acquire(Duration::from_secs(10)).await?;
                let at = Instant::now();
                permit.release().await?;
                Ok::<_, Error>(at)
            }
        });
        tokio::time::sleep(Duration::from_millis(300 + 37 * round)).await;
        let freed = Instant::now();
        blocker.release().await;
        let granted = waiter.await.unwrap().expect("the waiter gets the permit");
        times.push(granted.saturating_duration_since(freed));
    }
    times
}

/// A permit's release announces the freed slot, so a waiter queued on the
/// server is served at once, not at its next fallback try (every 200 ms).
/// The broken variant below frees the slot without the announcement.
#[sqlx::test(migrations = false)]
async fn a_released_permit_wakes_the_waiter_without_a_poll(pool: PgPool) {
    let times = hand_off_times(&pool, "sem:wake", 6, true).await;
    println!("release -> grant: {times:?}");
    assert!(
        times.iter().all(|t| *t < Duration::from_millis(100)),
        "a waiter waited for its fallback try: {times:?}"
    );
}

/// The broken variant of the test above: the slot is held through a plain
/// lock of its key, whose release announces nothing, so the waiter only
/// finds it at a fallback try, up to 200 ms later. Over eight rounds
/// spread across the fallback period, some hand-off takes 100 ms or more.
#[sqlx::test(migrations = false)]
async fn a_slot_freed_without_the_announcement_waits_for_the_fallback(pool: PgPool) {
    let times = hand_off_times(&pool, "sem:silent", 8, false).await;
    println!("release -> grant without the announcement: {times:?}");
    assert!(
        times.iter().any(|t| *t >= Duration::from_millis(100)),
        "the waiter was woken without an announcement: {times:?}"
    );
    assert!(
        times.iter().all(|t| *t < Duration::from_secs(1)),
        "the fallback try found the freed slot: {times:?}"
    );
}

/// What 200 waiters on 10 permits and one pool of 20 did: the history of
/// holds and the arrival numbers in the order the waiters were served.
struct Served {
    history: Vec<Held>,
    order: Vec<usize>,
}

/// 200 waiters arrive one by one (spawned in order, each polled once before
/// the next is spawned) and hold a permit for 10 ms. With `queued` they wait
/// in `acquire`; without it they skip the semaphore's line and poll
/// `try_acquire` at random intervals of up to 20 ms, as independent clients
/// of a semaphore without a queue would (the broken variant of the order
/// check).
async fn two_hundred_waiters(opts: &PgConnectOptions, queued: bool) -> Served {
    const WAITERS: usize = 200;
    let pool = PgPoolOptions::new()
        .max_connections(20)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(opts.clone())
        .await
        .expect("pool");
    let sem = semaphore(&PgLocker::new(pool.clone()), "sem:scale", SCALE_PERMITS);
    let clock = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let history = Arc::new(Mutex::new(Vec::new()));
    let served = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..WAITERS {
        let (sem, clock) = (sem.clone(), Arc::clone(&clock));
        let (history, served) = (Arc::clone(&history), Arc::clone(&served));
        tasks.spawn(async move {
            let permit = if queued {
                sem.acquire(Duration::from_secs(60)).await?
            } else {
                loop {
                    if let Some(permit) = sem.try_acquire().await? {
                        break permit;
                    }
                    // Independent clients poll out of step: equal intervals
                    // would keep the pollers' timers in arrival order, and
                    // the "broken" variant would be nearly first come,
                    // first served by accident.
                    let pause = rand::random_range(0..=20);
                    tokio::time::sleep(Duration::from_millis(pause)).await;
                }
            };
            let from = clock.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            served.lock().unwrap().push(i);
            tokio::time::sleep(Duration::from_millis(10)).await;
            let to = clock.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            history.lock().unwrap().push(Held {
                slot: permit.slot(),
                from,
                to,
            });
            permit.release().await
        });
        // Arrival order is the order of the first polls.
        tokio::task::yield_now().await;
    }
    // Meanwhile the pool serves others.
    sqlx::query("SELECT 1")
        .execute(&pool)
        .await
        .expect("a plain statement on the pool while 200 waiters wait");
    while let Some(done) = tasks.join_next().await {
        done.unwrap().expect("no waiter fails (no pool timeout)");
    }
    let history = history.lock().unwrap().clone();
    assert_eq!(history.len(), WAITERS);
    let order = served.lock().unwrap().clone();
    Served { history, order }
}

const SCALE_PERMITS: u32 = 10;

/// How far a waiter was served from its place in the line, at most: 0 for
/// first come, first served.
fn displacement(order: &[usize]) -> usize {
    order
        .iter()
        .enumerate()
        .map(|(at, i)| at.abs_diff(*i))
        .max()
        .unwrap_or(0)
}

/// The scale of the issue: 200 waiters, 10 permits, one pool of 20. No
/// pool error, never more than 10 holders (checked on the history), every
/// waiter served, and in arrival order within a bounded displacement.
#[sqlx::test(migrations = false)]
async fn two_hundred_waiters_share_ten_permits_on_a_pool_of_twenty(
    _pool_opts: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let served = two_hundred_waiters(&opts, true).await;
    let most = check(&served.history, SCALE_PERMITS).expect("never more than 10 holders");
    assert_eq!(
        most, SCALE_PERMITS as usize,
        "all ten permits were used at once"
    );
    let displaced = displacement(&served.order);
    println!("the furthest a waiter was served from its arrival: {displaced} places");
    assert!(
        displaced <= 2 * SCALE_PERMITS as usize,
        "served out of order: {:?}",
        served.order
    );
}

/// The broken variant of the order check above: waiters that skip the line
/// and poll with `try_acquire` are served far out of arrival order, and the
/// same bound catches them (the bound on holders still holds: they do take
/// permits).
#[sqlx::test(migrations = false)]
async fn waiters_that_skip_the_line_are_caught_out_of_order(
    _pool_opts: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let served = two_hundred_waiters(&opts, false).await;
    check(&served.history, SCALE_PERMITS).expect("never more than 10 holders");
    let displaced = displacement(&served.order);
    println!("waiters that poll: the furthest one was served {displaced} places from its arrival");
    assert!(
        displaced > 2 * SCALE_PERMITS as usize,
        "the order bound did not catch waiters that skip the line: {:?}",
        served.order
    );
}

/// The only permit of `name` is held on `holder`, `stuck` makes a head that
/// holds the queue and then goes quiet, the permit is freed: how long
/// another process's `acquire` takes to get it (6 s at most).
async fn behind_a_stuck_head<F, Fut, T>(
    holder: &PgLocker,
    stuck: F,
    other: &PgLocker,
    name: &str,
) -> (T, Result<Duration, Error>)
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = T>,
{
    let held = semaphore(holder, name, 1)
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    let stuck = stuck().await;
    held.release().await.unwrap();
    let started = Instant::now();
    let acquired = semaphore(other, name, 1)
        .acquire(Duration::from_secs(6))
        .await;
    let took = started.elapsed();
    match acquired {
        Ok(permit) => {
            permit.release().await.unwrap();
            (stuck, Ok(took))
        }
        Err(err) => (stuck, Err(err)),
    }
}

/// A head whose network stalls (a partition, or a paused process) holds the
/// queue; the server ends its session after the head's idle guard (2 s),
/// which frees the queue, so another process's waiter gets the freed permit.
/// When the network comes back, the stalled head lines up again and is
/// served too.
#[sqlx::test(migrations = false)]
async fn a_stalled_head_does_not_keep_the_queue(pool: PgPool) {
    let opts = pool.connect_options().as_ref().clone();
    let network = Proxy::start(opts.get_host(), opts.get_port())
        .await
        .expect("proxy");
    let through = PgLocker::new(pool_of(&network.options(&opts), 2).await);
    let mut obs = common::observer_for(&pool).await;
    let (obs, through, net) = (&mut obs, &through, &network);
    let stuck = move || async move {
        let stalled = semaphore(through, "sem:stalled", 1);
        let waiter = tokio::spawn(async move { stalled.acquire(Duration::from_secs(30)).await });
        common::semaphore_head_idle_with_queue(obs, "sem:stalled").await;
        net.stall();
        // A tuple: the closure's future yields the handle, not its result.
        (waiter,)
    };
    let other = PgLocker::new(pool_of(&opts, 2).await);
    let holder = PgLocker::new(pool.clone());
    let ((waiter,), took) = behind_a_stuck_head(&holder, stuck, &other, "sem:stalled").await;
    let took = took.expect("served past the stalled head");
    println!("another process's waiter was served after {took:?}");
    network.pass();
    let permit = common::bounded(
        "the stalled head is served",
        Duration::from_secs(30),
        waiter,
    )
    .await
    .unwrap()
    .expect("the stalled head lines up again");
    permit.release().await.unwrap();
}

/// The broken variant: a head without the idle guard (a raw session that
/// listens and holds the queue, as a head does, and then goes quiet) keeps
/// every other waiter from the freed permit.
#[sqlx::test(migrations = false)]
async fn a_head_without_the_guard_keeps_the_queue(pool: PgPool) {
    let opts = pool.connect_options().as_ref().clone();
    let mut raw = common::observer_for(&pool).await;
    let raw = &mut raw;
    let stuck = move || async move {
        sqlx::query("LISTEN distlock_semaphore")
            .execute(&mut *raw)
            .await
            .unwrap();
        sqlx::query("SELECT pg_advisory_lock($1, hashtext('sem:unguarded#queue'))")
            .bind(Semaphore::SLOT_NAMESPACE)
            .execute(&mut *raw)
            .await
            .unwrap();
    };
    let other = PgLocker::new(pool_of(&opts, 2).await);
    let holder = PgLocker::new(pool.clone());
    let ((), took) = behind_a_stuck_head(&holder, stuck, &other, "sem:unguarded").await;
    let err = took.expect_err("an unguarded head keeps the queue");
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
}

/// `PgLocker::semaphore` counts in the lock metrics under the semaphore's
/// name: permits taken, tries that found none, waits that timed out. The
/// prefix `metricssem` is used by no other test in this binary.
#[cfg(feature = "metrics")]
#[sqlx::test(migrations = false)]
async fn semaphore_calls_count_in_the_lock_metrics(pool: PgPool) {
    let captured = crate::job::recorder::Captured::global();
    let series = |name: &str| format!("{name}{{backend=postgres,key=metricssem}}");
    let sem = semaphore(&PgLocker::new(pool.clone()), "metricssem:exports", 1);
    let held = sem.try_acquire().await.unwrap().expect("free");
    assert_eq!(captured.get(&series("distlock_acquired_total")), 1.0);
    assert!(sem.try_acquire().await.unwrap().is_none(), "held");
    assert_eq!(captured.get(&series("distlock_busy_total")), 1.0);
    let timed_out = sem.acquire(Duration::from_millis(200)).await;
    assert!(
        matches!(timed_out, Err(Error::Timeout { .. })),
        "{timed_out:?}"
    );
    assert_eq!(captured.get(&series("distlock_timeout_total")), 1.0);
    held.release().await.unwrap();
    let waited = sem.acquire(Duration::from_secs(2)).await.expect("free");
    assert_eq!(captured.get(&series("distlock_acquired_total")), 2.0);
    waited.release().await.unwrap();
}

/// `Semaphore::new` over a `PgLocker` (as a `Locker`) is the PostgreSQL
/// semaphore, not permits polled as plain locks: it reads its free permits
/// from the server (the polled one cannot, and answers `None`), and its
/// waiter lines up on the server's queue.
#[sqlx::test(migrations = false)]
async fn semaphore_new_over_a_pg_locker_is_the_postgres_semaphore(pool: PgPool) {
    let locker: Arc<dyn distlock::Locker> = Arc::new(PgLocker::new(pool.clone()));
    let exports = Semaphore::new(locker, "sem:via-new", 1).unwrap();
    assert_eq!(exports.available_permits().await.unwrap(), Some(1));
    let held = exports.try_acquire().await.unwrap().expect("a free permit");
    assert_eq!(exports.available_permits().await.unwrap(), Some(0));
    let waiter = tokio::spawn({
        let exports = exports.clone();
        async move { exports.acquire(Duration::from_secs(30)).await }
    });
    let mut obs = common::observer_for(&pool).await;
    common::semaphore_head_idle_with_queue(&mut obs, "sem:via-new").await;
    held.release().await.unwrap();
    waiter
        .await
        .unwrap()
        .expect("served")
        .release()
        .await
        .unwrap();
    common::close(obs).await;
}
