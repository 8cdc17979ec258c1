//! Network faults between a lock holder and PostgreSQL, injected with a
//! loopback proxy (tests/common/proxy.rs): a stalled network (bytes stop
//! flowing, nothing is closed) and a cut connection.

use crate::common;

use std::time::{Duration, Instant};

use common::proxy::Proxy;
use common::*;
use distlock::{ElectionLocker, Error, LockKey, LossReason, PgLocker, Proclamation, Seat};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgPool};

/// A proxy in front of the test database and a pool whose connections all go
/// through it.
async fn proxied(connect_opts: &PgConnectOptions, max: u32) -> (Proxy, PgPool) {
    let proxy = Proxy::start(connect_opts.get_host(), connect_opts.get_port())
        .await
        .expect("proxy");
    let pool = PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(3))
        .connect_with(
            proxy
                .options(connect_opts)
                .application_name("distlock-proxied"),
        )
        .await
        .expect("pool through the proxy");
    assert!(proxy.accepted() >= 1, "the pool connects through the proxy");
    (proxy, pool)
}

/// Restores the network and closes everything (a pool cannot close over a
/// stalled link).
pub(crate) async fn teardown(proxy: Proxy, pool: PgPool) {
    proxy.pass();
    proxy.cut();
    bounded("pool close", Duration::from_secs(10), pool.close()).await;
    drop(proxy);
}

#[sqlx::test(migrations = false)]
async fn stalled_network_is_lost_with_heartbeat_timeout_and_cut_frees_server_lock(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let heartbeat = Duration::from_millis(200);
    let heartbeat_timeout = Duration::from_millis(300);
    let (proxy, pool) = proxied(&connect_opts, 3).await;
    let locker = PgLocker::builder(pool.clone())
        .heartbeat(heartbeat)
        .heartbeat_timeout(heartbeat_timeout)
        .build()
        .expect("valid settings");
    let mut obs = observer(&connect_opts).await;

    let guard = locker
        .try_lock("faults:stall")
        .await
        .unwrap()
        .expect("free");
    // Heartbeats pass through the healthy proxy.
    tokio::time::sleep(heartbeat * 3).await;
    assert!(
        !guard.is_lost(),
        "healthy network: not lost ({:?})",
        guard.loss()
    );

    proxy.stall();
    let started = Instant::now();
    let bound = heartbeat + heartbeat_timeout + Duration::from_millis(700);
    let reason = bounded(
        "lost() under a stalled network",
        Duration::from_secs(10),
        guard.lost(),
    )
    .await;
    let took = started.elapsed();
    println!("stalled network: lost() after {took:?} ({reason})");
    assert_eq!(reason, LossReason::HeartbeatTimedOut(heartbeat_timeout));
    assert!(
        took <= bound,
        "lost() must fire within heartbeat + heartbeat_timeout + slack = {bound:?}, took {took:?}"
    );
    assert!(
        took >= heartbeat_timeout,
        "cannot be declared lost before a heartbeat timed out: {took:?}"
    );
    assert!(guard.is_lost());

    // The server cannot know yet: behind the partition the session still holds it.
    assert!(
        !raw_can_take(&mut obs, &Raw::text("faults:stall")).await,
        "partitioned session still holds the lock"
    );
    // Once the connection is cut, the server frees it.
    proxy.cut();
    let freed = eventually(
        "server frees the lock after the cut",
        Duration::from_secs(5),
        async || raw_can_take(&mut obs, &Raw::text("faults:stall")).await,
    )
    .await;
    println!("server freed the lock {freed:?} after the cut");
    assert!(matches!(guard.release().await, Err(Error::LockLost { .. })));
    close(obs).await;
    teardown(proxy, pool).await;
}

