//! A permit given up while a waiter of the same process holds the
//! semaphore's queue is handed to that waiter as it is (the slot stays
//! locked by the same backend), and only then: not to a waiter behind
//! another process's, not when the permit is lost, not with fencing.

use std::time::{Duration, Instant};

use distlock::{PgLocker, Semaphore, SemaphorePermit};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// A pool of `size` connections, all open: run beside other tests, a pool
/// that opens connections mid-test can meet the server's connection limit.
pub(crate) async fn pool_of(opts: &PgConnectOptions, size: u32) -> PgPool {
    let pool = PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(opts.clone())
        .await
        .expect("pool");
    let mut open = Vec::new();
    for _ in 0..size {
        open.push(pool.acquire().await.expect("a connection"));
    }
    drop(open);
    pool
}

/// The backend that holds slot 0 of `name`, if one does.
async fn slot_holder(pool: &PgPool, name: &str) -> Option<i32> {
    holder_of(pool, format!("{name}#0")).await
}

/// The backend that holds `key` in the semaphore's namespace, if one does.
async fn holder_of(pool: &PgPool, key: String) -> Option<i32> {
    sqlx::query_scalar(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2 \
         AND classid = ($1::int8 & 4294967295)::oid \
         AND objid = (hashtext($2)::int8 & 4294967295)::oid",
    )
    .bind(i64::from(Semaphore::SLOT_NAMESPACE))
    .bind(key)
    .fetch_optional(pool)
    .await
    .expect("pg_locks")
}

/// Whether some session holds (`granted`) or waits for (not `granted`)
/// the queue lock of `name`.
pub(crate) async fn queue_lock(pool: &PgPool, name: &str, granted: bool) -> bool {
    sqlx::query_scalar(
        "SELECT count(*) > 0 FROM pg_locks WHERE locktype = 'advisory' AND granted = $3 \
         AND objsubid = 2 AND classid = ($1::int8 & 4294967295)::oid \
         AND objid = (hashtext($2)::int8 & 4294967295)::oid",
    )
    .bind(i64::from(Semaphore::SLOT_NAMESPACE))
    .bind(format!("{name}#queue"))
    .bind(granted)
    .fetch_one(pool)
    .await
    .expect("pg_locks")
}

