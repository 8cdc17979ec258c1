//! A `statement_timeout` set for the session (by the role, the database,
//! the connect options or an `after_connect` hook) does not cut distlock's
//! own lock waits short: a wait ends when the lock is granted or the
//! caller's timeout passes, not with SQLSTATE 57014 at the session's limit.
//! The caller's own statements keep their `statement_timeout`.

use crate::common::*;

use std::time::{Duration, Instant};

use distlock::PgLocker;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::task::JoinHandle;

/// The session's `statement_timeout` in these tests: shorter than the
/// holder's 2 s hold, so a wait that runs under it fails before the grant.
const SESSION_LIMIT: &str = "1s";

/// How long the outside holder keeps the key.
const HOLD: Duration = Duration::from_secs(2);

/// The caller's timeout: longer than the hold, so every wait is granted.
const TIMEOUT: Duration = Duration::from_secs(5);

/// A pool whose every connection starts with `statement_timeout = 1s`, as a
/// role setting would give it (a startup parameter, so the multiplexed
/// connection, opened from the pool's options, has it too).
async fn limited_pool(pool: &PgPool) -> PgPool {
    let options = (*pool.connect_options())
        .clone()
        .options([("statement_timeout", SESSION_LIMIT)]);
    PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .expect("pool with a statement_timeout")
}

/// Holds `key` (an advisory lock call's argument list, such as
/// `hashtext('k')`) exclusively from an outside session, and lets it go
/// after [`HOLD`].
async fn hold_then_release(pool: &PgPool, key: &str) -> JoinHandle<()> {
    let mut holder = observer_for(pool).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT pg_advisory_lock({key})"
    )))
    .execute(&mut holder)
    .await
    .expect("hold the key");
    tokio::spawn(async move {
        tokio::time::sleep(HOLD).await;
        close(holder).await;
    })
}

/// The wait must have lasted until the holder let go: granted, not failed.
/// `what` names the call and the session limit it ran under.
fn assert_granted_after_hold<T: std::fmt::Debug, E: std::fmt::Debug>(
    what: &str,
    started: Instant,
    outcome: Result<T, E>,
) -> T {
    let waited = started.elapsed();
    let value = match outcome {
        Ok(value) => value,
        Err(err) => panic!(
            "{what}: expected the lock after the {HOLD:?} hold, got {err:?} after {waited:?}"
        ),
    };
    assert!(
        waited >= HOLD - Duration::from_millis(200),
        "{what}: granted after {waited:?}, before the holder let go"
    );
    value
}

#[sqlx::test(migrations = false)]
async fn a_session_statement_timeout_does_not_cut_lock_short(pool: PgPool) {
    let limited = limited_pool(&pool).await;
    let locker = PgLocker::new(limited.clone());
    let holder = hold_then_release(&pool, "hashtext('k')").await;
    let started = Instant::now();
    let lock = assert_granted_after_hold(
        "lock under statement_timeout",
        started,
        locker.lock("k", TIMEOUT).await,
    );
    lock.release().await.expect("release");
    holder.await.expect("holder");
    limited.close().await;
}

#[sqlx::test(migrations = false)]
async fn a_session_statement_timeout_does_not_cut_lock_shared_short(pool: PgPool) {
    let limited = limited_pool(&pool).await;
    let locker = PgLocker::new(limited.clone());
    let holder = hold_then_release(&pool, "hashtext('k')").await;
    let started = Instant::now();
    let outcome = locker.lock_shared("k", TIMEOUT).await;
    let lock = assert_granted_after_hold("lock_shared under statement_timeout", started, outcome);
    lock.release().await.expect("release");
    holder.await.expect("holder");
    limited.close().await;
}

#[sqlx::test(migrations = false)]
async fn a_session_statement_timeout_does_not_cut_lock_all_short(pool: PgPool) {
    let limited = limited_pool(&pool).await;
    let locker = PgLocker::new(limited.clone());
    let holder = hold_then_release(&pool, "hashtext('k')").await;
    let started = Instant::now();
    let outcome = locker.lock_all(["j", "k"], TIMEOUT).await;
    let both = assert_granted_after_hold("lock_all under statement_timeout", started, outcome);
    both.release().await.expect("release");
    holder.await.expect("holder");
    limited.close().await;
}

