//! Errors that say what happened: each of distlock's own conditions is
//! produced on the real database, and its printed message is checked, since
//! the message is what a user reads first in a log.
// `f(&mut *tx)` is the documented way to pass a transaction's connection.
#![allow(clippy::explicit_auto_deref)]

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::pgbouncer::PgBouncer;
use common::*;
use distlock::memory::MemoryLocker;
use distlock::{Error, FencingToken, LockKey, Locker, PgLocker, SingletonJob};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgConnection, PgPool};

/// The advice every error for a missing schema gives.
const MIGRATE_FIRST: &str = "call distlock::migrate first";

fn shown(err: &Error) -> String {
    let text = err.to_string();
    println!("{text}");
    assert!(
        !text.ends_with('.') && !text.starts_with(char::is_uppercase),
        "messages read like sqlx's: lower case, no trailing punctuation: {text:?}"
    );
    text
}

#[sqlx::test(migrations = false)]
async fn a_fenced_lock_without_migrate_says_to_call_migrate(pool: PgPool) {
    let locker = PgLocker::builder(pool)
        .fencing(true)
        .build()
        .expect("valid settings");
    let err = locker.try_lock("fenced").await.expect_err("no schema");
    assert!(matches!(err, Error::NotMigrated { .. }), "{err:?}");
    assert!(shown(&err).contains(MIGRATE_FIRST), "{err}");
}

#[sqlx::test(migrations = false)]
async fn fence_check_without_migrate_says_to_call_migrate(pool: PgPool) {
    let mut conn = pool.acquire().await.expect("conn");
    let err = distlock::fence::check(&mut conn, "invoice:7", FencingToken::new(1))
        .await
        .expect_err("no schema");
    assert!(matches!(err, Error::NotMigrated { .. }), "{err:?}");
    assert!(shown(&err).contains(MIGRATE_FIRST), "{err}");
}

#[sqlx::test(migrations = false)]
async fn idempotency_claim_without_migrate_says_to_call_migrate(pool: PgPool) {
    let mut conn = pool.acquire().await.expect("conn");
    let err = distlock::idempotency::claim(&mut conn, "payments", "order-1")
        .await
        .expect_err("no schema");
    assert!(matches!(err, Error::NotMigrated { .. }), "{err:?}");
    assert!(shown(&err).contains(MIGRATE_FIRST), "{err}");
}

#[sqlx::test(migrations = false)]
async fn once_per_window_without_migrate_says_to_call_migrate(pool: PgPool) {
    let locker: Arc<dyn Locker> = Arc::new(PgLocker::new(pool.clone()));
    let job = SingletonJob::builder(locker, "job:daily")
        .once_per_window(pool.clone(), Duration::from_secs(86_400))
        .build()
        .expect("valid settings");
    let err = job
        .run(async |_ctx| Ok::<_, Error>(()))
        .await
        .expect_err("no schema");
    assert!(matches!(err, Error::NotMigrated { .. }), "{err:?}");
    assert!(shown(&err).contains(MIGRATE_FIRST), "{err}");
}

/// An application's own missing table or function whose unqualified name
/// is `distlock` is the application's error, not a missing migration: the
/// crate's objects are always named with their schema.
#[sqlx::test(migrations = false)]
async fn an_applications_missing_table_named_distlock_stays_a_database_error(pool: PgPool) {
    let locker = PgLocker::new(pool);
    for statement in ["SELECT * FROM distlock", "SELECT distlock(1)"] {
        let err = locker
            .with_advisory_lock("app", async |conn| {
                sqlx::query(statement).execute(&mut *conn).await?;
                Ok::<_, Error>(())
            })
            .await
            .expect_err("no such object");
        assert!(
            matches!(&err, Error::Database(db) if db.as_database_error().is_some()),
            "{statement}: {err:?}"
        );
    }
}

/// A pool of one connection to `pool`'s database that waits 500 ms for it.
async fn pool_of_one(pool: &PgPool) -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(500))
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .expect("pool of one")
}

/// The regression: a `try_lock` and then more work on a pool of one waited
/// out sqlx's acquire timeout and said only "pool timed out".
#[sqlx::test(migrations = false)]
async fn a_try_lock_on_a_pool_its_own_locks_fill_names_the_pool(pool: PgPool) {
    let small = pool_of_one(&pool).await;
    let locker = PgLocker::new(small);
    let held = locker.try_lock("first").await.expect("try").expect("free");
    let err = locker
        .try_lock("second")
        .await
        .expect_err("no connection left");
    assert!(matches!(err, Error::PoolExhausted { .. }), "{err:?}");
    let text = shown(&err);
    assert!(text.contains("\"second\""), "{text}");
    assert!(text.contains("max_connections 1"), "{text}");
    assert!(text.contains("held locks"), "{text}");
    held.release().await.expect("release");
}

