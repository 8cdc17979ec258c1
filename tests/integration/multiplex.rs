//! Multiplexed session locks (`PgLocker::builder(pool).multiplex(n)`): many
//! locks over a few shared connections, with the guarantees of the default
//! mode.

use crate::common;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::proxy::Proxy;
use common::roles::{drop_role, make_role};
use common::*;
use distlock::{Error, LockKey, LossReason, PgLocker, SessionLock};
use rand::Rng;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

fn mux(pool: &PgPool, connections: usize) -> PgLocker {
    PgLocker::builder(pool.clone())
        .multiplex(connections)
        .build()
        .expect("valid settings")
}

/// Pids of the sessions holding granted advisory locks in this database.
async fn holder_pids(obs: &mut sqlx::PgConnection) -> BTreeMap<i32, usize> {
    let mut pids = BTreeMap::new();
    for row in advisory_locks(obs).await.iter().filter(|r| r.granted) {
        *pids.entry(row.pid).or_default() += 1;
    }
    pids
}

#[sqlx::test(migrations = false)]
async fn five_thousand_locks_are_held_over_at_most_four_connections(pool: PgPool) {
    init_tracing();
    let locker = mux(&pool, 4);
    let mut obs = observer_for(&pool).await;
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for part in 0..8i64 {
        let locker = locker.clone();
        tasks.spawn(async move {
            let mut held = Vec::new();
            for i in (part * 625)..((part + 1) * 625) {
                let lock = locker.try_lock(LockKey::id(1_000_000 + i)).await.unwrap();
                held.push(lock.unwrap_or_else(|| panic!("key {i} is free")));
            }
            held
        });
    }
    let mut held: Vec<SessionLock> = Vec::new();
    while let Some(part) = tasks.join_next().await {
        held.extend(part.unwrap());
    }
    println!("5,000 multiplexed locks taken in {:?}", started.elapsed());
    assert_eq!(held.len(), 5_000);

    let pids = holder_pids(&mut obs).await;
    assert_eq!(pids.values().sum::<usize>(), 5_000, "{pids:?}");
    assert!(pids.len() <= 4, "at most 4 sessions hold them: {pids:?}");
    let guard_pids: HashSet<i32> = held.iter().map(SessionLock::backend_pid).collect();
    assert_eq!(guard_pids, pids.keys().copied().collect());
    // The shared connections are not the pool's: its connections hold none.
    let sessions: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid = ANY($1)",
    )
    .bind(pids.keys().copied().collect::<Vec<i32>>())
    .fetch_one(&mut obs)
    .await
    .unwrap();
    assert_eq!(sessions, i64::try_from(pids.len()).unwrap());

    // Half released explicitly, half dropped: all gone on the server.
    let rest = held.split_off(2_500);
    for lock in held {
        lock.release().await.unwrap();
    }
    assert_eq!(granted_count(&mut obs).await, 2_500);
    drop(rest);
    let _ = assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(10)).await;
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn the_same_key_twice_in_one_process_is_busy(pool: PgPool) {
    let locker = mux(&pool, 1);
    let mut obs = observer_for(&pool).await;
    let first = locker
        .try_lock("mux:reentrant")
        .await
        .unwrap()
        .expect("free");
    // PostgreSQL would grant it again on the same session; the locker must not.
    assert!(locker.try_lock("mux:reentrant").await.unwrap().is_none());
    assert!(
        locker
            .clone()
            .try_lock("mux:reentrant")
            .await
            .unwrap()
            .is_none()
    );
    let waited = locker
        .lock("mux:reentrant", Duration::from_millis(300))
        .await;
    assert!(matches!(waited, Err(Error::Timeout { .. })), "{waited:?}");

    // Another name of the same server lock is busy too, and the re-entrant
    // level PostgreSQL granted for it is taken back at once.
    let hash = hashtext(&mut obs, "mux:reentrant").await;
    let alias = LockKey::id(i64::from(hash));
    assert!(locker.try_lock(alias.clone()).await.unwrap().is_none());
    let rows = advisory_locks(&mut obs).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    first.release().await.unwrap();
    assert!(
        raw_can_take(&mut obs, &Raw::text("mux:reentrant")).await,
        "no extra lock level left on the shared session"
    );

    // Taken under the alias, the name is busy.
    let by_id = locker.try_lock(alias).await.unwrap().expect("free again");
    assert!(locker.try_lock("mux:reentrant").await.unwrap().is_none());
    by_id.release().await.unwrap();
    assert!(advisory_locks(&mut obs).await.is_empty());
    close(obs).await;
}