#[sqlx::test(migrations = false)]
async fn release_under_stalled_network_returns_err_within_release_timeout(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let release_timeout = Duration::from_millis(400);
    let (proxy, pool) = proxied(&connect_opts, 3).await;
    // The longest heartbeat, so no heartbeat is in flight: this is about
    // release().
    let locker = PgLocker::builder(pool.clone())
        .heartbeat(Duration::from_secs(10))
        .release_timeout(release_timeout)
        .build()
        .expect("valid settings");
    let mut obs = observer(&connect_opts).await;
    let guard = locker
        .try_lock("faults:release")
        .await
        .unwrap()
        .expect("free");
    let size_before = pool.size();

    proxy.stall();
    let started = Instant::now();
    let res = bounded(
        "release() under a stalled network",
        Duration::from_secs(10),
        guard.release(),
    )
    .await;
    let took = started.elapsed();
    println!("release() under a stalled network returned {res:?} after {took:?}");
    match res {
        Err(Error::ReleaseTimedOut { key, after }) => {
            assert_eq!(key, LockKey::from("faults:release"));
            assert_eq!(after, release_timeout);
        }
        other => panic!("expected Err(ReleaseTimedOut), got {other:?}"),
    }
    assert!(took >= release_timeout, "{took:?}");
    assert!(
        took <= release_timeout + Duration::from_millis(600),
        "release() must give up at its deadline, took {took:?}"
    );
    // The connection was closed, not returned to the pool.
    eventually(
        "the stalled connection leaves the pool",
        Duration::from_secs(2),
        async || pool.size() < size_before,
    )
    .await;

    proxy.cut();
    eventually(
        "server frees the lock after the cut",
        Duration::from_secs(5),
        async || raw_can_take(&mut obs, &Raw::text("faults:release")).await,
    )
    .await;
    close(obs).await;
    teardown(proxy, pool).await;
}

#[sqlx::test(migrations = false)]
async fn release_under_stalled_network_with_heartbeat_in_flight_honours_release_timeout(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let release_timeout = Duration::from_millis(300);
    let (proxy, pool) = proxied(&connect_opts, 3).await;
    let locker = PgLocker::builder(pool.clone())
        .heartbeat(Duration::from_millis(100))
        .heartbeat_timeout(Duration::from_secs(4))
        .release_timeout(release_timeout)
        .build()
        .expect("valid settings");
    let guard = locker
        .try_lock("faults:release-hb")
        .await
        .unwrap()
        .expect("free");
    proxy.stall();
    // Let a heartbeat start and hang on the stalled link.
    tokio::time::sleep(Duration::from_millis(250)).await;
    let started = Instant::now();
    let res = bounded("release()", Duration::from_secs(10), guard.release()).await;
    let took = started.elapsed();
    println!("release() with a heartbeat in flight returned {res:?} after {took:?}");
    assert!(res.is_err());
    assert!(
        took <= release_timeout + Duration::from_millis(600),
        "release() took {took:?}, release_timeout is {release_timeout:?}"
    );
    teardown(proxy, pool).await;
}

#[sqlx::test(migrations = false)]
async fn cut_connection_makes_lost_fire_with_connection_failed(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let heartbeat = Duration::from_millis(200);
    let (proxy, pool) = proxied(&connect_opts, 3).await;
    let locker = PgLocker::builder(pool.clone())
        .heartbeat(heartbeat)
        .build()
        .expect("valid settings");
    let mut obs = observer(&connect_opts).await;
    let guard = locker.try_lock("faults:cut").await.unwrap().expect("free");
    tokio::time::sleep(heartbeat * 2).await;
    assert!(!guard.is_lost());

    proxy.cut();
    let started = Instant::now();
    let reason = bounded("lost() after a cut", Duration::from_secs(10), guard.lost()).await;
    let took = started.elapsed();
    println!("cut connection: lost() after {took:?} ({reason})");
    assert!(
        matches!(reason, LossReason::ConnectionFailed(_)),
        "reason: {reason:?}"
    );
    assert!(
        took <= 2 * heartbeat + Duration::from_millis(500),
        "took {took:?}"
    );
    assert!(guard.is_lost());
    // Both sides were closed, so the server freed the lock.
    eventually(
        "server frees the lock after the cut",
        Duration::from_secs(5),
        async || raw_can_take(&mut obs, &Raw::text("faults:cut")).await,
    )
    .await;
    match guard.release().await {
        Err(Error::LockLost { reason: r, .. }) => assert_eq!(r, reason),
        other => panic!("expected LockLost, got {other:?}"),
    }
    // The locker recovers through the (passing) proxy.
    let g = locker
        .try_lock("faults:cut")
        .await
        .unwrap()
        .expect("free again");
    g.release().await.unwrap();
    close(obs).await;
    teardown(proxy, pool).await;
}