/// The regression: a semaphore's `try_acquire` on a full pool named its
/// internal queue lock (`Namespaced(i32::MIN, "reports#queue")`), not the
/// semaphore.
#[sqlx::test(migrations = false)]
async fn a_semaphore_try_on_a_full_pool_names_the_semaphore(pool: PgPool) {
    let small = pool_of_one(&pool).await;
    let locker = PgLocker::new(small);
    let reports = locker.semaphore("reports", 2).expect("valid");
    let held = reports.try_acquire().await.expect("try").expect("free");
    let err = reports.try_acquire().await.expect_err("no connection left");
    match &err {
        Error::PoolExhausted { key, .. } => assert_eq!(*key, LockKey::from("reports")),
        other => panic!("expected PoolExhausted, got {other:?}"),
    }
    assert!(!shown(&err).contains("#queue"), "{err}");
    held.release().await.expect("release");
}

/// The regression: an inner `with_advisory_lock` on the key its enclosing
/// one holds returned `Ok(None)`, as if another process held it.
#[sqlx::test(migrations = false)]
async fn a_nested_with_advisory_lock_on_the_same_key_says_it_is_nested(pool: PgPool) {
    let inner = nested(&PgLocker::new(pool), "k".into(), "k".into()).await;
    let err = inner.expect_err("nested on the same key");
    assert!(matches!(err, Error::NestedLock { .. }), "{err:?}");
    let text = shown(&err);
    assert!(
        text.contains("\"k\"") && text.contains("this task"),
        "{text}"
    );
}

/// Two spellings of one server lock are one lock for the nesting check too:
/// `LockKey::hashed64(name)` and the id of its value both lock that
/// `bigint`, so an inner call on the one inside an outer call on the other
/// could never be granted (it came back busy, and a waiting one waited for
/// itself until its timeout).
#[sqlx::test(migrations = false)]
async fn a_nested_lock_on_another_spelling_of_the_same_server_lock_is_nested(pool: PgPool) {
    let outer = LockKey::hashed64("k");
    let inner = LockKey::id(outer.pg_bigint().expect("a bigint key"));
    let inner = nested(&PgLocker::new(pool), outer, inner).await;
    assert!(matches!(inner, Err(Error::NestedLock { .. })), "{inner:?}");
}

/// What `with_advisory_lock(inner)` answers inside `with_advisory_lock(outer)`.
async fn nested(locker: &PgLocker, outer: LockKey, inner: LockKey) -> Result<Option<()>, Error> {
    locker
        .with_advisory_lock(outer, async |_conn| {
            let nested = locker
                .with_advisory_lock(inner, async |_conn| Ok::<_, Error>(()))
                .await;
            Ok::<_, Error>(nested)
        })
        .await
        .expect("outer")
        .expect("outer took the free key")
}

/// The regression: the waiting variant blocked until its timeout and then
/// named the enclosing transaction's own backend as "the holder".
#[sqlx::test(migrations = false)]
async fn a_nested_waiting_lock_fails_at_once_instead_of_waiting_for_itself(pool: PgPool) {
    let locker = PgLocker::new(pool);
    let (inner, waited) = locker
        .with_advisory_lock("k", async |_conn| {
            let started = Instant::now();
            let nested = locker
                .with_advisory_lock_wait("k", Duration::from_secs(3), async |_conn| {
                    Ok::<_, Error>(())
                })
                .await;
            Ok::<_, Error>((nested, started.elapsed()))
        })
        .await
        .expect("outer")
        .expect("outer took the free key");
    let err = inner.expect_err("nested on the same key");
    assert!(waited < Duration::from_secs(1), "waited {waited:?}");
    assert!(matches!(err, Error::NestedLock { .. }), "{err:?}");
    assert!(shown(&err).contains("this task"));
}

