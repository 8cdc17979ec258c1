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
        .build();
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

/// `keep_warm(0, ..)` turns it off: every acquisition borrows from the pool.
#[sqlx::test(migrations = false)]
async fn keep_warm_zero_keeps_nothing(pool: PgPool) {
    let locker = PgLocker::builder(pool.clone())
        .keep_warm(0, Duration::from_secs(3600))
        .build();
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
