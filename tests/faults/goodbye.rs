//! The server ends a held lock's session (`pg_terminate_backend`, as in a
//! fast shutdown, a crash or a switchover): it sends its goodbye (an
//! ErrorResponse, FATAL 57P01) and closes the socket. The holder must learn
//! of it from that goodbye, not at its next heartbeat, in every mode.
//!
//! The heartbeat is set to 10 s so that heartbeat-only detection cannot pass
//! the 1 s bound; the measured delays are printed, not asserted (RELIABILITY.md,
//! "Server-ended sessions", reports them). Half the trials end the session
//! right after the grant, before a lock of its own connection is watched
//! (its keeper starts a few milliseconds after the grant, and then reads
//! the goodbye that came first); the other half once it is watched. An
//! upgradeable lock is upgraded (and downgraded) on the caller's task once
//! its keeper watches it: the statement's read of the socket must not leave
//! the keeper deaf to the goodbye.

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use distlock::{LossReason, MultiLock, PgLocker, SemaphorePermit, SessionLock, UpgradeableLock};
use sqlx::PgPool;
use sqlx::postgres::PgConnection;

/// Trials per mode.
const TRIALS: usize = 60;
/// Far below the 10 s heartbeat: only the goodbye itself can be this quick.
const BOUND: Duration = Duration::from_secs(1);
const HEARTBEAT: Duration = Duration::from_secs(10);
/// How long the odd trials hold the lock before the session is ended: long
/// enough for a lock of its own connection to be watched.
const WATCHED_AFTER: Duration = Duration::from_millis(30);

#[derive(Debug, Clone, Copy)]
enum Mode {
    Exclusive,
    Shared,
    Multi,
    Multiplexed,
    Fenced,
    Semaphore,
    Upgraded,
    Downgraded,
}

enum Held {
    One(SessionLock),
    Many(MultiLock),
    Permit(SemaphorePermit),
    Upgradeable(UpgradeableLock),
}

impl Held {
    async fn lost(&self) -> LossReason {
        match self {
            Self::One(lock) => lock.lost().await,
            Self::Many(lock) => lock.lost().await,
            Self::Permit(permit) => permit.lost().await,
            Self::Upgradeable(lock) => lock.lost().await,
        }
    }

    fn is_lost(&self) -> bool {
        match self {
            Self::One(lock) => lock.is_lost(),
            Self::Many(lock) => lock.is_lost(),
            Self::Permit(permit) => permit.is_lost(),
            Self::Upgradeable(lock) => lock.is_lost(),
        }
    }
}

async fn locker(pool: &PgPool, mode: Mode) -> PgLocker {
    let builder = PgLocker::builder(pool.clone()).heartbeat(HEARTBEAT);
    match mode {
        Mode::Multiplexed => builder.multiplex(1).build().expect("valid settings"),
        Mode::Fenced => {
            distlock::migrate(pool).await.expect("migrate");
            builder.fencing(true).build().expect("valid settings")
        }
        Mode::Exclusive
        | Mode::Shared
        | Mode::Multi
        | Mode::Semaphore
        | Mode::Upgraded
        | Mode::Downgraded => builder.build().expect("valid settings"),
    }
}

async fn take(locker: &PgLocker, mode: Mode, trial: usize) -> Held {
    let key = format!("goodbye:{trial}");
    match mode {
        Mode::Exclusive | Mode::Multiplexed | Mode::Fenced => {
            Held::One(locker.try_lock(key).await.expect("try_lock").expect("free"))
        }
        Mode::Shared => Held::One(
            locker
                .try_lock_shared(key)
                .await
                .expect("try_lock_shared")
                .expect("free"),
        ),
        Mode::Multi => Held::Many(
            locker
                .try_lock_all([format!("{key}:a"), format!("{key}:b")])
                .await
                .expect("try_lock_all")
                .expect("free"),
        ),
        Mode::Semaphore => Held::Permit(
            locker
                .semaphore(&key, 2)
                .expect("a valid semaphore")
                .try_acquire()
                .await
                .expect("try_acquire")
                .expect("a free permit"),
        ),
        Mode::Upgraded | Mode::Downgraded => {
            Held::Upgradeable(changed(locker, &key, matches!(mode, Mode::Downgraded)).await)
        }
    }
}

/// An upgradeable lock on `key`, upgraded (and `downgrade`d back to a read
/// lock) on this task once its keeper watches its connection.
async fn changed(locker: &PgLocker, key: &str, downgrade: bool) -> UpgradeableLock {
    let mut lock = locker
        .try_lock_upgradeable(key)
        .await
        .expect("try_lock_upgradeable")
        .expect("free");
    tokio::time::sleep(WATCHED_AFTER).await;
    assert!(
        lock.try_upgrade().await.expect("try_upgrade"),
        "no other reader"
    );
    if downgrade {
        lock.downgrade().await.expect("downgrade");
    }
    lock
}