/// A pool of one connection through a fresh proxy, handing out connections
/// without a ping, so a statement goes straight into the stalled link.
pub(crate) async fn proxied_unpinged(connect_opts: &PgConnectOptions) -> (Proxy, PgPool) {
    let proxy = Proxy::start(connect_opts.get_host(), connect_opts.get_port())
        .await
        .unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .connect_with(proxy.options(connect_opts))
        .await
        .unwrap();
    (proxy, pool)
}

#[sqlx::test(migrations = false)]
async fn lock_under_stalled_network_times_out_instead_of_hanging(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    // Documented: if the server does not answer within `timeout` plus the
    // heartbeat deadline, the attempt is abandoned and reported as a timeout.
    stalled_wait(&connect_opts, "lock()", async |l, timeout| {
        l.lock("faults:lock", timeout).await
    })
    .await;
}

#[sqlx::test(migrations = false)]
async fn first_lock_of_a_locker_under_stalled_network_times_out_instead_of_hanging(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let heartbeat_timeout = Duration::from_millis(300);
    let timeout = Duration::from_millis(500);
    let (proxy, pool) = proxied_unpinged(&connect_opts).await;
    let locker = PgLocker::builder(pool.clone())
        .heartbeat_timeout(heartbeat_timeout)
        .build()
        .expect("valid settings");
    proxy.stall();
    let started = Instant::now();
    let res = bounded(
        "first lock() under a stalled network",
        Duration::from_secs(10),
        locker.lock("faults:lock", timeout),
    )
    .await;
    let took = started.elapsed();
    println!("first lock() under a stalled network: {res:?} after {took:?}");
    assert!(matches!(res, Err(Error::Timeout { .. })), "got {res:?}");
    assert!(
        took <= timeout + heartbeat_timeout + Duration::from_millis(700),
        "{took:?}"
    );
    teardown(proxy, pool).await;
}

#[sqlx::test(migrations = false)]
async fn lock_under_stalled_network_with_idle_connections_does_not_hang(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let heartbeat_timeout = Duration::from_millis(300);
    let timeout = Duration::from_millis(500);
    let (proxy, pool) = proxied(&connect_opts, 3).await;
    // Two idle connections in the pool.
    {
        let a = pool.acquire().await.unwrap();
        let b = pool.acquire().await.unwrap();
        drop((a, b));
    }
    eventually("two idle connections", Duration::from_secs(5), async || {
        pool.num_idle() >= 2
    })
    .await;
    let locker = PgLocker::builder(pool.clone())
        .heartbeat_timeout(heartbeat_timeout)
        .build()
        .expect("valid settings");
    locker
        .try_lock("faults:warm")
        .await
        .unwrap()
        .expect("free")
        .release()
        .await
        .unwrap();
    eventually(
        "two idle connections again",
        Duration::from_secs(5),
        async || pool.num_idle() >= 2,
    )
    .await;
    proxy.stall();
    let started = Instant::now();
    let res = bounded(
        "lock() under a stalled network",
        Duration::from_secs(10),
        locker.lock("faults:lock-idle", timeout),
    )
    .await;
    let took = started.elapsed();
    println!("lock() under a stalled network (idle connections): {res:?} after {took:?}");
    // The pool's ping of an idle connection stalls too: the call may never
    // get a connection (NoConnection) or time out on the server's answer.
    assert!(
        matches!(res, Err(Error::Timeout { .. } | Error::NoConnection { .. })),
        "got {res:?}"
    );
    assert!(
        took <= timeout + heartbeat_timeout + Duration::from_millis(700),
        "{took:?}"
    );
    teardown(proxy, pool).await;
}