/// How many holders are inside the critical section of each key.
#[derive(Default)]
struct Sections {
    inside: Vec<AtomicUsize>,
    violations: AtomicUsize,
    entries: AtomicUsize,
}

impl Sections {
    fn new(keys: usize) -> Self {
        Self {
            inside: (0..keys).map(|_| AtomicUsize::new(0)).collect(),
            ..Self::default()
        }
    }

    async fn run(&self, key: usize) {
        if self.inside[key].fetch_add(1, Ordering::SeqCst) != 0 {
            self.violations.fetch_add(1, Ordering::SeqCst);
        }
        self.entries.fetch_add(1, Ordering::SeqCst);
        let pause = Duration::from_micros(rand::rng().random_range(0..800));
        tokio::time::sleep(pause).await;
        self.inside[key].fetch_sub(1, Ordering::SeqCst);
    }
}

#[sqlx::test(migrations = false)]
async fn mutual_exclusion_holds_within_a_process_and_across_two_lockers(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    const KEYS: usize = 6;
    const TASKS_PER_LOCKER: usize = 12;
    const ROUNDS: usize = 25;
    let pool = |app: &'static str| {
        PgPoolOptions::new()
            .max_connections(14)
            .connect_with(connect_opts.clone().application_name(app))
    };
    let lockers = [
        mux(&pool("distlock-mux-a").await.unwrap(), 2),
        mux(&pool("distlock-mux-b").await.unwrap(), 3),
    ];
    let sections = Arc::new(Sections::new(KEYS));
    let mut tasks = tokio::task::JoinSet::new();
    for locker in &lockers {
        for task in 0..TASKS_PER_LOCKER {
            let (locker, sections) = (locker.clone(), sections.clone());
            tasks.spawn(async move {
                for round in 0..ROUNDS {
                    let key: usize = rand::rng().random_range(0..KEYS);
                    let name = format!("mux:exclusive:{key}");
                    // Half the tasks wait, half try.
                    let lock = if (task + round) % 2 == 0 {
                        locker.lock(name, Duration::from_secs(20)).await.map(Some)
                    } else {
                        locker.try_lock(name).await
                    };
                    if let Some(lock) = lock.expect("lock") {
                        sections.run(key).await;
                        if round % 3 == 0 {
                            drop(lock);
                        } else {
                            lock.release().await.expect("release");
                        }
                    }
                }
            });
        }
    }
    bounded("workload", Duration::from_secs(120), async {
        while let Some(done) = tasks.join_next().await {
            done.unwrap();
        }
    })
    .await;
    let entries = sections.entries.load(Ordering::SeqCst);
    println!("{entries} critical sections entered");
    assert!(
        entries >= TASKS_PER_LOCKER * ROUNDS,
        "the waiting half always gets in: {entries}"
    );
    assert_eq!(sections.violations.load(Ordering::SeqCst), 0);
    let mut obs = observer(&connect_opts).await;
    let _ = assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(10)).await;
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn terminating_a_shared_connection_loses_all_its_locks_at_once(pool: PgPool) {
    let locker = PgLocker::builder(pool.clone())
        .multiplex(2)
        .heartbeat(Duration::from_millis(100))
        .heartbeat_timeout(PATIENT)
        .build()
        .expect("valid settings");
    let mut obs = observer_for(&pool).await;
    let mut held = Vec::new();
    for i in 0..200 {
        held.push(
            locker
                .try_lock(format!("mux:fate:{i}"))
                .await
                .unwrap()
                .expect("free"),
        );
    }
    let pids: BTreeMap<i32, usize> = held.iter().fold(BTreeMap::new(), |mut m, l| {
        *m.entry(l.backend_pid()).or_default() += 1;
        m
    });
    assert_eq!(pids.len(), 2, "keys spread over both connections: {pids:?}");
    let victim = *pids.keys().next().unwrap();
    let (doomed, spared): (Vec<_>, Vec<_>) =
        held.into_iter().partition(|l| l.backend_pid() == victim);

    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(victim)
        .fetch_one(&mut obs)
        .await
        .unwrap();
    assert!(terminated);
    let reason = bounded("lost()", Duration::from_secs(5), doomed[0].lost()).await;
    assert!(
        matches!(reason, LossReason::ConnectionFailed(_)),
        "{reason}"
    );
    // One signal for all of them: the moment one knows, all know.
    assert!(doomed.iter().all(SessionLock::is_lost));
    assert!(doomed.iter().all(|l| l.loss() == Some(reason.clone())));
    assert!(
        spared.iter().all(|l| !l.is_lost()),
        "the other connection is fine"
    );

    // Free on the server: another session takes every doomed key.
    eventually(
        "the terminated backend is gone",
        Duration::from_secs(5),
        async || !holder_pids(&mut obs).await.contains_key(&victim),
    )
    .await;
    for lock in &doomed {
        let name = lock.key().to_string();
        assert!(raw_can_take(&mut obs, &Raw::text(&name)).await);
    }

    // Releasing a lost lock says so; new acquisitions get a new connection.
    let key = doomed[0].key().clone();
    let released = doomed.into_iter().next().unwrap().release().await;
    assert!(
        matches!(released, Err(Error::LockLost { .. })),
        "{released:?}"
    );
    let again = locker
        .try_lock(key)
        .await
        .unwrap()
        .expect("free after the loss");
    assert_ne!(again.backend_pid(), victim);
    assert!(!again.is_lost());
    again.release().await.unwrap();
    for lock in spared {
        lock.release().await.unwrap();
    }
    let _ = assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(5)).await;
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn a_waiting_lock_does_not_block_other_keys_on_the_shared_connection(pool: PgPool) {
    // One shared connection: every other key goes through it.
    let locker = mux(&pool, 1);
    let mut obs = observer_for(&pool).await;
    let contested = "mux:wait:contested";
    assert!(raw_try_lock(&mut obs, &Raw::text(contested)).await);

    let waiter = {
        let locker = locker.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let lock = locker
                .lock("mux:wait:contested", Duration::from_secs(10))
                .await;
            (lock, started.elapsed())
        })
    };
    wait_for_waiters(&mut obs, 1, Duration::from_secs(5)).await;

    let mut slowest = Duration::ZERO;
    let started = Instant::now();
    for i in 0..50 {
        let t = Instant::now();
        let lock = locker
            .try_lock(format!("mux:wait:other:{i}"))
            .await
            .unwrap()
            .expect("free");
        lock.release().await.unwrap();
        slowest = slowest.max(t.elapsed());
    }
    println!(
        "50 try+release cycles during a wait: {:?}, slowest {slowest:?}",
        started.elapsed()
    );
    assert!(
        slowest < Duration::from_millis(500),
        "a cycle took {slowest:?}"
    );
    assert!(!waiter.is_finished(), "still waiting");

    let released_at = Instant::now();
    assert!(raw_unlock(&mut obs, &Raw::text(contested)).await);
    let (lock, _) = bounded("waiter", Duration::from_secs(5), waiter)
        .await
        .unwrap();
    let lock = lock.expect("acquired after the holder let go");
    println!("hand-off took {:?}", released_at.elapsed());
    assert!(!raw_can_take(&mut obs, &Raw::text(contested)).await);
    lock.release().await.unwrap();
    let _ = assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(5)).await;
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn a_missed_deadline_names_the_holder(pool: PgPool) {
    let locker = mux(&pool, 2);
    let mut obs = observer_for(&pool).await;
    let holder_pid = backend_pid(&mut obs).await;
    assert!(raw_try_lock(&mut obs, &Raw::text("mux:deadline")).await);
    let started = Instant::now();
    let err = locker
        .lock("mux:deadline", Duration::from_millis(300))
        .await
        .expect_err("held elsewhere");
    let took = started.elapsed();
    match err {
        Error::Timeout {
            holder_pid: Some(pid),
            holder_application,
            ..
        } => {
            assert_eq!(pid, holder_pid);
            assert_eq!(holder_application.as_deref(), Some(OBSERVER_APP));
        }
        other => panic!("expected a timeout naming the holder, got {other:?}"),
    }
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert!(raw_unlock(&mut obs, &Raw::text("mux:deadline")).await);
    // Zero timeout: a single try.
    let lock = locker.lock("mux:deadline", Duration::ZERO).await.unwrap();
    lock.release().await.unwrap();
    let _ = assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(5)).await;
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn dropped_guards_and_dropped_futures_leave_nothing_held(pool: PgPool) {
    let locker = mux(&pool, 2);
    let mut obs = observer_for(&pool).await;
    let guards: Vec<_> = {
        let mut v = Vec::new();
        for i in 0..100 {
            v.push(
                locker
                    .try_lock(format!("mux:drop:{i}"))
                    .await
                    .unwrap()
                    .expect("free"),
            );
        }
        v
    };
    assert_eq!(granted_count(&mut obs).await, 100);
    drop(guards);
    let _ = assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(5)).await;

    // Futures dropped at arbitrary points, with and without a wait.
    assert!(raw_try_lock(&mut obs, &Raw::text("mux:drop:held")).await);
    for i in 0..200u64 {
        let cut = Duration::from_micros(i * 37 % 3_000);
        let _ = tokio::time::timeout(cut, locker.try_lock(format!("mux:cancel:{}", i % 7))).await;
        let _ =
            tokio::time::timeout(cut, locker.lock("mux:drop:held", Duration::from_secs(5))).await;
        let _ = tokio::time::timeout(cut, async {
            if let Some(lock) = locker
                .try_lock(format!("mux:cancel:rel:{i}"))
                .await
                .unwrap()
            {
                lock.release().await.unwrap();
            }
        })
        .await;
    }
    assert!(raw_unlock(&mut obs, &Raw::text("mux:drop:held")).await);
    let _ = assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(5)).await;
    // And every key is still usable.
    for i in 0..7 {
        let lock = locker
            .try_lock(format!("mux:cancel:{i}"))
            .await
            .unwrap()
            .expect("free");
        lock.release().await.unwrap();
    }
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn fencing_tokens_increase_in_multiplexed_mode(pool: PgPool) {
    distlock::migrate(&pool).await.expect("migrate");
    let locker = PgLocker::builder(pool.clone())
        .multiplex(2)
        .fencing(true)
        .build()
        .expect("valid settings");
    let plain = PgLocker::builder(pool.clone())
        .fencing(true)
        .build()
        .expect("valid settings");
    let mut last = 0;
    for i in 0..12 {
        let lock = match i % 3 {
            0 => locker.try_lock("mux:fence").await.unwrap().expect("free"),
            1 => locker
                .lock("mux:fence", Duration::from_secs(5))
                .await
                .unwrap(),
            // Shared counter with the default mode.
            _ => plain.try_lock("mux:fence").await.unwrap().expect("free"),
        };
        let token = lock.fencing_token().expect("fencing on").value();
        assert!(token > last, "{token} after {last}");
        last = token;
        lock.release().await.unwrap();
    }
    // A busy try issues no token.
    let held = locker.try_lock("mux:fence").await.unwrap().expect("free");
    assert!(plain.try_lock("mux:fence").await.unwrap().is_none());
    assert!(locker.try_lock("mux:fence").await.unwrap().is_none());
    let token = held.fencing_token().unwrap().value();
    held.release().await.unwrap();
    let next = locker.try_lock("mux:fence").await.unwrap().expect("free");
    assert_eq!(next.fencing_token().unwrap().value(), token + 1);
    next.release().await.unwrap();
}