/// Waits (up to 5 s) until a head holds the queue of `name` and its
/// statement has ended (its backend is idle), then 50 ms more: the server
/// grants the queue before the head's process reads the answer and opens
/// its turn, and a permit given up in between is unlocked, not handed over
/// (seen once under a loaded `cargo test`).
async fn until_queued(pool: &PgPool, name: &str) {
    let started = Instant::now();
    while !(queue_lock(pool, name, true).await && queue_holder_idle(pool, name).await) {
        assert!(started.elapsed() < Duration::from_secs(5), "no head queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// Whether the session that holds the queue lock of `name` is idle.
async fn queue_holder_idle(pool: &PgPool, name: &str) -> bool {
    sqlx::query_scalar(
        "SELECT count(*) > 0 FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 \
         AND l.classid = ($1::int8 & 4294967295)::oid \
         AND l.objid = (hashtext($2)::int8 & 4294967295)::oid AND a.state = 'idle'",
    )
    .bind(i64::from(Semaphore::SLOT_NAMESPACE))
    .bind(format!("{name}#queue"))
    .fetch_one(pool)
    .await
    .expect("pg_stat_activity")
}

/// How the holder gives its permit up.
#[derive(Clone, Copy, Debug)]
enum GiveUp {
    Release,
    Drop,
}

/// A 1-permit semaphore, held; a clone waits; the holder gives the permit
/// up: the waiter's permit and the backend that holds the slot before and
/// after.
async fn hand_over(pool: &PgPool, locker: &PgLocker, name: &str, how: GiveUp) -> Handed {
    let sem = locker.semaphore(name, 1).expect("valid");
    let held = sem.try_acquire().await.expect("try").expect("free");
    let before = slot_holder(pool, name).await.expect("held");
    let waiter = tokio::spawn({
        let sem = sem.clone();
        async move { sem.acquire(Duration::from_secs(10)).await }
    });
    until_queued(pool, name).await;
    match how {
        GiveUp::Release => held.release().await.expect("release"),
        GiveUp::Drop => drop(held),
    }
    let permit = waiter.await.expect("task").expect("the waiter is served");
    let after = slot_holder(pool, name).await.expect("held");
    Handed {
        permit,
        before,
        after,
    }
}

struct Handed {
    permit: SemaphorePermit,
    before: i32,
    after: i32,
}

#[sqlx::test(migrations = false)]
async fn a_permit_given_up_goes_to_the_waiting_head_as_it_is(
    _pool_opts: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let pool = pool_of(&opts, 6).await;
    let locker = PgLocker::new(pool.clone());
    for how in [GiveUp::Release, GiveUp::Drop] {
        let name = format!("relay:{how:?}");
        let handed = hand_over(&pool, &locker, &name, how).await;
        assert_eq!(
            handed.before, handed.after,
            "{how:?}: the slot changed backends, so it was unlocked and taken again"
        );
        assert!(!handed.permit.is_lost());
        // The waiter's queue is given back (in the background), so a
        // later try of another process finds the slot once it is free.
        handed.permit.release().await.expect("release");
        let other = PgLocker::new(pool_of(&opts, 2).await)
            .semaphore(&name, 1)
            .expect("valid");
        let started = Instant::now();
        let again = loop {
            if let Some(permit) = other.try_acquire().await.expect("try") {
                break permit;
            }
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{how:?}: the queue was kept after the hand-over"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        again.release().await.expect("release");
    }
}

/// Another process's waiter holds the queue: a permit given up here is
/// unlocked for it, not handed to this process's waiter behind it. (A relay
/// that hands permits over without its process's turn fails it: the other
/// process's head is never served.)
#[sqlx::test(migrations = false)]
async fn a_permit_goes_to_the_process_first_in_line(
    _pool_opts: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let name = "relay:order";
    let here = PgLocker::new(pool_of(&opts, 6).await)
        .semaphore(name, 1)
        .expect("valid");
    let there = PgLocker::new(pool_of(&opts, 6).await)
        .semaphore(name, 1)
        .expect("valid");
    let observer = pool_of(&opts, 1).await;
    let held = here.try_acquire().await.expect("try").expect("free");
    let first = tokio::spawn({
        let there = there.clone();
        async move { there.acquire(Duration::from_secs(10)).await }
    });
    until_queued(&observer, name).await;
    let second = tokio::spawn({
        let here = here.clone();
        async move { here.acquire(Duration::from_secs(10)).await }
    });
    // The second waiter is lined up on the server behind the first.
    tokio::time::sleep(Duration::from_millis(300)).await;
    held.release().await.expect("release");
    let permit = first
        .await
        .expect("task")
        .expect("the first in line is served");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !second.is_finished(),
        "the process's own waiter took the permit ahead of the other process's"
    );
    permit.release().await.expect("release");
    let last = second.await.expect("task").expect("then the second");
    last.release().await.expect("release");
}

/// A lost permit is not handed over: the waiter gets the slot from the
/// server, on a backend that holds it.
#[sqlx::test(migrations = false)]
async fn a_lost_permit_is_not_handed_over(_pool_opts: PgPoolOptions, opts: PgConnectOptions) {
    let name = "relay:lost";
    let (pool, sem, held, pid) = one_permit_held(&opts, name).await;
    let waiter = tokio::spawn({
        let sem = sem.clone();
        async move { sem.acquire(Duration::from_secs(10)).await }
    });
    until_queued(&pool, name).await;
    terminate(&pool, pid).await;
    tokio::time::timeout(Duration::from_secs(5), held.lost())
        .await
        .expect("the loss is seen");
    drop(held);
    let permit = waiter.await.expect("task").expect("the waiter is served");
    served_by_another_backend(&pool, name, permit, pid).await;
}

/// A pool, a 1-permit semaphore `name` on it, its permit held, and the
/// backend that holds the permit's slot.
async fn one_permit_held(
    opts: &PgConnectOptions,
    name: &str,
) -> (PgPool, Semaphore, SemaphorePermit, i32) {
    let pool = pool_of(opts, 6).await;
    let sem = PgLocker::new(pool.clone())
        .semaphore(name, 1)
        .expect("valid");
    let held = sem.try_acquire().await.expect("try").expect("free");
    let pid = slot_holder(&pool, name).await.expect("held");
    (pool, sem, held, pid)
}

/// Ends the session `pid`.
async fn terminate(pool: &PgPool, pid: i32) {
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .execute(pool)
        .await
        .expect("terminate");
}

/// A waiter's `permit` of `name` is not lost, and its slot is held by
/// another backend than the lost permit's (`pid`); then it is released.
async fn served_by_another_backend(pool: &PgPool, name: &str, permit: SemaphorePermit, pid: i32) {
    assert!(
        !permit.is_lost(),
        "the waiter took a lost permit: {:?}",
        permit.loss()
    );
    let now = slot_holder(pool, name).await.expect("held");
    assert_ne!(now, pid);
    permit.release().await.expect("release");
}

/// A permit lost after it was handed over, before its waiter took it (the
/// waiter's task not run meanwhile), is not the waiter's permit: the wait
/// goes on and gets the slot from the server, on a backend that holds it.
/// Handed out, it would be one holder more than the permits (the server
/// freed its slot with the session).
#[sqlx::test(migrations = false)]
async fn a_permit_lost_on_its_way_to_the_waiter_is_not_taken(
    _pool_opts: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let name = "relay:lost-on-its-way";
    let (pool, sem, held, pid) = one_permit_held(&opts, name).await;
    let mut waiting = std::pin::pin!(sem.acquire(Duration::from_secs(10)));
    tokio::select! {
        biased;
        got = &mut waiting => panic!("served while the permit was held: {got:?}"),
        () = until_queued(&pool, name) => {}
    }
    held.release().await.expect("release");
    // Handed over (in the waiter's channel); now its session ends, and its
    // loss is seen (the goodbye at once, the heartbeat within 2 s).
    terminate(&pool, pid).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let permit = waiting.await.expect("the waiter is served");
    served_by_another_backend(&pool, name, permit, pid).await;
}

/// With fencing, each holder draws its own token: a permit given up is not
/// handed over, or two holders in a row would carry one token.
#[sqlx::test(migrations = false)]
async fn fenced_permits_are_not_handed_over(pool: PgPool) {
    distlock::migrate(&pool).await.expect("migrate");
    let locker = PgLocker::builder(pool.clone())
        .fencing(true)
        .build()
        .expect("valid settings");
    let handed = hand_over(&pool, &locker, "relay:fenced", GiveUp::Release).await;
    let token = handed.permit.fencing_token().expect("fencing on");
    assert_ne!(
        handed.before, handed.after,
        "the fenced permit was handed over"
    );
    handed.permit.release().await.expect("release");
    let next = locker.semaphore("relay:fenced", 1).expect("valid");
    let later = next.try_acquire().await.expect("try").expect("free");
    assert!(later.fencing_token().expect("fencing on") > token);
    later.release().await.expect("release");
}

/// A process keeps its turn for a bounded number of hand-overs while
/// another process waits: here one permit, 24 waiters of this process
/// that pass it on from one to the next, and a waiter of another process
/// that queues on the server once the hand-overs have begun. From then on
/// it is served after at most `4 × permits` hand-overs and a few in flight,
/// not after the whole line. (Without the bound it would come last.)
#[sqlx::test(migrations = false)]
async fn another_process_gets_its_turn_within_the_bound(
    _pool_opts: PgPoolOptions,
    opts: PgConnectOptions,
) {
    const LOCAL: usize = 24;
    let name = "relay:turns";
    let here = PgLocker::new(pool_of(&opts, 4).await)
        .semaphore(name, 1)
        .expect("valid");
    let there = PgLocker::new(pool_of(&opts, 3).await)
        .semaphore(name, 1)
        .expect("valid");
    let observer = pool_of(&opts, 1).await;
    let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let held = here.try_acquire().await.expect("try").expect("free");
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..LOCAL {
        let (here, order) = (here.clone(), order.clone());
        tasks.spawn(async move {
            let permit = here.acquire(Duration::from_secs(30)).await?;
            order.lock().unwrap().push(format!("here {i}"));
            tokio::time::sleep(Duration::from_millis(20)).await;
            permit.release().await
        });
        tokio::task::yield_now().await;
    }
    until_queued(&observer, name).await;
    held.release().await.expect("release");
    let other = {
        let order = order.clone();
        tokio::spawn(async move {
            let permit = there.acquire(Duration::from_secs(30)).await?;
            order.lock().unwrap().push("there".to_owned());
            permit.release().await
        })
    };
    // The other process's head waits on the server from here on.
    let started = Instant::now();
    while !queue_lock(&observer, name, false).await {
        assert!(started.elapsed() < Duration::from_secs(5), "never queued");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let queued_at = order.lock().unwrap().len();
    while let Some(done) = tasks.join_next().await {
        done.expect("task").expect("every local waiter is served");
    }
    other
        .await
        .expect("task")
        .expect("the other process is served");
    let order = order.lock().unwrap().clone();
    let at = order.iter().position(|who| who == "there").expect("served");
    println!("queued after {queued_at} grants; served: {order:?}");
    assert!(
        at <= queued_at + 4 + 2,
        "the other process waited for {} hand-overs: {order:?}",
        at - queued_at
    );
}

/// A head whose wait times out leaves the queue to its process's next
/// waiter, which arrived before the other process's: that waiter is served
/// first. (Giving the queue back would let the other process's head, which
/// waits on the server, take it first.)
#[sqlx::test(migrations = false)]
async fn a_timed_out_head_leaves_the_turn_to_the_next_waiter(
    _pool_opts: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let name = "relay:timeout";
    let here = PgLocker::new(pool_of(&opts, 4).await)
        .semaphore(name, 1)
        .expect("valid");
    let there = PgLocker::new(pool_of(&opts, 4).await)
        .semaphore(name, 1)
        .expect("valid");
    let holder = PgLocker::new(pool_of(&opts, 1).await)
        .semaphore(name, 1)
        .expect("valid");
    let observer = pool_of(&opts, 1).await;
    let held = holder.try_acquire().await.expect("try").expect("free");
    let short = tokio::spawn({
        let here = here.clone();
        async move { here.acquire(Duration::from_millis(600)).await }
    });
    until_queued(&observer, name).await;
    let next = tokio::spawn({
        let here = here.clone();
        async move { here.acquire(Duration::from_secs(10)).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let other = tokio::spawn(async move { there.acquire(Duration::from_secs(10)).await });
    let started = Instant::now();
    while !queue_lock(&observer, name, false).await {
        assert!(started.elapsed() < Duration::from_secs(5), "never queued");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        matches!(
            short.await.expect("task"),
            Err(distlock::Error::Timeout { .. })
        ),
        "the head times out"
    );
    // The queue changes hands (or not) as the head leaves.
    tokio::time::sleep(Duration::from_millis(200)).await;
    held.release().await.expect("release");
    let (mut next, mut other) = (next, other);
    let first = tokio::select! {
        permit = &mut next => ("here", permit.expect("task")),
        permit = &mut other => ("there", permit.expect("task")),
    };
    assert_eq!(
        first.0, "here",
        "the other process took the queue from the timed-out head's process"
    );
    first.1.expect("served").release().await.expect("release");
    let last = other.await.expect("task").expect("then the other process");
    last.release().await.expect("release");
}

/// A first waiter that waits for a pooled connection (the pool is taken by
/// the permits and the queue) while its process's turn is open takes a
/// permit handed to it at once: it does not wait for a connection that
/// only a release would free (before the fix it was served at its
/// deadline, from the permit left in its channel).
#[sqlx::test(migrations = false)]
async fn a_waiter_waiting_for_a_connection_takes_a_permit_handed_to_it(
    _pool_opts: PgPoolOptions,
    opts: PgConnectOptions,
) {
    use std::future::Future;
    use std::task::Poll;
    let name = "relay:no-room";
    let here = PgLocker::new(pool_of(&opts, 3).await)
        .semaphore(name, 2)
        .expect("valid");
    let observer = pool_of(&opts, 1).await;
    let first = here.try_acquire().await.expect("try").expect("free");
    let second = here.try_acquire().await.expect("try").expect("free");
    // The head: it takes the queue on the pool's last connection.
    let head = tokio::spawn({
        let here = here.clone();
        async move { here.acquire(Duration::from_secs(30)).await }
    });
    until_queued(&observer, name).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Handed to the head, which has not run yet (one thread): no waiter of
    // the process is registered, so the next one tries as it arrives, and
    // waits for a connection (the permits hold two, the queue the third).
    first.release().await.expect("release");
    let mut waiter = Box::pin({
        let here = here.clone();
        async move { here.acquire(Duration::from_secs(30)).await }
    });
    let polled = std::future::poll_fn(|cx| Poll::Ready(waiter.as_mut().poll(cx))).await;
    assert!(polled.is_pending(), "the pool has no connection for it");
    let waiter = tokio::spawn(waiter);
    let head = head.await.expect("task").expect("the head is served");
    // The head left the turn to the waiter; this permit is handed to it.
    second.release().await.expect("release");
    let served = tokio::time::timeout(Duration::from_secs(5), waiter).await;
    let permit = served
        .expect("served without a connection of its own, long before its deadline")
        .expect("task")
        .expect("served");
    permit.release().await.expect("release");
    head.release().await.expect("release");
}

/// The backend that holds the queue lock of `name`, if one does.
async fn queue_holder(pool: &PgPool, name: &str) -> Option<i32> {
    holder_of(pool, format!("{name}#queue")).await
}

/// A head that waits alone takes a permit another process releases on the
/// queue's own connection (one statement takes the slot and gives the
/// queue back), not through a try on another pooled connection.
#[sqlx::test(migrations = false)]
async fn a_lone_head_takes_an_announced_permit_on_the_queues_connection(
    _pool_opts: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let name = "relay:lone";
    let there = PgLocker::new(pool_of(&opts, 2).await)
        .semaphore(name, 1)
        .expect("valid");
    let here = PgLocker::new(pool_of(&opts, 4).await)
        .semaphore(name, 1)
        .expect("valid");
    let observer = pool_of(&opts, 1).await;
    let held = there.try_acquire().await.expect("try").expect("free");
    let waiter = tokio::spawn(async move { here.acquire(Duration::from_secs(10)).await });
    until_queued(&observer, name).await;
    // Past the turn's first tries.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let head = queue_holder(&observer, name).await.expect("the head");
    held.release().await.expect("release");
    let permit = waiter.await.expect("task").expect("served");
    assert_eq!(
        slot_holder(&observer, name).await,
        Some(head),
        "the permit is held by the connection that held the queue"
    );
    assert_eq!(
        queue_holder(&observer, name).await,
        None,
        "queue given back"
    );
    permit.release().await.expect("release");
}