/// The regression: with a session limit, `lock_all`'s wait runs in a
/// transaction of its own; its `lock_timeout` aborted that transaction, and
/// the lookup of whom it waited behind ran on it and failed, so the
/// `Timeout` named the first key and no holder.
#[sqlx::test(migrations = false)]
async fn a_lock_all_timeout_under_a_session_statement_timeout_names_its_holder(pool: PgPool) {
    let limited = limited_pool(&pool).await;
    let locker = PgLocker::new(limited.clone());
    let mut holder = observer_for(&pool).await;
    let holder_pid: i32 =
        sqlx::query_scalar("SELECT pg_backend_pid() FROM pg_advisory_lock(hashtext('k'))")
            .fetch_one(&mut holder)
            .await
            .expect("hold the key");
    let err = locker
        .lock_all(["j", "k"], Duration::from_millis(300))
        .await
        .expect_err("k is held");
    match &err {
        distlock::Error::Timeout {
            key,
            holder_pid: by,
            ..
        } => {
            assert_eq!(*key, distlock::LockKey::from("k"), "{err:?}");
            assert_eq!(*by, Some(holder_pid), "{err:?}");
        }
        other => panic!("expected Timeout, got {other:?}"),
    }
    close(holder).await;
    limited.close().await;
}

#[sqlx::test(migrations = false)]
async fn a_session_statement_timeout_does_not_cut_the_transaction_wait_short(pool: PgPool) {
    let limited = limited_pool(&pool).await;
    let locker = PgLocker::new(limited.clone());
    let holder = hold_then_release(&pool, "hashtext('k')").await;
    let started = Instant::now();
    let outcome = locker
        .with_advisory_lock_wait("k", TIMEOUT, async |conn| {
            // The closure's own statements run under the session's limit.
            sqlx::query_scalar::<_, String>("SHOW statement_timeout")
                .fetch_one(conn)
                .await
                .map_err(distlock::Error::from)
        })
        .await;
    let inside = assert_granted_after_hold(
        "with_advisory_lock_wait under statement_timeout",
        started,
        outcome,
    );
    assert_eq!(inside, SESSION_LIMIT, "the closure's statement_timeout");
    holder.await.expect("holder");
    limited.close().await;
}

#[sqlx::test(migrations = false)]
async fn a_session_statement_timeout_does_not_cut_lock_xact_short(pool: PgPool) {
    let limited = limited_pool(&pool).await;
    let holder = hold_then_release(&pool, "hashtext('k')").await;
    let mut tx = limited.begin().await.expect("begin");
    let started = Instant::now();
    let outcome = distlock::lock_xact(&mut tx, "k", TIMEOUT).await;
    assert_granted_after_hold("lock_xact under statement_timeout", started, outcome);
    // The caller's transaction keeps its own limit after the wait.
    let after: String = sqlx::query_scalar("SHOW statement_timeout")
        .fetch_one(&mut *tx)
        .await
        .expect("statement_timeout after the wait");
    assert_eq!(after, SESSION_LIMIT, "the caller's statement_timeout");
    tx.commit().await.expect("commit");
    holder.await.expect("holder");
    limited.close().await;
}

#[sqlx::test(migrations = false)]
async fn a_session_statement_timeout_does_not_cut_a_multiplexed_lock_short(pool: PgPool) {
    let limited = limited_pool(&pool).await;
    let locker = PgLocker::builder(limited.clone())
        .multiplex(1)
        .build()
        .expect("valid settings");
    let holder = hold_then_release(&pool, "hashtext('k')").await;
    let started = Instant::now();
    let outcome = locker.lock("k", TIMEOUT).await;
    let lock =
        assert_granted_after_hold("multiplexed lock under statement_timeout", started, outcome);
    lock.release().await.expect("release");
    holder.await.expect("holder");
    drop(locker);
    limited.close().await;
}

/// With a session limit, a free key costs what it costs without one, and the
/// session's limit is untouched by the lock (the extra statements run only
/// around a wait).
#[sqlx::test(migrations = false)]
async fn a_session_statement_timeout_survives_a_lock_and_its_wait(pool: PgPool) {
    let limited = limited_pool(&pool).await;
    let locker = PgLocker::new(limited.clone());
    let holder = hold_then_release(&pool, "hashtext('k')").await;
    let lock = locker
        .lock("k", TIMEOUT)
        .await
        .expect("lock after the hold");
    holder.await.expect("holder");
    let pid = lock.backend_pid();
    lock.release().await.expect("release");
    // The released connection is back in the pool with the session's limit.
    let mut conn = limited.acquire().await.expect("pooled connection");
    let same = backend_pid(&mut conn).await == pid;
    let limit: String = sqlx::query_scalar("SHOW statement_timeout")
        .fetch_one(&mut *conn)
        .await
        .expect("statement_timeout");
    assert_eq!(
        limit, SESSION_LIMIT,
        "statement_timeout after a wait (same backend: {same})"
    );
    drop(conn);
    limited.close().await;
}