#[sqlx::test(migrations = false)]
async fn a_stalled_shared_connection_loses_its_locks_within_the_heartbeat_bound(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let proxy = Proxy::start(connect_opts.get_host(), connect_opts.get_port())
        .await
        .expect("proxy");
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(proxy.options(&connect_opts))
        .await
        .expect("pool through the proxy");
    let heartbeat = Duration::from_millis(150);
    let locker = PgLocker::builder(pool.clone())
        .multiplex(1)
        .heartbeat(heartbeat)
        .heartbeat_timeout(Duration::from_millis(250))
        .build()
        .expect("valid settings");
    let mut held = Vec::new();
    for i in 0..20 {
        held.push(
            locker
                .try_lock(format!("mux:stall:{i}"))
                .await
                .unwrap()
                .expect("free"),
        );
    }
    tokio::time::sleep(heartbeat * 3).await;
    assert!(held.iter().all(|l| !l.is_lost()));

    proxy.stall();
    let started = Instant::now();
    let reason = bounded("lost()", Duration::from_secs(5), held[0].lost()).await;
    println!(
        "stalled shared connection: lost after {:?}",
        started.elapsed()
    );
    assert_eq!(
        reason,
        LossReason::HeartbeatTimedOut(Duration::from_millis(250))
    );
    assert!(held.iter().all(SessionLock::is_lost));
    // A release does not hang on the stalled link either.
    let released = bounded(
        "release",
        Duration::from_secs(3),
        held.pop().unwrap().release(),
    )
    .await;
    assert!(
        matches!(released, Err(Error::LockLost { .. })),
        "{released:?}"
    );

    // The socket was dropped; once the network is back, the server freed all.
    proxy.pass();
    proxy.cut();
    let mut obs = observer(&connect_opts).await;
    let _ = assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(10)).await;
    drop(held);
    bounded("pool close", Duration::from_secs(10), pool.close()).await;
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn many_local_waiters_of_one_key_each_get_it_once_in_turn(pool: PgPool) {
    let locker = mux(&pool, 2);
    let mut obs = observer_for(&pool).await;
    assert!(raw_try_lock(&mut obs, &Raw::text("mux:herd")).await);
    let inside = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let (locker, inside) = (locker.clone(), inside.clone());
        tasks.spawn(async move {
            let lock = locker
                .lock("mux:herd", Duration::from_secs(30))
                .await
                .expect("lock");
            assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
            tokio::time::sleep(Duration::from_millis(2)).await;
            inside.fetch_sub(1, Ordering::SeqCst);
            lock.release().await.expect("release");
        });
    }
    // Waiters that give up while queued behind the others do not disturb them.
    for _ in 0..8 {
        let waited = tokio::time::timeout(
            Duration::from_millis(50),
            locker.lock("mux:herd", Duration::from_secs(30)),
        )
        .await;
        assert!(waited.is_err(), "still held by the observer");
    }
    // Only one of this process's waiters waits on the server. (A cancelled
    // waiter's session may linger for up to 100 ms, until the server's
    // `client_connection_check_interval` notices it is gone.)
    eventually(
        "a single server-side waiter",
        Duration::from_secs(5),
        async || {
            advisory_locks(&mut obs)
                .await
                .iter()
                .filter(|r| !r.granted)
                .count()
                == 1
        },
    )
    .await;
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(30)).await;
        let waiting = advisory_locks(&mut obs)
            .await
            .iter()
            .filter(|r| !r.granted)
            .count();
        assert_eq!(waiting, 1, "one server-side waiter per process and key");
    }

    assert!(raw_unlock(&mut obs, &Raw::text("mux:herd")).await);
    bounded("16 waiters in turn", Duration::from_secs(20), async {
        while let Some(done) = tasks.join_next().await {
            done.unwrap();
        }
    })
    .await;
    let _ = assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(5)).await;
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn a_cancelled_wait_is_abandoned_on_the_server_promptly(pool: PgPool) {
    let locker = mux(&pool, 1);
    let mut obs = observer_for(&pool).await;
    assert!(raw_try_lock(&mut obs, &Raw::text("mux:abandon")).await);
    let waiting = {
        let locker = locker.clone();
        tokio::spawn(async move { locker.lock("mux:abandon", Duration::from_secs(60)).await })
    };
    wait_for_waiters(&mut obs, 1, Duration::from_secs(5)).await;
    waiting.abort();
    let gone = wait_for_no_waiters(&mut obs, Duration::from_secs(3)).await;
    println!("cancelled wait gone from pg_locks after {gone:?}");
    assert!(gone < Duration::from_secs(1), "{gone:?}");
    assert!(raw_unlock(&mut obs, &Raw::text("mux:abandon")).await);
    // The key is usable at once.
    let lock = locker.try_lock("mux:abandon").await.unwrap().expect("free");
    lock.release().await.unwrap();
    close(obs).await;
}

