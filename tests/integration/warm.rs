//! Warm connections (`PgLockerBuilder::keep_warm`): a released lock's
//! connection is reused by the next acquisition without the pool's pings,
//! never while it holds a lock, never while someone waits for a
//! connection, and never when the server ended its session meanwhile.

use crate::common;

use std::time::Duration;

use common::*;
use distlock::PgLocker;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// A locker that keeps connections for an hour: anything that relies on the
/// idle timeout to give a connection back would hang the test.
fn keeping_locker(pool: &PgPool) -> PgLocker {
    PgLocker::builder(pool.clone())
        .keep_warm(2, Duration::from_secs(3600))
        .build()
        .expect("valid settings")
}

#[sqlx::test(migrations = false)]
async fn a_released_connection_is_reused_and_holds_nothing(pool: PgPool) {
    let locker = keeping_locker(&pool);
    let mut obs = observer_for(&pool).await;
    let first = locker.try_lock("warm:a").await.unwrap().expect("free");
    let pid = first.backend_pid();
    first.release().await.unwrap();
    // The kept session holds no advisory lock (the unlock was confirmed).
    assert_eq!(granted_count(&mut obs).await, 0);
    let second = locker.try_lock("warm:b").await.unwrap().expect("free");
    assert_eq!(second.backend_pid(), pid, "the kept connection is reused");
    // A busy try also leaves its connection kept, holding nothing.
    let busy = locker.try_lock("warm:b").await.unwrap();
    assert!(busy.is_none());
    let rows = advisory_locks(&mut obs).await;
    assert_eq!(rows.len(), 1, "only warm:b, on its holder: {rows:?}");
    assert_eq!(rows[0].pid, pid);
    second.release().await.unwrap();
    assert_eq!(granted_count(&mut obs).await, 0);
}

#[sqlx::test(migrations = false)]
async fn with_advisory_lock_reuses_the_kept_connection(pool: PgPool) {
    let locker = keeping_locker(&pool);
    let mut pids = Vec::new();
    for _ in 0..3 {
        pids.push(xact_backend_pid(&locker, "warm:xact").await);
    }
    assert!(pids.windows(2).all(|w| w[0] == w[1]), "{pids:?}");
}

/// The backend that runs `with_advisory_lock(key, ..)`'s closure.
async fn xact_backend_pid(locker: &PgLocker, key: &str) -> i32 {
    locker
        .with_advisory_lock(key, async |conn| {
            sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
                .fetch_one(conn)
                .await
                .map_err(distlock::Error::from)
        })
        .await
        .unwrap()
        .expect("free")
}

/// The server ends a kept connection's session (as `pg_terminate_backend`,
/// a restart or an idle timeout would): the next acquisition must not fail
/// for it, but take the lock on a connection from the pool.
#[sqlx::test(migrations = false)]
async fn a_kept_connection_the_server_ended_is_replaced_once(pool: PgPool) {
    let locker = keeping_locker(&pool);
    let mut obs = observer_for(&pool).await;
    for round in 0..3 {
        let lock = locker.try_lock("warm:term").await.unwrap().expect("free");
        let pid = lock.backend_pid();
        lock.release().await.unwrap();
        terminate(&mut obs, pid).await;
        let next = match round {
            0 => locker.try_lock("warm:term").await.unwrap().expect("free"),
            1 => locker
                .lock("warm:term", Duration::from_secs(5))
                .await
                .unwrap(),
            _ => {
                assert_ne!(xact_backend_pid(&locker, "warm:term").await, pid);
                continue;
            }
        };
        assert_ne!(next.backend_pid(), pid, "round {round}: a new session");
        assert!(!next.is_lost());
        next.release().await.unwrap();
    }
}