/// A shared lock inside a shared lock on the same key is refused as well:
/// a writer that queues for the key between them waits for the outer
/// call, and PostgreSQL queues the inner one behind the writer, a cycle
/// the server cannot see (its last link is in the client). Shown with a
/// writer queued: the inner shared call would wait until its timeout.
#[sqlx::test(migrations = false)]
async fn a_shared_lock_inside_a_shared_lock_on_the_same_key_is_nested_too(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let writer = locker.clone();
    let (nested, raw) = locker
        .with_shared_advisory_lock("k", async |_conn| {
            let queued = tokio::spawn(async move {
                writer
                    .with_advisory_lock_wait("k", Duration::from_secs(5), async |_conn| {
                        Ok::<_, Error>(())
                    })
                    .await
            });
            let mut obs = crate::common::observer_for(&pool).await;
            crate::common::wait_for_waiters(&mut obs, 1, Duration::from_secs(5)).await;
            let nested = locker
                .with_shared_advisory_lock_wait("k", Duration::from_millis(500), async |_conn| {
                    Ok::<_, Error>(())
                })
                .await;
            // What the refusal spares: a shared request on another session
            // queues behind the writer, which waits for the outer call.
            let raw: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock_shared(hashtext('k'))")
                .fetch_one(&mut obs)
                .await
                .expect("raw try");
            drop(queued);
            Ok::<_, Error>((nested, raw))
        })
        .await
        .expect("outer")
        .expect("outer took the free key");
    assert!(
        matches!(nested, Err(Error::NestedLock { .. })),
        "{nested:?}"
    );
    assert!(!raw, "a shared try behind a queued writer is refused");
}

/// Other tasks of the process are other holders: they wait as usual.
#[sqlx::test(migrations = false)]
async fn the_same_key_in_another_task_is_contention_not_nesting(pool: PgPool) {
    let locker = PgLocker::new(pool);
    let other = locker.clone();
    let outcome = locker
        .with_advisory_lock("k", async |_conn| {
            let busy = tokio::spawn(async move {
                other
                    .with_advisory_lock("k", async |_conn| Ok::<_, Error>(()))
                    .await
            })
            .await
            .expect("task");
            Ok::<_, Error>(busy)
        })
        .await
        .expect("outer")
        .expect("free");
    assert!(matches!(outcome, Ok(None)), "{outcome:?}");
}

#[sqlx::test(migrations = false)]
async fn multi_key_argument_problems_have_their_own_variants(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());

    let err = locker
        .try_lock_all(Vec::<LockKey>::new())
        .await
        .expect_err("no keys");
    assert!(matches!(err, Error::NoKeys), "{err:?}");
    assert_eq!(shown(&err), "no keys to lock");

    let err = locker
        .try_lock_all(["a", "b", "a"])
        .await
        .expect_err("twice");
    assert!(matches!(err, Error::DuplicateKey { .. }), "{err:?}");
    assert_eq!(shown(&err), "lock \"a\" is listed twice");

    let mut obs = observer_for(&pool).await;
    let hashed = i64::from(hashtext(&mut obs, "x").await);
    let err = locker
        .try_lock_all([LockKey::from("x"), LockKey::id(hashed)])
        .await
        .expect_err("two spellings of one lock");
    assert!(matches!(err, Error::SameServerLock { .. }), "{err:?}");
    let text = shown(&err);
    assert!(
        text.contains("\"x\"") && text.contains(&hashed.to_string()),
        "{text}"
    );
    assert!(text.contains("same server lock"), "{text}");
    close(obs).await;
}

/// `LockKey::id(42)` and `"42"` are different locks, so their errors must
/// not read the same.
#[sqlx::test(migrations = false)]
async fn errors_tell_an_id_key_from_a_name(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let wait = Duration::from_millis(300);
    for (key, wanted) in [
        (LockKey::from("42"), "lock \"42\""),
        (LockKey::id(42), "lock 42 "),
        (LockKey::namespaced(7, "job"), "lock \"job\" in namespace 7"),
    ] {
        let held = locker.try_lock(&key).await.expect("try").expect("free");
        let other = PgLocker::new(pool.clone());
        let err = other.lock(&key, wait).await.expect_err("held");
        let text = shown(&err);
        assert!(text.contains(wanted), "{text} should contain {wanted:?}");
        match err {
            Error::Timeout { key: in_err, .. } => assert_eq!(in_err, key),
            other => panic!("{other:?}"),
        }
        held.release().await.expect("release");
    }
}