/// A migrated pool whose connections carry a `lock_timeout` of 300 ms, and
/// a fenced multiplexed locker on it. Shared connections are opened from
/// the pool's connect options, so they inherit the `lock_timeout`, which
/// ends a token write that [`block_fencing_counters`] holds up.
async fn fenced_mux_under_lock_timeout(connect: &PgConnectOptions) -> (PgPool, PgLocker) {
    let pool = PgPoolOptions::new()
        .connect_with(connect.clone().options([("lock_timeout", "300ms")]))
        .await
        .unwrap();
    distlock::migrate(&pool).await.unwrap();
    let locker = PgLocker::builder(pool.clone())
        .fencing(true)
        .multiplex(1)
        .build()
        .expect("valid settings");
    (pool, locker)
}

/// A multiplexed try whose token write fails after the grant must not leave
/// the key held by the shared session with no guard owning it.
#[sqlx::test(migrations = false)]
async fn a_fenced_try_whose_token_write_fails_leaves_no_lock_on_the_shared_session(
    _opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let (pool, locker) = fenced_mux_under_lock_timeout(&connect).await;
    let mut obs = observer(&connect).await;
    let raw = Raw::text("mux:leak");
    let first = locker.try_lock("mux:leak").await.unwrap().expect("free");
    first.release().await.unwrap();
    let blocker = block_fencing_counters(&pool).await;
    let outcome = locker.try_lock("mux:leak").await;
    assert!(outcome.is_err(), "no token, no lock: {outcome:?}");
    unblock_fencing_counters(blocker).await;
    // Nobody may hold it: not a pooled connection, not a shared session.
    eventually(
        "no advisory lock left",
        Duration::from_secs(2),
        async || granted_count(&mut obs).await == 0,
    )
    .await;
    assert!(raw_can_take(&mut obs, &raw).await);
    let again = locker.try_lock("mux:leak").await.unwrap();
    assert!(again.is_some(), "the key stayed on the shared session");
}