#[sqlx::test(migrations = false)]
async fn proxy_stall_and_pass_are_transparent_when_short(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    // Sanity check of the fault injector itself: a stall shorter than the
    // heartbeat deadline is not a loss, and traffic resumes after it.
    let (proxy, pool) = proxied(&connect_opts, 2).await;
    let locker = PgLocker::builder(pool.clone())
        .heartbeat(Duration::from_millis(100))
        .heartbeat_timeout(Duration::from_secs(3))
        .build()
        .expect("valid settings");
    let guard = locker.try_lock("faults:blip").await.unwrap().expect("free");
    proxy.stall();
    tokio::time::sleep(Duration::from_millis(400)).await;
    // While stalled, a query cannot complete.
    let stalled = tokio::time::timeout(
        Duration::from_millis(200),
        sqlx::query("SELECT 1").execute(&pool),
    )
    .await;
    assert!(stalled.is_err(), "the stall must stop traffic");
    proxy.pass();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !guard.is_lost(),
        "a short stall is not a loss: {:?}",
        guard.loss()
    );
    bounded(
        "release after the blip",
        Duration::from_secs(5),
        guard.release(),
    )
    .await
    .unwrap();
    teardown(proxy, pool).await;
}

/// One try under a stalled network, on a fresh proxy and locker whose
/// connection stalled after a healthy first lock: it must fail with
/// `CommandTimedOut` within the heartbeat deadline (a try has no timeout of
/// its own) instead of hanging until TCP gives up, and leave nothing held
/// once the network is back.
async fn stalled_try<T: std::fmt::Debug>(
    connect_opts: &PgConnectOptions,
    (what, named): (&str, &str),
    try_it: impl AsyncFnOnce(&PgLocker) -> Result<T, Error>,
) {
    let heartbeat_timeout = Duration::from_millis(300);
    let (proxy, pool, locker) = stalled_locker(connect_opts, heartbeat_timeout).await;
    let started = Instant::now();
    let res = bounded(what, Duration::from_secs(10), try_it(&locker)).await;
    let took = started.elapsed();
    println!("{what} under a stalled network: {res:?} after {took:?}");
    assert!(
        matches!(&res, Err(Error::CommandTimedOut { key, after })
            if *after == heartbeat_timeout && *key == LockKey::from(named)),
        "{what}: got {res:?}"
    );
    assert!(
        took <= heartbeat_timeout + Duration::from_millis(700),
        "{what}: {took:?}"
    );
    // Its connection is closed, not given back to sqlx, whose return to the
    // pool pings it without a deadline: a slot held until TCP gives up.
    eventually(
        &format!("{what}: its connection closed"),
        Duration::from_secs(1),
        async || pool.size() == 0,
    )
    .await;
    proxy.pass();
    let mut observer = sqlx::PgConnection::connect_with(connect_opts)
        .await
        .unwrap();
    let held = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
                AND database = (SELECT oid FROM pg_database WHERE datname = current_database())";
    eventually(
        "nothing held once the network is back",
        Duration::from_secs(5),
        async || {
            sqlx::query_scalar::<_, i64>(held)
                .fetch_one(&mut observer)
                .await
                .unwrap()
                == 0
        },
    )
    .await;
    close(observer).await;
    teardown(proxy, pool).await;
}