/// The one session holding advisory locks in this test's database.
async fn holder_pid(obs: &mut PgConnection) -> i32 {
    let rows = advisory_locks(obs).await;
    let pid = rows.first().map(|row| row.pid).expect("a lock is held");
    assert!(rows.iter().all(|row| row.pid == pid), "{rows:?}");
    pid
}

/// Delays from `pg_terminate_backend` returning to `lost()` completing:
/// for the trials that end the session at once, then for those that end it
/// once the lock is watched. It returns once the backend is signalled,
/// before the backend sends its goodbye, so each delay is an upper bound on
/// the delay from the goodbye. (With a timeout it would wait for the exit,
/// polling every 100 ms, and hide the delay.)
async fn measure(pool: &PgPool, mode: Mode) -> (Vec<Duration>, Vec<Duration>) {
    let locker = locker(pool, mode).await;
    let mut obs = observer_for(pool).await;
    let (mut young, mut watched) = (Vec::new(), Vec::new());
    for trial in 0..TRIALS {
        let held = take(&locker, mode, trial).await;
        let delays = if trial % 2 == 0 {
            &mut young
        } else {
            tokio::time::sleep(WATCHED_AFTER).await;
            &mut watched
        };
        let pid = holder_pid(&mut obs).await;
        let signalled: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .fetch_one(&mut obs)
            .await
            .expect("pg_terminate_backend");
        assert!(signalled, "backend {pid} was not signalled");
        let ended = Instant::now();
        let reason = match tokio::time::timeout(BOUND, held.lost()).await {
            Ok(reason) => reason,
            Err(_) => panic!(
                "{mode:?}, trial {trial}: lost() did not complete within {BOUND:?} of the \
                 server ending the session (heartbeat {HEARTBEAT:?}); is_lost() = {}",
                held.is_lost()
            ),
        };
        delays.push(ended.elapsed());
        assert!(
            matches!(reason, LossReason::ConnectionFailed(_)),
            "{mode:?}: {reason:?}"
        );
        assert!(held.is_lost());
        // The key is free again for a waiter (the backend frees its locks
        // as it exits, right after its goodbye).
        eventually(
            "the key is free again",
            Duration::from_secs(5),
            async || granted_count(&mut obs).await == 0,
        )
        .await;
    }
    close(obs).await;
    (young, watched)
}

fn report(mode: Mode, when: &str, mut delays: Vec<Duration>) {
    delays.sort();
    let at = |q: f64| {
        let i = ((delays.len() as f64 - 1.0) * q).round() as usize;
        delays[i]
    };
    println!(
        "goodbye {mode:?}, session ended {when}: lost() after {} trials: \
         min {:?} p50 {:?} p90 {:?} max {:?}",
        delays.len(),
        at(0.0),
        at(0.5),
        at(0.9),
        at(1.0)
    );
}

async fn run(pool: PgPool, mode: Mode) {
    let (young, watched) = measure(&pool, mode).await;
    report(mode, "right after the grant", young);
    report(mode, &format!("{WATCHED_AFTER:?} after the grant"), watched);
}

#[sqlx::test(migrations = false)]
async fn session_lock_learns_of_a_server_ended_session_at_once(pool: PgPool) {
    run(pool, Mode::Exclusive).await;
}

#[sqlx::test(migrations = false)]
async fn shared_lock_learns_of_a_server_ended_session_at_once(pool: PgPool) {
    run(pool, Mode::Shared).await;
}

#[sqlx::test(migrations = false)]
async fn multi_lock_learns_of_a_server_ended_session_at_once(pool: PgPool) {
    run(pool, Mode::Multi).await;
}

#[sqlx::test(migrations = false)]
async fn multiplexed_lock_learns_of_a_server_ended_session_at_once(pool: PgPool) {
    run(pool, Mode::Multiplexed).await;
}

#[sqlx::test(migrations = false)]
async fn fenced_lock_learns_of_a_server_ended_session_at_once(pool: PgPool) {
    run(pool, Mode::Fenced).await;
}

#[sqlx::test(migrations = false)]
async fn semaphore_permit_learns_of_a_server_ended_session_at_once(pool: PgPool) {
    run(pool, Mode::Semaphore).await;
}

#[sqlx::test(migrations = false)]
async fn upgraded_lock_learns_of_a_server_ended_session_at_once(pool: PgPool) {
    run(pool, Mode::Upgraded).await;
}

#[sqlx::test(migrations = false)]
async fn downgraded_lock_learns_of_a_server_ended_session_at_once(pool: PgPool) {
    run(pool, Mode::Downgraded).await;
}