/// The same, where the failed try's name is another spelling of a lock the
/// shared session holds: PostgreSQL grants it again (one more level, no
/// new row in `pg_locks`), so the session cannot show that the try took
/// nothing, and the connection goes with both. Were it kept, the extra
/// level would hold the key past the other lock's release.
#[sqlx::test(migrations = false)]
async fn a_failed_fenced_try_that_reentered_a_held_lock_is_not_trusted_to_have_taken_nothing(
    _opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let (pool, locker) = fenced_mux_under_lock_timeout(&connect).await;
    let mut obs = observer(&connect).await;
    let id = i64::from(hashtext(&mut obs, "mux:respelled").await);
    let held = locker
        .try_lock(LockKey::id(id))
        .await
        .unwrap()
        .expect("free");
    let blocker = block_fencing_counters(&pool).await;
    let outcome = locker.try_lock("mux:respelled").await;
    assert!(outcome.is_err(), "no token, no lock: {outcome:?}");
    unblock_fencing_counters(blocker).await;
    bounded(
        "the held lock reported lost",
        Duration::from_secs(5),
        held.lost(),
    )
    .await;
    drop(held);
    eventually(
        "no advisory lock left",
        Duration::from_secs(2),
        async || granted_count(&mut obs).await == 0,
    )
    .await;
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn max_locks_caps_the_locks_held_with_a_typed_error(pool: PgPool) {
    let locker = PgLocker::builder(pool.clone())
        .multiplex(2)
        .max_locks(3)
        .build()
        .expect("valid settings");
    let mut held = Vec::new();
    for i in 0..3 {
        held.push(locker.try_lock(format!("cap:{i}")).await.unwrap().unwrap());
    }
    // The fourth fails at once, try or wait, and holds nothing.
    let started = Instant::now();
    assert!(matches!(
        locker.try_lock("cap:3").await,
        Err(Error::TooManyLocks { limit: 3 })
    ));
    assert!(matches!(
        locker.lock("cap:3", Duration::from_secs(5)).await,
        Err(Error::TooManyLocks { limit: 3 })
    ));
    assert!(started.elapsed() < Duration::from_secs(1));
    // A clone shares the cap.
    assert!(matches!(
        locker.clone().try_lock("cap:3").await,
        Err(Error::TooManyLocks { .. })
    ));
    // Busy keys do not use up places.
    let other = PgLocker::new(pool.clone());
    let foreign = other.try_lock("cap:busy").await.unwrap().unwrap();
    held.pop().unwrap().release().await.unwrap();
    for _ in 0..5 {
        assert!(locker.try_lock("cap:busy").await.unwrap().is_none());
    }
    foreign.release().await.unwrap();
    // Released and dropped guards give their place back.
    held.push(locker.try_lock("cap:3").await.unwrap().unwrap());
    drop(held.pop());
    let mut again = None;
    eventually(
        "a dropped guard's place is given back",
        Duration::from_secs(5),
        async || {
            again = locker.try_lock("cap:4").await.ok().flatten();
            again.is_some()
        },
    )
    .await;
    again.unwrap().release().await.unwrap();
    for lock in held {
        lock.release().await.unwrap();
    }
}

/// A multiplexed lock is kept by its shared connection's driver, on the
/// runtime that opened that connection. A lock taken on another runtime,
/// which then shuts down, stays held and trusted: nothing of it may live on
/// that runtime (a task there that owned the lock's ticket let the lock go,
/// as the runtime dropped it, behind a guard that still reported it held).
#[sqlx::test(migrations = false)]
async fn a_lock_outlives_the_runtime_that_took_it(pool: PgPool) {
    let locker = mux(&pool, 1);
    // The driver starts here, on the test's runtime.
    let warm = locker.try_lock("mux:warm").await.unwrap().unwrap();
    warm.release().await.unwrap();
    let other = locker.clone();
    let lock = tokio::task::spawn_blocking(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let lock = rt.block_on(other.try_lock("mux:rt")).unwrap();
        drop(rt);
        lock.expect("free")
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!lock.is_lost(), "{:?}", lock.loss());
    let rival = PgLocker::new(pool.clone());
    assert!(
        rival.try_lock("mux:rt").await.unwrap().is_none(),
        "the lock was let go while its guard reports it held"
    );
    lock.release().await.unwrap();
    let taken = rival.try_lock("mux:rt").await.unwrap();
    assert!(taken.is_some(), "released");
}

/// A try that takes nothing gives its place under `max_locks` back before
/// its caller hears the answer: the caller's next try, at once, never finds
/// the cap full of places nobody holds. A key the multiplexer already holds
/// is answered busy without a round trip, which makes the window between
/// the answer and the place's return as wide as a reply's wake-up.
#[sqlx::test(migrations = false)]
async fn a_busy_try_gives_its_place_back_before_it_answers(pool: PgPool) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("runtime");
    let outcome = std::thread::spawn(move || {
        runtime.block_on(async move {
            let locker = PgLocker::builder(pool.clone())
                .multiplex(1)
                .max_locks(2)
                .build()
                .expect("valid settings");
            let held = locker.try_lock("cap:reentrant").await.unwrap().unwrap();
            let spurious = tokio::spawn(async move {
                for round in 0..50_000 {
                    match locker.try_lock("cap:reentrant").await {
                        Ok(None) => {}
                        other => return Some((round, format!("{other:?}"))),
                    }
                }
                None
            })
            .await
            .expect("the tries");
            held.release().await.unwrap();
            spurious
        })
    })
    .join()
    .expect("the runtime's thread");
    assert_eq!(outcome, None, "a busy try was refused at the cap");
}