#[sqlx::test(migrations = false)]
async fn tries_under_stalled_network_fail_within_the_heartbeat_deadline(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    stalled_try(&connect_opts, ("try_lock()", "faults:t"), async |l| {
        l.try_lock("faults:t").await
    })
    .await;
    stalled_try(
        &connect_opts,
        ("try_lock_shared()", "faults:t"),
        async |l| l.try_lock_shared("faults:t").await,
    )
    .await;
    stalled_try(
        &connect_opts,
        ("try_lock_upgradeable()", "faults:t"),
        async |l| l.try_lock_upgradeable("faults:t").await,
    )
    .await;
    stalled_try(&connect_opts, ("try_lock_all()", "faults:a"), async |l| {
        l.try_lock_all(["faults:a", "faults:b"]).await
    })
    .await;
    stalled_try(
        &connect_opts,
        ("Semaphore::try_acquire()", "faults:s"),
        async |l| l.semaphore("faults:s", 2)?.try_acquire().await,
    )
    .await;
}

/// The leader election's records (`proclaim`, `withdraw`, `leader`) and
/// the semaphore's `available_permits` under a stalled network: each sent
/// its statement on a pooled connection without a deadline and waited until
/// TCP gave up, so a campaign could hold the election's lock and never
/// lead, and each read the observer gave up on kept a pool slot. Each now
/// fails within the heartbeat deadline, its connection closed.
#[sqlx::test(migrations = false)]
async fn election_records_under_stalled_network_fail_within_the_heartbeat_deadline(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let direct = pool_opts.connect_with(connect_opts.clone()).await.unwrap();
    distlock::migrate(&direct).await.expect("migrate");
    let key = LockKey::from("faults:e");
    let seat = Seat::new(1);
    stalled_try(&connect_opts, ("leader()", "faults:e"), async |l| {
        l.leader(&key).await
    })
    .await;
    stalled_try(&connect_opts, ("withdraw()", "faults:e"), async |l| {
        l.withdraw(&key, seat, None).await
    })
    .await;
    let proclamation = Proclamation {
        identity: "faults".into(),
        value: String::new(),
        fencing_token: None,
        grace: Duration::ZERO,
    };
    stalled_try(&connect_opts, ("proclaim()", "faults:e"), async |l| {
        l.proclaim(&key, seat, &proclamation).await
    })
    .await;
    stalled_try(
        &connect_opts,
        ("Semaphore::available_permits()", "faults:s"),
        async |l| l.semaphore("faults:s", 2)?.available_permits().await,
    )
    .await;
    direct.close().await;
}

/// A semaphore's waiters under a stalled network. While its process holds
/// the semaphore's queue, it tries the slots in the background (its fill)
/// every 200 ms on other pooled connections; those tries had no deadline,
/// so a try sent into the stall kept its connection, and the process's
/// fill (no other could start), until TCP gave up, long after every waiter
/// had returned. Each try now answers within the heartbeat deadline or its
/// connection is closed.
#[sqlx::test(migrations = false)]
async fn a_semaphore_fill_under_a_stalled_network_closes_its_connections(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    const NAME: &str = "faults:fill";
    let direct = pool_opts.connect_with(connect_opts.clone()).await.unwrap();
    let holder = PgLocker::new(direct.clone()).semaphore(NAME, 1).unwrap();
    let held = holder.try_acquire().await.unwrap().expect("free");
    let proxy = Proxy::start(connect_opts.get_host(), connect_opts.get_port())
        .await
        .unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .test_before_acquire(false)
        .connect_with(proxy.options(&connect_opts))
        .await
        .unwrap();
    let locker = PgLocker::builder(pool.clone())
        .heartbeat_timeout(Duration::from_millis(300))
        .build()
        .expect("valid settings");
    let semaphore = locker.semaphore(NAME, 1).unwrap();
    let waiters: Vec<_> = (0..2)
        .map(|_| {
            let semaphore = semaphore.clone();
            tokio::spawn(async move { semaphore.acquire(Duration::from_secs(2)).await })
        })
        .collect();
    // The head holds the queue, and its fill has tried the slots (busy) on
    // a healthy network. The stall starts between two fill rounds, when
    // every connection but the queue's is back in the pool: one still on
    // its way back (sqlx pings it first, without a deadline) would stay
    // out under the stall whatever the fill does.
    tokio::time::sleep(Duration::from_millis(500)).await;
    eventually(
        "the fill's connections back in the pool",
        Duration::from_secs(1),
        async || pool.size() >= 2 && pool.num_idle() + 1 == pool.size() as usize,
    )
    .await;
    proxy.stall();
    for waiter in waiters {
        let res = bounded("a waiter under the stall", Duration::from_secs(5), waiter)
            .await
            .unwrap();
        assert!(res.is_err(), "no permit was free: {res:?}");
    }
    // None out of the pool: an idle one no round reached may stay.
    eventually(
        "every connection of the stalled fill closed",
        Duration::from_secs(1),
        async || pool.size() as usize == pool.num_idle(),
    )
    .await;
    held.release().await.unwrap();
    teardown(proxy, pool).await;
    direct.close().await;
}