/// A pool of one connection to `pool`'s database whose session carries
/// a lock marker, as another client's session lock leaves it; and that
/// session's backend pid.
async fn marked_session(pool: &PgPool) -> (PgPool, i32) {
    let one = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .expect("pool of one");
    let mut conn = one.acquire().await.expect("conn");
    sqlx::query("SELECT pg_catalog.set_config('distlock.locks', '1', false)")
        .execute(&mut *conn)
        .await
        .expect("mark the session as another client would");
    let pid = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await
        .expect("pid");
    drop(conn);
    (one, pid)
}

/// A connection whose session already carries another client's lock
/// marker is what a transaction pooler hands out: the refusal says so,
/// instead of "backend pid changed from 4242 to 4242".
#[sqlx::test(migrations = false)]
async fn a_session_with_another_clients_marker_is_refused_with_that_evidence(pool: PgPool) {
    let (one, _) = marked_session(&pool).await;
    let locker = PgLocker::new(one);
    let err = locker.try_lock("k").await.expect_err("marked session");
    let text = shown(&err);
    assert!(
        matches!(
            err,
            Error::PoolerDetected {
                evidence: distlock::PoolerEvidence::MarkerSeen { .. }
            }
        ),
        "{err:?}"
    );
    assert!(!text.contains("changed from"), "{text}");
    assert!(
        text.contains("already holds another client's lock"),
        "{text}"
    );
}

/// `with_advisory_lock` on such a session is refused the same way, naming
/// the backend, whether its try answers (the default) or fails the
/// statement it shares with the `BEGIN` (`try_with_begin`); the
/// connection is rolled back and usable after either.
#[sqlx::test(migrations = false)]
async fn with_advisory_lock_on_a_session_with_another_clients_marker_is_refused(pool: PgPool) {
    let (one, pid) = marked_session(&pool).await;
    for try_with_begin in [false, true, true] {
        let locker = PgLocker::builder(one.clone())
            .try_with_begin(try_with_begin)
            .build()
            .expect("valid settings");
        let err = locker
            .with_advisory_lock("k", async |_| Ok::<_, Error>(()))
            .await
            .expect_err("marked session");
        match err {
            Error::PoolerDetected {
                evidence: distlock::PoolerEvidence::MarkerSeen { pid: seen },
            } => assert_eq!(seen, pid, "{try_with_begin}"),
            other => panic!("{try_with_begin}: {other:?}"),
        }
        let status: Option<String> =
            sqlx::query_scalar("SELECT current_setting('distlock.xact_lock', true)")
                .fetch_one(&one)
                .await
                .expect("the connection is usable");
        assert!(status.as_deref().is_none_or(str::is_empty), "{status:?}");
    }
}

/// A pool of one connection to `pool`'s database whose session already has
/// prepared statements named as sqlx names its own, `sqlx_s_{from}` to
/// `sqlx_s_4` (another client's, as a transaction pooler that lets them
/// leak hands out).
async fn with_foreign_statements(pool: &PgPool, from: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .after_connect(move |conn, _| {
            Box::pin(async move {
                // Simple protocol: does not advance sqlx's own numbering.
                let names = (from..=4)
                    .map(|i| format!("PREPARE sqlx_s_{i} AS SELECT {i};"))
                    .collect::<String>();
                sqlx::raw_sql(sqlx::AssertSqlSafe(names))
                    .execute(conn)
                    .await?;
                Ok(())
            })
        })
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .expect("pool of one")
}

fn refused<T: std::fmt::Debug>(what: &str, res: Result<T, Error>) {
    match res {
        Err(Error::PoolerDetected { .. }) => {}
        other => panic!("{what}: expected PoolerDetected, got {other:?}"),
    }
}

/// The regression: a session that already has prepared statements under
/// sqlx's names answers distlock's first prepared statement with 42P05.
/// The single-key lock reported `PoolerDetected`; the multi-key lock, the
/// multiplexed wake-up wait and the semaphore reported the raw `Database`
/// error.
#[sqlx::test(migrations = false)]
async fn a_foreign_prepared_statement_is_a_pooler_on_every_session_path(pool: PgPool) {
    let foreign = with_foreign_statements(&pool, 1).await;
    let locker = PgLocker::new(foreign.clone());
    refused("try_lock", locker.try_lock("k").await);
    refused("try_lock_all", locker.try_lock_all(["a", "b"]).await);
    let semaphore = locker.semaphore("s", 2).expect("valid");
    refused("Semaphore::try_acquire", semaphore.try_acquire().await);
    // A busy key: the multiplexed try (on a connection of its own, opened
    // outside the pool) finds it held and waits on a pooled connection,
    // whose first prepared statement collides.
    let mut holder = observer_for(&pool).await;
    sqlx::query("SELECT pg_advisory_lock(hashtext('b'))")
        .execute(&mut holder)
        .await
        .expect("hold b");
    let mux = PgLocker::builder(foreign.clone())
        .multiplex(1)
        .build()
        .expect("valid settings");
    refused(
        "multiplexed lock",
        mux.lock("b", Duration::from_secs(1)).await,
    );
    drop(mux);
    foreign.close().await;
    // Only the second statement collides: `lock_all`'s try (the first)
    // finds `b` busy, its wait (the second) collides.
    let foreign = with_foreign_statements(&pool, 2).await;
    let locker = PgLocker::new(foreign.clone());
    refused(
        "lock_all's wait",
        locker.lock_all(["a", "b"], Duration::from_secs(1)).await,
    );
    close(holder).await;
    foreign.close().await;
}