/// A multiplexed `lock()` whose waiting connection comes late from a busy
/// pool waits on the server only for what is left of its timeout: it
/// times out at its deadline, not granted a second after it (the wait's
/// `lock_timeout` was measured before the pool handed the connection out).
#[sqlx::test(migrations = false)]
async fn a_multiplexed_wait_counts_the_time_spent_getting_its_connection(pool: PgPool) {
    let busy_pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with((*pool.connect_options()).clone())
        .await
        .expect("a pool of one");
    let locker = PgLocker::builder(busy_pool.clone())
        .multiplex(1)
        .heartbeat_timeout(Duration::from_secs(5))
        .build()
        .expect("valid settings");
    let holder = PgLocker::new(pool.clone());
    let held = holder.try_lock("mux:late-conn").await.unwrap().unwrap();
    // The pool's one connection is busy for 1.5 s; the key is let go at 3 s.
    let work = busy_pool.acquire().await.expect("the pool's connection");
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        drop(work);
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        held.release().await.unwrap();
    });
    let started = Instant::now();
    let outcome = locker.lock("mux:late-conn", Duration::from_secs(2)).await;
    let took = started.elapsed();
    assert!(
        matches!(outcome, Err(Error::Timeout { .. })),
        "{outcome:?} after {took:?}"
    );
    assert!(
        took < Duration::from_millis(2_800),
        "timed out after {took:?}"
    );
}

