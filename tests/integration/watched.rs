//! A session lock's connection is watched while idle, from a few
//! milliseconds after the grant, so that a session the server ends is lost
//! at once (`tests/faults/goodbye.rs` measures how soon). Watching must
//! change nothing else: a watched lock releases, pools its connection and
//! frees its key as before; a healthy idle connection, or one that receives
//! a notification, is never reported lost; and a connection that may hold a
//! lock is closed, not pooled, and gives its pool slot back.

use crate::common;

use std::time::Duration;

use common::*;
use distlock::{LossReason, PgLocker};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// Long enough for a lock's keeper to have started watching it.
const WATCHED: Duration = Duration::from_millis(50);
/// Far from every bound below: nothing here waits for a heartbeat.
const HEARTBEAT: Duration = Duration::from_secs(10);

fn locker(pool: &PgPool) -> PgLocker {
    PgLocker::builder(pool.clone())
        .heartbeat(HEARTBEAT)
        .build()
        .expect("valid settings")
}

#[sqlx::test(migrations = false)]
async fn a_watched_lock_releases_and_its_connection_is_reused(pool: PgPool) {
    let locker = locker(&pool);
    let mut obs = observer_for(&pool).await;

    let lock = locker.try_lock("watched:x").await.unwrap().expect("free");
    tokio::time::sleep(WATCHED).await;
    let pid = lock.backend_pid();
    lock.release().await.unwrap();
    assert_eq!(granted_count(&mut obs).await, 0);
    // The released connection holds nothing and serves the next lock.
    let shared = locker.try_lock_shared("watched:s").await.unwrap();
    let shared = shared.expect("free");
    assert_eq!(shared.backend_pid(), pid, "the kept connection is reused");
    tokio::time::sleep(WATCHED).await;
    shared.release().await.unwrap();
    assert_eq!(granted_count(&mut obs).await, 0);

    let all = locker
        .try_lock_all(["watched:a", "watched:b"])
        .await
        .unwrap();
    let all = all.expect("free");
    tokio::time::sleep(WATCHED).await;
    all.release().await.unwrap();
    assert_eq!(granted_count(&mut obs).await, 0);
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn a_watched_guard_dropped_is_released_at_once(pool: PgPool) {
    let locker = locker(&pool);
    let mut obs = observer_for(&pool).await;
    let lock = locker
        .try_lock("watched:drop")
        .await
        .unwrap()
        .expect("free");
    tokio::time::sleep(WATCHED).await;
    drop(lock);
    // Released by the running keeper, not at its next heartbeat.
    eventually(
        "the dropped guard's key is free",
        Duration::from_secs(2),
        async || granted_count(&mut obs).await == 0,
    )
    .await;
    close(obs).await;
}

/// A healthy connection that sends nothing is never taken for a lost one,
/// through several heartbeats, each of which runs on the watched
/// connection between two reads of it.
#[sqlx::test(migrations = false)]
async fn an_idle_watched_lock_stays_held_through_its_heartbeats(pool: PgPool) {
    let locker = PgLocker::builder(pool.clone())
        .heartbeat(Duration::from_millis(40))
        .heartbeat_timeout(PATIENT)
        .build()
        .expect("valid settings");
    let mut obs = observer_for(&pool).await;
    let lock = locker
        .try_lock("watched:idle")
        .await
        .unwrap()
        .expect("free");
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!lock.is_lost(), "{:?}", lock.loss());
    assert_eq!(granted_count(&mut obs).await, 1);
    lock.release().await.unwrap();
    close(obs).await;
}

/// A pooled connection may still listen to a channel an earlier user of the
/// pool subscribed to: a notification arriving while it holds a watched
/// lock is read and ignored, not taken for the server's goodbye.
#[sqlx::test(migrations = false)]
async fn a_notification_on_a_watched_connection_is_no_loss(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    // One connection: the listening one is the lock's.
    let pool = pool_opts
        .max_connections(1)
        .connect_with(connect_opts)
        .await
        .unwrap();
    sqlx::query("LISTEN distlock_watched")
        .execute(&pool)
        .await
        .unwrap();
    let locker = PgLocker::builder(pool.clone())
        .heartbeat(HEARTBEAT)
        .keep_warm(0, Duration::ZERO)
        .build()
        .expect("valid settings");
    let mut obs = observer_for(&pool).await;
    let lock = locker
        .try_lock("watched:notified")
        .await
        .unwrap()
        .expect("free");
    tokio::time::sleep(WATCHED).await;
    sqlx::query("NOTIFY distlock_watched, 'hello'")
        .execute(&mut obs)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!lock.is_lost(), "{:?}", lock.loss());
    // The connection is still in step: the unlock is answered.
    lock.release().await.unwrap();
    assert_eq!(granted_count(&mut obs).await, 0);
    // And the loss a goodbye brings is still seen after the notification.
    let lock = locker
        .try_lock("watched:notified")
        .await
        .unwrap()
        .expect("free");
    tokio::time::sleep(WATCHED).await;
    sqlx::query("NOTIFY distlock_watched, 'again'")
        .execute(&mut obs)
        .await
        .unwrap();
    terminate(&mut obs, lock.backend_pid()).await;
    let reason = bounded(
        "lost() after the goodbye",
        Duration::from_secs(1),
        lock.lost(),
    )
    .await;
    assert!(
        matches!(reason, LossReason::ConnectionFailed(_)),
        "{reason:?}"
    );
    close(obs).await;
    drop(locker);
    pool.close().await;
}

/// A wait abandoned mid-statement may have been granted: its connection is
/// closed, never pooled. Closing it gives its slot back to the pool (a pool
/// of one connection serves the next lock) and ends its session.
#[sqlx::test(migrations = false)]
async fn a_closed_lock_connection_gives_its_pool_slot_back(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let pool = pool_opts
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(connect_opts)
        .await
        .unwrap();
    let locker = locker(&pool);
    let mut obs = observer_for(&pool).await;
    assert!(raw_try_lock(&mut obs, &Raw::text("watched:busy")).await);
    for round in 0..3 {
        let abandoned = tokio::time::timeout(
            Duration::from_millis(200),
            locker.lock("watched:busy", Duration::from_secs(10)),
        )
        .await;
        assert!(
            abandoned.is_err(),
            "round {round}: lock() was still waiting"
        );
        wait_for_no_waiters(&mut obs, Duration::from_secs(3)).await;
        // The pool's only slot is free again.
        let next = bounded(
            "a lock on the pool's only connection",
            Duration::from_secs(5),
            locker.try_lock("watched:free"),
        )
        .await;
        next.unwrap().expect("free").release().await.unwrap();
        assert!(pool.size() <= 1, "round {round}: pool size {}", pool.size());
    }
    assert!(raw_unlock(&mut obs, &Raw::text("watched:busy")).await);
    close(obs).await;
    drop(locker);
    pool.close().await;
}