/// A migrated test database with a locker on it, and a singleton job `key`
/// on that locker whose run record (`once_per_window`) is on a pool of one
/// unpinged connection through a proxy, so that the record can stall
/// alone.
async fn job_with_proxied_record(
    pool_opts: PgPoolOptions,
    connect_opts: &PgConnectOptions,
    key: &str,
) -> (
    PgPool,
    std::sync::Arc<PgLocker>,
    (Proxy, PgPool),
    distlock::SingletonJob,
) {
    let direct = pool_opts.connect_with(connect_opts.clone()).await.unwrap();
    distlock::migrate(&direct).await.expect("migrate");
    let locker = std::sync::Arc::new(PgLocker::new(direct.clone()));
    let (proxy, record) = proxied_unpinged(connect_opts).await;
    let job = distlock::SingletonJob::builder(locker.clone(), key)
        .once_per_window(record.clone(), Duration::from_secs(86_400))
        .build()
        .expect("valid settings");
    (direct, locker, (proxy, record), job)
}

/// The record's connection is closed, not left to sqlx's return ping.
async fn record_closed(record: &PgPool) {
    eventually(
        "the record's connection closed",
        Duration::from_secs(1),
        async || record.size() == 0,
    )
    .await;
}

/// Stalls `proxy` once the one connection of `record` is idle in its pool,
/// not on its way back (sqlx's return ping, which a stall would hold).
async fn stall_when_idle(proxy: &Proxy, record: &PgPool) {
    eventually(
        "the record's connection is idle in the pool",
        Duration::from_secs(5),
        async || record.num_idle() == 1,
    )
    .await;
    proxy.stall();
}

/// A singleton job's run record under a stalled network: the claim of the
/// window waited for its answer without a deadline, until TCP gave up,
/// holding the job's lock all the while (another replica could not run the
/// job either). It now fails with `CommandTimedOut` naming the job after
/// the record's deadline (5 s), its connection closed, and the lock is
/// released.
#[sqlx::test(migrations = false)]
async fn a_job_run_record_under_stalled_network_fails_within_its_deadline(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let (direct, locker, (proxy, record), job) =
        job_with_proxied_record(pool_opts, &connect_opts, "faults:job").await;
    sqlx::query("SELECT 1").execute(&record).await.unwrap();
    stall_when_idle(&proxy, &record).await;
    let started = Instant::now();
    let ran = bounded(
        "a run under a stalled record",
        Duration::from_secs(15),
        job.run(async |_ctx| Ok::<_, std::convert::Infallible>(())),
    )
    .await;
    let took = started.elapsed();
    match ran {
        Err(Error::CommandTimedOut { key, after }) => {
            assert_eq!(
                (key, after),
                (LockKey::from("faults:job"), Duration::from_secs(5))
            );
        }
        other => panic!("expected CommandTimedOut, got {other:?}"),
    }
    assert!(took < Duration::from_secs(7), "{took:?}");
    record_closed(&record).await;
    let again = locker.try_lock("faults:job").await.unwrap();
    assert!(again.is_some(), "the job's lock was released");
    drop(again);
    teardown(proxy, record).await;
    direct.close().await;
}