/// The multiplexed locker's shared connection opened on a server session
/// that already has a statement under sqlx's first name (a transaction
/// pooler with one server connection, another sqlx client's statement on
/// it): the connection's first named statement collides (42P05). That is
/// `PoolerDetected`, as on every other session path, not a connection that
/// failed to open (which a caller would retry). The pooler probe before it
/// sees one backend throughout, so only the collision tells.
#[sqlx::test(migrations = false)]
async fn a_multiplexed_connection_opened_on_a_shared_session_is_a_pooler(pool: PgPool) {
    let direct = pool.connect_options().as_ref().clone();
    let bouncer = PgBouncer::builder(direct.get_port())
        .set("default_pool_size", "1")
        .start()
        .await;
    // sqlx's own statement cache: queries use named statements.
    let through = direct.host("127.0.0.1").port(bouncer.port());
    let mut other = PgConnection::connect_with(&through)
        .await
        .expect("another client");
    let one: i32 = sqlx::query_scalar("SELECT $1::int4")
        .bind(1)
        .fetch_one(&mut other)
        .await
        .expect("its prepared statement");
    assert_eq!(one, 1);
    let clients = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(through)
        .await
        .expect("pool through pgbouncer");
    let mux = PgLocker::builder(clients.clone())
        .multiplex(1)
        .build()
        .expect("valid settings");
    refused("multiplexed try_lock", mux.try_lock("k").await);
    drop(mux);
    clients.close().await;
    close(other).await;
}

/// A fenced grant that came without a token is distlock's own finding,
/// not a driver fault.
#[sqlx::test(migrations = false)]
async fn a_grant_without_a_fencing_token_is_its_own_error(pool: PgPool) {
    distlock::migrate(&pool).await.expect("migrate");
    sqlx::query(
        "CREATE OR REPLACE FUNCTION distlock.next_token() RETURNS bigint \
         LANGUAGE sql AS 'SELECT NULL::bigint'",
    )
    .execute(&pool)
    .await
    .expect("a broken token function");
    let locker = PgLocker::builder(pool)
        .fencing(true)
        .build()
        .expect("valid settings");
    let err = locker.try_lock("k").await.expect_err("no token");
    assert!(matches!(err, Error::MissingFencingToken { .. }), "{err:?}");
    assert!(shown(&err).contains("without a fencing token"));
}

/// DESIGN.md's re-entrancy rule: a second `try_lock` of a key this process
/// holds is `Ok(None)`, in every mode and on every backend.
#[sqlx::test(migrations = false)]
async fn a_second_try_lock_of_a_held_key_is_none_in_every_mode(pool: PgPool) {
    let plain = PgLocker::new(pool.clone());
    let multiplexed = PgLocker::builder(pool.clone())
        .multiplex(1)
        .build()
        .expect("valid settings");
    for locker in [&plain, &multiplexed] {
        let held = locker.try_lock("k").await.expect("try").expect("free");
        assert!(locker.try_lock("k").await.expect("again").is_none());
        assert!(
            locker
                .try_lock(&held.key().clone())
                .await
                .expect("again")
                .is_none()
        );
        held.release().await.expect("release");
    }
    // Two lockers of one process are two holders as well.
    let held = plain.try_lock("k").await.expect("try").expect("free");
    assert!(multiplexed.try_lock("k").await.expect("other").is_none());
    held.release().await.expect("release");

    let memory = MemoryLocker::new();
    let held = memory.try_lock("k").await.expect("try").expect("free");
    assert!(memory.try_lock("k").await.expect("again").is_none());
    held.release().await.expect("release");
}