/// Every try queued for a shared connection that fails to open learns why,
/// in the first round. Before, only the first try of each round got the
/// server's error; the others retried on a fresh connection, and past the
/// third round got `MultiplexFailed` (each round costing up to twice the
/// pool's `acquire_timeout` against an unreachable server). Causes: a
/// missing database, nothing listening, a server that never answers, a role
/// without the CONNECT right.
#[sqlx::test(migrations = false)]
async fn every_try_queued_for_a_connection_that_fails_to_open_learns_why(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    init_tracing();
    // Refused at once by the server: a database that does not exist.
    let missing = PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy_with(connect_opts.clone().database("distlock_no_such_database"));
    // Refused by nobody listening: the pool retries until its deadline,
    // then one direct attempt tells why.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let nobody = PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy_with(connect_opts.clone().host("127.0.0.1").port(port));
    for (pool, expected) in [(missing, "3D000"), (nobody, "connection refused")] {
        let answers = queued_answers(&pool).await;
        for answer in &answers {
            let Err(Error::ConnectFailed { cause }) = answer else {
                panic!("{expected}: expected ConnectFailed, got {answers:?}");
            };
            let said = match cause.as_ref() {
                sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
                sqlx::Error::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused => {
                    Some("connection refused".to_owned())
                }
                _ => None,
            };
            assert_eq!(said.as_deref(), Some(expected), "{answer:?}");
            let shown = answer.as_ref().expect_err("failed").to_string();
            assert!(shown.contains("multiplexed connection"), "{shown}");
        }
    }

    // A server that accepts and never answers: the pool gives up at its
    // deadline, and so does the direct attempt after it; a copied
    // `ConnectTimedOut` each.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a free port");
    let port = silent.local_addr().expect("its address").port();
    let holding = tokio::spawn(async move {
        let mut accepted = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            accepted.push(socket);
        }
    });
    let mute = PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy_with(connect_opts.clone().host("127.0.0.1").port(port));
    let answers = queued_answers(&mute).await;
    for answer in &answers {
        assert!(
            matches!(answer, Err(Error::ConnectTimedOut { after }) if *after == Duration::from_millis(300)),
            "expected ConnectTimedOut, got {answers:?}"
        );
    }
    holding.abort();

    // A role without the CONNECT right: a copied `PermissionDenied` each.
    let admin = pool_opts
        .connect_with(connect_opts.clone())
        .await
        .expect("admin pool");
    let role = make_role(&admin, "dlmux_noconnect").await;
    let db: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(&admin)
        .await
        .expect("current_database");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "REVOKE CONNECT ON DATABASE \"{db}\" FROM PUBLIC"
    )))
    .execute(&admin)
    .await
    .expect("revoke");
    let refused = PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy_with(connect_opts.clone().username(&role));
    let answers = queued_answers(&refused).await;
    for answer in &answers {
        assert!(
            matches!(answer, Err(Error::PermissionDenied { message }) if message.contains("permission denied for database")),
            "expected PermissionDenied, got {answers:?}"
        );
    }
    refused.close().await;
    drop_role(&admin, &role).await.expect("drop role");
    admin.close().await;
}

/// What 8 tries queued at once for the one shared connection of a
/// multiplexed locker on `pool` answer.
async fn queued_answers(pool: &PgPool) -> Vec<Result<bool, Error>> {
    let locker = mux(pool, 1);
    let mut tries = tokio::task::JoinSet::new();
    for k in 0..8 {
        let locker = locker.clone();
        tries.spawn(async move { locker.try_lock(format!("unopened:{k}")).await });
    }
    let mut answers = Vec::new();
    while let Some(joined) = tries.join_next().await {
        answers.push(joined.expect("try").map(|lock| lock.is_some()));
    }
    answers
}