/// The same record's note of how a run ended, sent after the job into a
/// stalled network: given up 5 s after its send, its connection closed;
/// the run's outcome is kept.
#[sqlx::test(migrations = false)]
async fn a_job_run_note_under_stalled_network_keeps_the_outcome(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let (direct, _locker, (proxy, record), job) =
        job_with_proxied_record(pool_opts, &connect_opts, "faults:note").await;
    let mut stalled_at = None;
    let ran = bounded(
        "a run whose note meets a stall",
        Duration::from_secs(15),
        job.run(async |_ctx| {
            // The claim's connection back in the pool, then the stall.
            stall_when_idle(&proxy, &record).await;
            stalled_at = Some(Instant::now());
            Ok::<_, std::convert::Infallible>(7)
        }),
    )
    .await;
    let took = stalled_at.expect("the job ran").elapsed();
    assert!(
        matches!(ran, Ok(distlock::JobOutcome::Ran(7))),
        "the outcome is kept: {ran:?}"
    );
    assert!(took < Duration::from_secs(7), "{took:?}");
    record_closed(&record).await;
    teardown(proxy, record).await;
    direct.close().await;
}

#[sqlx::test(migrations = false)]
async fn lock_all_under_stalled_network_times_out_instead_of_hanging(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    // As for lock(): the attempt, its first try included.
    stalled_wait(&connect_opts, "lock_all()", async |l, timeout| {
        l.lock_all(["faults:a", "faults:b"], timeout).await
    })
    .await;
}

#[sqlx::test(migrations = false)]
async fn with_advisory_lock_under_stalled_network_fails_within_the_heartbeat_deadline(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    stalled_try(
        &connect_opts,
        ("with_advisory_lock()", "faults:x"),
        async |l| {
            l.with_advisory_lock("faults:x", async |_conn| Ok::<_, Error>(0))
                .await
        },
    )
    .await;
}

/// The same with the try sent in the `BEGIN`'s round trip
/// (`try_with_begin`), whose answer is the one that stalls.
#[sqlx::test(migrations = false)]
async fn with_advisory_lock_trying_with_begin_under_stalled_network_fails_within_the_heartbeat_deadline(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    stalled_try(
        &connect_opts,
        ("with_advisory_lock() trying with BEGIN", "faults:x"),
        async |l| {
            let trying = PgLocker::builder(l.pool().clone())
                .heartbeat_timeout(l.heartbeat_timeout())
                .try_with_begin(true)
                .build()
                .expect("valid settings");
            trying
                .with_advisory_lock("faults:x", async |_conn| Ok::<_, Error>(0))
                .await
        },
    )
    .await;
}

#[sqlx::test(migrations = false)]
async fn with_advisory_lock_wait_under_stalled_network_times_out_instead_of_hanging(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    stalled_wait(
        &connect_opts,
        "with_advisory_lock_wait()",
        async |l, timeout| {
            l.with_advisory_lock_wait("faults:x", timeout, async |_conn| Ok::<_, Error>(0))
                .await
        },
    )
    .await;
}

/// One waiting call under a stalled network, on a fresh proxy and locker
/// whose connection stalled after a healthy first lock: as documented for
/// `lock()`, it must give up a heartbeat deadline after its `timeout` with
/// `Error::Timeout` instead of hanging until TCP gives up.
async fn stalled_wait<T: std::fmt::Debug>(
    connect_opts: &PgConnectOptions,
    what: &str,
    wait: impl AsyncFnOnce(&PgLocker, Duration) -> Result<T, Error>,
) {
    let heartbeat_timeout = Duration::from_millis(300);
    let timeout = Duration::from_millis(500);
    let (proxy, pool, locker) = stalled_locker(connect_opts, heartbeat_timeout).await;
    let started = Instant::now();
    let res = bounded(what, Duration::from_secs(10), wait(&locker, timeout)).await;
    let took = started.elapsed();
    println!("{what} under a stalled network: {res:?} after {took:?}");
    assert!(
        matches!(res, Err(Error::Timeout { .. })),
        "{what}: got {res:?}"
    );
    assert!(took >= timeout, "{what}: {took:?}");
    assert!(
        took <= timeout + heartbeat_timeout + Duration::from_millis(700),
        "{what}: {took:?}"
    );
    teardown(proxy, pool).await;
}