/// A pool whose every connection starts with `transaction_timeout = 1s`
/// (PostgreSQL 17 and later; `None` before, where the setting does not
/// exist). A lock wait is a transaction of its own (implicit, or the one a
/// lifted `statement_timeout` opens), so the server would end the session
/// at that limit, in the middle of the wait.
async fn transaction_limited_pool(pool: &PgPool) -> Option<PgPool> {
    let version: i32 = sqlx::query_scalar("SELECT current_setting('server_version_num')::int")
        .fetch_one(pool)
        .await
        .expect("server_version_num");
    if version < 170_000 {
        println!("PostgreSQL {version} has no transaction_timeout: nothing to test");
        return None;
    }
    let options = (*pool.connect_options())
        .clone()
        .options([("transaction_timeout", SESSION_LIMIT)]);
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .expect("pool with a transaction_timeout");
    Some(pool)
}

#[sqlx::test(migrations = false)]
async fn a_session_transaction_timeout_does_not_cut_session_waits_short(pool: PgPool) {
    let Some(limited) = transaction_limited_pool(&pool).await else {
        return;
    };
    for multiplexed in [false, true] {
        let locker = if multiplexed {
            PgLocker::builder(limited.clone())
                .multiplex(1)
                .build()
                .expect("valid settings")
        } else {
            PgLocker::new(limited.clone())
        };
        let holder = hold_then_release(&pool, "hashtext('k')").await;
        let started = Instant::now();
        let outcome = locker.lock("k", TIMEOUT).await;
        let what = format!("lock (multiplexed: {multiplexed}) under transaction_timeout");
        let lock = assert_granted_after_hold(&what, started, outcome);
        lock.release().await.expect("release");
        holder.await.expect("holder");
    }
    let locker = PgLocker::new(limited.clone());
    let holder = hold_then_release(&pool, "hashtext('k')").await;
    let started = Instant::now();
    let outcome = locker.lock_shared("k", TIMEOUT).await;
    let lock = assert_granted_after_hold("lock_shared under transaction_timeout", started, outcome);
    lock.release().await.expect("release");
    holder.await.expect("holder");
    let holder = hold_then_release(&pool, "hashtext('k')").await;
    let started = Instant::now();
    let outcome = locker.lock_all(["j", "k"], TIMEOUT).await;
    let both = assert_granted_after_hold("lock_all under transaction_timeout", started, outcome);
    both.release().await.expect("release");
    holder.await.expect("holder");
    // The session's limit is back once the wait is over.
    let limit: String = sqlx::query_scalar("SHOW transaction_timeout")
        .fetch_one(&limited)
        .await
        .expect("transaction_timeout");
    assert_eq!(limit, SESSION_LIMIT);
    limited.close().await;
}