/// With no slack in the pool (one connection, in use), a released
/// connection goes straight back to the pool: a task waiting for it gets it
/// at once, not after the locker's (here: hour-long) idle timeout.
#[sqlx::test(migrations = false)]
async fn nothing_is_kept_while_the_pool_has_no_slack(
    _opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(connect)
        .await
        .unwrap();
    let locker = keeping_locker(&pool);
    let lock = locker.try_lock("warm:slack").await.unwrap().expect("free");
    let waiter = tokio::spawn({
        let pool = pool.clone();
        async move { pool.acquire().await.map(drop) }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    lock.release().await.unwrap();
    bounded(
        "the pool's waiter gets the connection",
        Duration::from_secs(10),
        waiter,
    )
    .await
    .unwrap()
    .unwrap();
}

/// Kept connections go back to the pool after the idle timeout, and
/// `PgPool::close` does not wait for a kept connection.
#[sqlx::test(migrations = false)]
async fn kept_connections_go_back_after_the_idle_timeout_and_on_close(pool: PgPool) {
    let locker = PgLocker::builder(pool.clone())
        .keep_warm(2, Duration::from_millis(100))
        .build()
        .expect("valid settings");
    let lock = locker.try_lock("warm:idle").await.unwrap().expect("free");
    lock.release().await.unwrap();
    all_back_in_the_pool(&pool).await;

    let keeping = keeping_locker(&pool);
    let lock = keeping.try_lock("warm:close").await.unwrap().expect("free");
    lock.release().await.unwrap();
    assert!(pool.num_idle() < pool.size() as usize, "one is kept");
    bounded(
        "close() with a kept connection",
        Duration::from_secs(10),
        pool.close(),
    )
    .await;
}

/// An idle time too long for the clock (`Duration::MAX`) keeps a
/// connection until the pool closes, and then `PgPool::close` gets it back:
/// the sweeper must still be there to hand it back.
#[sqlx::test(migrations = false)]
async fn an_endless_idle_time_still_gives_connections_back_on_close(pool: PgPool) {
    let locker = PgLocker::builder(pool.clone())
        .keep_warm(2, Duration::MAX)
        .build()
        .expect("valid settings");
    let lock = locker
        .try_lock("warm:forever")
        .await
        .unwrap()
        .expect("free");
    lock.release().await.unwrap();
    assert!(pool.num_idle() < pool.size() as usize, "one is kept");
    bounded(
        "close() with a connection kept for ever",
        Duration::from_secs(10),
        pool.close(),
    )
    .await;
    drop(locker);
}

/// `keep_warm(0, ..)` turns it off: every acquisition borrows from the pool.
#[sqlx::test(migrations = false)]
async fn keep_warm_zero_keeps_nothing(pool: PgPool) {
    let locker = PgLocker::builder(pool.clone())
        .keep_warm(0, Duration::from_secs(3600))
        .build()
        .expect("valid settings");
    let lock = locker.try_lock("warm:off").await.unwrap().expect("free");
    lock.release().await.unwrap();
    all_back_in_the_pool(&pool).await;
}

/// Waits (bounded) until every connection of `pool` is idle in it.
async fn all_back_in_the_pool(pool: &PgPool) {
    eventually(
        "every connection is idle in the pool",
        Duration::from_secs(5),
        async || pool.num_idle() as u32 == pool.size(),
    )
    .await;
}

/// The server ends a kept connection's session while `lock()` waits on it:
/// the wait goes on, on a pooled connection, within the same deadline, and
/// gets the lock when its holder lets go (documented on `keep_warm`).
#[sqlx::test(migrations = false)]
async fn a_wait_whose_kept_connection_is_ended_goes_on_on_the_pool(pool: PgPool) {
    let holder = PgLocker::new(pool.clone());
    let waiter = keeping_locker(&pool);
    let mut obs = observer_for(&pool).await;
    let held = holder.try_lock("warm:wait").await.unwrap().expect("free");
    // A busy try leaves the waiter's locker with a kept connection.
    assert!(waiter.try_lock("warm:wait").await.unwrap().is_none());
    let waiting = tokio::spawn({
        let waiter = waiter.clone();
        async move { waiter.lock("warm:wait", Duration::from_secs(20)).await }
    });
    wait_for_waiters(&mut obs, 1, Duration::from_secs(5)).await;
    let rows = advisory_locks(&mut obs).await;
    let waiting_pid = rows.iter().find(|r| !r.granted).expect("a waiter").pid;
    terminate(&mut obs, waiting_pid).await;
    // The wait is back in the server's queue, on another session.
    eventually(
        "the wait resumes on a new session",
        Duration::from_secs(5),
        async || {
            advisory_locks(&mut obs)
                .await
                .iter()
                .any(|r| !r.granted && r.pid != waiting_pid)
        },
    )
    .await;
    held.release().await.unwrap();
    let lock = bounded("the resumed wait", Duration::from_secs(10), waiting)
        .await
        .unwrap()
        .expect("granted after the holder let go");
    assert_ne!(lock.backend_pid(), waiting_pid);
    lock.release().await.unwrap();
}

/// A pool whose connections go through a round-trip-counting proxy, with
/// sqlx's default pings (`test_before_acquire`), and a direct observer.
async fn counted_pool(connect: &PgConnectOptions) -> (common::proxy::Proxy, PgPool) {
    let proxy = common::proxy::Proxy::start(connect.get_host(), connect.get_port())
        .await
        .expect("proxy starts");
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(proxy.options(connect))
        .await
        .expect("connects through the proxy");
    (proxy, pool)
}

/// `try_lock_all` + `release` on a kept connection: 2 round trips (the try
/// and the unlock), for 1 to 16 keys, no pool ping among them; `lock_all`
/// of free keys the same. Each released connection holds nothing.
#[sqlx::test(migrations = false)]
async fn multi_key_locks_take_two_round_trips_on_a_kept_connection(
    _opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let (proxy, pool) = counted_pool(&connect).await;
    let locker = keeping_locker(&pool);
    let mut obs = observer(&connect).await;
    // The locker's first lock probes for a transaction pooler, and the
    // connection prepares the statements once.
    for _ in 0..2 {
        let warmup = locker.try_lock_all(["warm:multi"]).await.unwrap();
        warmup.expect("free").release().await.unwrap();
    }
    for n in [1, 2, 16] {
        let keys: Vec<String> = (0..n).map(|i| format!("warm:multi:{n}:{i}")).collect();
        let before = proxy.round_trips();
        let all = locker.try_lock_all(keys.clone()).await.unwrap();
        let all = all.expect("free");
        assert_eq!(proxy.round_trips() - before, 1, "try_lock_all, {n} keys");
        assert_eq!(granted_count(&mut obs).await, n);
        all.release().await.unwrap();
        assert_eq!(proxy.round_trips() - before, 2, "with release, {n} keys");
        assert_eq!(
            granted_count(&mut obs).await,
            0,
            "the kept one holds nothing"
        );

        let before = proxy.round_trips();
        let all = locker.lock_all(keys, Duration::from_secs(5)).await.unwrap();
        all.release().await.unwrap();
        assert_eq!(proxy.round_trips() - before, 2, "lock_all, {n} keys");
    }
}

/// A multi-key try that finds one key busy gives back the others in the
/// same statement: its connection is kept holding nothing (the next try
/// runs on it, 1 round trip, no ping); a dropped `MultiLock`'s connection
/// is kept only after its background unlock.
#[sqlx::test(migrations = false)]
async fn a_busy_or_dropped_multi_key_lock_keeps_nothing_locked(
    _opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let (proxy, pool) = counted_pool(&connect).await;
    let locker = keeping_locker(&pool);
    let mut obs = observer(&connect).await;
    let mut holder = observer(&connect).await;
    let warmup = locker.try_lock_all(["warm:busy:a"]).await.unwrap();
    warmup.expect("free").release().await.unwrap();
    assert!(raw_try_lock(&mut holder, &Raw::text("warm:busy:z")).await);
    let holder_pid = backend_pid(&mut holder).await;

    let before = proxy.round_trips();
    let keys = ["warm:busy:a", "warm:busy:b", "warm:busy:z"];
    assert!(locker.try_lock_all(keys).await.unwrap().is_none());
    assert_eq!(
        proxy.round_trips() - before,
        1,
        "a kept connection, no ping"
    );
    let rows = advisory_locks(&mut obs).await;
    assert!(rows.iter().all(|r| r.pid == holder_pid), "{rows:?}");

    let before = proxy.round_trips();
    let all = locker.try_lock_all(["warm:busy:a", "warm:busy:b"]).await;
    let all = all.unwrap().expect("free");
    assert_eq!(
        proxy.round_trips() - before,
        1,
        "the busy try's connection, kept"
    );
    let pid = advisory_locks(&mut obs)
        .await
        .iter()
        .find(|r| r.pid != holder_pid)
        .expect("the multi-key lock")
        .pid;
    drop(all);
    eventually(
        "the dropped lock is unlocked",
        Duration::from_secs(5),
        async || {
            advisory_locks(&mut obs)
                .await
                .iter()
                .all(|r| r.pid == holder_pid)
        },
    )
    .await;
    // The unlock shows in pg_locks before its reply reaches the background
    // task that then keeps the connection: give that task a moment.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let again = locker.try_lock_all(["warm:busy:c"]).await.unwrap();
    let again = again.expect("free");
    let rows = advisory_locks(&mut obs).await;
    assert!(rows.iter().any(|r| r.pid == pid), "reused: {rows:?}");
    again.release().await.unwrap();
}

/// The server ends a kept connection's session: `try_lock_all` and
/// `lock_all` take their keys on a connection from the pool instead.
#[sqlx::test(migrations = false)]
async fn a_multi_key_lock_on_a_kept_connection_the_server_ended_goes_to_the_pool(pool: PgPool) {
    let locker = keeping_locker(&pool);
    let mut obs = observer_for(&pool).await;
    for round in 0..2 {
        let all = locker.try_lock_all(["warm:mterm:a", "warm:mterm:b"]).await;
        let all = all.unwrap().expect("free");
        let pid = advisory_locks(&mut obs).await[0].pid;
        all.release().await.unwrap();
        terminate(&mut obs, pid).await;
        let next = match round {
            0 => locker
                .try_lock_all(["warm:mterm:a"])
                .await
                .unwrap()
                .expect("free"),
            _ => locker
                .lock_all(["warm:mterm:a"], Duration::from_secs(5))
                .await
                .unwrap(),
        };
        let rows = advisory_locks(&mut obs).await;
        assert_eq!(rows.len(), 1, "{rows:?}");
        assert_ne!(rows[0].pid, pid, "round {round}: a new session");
        assert!(!next.is_lost());
        next.release().await.unwrap();
    }
}

/// `with_advisory_lock` commits with `COMMIT; BEGIN`, so that sqlx's
/// `Transaction` still finds a transaction to roll back when it drops, and
/// that `ROLLBACK` waits in sqlx's buffer. Left there, the next statement on
/// the kept connection sends it first and waits for its answer: a round
/// trip more for the next lock, whenever it comes. Sent as the closure's
/// transaction ends, it is answered by then: a try on the kept connection a
/// moment later takes the 1 round trip of its own statement, and meanwhile
/// the kept session is idle, not idle in a transaction.
#[sqlx::test(migrations = false)]
async fn the_next_lock_after_with_advisory_lock_pays_no_round_trip_for_its_rollback(
    _opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let (proxy, pool) = counted_pool(&connect).await;
    let locker = keeping_locker(&pool);
    let mut obs = observer(&connect).await;
    let key = "warm:after-xact";
    // The locker's first lock probes for a transaction pooler, and the
    // connection prepares the statements once.
    for _ in 0..2 {
        xact_backend_pid(&locker, key).await;
        let lock = locker.try_lock(key).await.unwrap().expect("free");
        lock.release().await.unwrap();
    }
    for round in 0..3 {
        let pid = xact_backend_pid(&locker, key).await;
        // Other work between two locks; the proxy has seen all that was sent.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let state: String = sqlx::query_scalar("SELECT state FROM pg_stat_activity WHERE pid = $1")
            .bind(pid)
            .fetch_one(&mut obs)
            .await
            .unwrap();
        assert_eq!(state, "idle", "round {round}: the kept session");
        let before = proxy.round_trips();
        let lock = locker.try_lock(key).await.unwrap().expect("free");
        assert_eq!(proxy.round_trips() - before, 1, "round {round}: try_lock");
        assert_eq!(lock.backend_pid(), pid, "on the kept connection");
        lock.release().await.unwrap();
    }
}

/// The proxy's count of round trips once what was sent has reached it: the
/// `ROLLBACK` a `with_advisory_lock` sends without waiting may still be on
/// its way when the call returns.
async fn settled(proxy: &common::proxy::Proxy) -> usize {
    tokio::time::sleep(Duration::from_millis(50)).await;
    proxy.round_trips()
}

/// A locker that keeps connections (as [`keeping_locker`]) and sends
/// `with_advisory_lock`'s try with its `BEGIN` when `try_with_begin`.
fn keeping_locker_trying(pool: &PgPool, try_with_begin: bool) -> PgLocker {
    PgLocker::builder(pool.clone())
        .keep_warm(2, Duration::from_secs(3600))
        .try_with_begin(try_with_begin)
        .build()
        .expect("valid settings")
}

/// `with_advisory_lock` on a kept connection, with `try_with_begin`, sends
/// its try with the `BEGIN`, in one round trip: the call costs that one,
/// the checked commit, and the `ROLLBACK` that ends sqlx's transaction
/// (sent without waiting for its answer, but a burst of its own for the
/// proxy); a busy key costs the try and its rollback. Without the setting,
/// `BEGIN` and try are a round trip each.
#[sqlx::test(migrations = false)]
async fn with_advisory_lock_tries_in_the_round_trip_of_its_begin(
    _opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let (proxy, pool) = counted_pool(&connect).await;
    let mut other = observer(&connect).await;
    for (try_with_begin, taken, busy) in [(false, 4, 3), (true, 3, 2)] {
        let locker = keeping_locker_trying(&pool, try_with_begin);
        let key = format!("warm:fused:{try_with_begin}");
        // The locker's first lock probes for a transaction pooler, and the
        // connection prepares the statements once.
        for _ in 0..2 {
            xact_backend_pid(&locker, &key).await;
        }
        for round in 0..3 {
            let before = settled(&proxy).await;
            locker
                .with_advisory_lock(&key, async |_| Ok::<_, distlock::Error>(()))
                .await
                .unwrap()
                .expect("free");
            let trips = settled(&proxy).await - before;
            assert_eq!(trips, taken, "{try_with_begin}, round {round}: taken");
        }
        sqlx::query("SELECT pg_advisory_lock(hashtext($1))")
            .bind(&key)
            .execute(&mut other)
            .await
            .unwrap();
        for round in 0..3 {
            let before = settled(&proxy).await;
            let ran = locker
                .with_advisory_lock(&key, async |_| Ok::<_, distlock::Error>(()))
                .await
                .unwrap();
            assert!(ran.is_none(), "round {round}: the key is held");
            let trips = settled(&proxy).await - before;
            assert_eq!(trips, busy, "{try_with_begin}, round {round}: busy");
        }
    }
}

/// A session that lost the prepared try (the closure deallocated it, as
/// `DISCARD ALL` would) prepares it again on the next call, which takes
/// the lock all the same; the call after that is back to one round trip
/// for `BEGIN` and try.
#[sqlx::test(migrations = false)]
async fn with_advisory_lock_prepares_its_try_again_where_a_session_lost_it(
    _opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let (proxy, pool) = counted_pool(&connect).await;
    let locker = keeping_locker_trying(&pool, true);
    let key = "warm:deallocated";
    let pid = xact_backend_pid(&locker, key).await;
    let cost = async || {
        let before = settled(&proxy).await;
        let pid = xact_backend_pid(&locker, key).await;
        (pid, settled(&proxy).await - before)
    };
    assert_eq!(cost().await, (pid, 4), "prepared once, on the first call");
    let left = locker
        .with_advisory_lock(key, async |conn| {
            let ours = "SELECT name FROM pg_prepared_statements WHERE name LIKE 'distlock%'";
            let names: Vec<String> = sqlx::query_scalar(ours).fetch_all(&mut *conn).await?;
            assert_eq!(names.len(), 1, "one prepared try: {names:?}");
            for name in names {
                let deallocate = format!("DEALLOCATE \"{name}\"");
                sqlx::raw_sql(sqlx::AssertSqlSafe(deallocate))
                    .execute(&mut *conn)
                    .await?;
            }
            let left: Vec<String> = sqlx::query_scalar(ours).fetch_all(&mut *conn).await?;
            Ok::<_, distlock::Error>(left)
        })
        .await
        .unwrap()
        .expect("free");
    assert!(left.is_empty(), "{left:?}");
    let (again, trips) = cost().await;
    assert_eq!(again, pid, "the same kept session");
    assert_eq!(
        trips,
        4 + 3,
        "the failed try, rollback and prepare, BEGIN and try apart"
    );
    assert_eq!(cost().await, (pid, 4), "prepared again");
}

/// A locker used on two runtimes: a current-thread runtime that took and
/// released two locks and then sits idle (its `block_on` returned, nobody
/// drives it), and the test's. The connections kept there are registered
/// with that runtime's reactor: handed to the test's runtime, their
/// answers would depend on a reactor nobody drives. And one sweeper swept
/// for every runtime: started on the idle one, it never ran, and the
/// connections kept on the test's runtime stayed out of the pool. Each
/// runtime now hands out only the connections kept on it and has its own
/// sweeper; connections of a runtime whose sweeper has not run for twice
/// the idle time are closed by the next checkout or keep elsewhere, so they hold
/// neither the pool's slots nor the locker's limit.
#[sqlx::test(migrations = false)]
async fn a_runtime_left_idle_strands_neither_its_kept_connections_nor_the_others(pool: PgPool) {
    let idle_time = Duration::from_millis(50);
    let locker = locker_on_two_runtimes(&pool, idle_time);
    let (idle, idle_pids) = idle_after_locks(&locker, &["warm:idle-a", "warm:idle-b"]).await;
    assert_eq!(pool.num_idle(), 0, "both kept on the idle runtime");

    // Past twice the idle time: two locks at once on the test's runtime,
    // neither on a connection kept on the idle one; both kept once
    // released, in place of the idle runtime's.
    tokio::time::sleep(idle_time * 3).await;
    let mut held = Vec::new();
    for key in ["warm:here", "warm:there"] {
        let lock = bounded(
            "a try on the test's runtime",
            Duration::from_secs(20),
            locker.try_lock(key),
        )
        .await
        .expect("try")
        .expect("free");
        assert!(
            !idle_pids.contains(&lock.backend_pid()),
            "a connection kept on the idle runtime"
        );
        held.push(lock);
    }
    for lock in held {
        lock.release().await.unwrap();
    }
    // The test runtime's go back after their idle time; the idle
    // runtime's were closed.
    all_back_in_the_pool(&pool).await;
    assert_eq!(pool.size(), 2);
    bounded(
        "close() with the idle runtime alive",
        Duration::from_secs(10),
        pool.close(),
    )
    .await;
    tokio::task::spawn_blocking(move || drop(idle))
        .await
        .expect("dropped");
}

/// A connection kept on a runtime that then sits idle must not starve the
/// others of the pool: on a pool of two, with one kept there, the test's
/// runtime takes two locks at once. The idle runtime's connection, kept
/// past twice the idle time, is closed by the next acquisition here, which
/// used to wait for the pool instead.
#[sqlx::test(migrations = false)]
async fn a_connection_stranded_on_an_idle_runtime_frees_its_pool_slot(
    _opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(connect)
        .await
        .unwrap();
    let idle_time = Duration::from_millis(50);
    let locker = locker_on_two_runtimes(&pool, idle_time);
    let (idle, _) = idle_after_locks(&locker, &["warm:idle"]).await;
    assert_eq!(
        (pool.size(), pool.num_idle()),
        (1, 0),
        "kept on the idle runtime"
    );

    tokio::time::sleep(idle_time * 3).await;
    let first = locker
        .try_lock("warm:one")
        .await
        .expect("first")
        .expect("free");
    let second = locker
        .try_lock("warm:two")
        .await
        .expect("second")
        .expect("free");
    first.release().await.unwrap();
    second.release().await.unwrap();
    tokio::task::spawn_blocking(move || drop(idle))
        .await
        .expect("dropped");
}

/// A locker keeping up to two connections for `idle_time`, to be shared
/// with a runtime of its own ([`idle_after_locks`]).
fn locker_on_two_runtimes(pool: &PgPool, idle_time: Duration) -> std::sync::Arc<PgLocker> {
    std::sync::Arc::new(
        PgLocker::builder(pool.clone())
            .keep_warm(2, idle_time)
            .build()
            .expect("valid settings"),
    )
}

/// A current-thread runtime on which `locker` took `keys` at once and
/// released them, left idle (its `block_on` returned), with the backend
/// pids of those locks. Dropped, it must be dropped off the test's
/// runtime (`spawn_blocking`).
async fn idle_after_locks(
    locker: &std::sync::Arc<PgLocker>,
    keys: &'static [&'static str],
) -> (tokio::runtime::Runtime, Vec<i32>) {
    let locker = locker.clone();
    tokio::task::spawn_blocking(move || {
        let idle = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let pids = idle.block_on(async {
            let mut held = Vec::new();
            for key in keys {
                held.push(locker.try_lock(*key).await.unwrap().expect("free"));
            }
            let pids = held.iter().map(|lock| lock.backend_pid()).collect();
            for lock in held {
                lock.release().await.unwrap();
            }
            pids
        });
        (idle, pids)
    })
    .await
    .expect("the idle runtime's thread")
}