/// A proxy, a pool of one connection through it (see `proxied_unpinged`)
/// and a locker on that pool with the heartbeat deadline
/// `heartbeat_timeout`, after one lock on a healthy network (the locker's
/// one-time checks happen there) whose connection went back to the pool;
/// then the network stalls.
async fn stalled_locker(
    connect_opts: &PgConnectOptions,
    heartbeat_timeout: Duration,
) -> (Proxy, PgPool, PgLocker) {
    let (proxy, pool) = proxied_unpinged(connect_opts).await;
    let locker = PgLocker::builder(pool.clone())
        .heartbeat_timeout(heartbeat_timeout)
        .build()
        .expect("valid settings");
    locker
        .try_lock("faults:warm")
        .await
        .unwrap()
        .expect("free")
        .release()
        .await
        .unwrap();
    eventually(
        "the connection is idle in the pool",
        Duration::from_secs(5),
        async || pool.num_idle() == 1,
    )
    .await;
    proxy.stall();
    (proxy, pool, locker)
}

/// A timed-out upgrade names the reader it waited for with one more
/// statement on the lock's own connection. If that lookup gets no answer
/// within the heartbeat deadline, the connection is left mid-statement, and
/// what its session holds is unknown: the lock is lost and the connection
/// closed, not kept by a guard that reports a read lock still held.
#[sqlx::test(migrations = false)]
async fn a_timed_out_upgrade_whose_lookup_stalls_loses_the_lock(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let key = "faults:upgrade-lookup";
    let (proxy, pool) = proxied(&connect_opts, 2).await;
    let locker = PgLocker::builder(pool.clone())
        .heartbeat(Duration::from_secs(10))
        .heartbeat_timeout(Duration::from_millis(500))
        .build()
        .expect("valid settings");
    let direct = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(connect_opts.clone())
        .await
        .unwrap();
    let reader = PgLocker::new(direct.clone());
    let reader = reader.try_lock_shared(key).await.unwrap().expect("free");
    let mut lock = locker
        .try_lock_upgradeable(key)
        .await
        .unwrap()
        .expect("shared");
    let wait = Duration::from_millis(200);
    // Once, for the statements to be prepared on the connection, and to
    // count the round trips of a timed-out upgrade: the lookup is the last.
    let err = lock.upgrade(wait).await.unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    let before = proxy.round_trips();
    let err = lock.upgrade(wait).await.unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    let per_upgrade = proxy.round_trips() - before;
    assert!(per_upgrade >= 2, "{per_upgrade} round trips");
    proxy.stall_at_round_trip(proxy.round_trips() + per_upgrade);
    let err = bounded(
        "the upgrade ends",
        Duration::from_secs(10),
        lock.upgrade(wait),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(
            err,
            Error::LockLost {
                reason: LossReason::HeartbeatTimedOut(_),
                ..
            }
        ),
        "{err:?}"
    );
    assert!(lock.is_lost());
    proxy.pass();
    // The closed connection's session ends: only the reader is left.
    let mut obs = observer(&connect_opts).await;
    let pid = lock.backend_pid();
    eventually(
        "the upgradeable session has ended",
        Duration::from_secs(10),
        async || {
            advisory_locks(&mut obs)
                .await
                .iter()
                .all(|row| row.pid != pid)
        },
    )
    .await;
    reader.release().await.unwrap();
    close(obs).await;
    direct.close().await;
    teardown(proxy, pool).await;
}