/// Waits for a permit of a `Semaphore(1)` on `limited` while the permit is
/// held for [`HOLD`] and a head of another process holds the semaphore's
/// queue: this process's head lines up behind it in the server's lock
/// queue, a wait of about [`HOLD`] that must end with the grant, not at
/// the session's limit, which (`setting`) every connection has again
/// afterwards.
async fn assert_semaphore_queue_wait_granted(
    pool: &PgPool,
    limited: &PgPool,
    setting: &str,
    what: &str,
) {
    const NAME: &str = "sem:limited";
    let permit = PgLocker::new(pool.clone())
        .semaphore(NAME, 1)
        .expect("a valid semaphore")
        .try_acquire()
        .await
        .expect("try_acquire")
        .expect("a free permit");
    // The other process: a semaphore of its own, on a pool of its own.
    let other = PgPoolOptions::new()
        .max_connections(2)
        .connect_with((*pool.connect_options()).clone())
        .await
        .expect("the other process's pool");
    let other = PgLocker::new(other)
        .semaphore(NAME, 1)
        .expect("a valid semaphore");
    let other_head = tokio::spawn(async move {
        let permit = other.acquire(TIMEOUT * 2).await?;
        permit.release().await
    });
    let mut obs = observer_for(pool).await;
    semaphore_head_idle_with_queue(&mut obs, NAME).await;
    // No warm connections: each goes back to the pool once released.
    let ours = PgLocker::builder(limited.clone())
        .keep_warm(0, Duration::ZERO)
        .build()
        .expect("valid settings")
        .semaphore(NAME, 1)
        .expect("a valid semaphore");
    let started = Instant::now();
    let holder = tokio::spawn(async move {
        tokio::time::sleep(HOLD).await;
        permit.release().await.expect("release the held permit");
    });
    let outcome = ours.acquire(TIMEOUT).await;
    let permit = assert_granted_after_hold(what, started, outcome);
    permit.release().await.expect("release");
    holder.await.expect("holder");
    other_head
        .await
        .expect("the other head")
        .expect("the other process gets the permit first and gives it back");
    drop(ours);
    // Every connection back in the pool (the head's goes back from a task
    // of its own, after an `UNLISTEN *`), then each of them looked at.
    eventually(
        "every connection back in the pool",
        Duration::from_secs(5),
        async || limited.num_idle() == limited.size() as usize,
    )
    .await;
    let mut conns = Vec::new();
    for _ in 0..limited.size() {
        conns.push(limited.acquire().await.expect("a connection"));
    }
    for conn in &mut conns {
        let limit: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SHOW {setting}")))
            .fetch_one(&mut **conn)
            .await
            .expect("the session's limit");
        assert_eq!(limit, SESSION_LIMIT, "{what}: {setting} afterwards");
    }
}

/// A `Semaphore::acquire` whose head waits in the server's queue behind
/// another process's head waits past the session's `statement_timeout`.
#[sqlx::test(migrations = false)]
async fn a_session_statement_timeout_does_not_cut_a_semaphore_queue_wait_short(pool: PgPool) {
    let limited = limited_pool(&pool).await;
    let what = "Semaphore::acquire under statement_timeout";
    assert_semaphore_queue_wait_granted(&pool, &limited, "statement_timeout", what).await;
    limited.close().await;
}

/// The same under a session `transaction_timeout` (PostgreSQL 17 and
/// later), which would end the session in the middle of the wait.
#[sqlx::test(migrations = false)]
async fn a_session_transaction_timeout_does_not_cut_a_semaphore_queue_wait_short(pool: PgPool) {
    let Some(limited) = transaction_limited_pool(&pool).await else {
        return;
    };
    let what = "Semaphore::acquire under transaction_timeout";
    assert_semaphore_queue_wait_granted(&pool, &limited, "transaction_timeout", what).await;
    limited.close().await;
}

/// `migrate` called while another process migrates queues on the
/// migration lock past the session's `lock_timeout`, `statement_timeout`
/// and (PostgreSQL 17 and later) `transaction_timeout`, as the docs say
/// concurrent calls do, instead of failing (or, under
/// `transaction_timeout`, having its session ended) at the limit.
#[sqlx::test(migrations = false)]
async fn a_session_limit_does_not_cut_a_queued_migrate_short(pool: PgPool) {
    let version: i32 = sqlx::query_scalar("SELECT current_setting('server_version_num')::int")
        .fetch_one(&pool)
        .await
        .expect("server_version_num");
    let mut settings = vec!["lock_timeout", "statement_timeout"];
    if version >= 170_000 {
        settings.push("transaction_timeout");
    }
    for setting in settings {
        let options = (*pool.connect_options())
            .clone()
            .options([(setting, SESSION_LIMIT)]);
        let limited = PgPoolOptions::new()
            .max_connections(2)
            .connect_with(options)
            .await
            .expect("a pool with a session limit");
        // Another process holds the migration lock (namespace "dl", 1).
        let holder = hold_then_release(&pool, "25708, 1").await;
        let started = Instant::now();
        let outcome = distlock::migrate(&limited).await;
        assert_granted_after_hold(&format!("migrate under {setting}"), started, outcome);
        holder.await.expect("holder");
        let limit: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SHOW {setting}")))
            .fetch_one(&limited)
            .await
            .expect("the setting");
        assert_eq!(
            limit, SESSION_LIMIT,
            "{setting} is back on the pool's connection"
        );
        limited.close().await;
    }
}
