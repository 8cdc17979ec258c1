//! A lock wait is a statement that runs as long as the wait, so sqlx logs
//! it as a slow statement (`WARN`, target `sqlx::query`). Every statement of
//! distlock's that waits runs in the `distlock.wait` span, which tells that
//! warning from a slow query of the caller's and lets the filter of the
//! README ("Observability") drop it while the caller's own slow queries
//! still show.
//!
//! One subscriber, two layers: one shows every warning (where each waiting
//! path must have logged a slow statement inside `distlock.wait`, so the
//! other layer's silence is not an accident), the other has the README's
//! filter (where the one slow statement left must be the caller's).
//!
//! A test binary of its own: in the integration binary, with other tests
//! running on other threads (which have no subscriber), this test's
//! thread-local subscriber sometimes saw no slow statement at all; `tracing`
//! caches per callsite, for every thread, whether anyone listens.

#[path = "common/mod.rs"]
mod common;

use std::future::Future;
use std::time::Duration;

use common::captured::Captured;
use distlock::{PgLocker, SessionLock};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool};
use tracing_subscriber::filter::{self, LevelFilter};
use tracing_subscriber::prelude::*;

/// How long each holder keeps its lock: well above the slow-statement
/// threshold below, so every wait behind it is a slow statement.
const HOLD: Duration = Duration::from_millis(200);
const THRESHOLD: Duration = Duration::from_millis(50);
const WAIT: Duration = Duration::from_secs(10);

/// The README's filter: everything but sqlx's statements inside a
/// `distlock.wait` span.
fn not_lock_waits<S>() -> filter::DynFilterFn<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    filter::dynamic_filter_fn(|meta, cx| {
        meta.target() != "sqlx::query"
            || !cx
                .lookup_current()
                .is_some_and(|span| span.scope().any(|s| s.name() == "distlock.wait"))
    })
}

/// The lines of `captured` that start a slow-statement event.
fn slow(captured: &Captured) -> Vec<String> {
    captured
        .text()
        .lines()
        .filter(|line| line.contains("slow statement"))
        .map(str::to_owned)
        .collect()
}

/// A plain-text fmt layer writing to `to`.
fn fmt<S>(to: Captured) -> impl tracing_subscriber::Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    tracing_subscriber::fmt::layer()
        .with_ansi(false)
        .with_writer(to)
}

/// Runs `wait` while `held` is held, and lets `held` go after [`HOLD`].
async fn behind<T>(held: SessionLock, wait: impl Future<Output = T>) -> T {
    let release = async {
        tokio::time::sleep(HOLD).await;
        held.release().await.unwrap();
    };
    // Boxed: the futures of the waiting calls are large in a debug build.
    let (waited, ()) = tokio::join!(Box::pin(wait), release);
    waited
}

/// Returns once a session holds the advisory lock of `key` (in the
/// semaphore's namespace).
async fn queue_held(pool: &PgPool, key: &str) {
    loop {
        let held: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND objsubid = 2 AND objid = (hashtext($1)::int8 & 4294967295)::oid)",
        )
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap();
        if held {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[sqlx::test(migrations = false)]
async fn lock_waits_are_told_from_slow_queries_and_can_be_filtered(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    // Boxed: the scenario's future is too large for a test thread's stack in
    // a debug build.
    Box::pin(scenario(connect_opts)).await;
}

async fn scenario(connect_opts: PgConnectOptions) {
    let all = Captured::default();
    let filtered = Captured::default();
    let subscriber = tracing_subscriber::registry()
        .with(LevelFilter::INFO)
        .with(fmt(all.clone()).with_filter(LevelFilter::WARN))
        .with(fmt(filtered.clone()).with_filter(not_lock_waits()));
    let _guard = tracing::subscriber::set_default(subscriber);

    // The caller's pool warns of statements slower than THRESHOLD; the
    // holders' pool never does.
    let slow_opts = connect_opts
        .clone()
        .log_slow_statements(log::LevelFilter::Warn, THRESHOLD);
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect_with(slow_opts)
        .await
        .unwrap();
    let quiet: PgPool = PgPoolOptions::new()
        .max_connections(8)
        .connect_with(connect_opts.clone().disable_statement_logging())
        .await
        .unwrap();

    // The migration lock, held by another session.
    let mut other = connect_opts.connect().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock(25708, 1)")
        .execute(&mut other)
        .await
        .unwrap();
    let migrated = async {
        Box::pin(distlock::migrate(&pool)).await.unwrap();
    };
    let unlock = async {
        tokio::time::sleep(HOLD).await;
        sqlx::query("SELECT pg_advisory_unlock(25708, 1)")
            .execute(&mut other)
            .await
            .unwrap();
    };
    tokio::join!(migrated, unlock);
    other.close().await.unwrap();

    let holder = PgLocker::new(quiet.clone());
    let locker = PgLocker::new(pool.clone());
    let held = |key: &'static str| {
        let holder = holder.clone();
        async move { holder.try_lock(key).await.unwrap().unwrap() }
    };

    let lock = behind(held("w-session").await, locker.lock("w-session", WAIT)).await;
    lock.unwrap().release().await.unwrap();
    let lock = behind(held("w-shared").await, locker.lock_shared("w-shared", WAIT)).await;
    lock.unwrap().release().await.unwrap();
    let lock = behind(
        held("w-upgradeable").await,
        locker.lock_upgradeable("w-upgradeable", WAIT),
    )
    .await;
    lock.unwrap().release().await.unwrap();
    let mut upgradeable = locker
        .try_lock_upgradeable("w-upgrade")
        .await
        .unwrap()
        .unwrap();
    let reader = holder.try_lock_shared("w-upgrade").await.unwrap().unwrap();
    behind(reader, upgradeable.upgrade(WAIT)).await.unwrap();
    upgradeable.release().await.unwrap();
    let all_keys = behind(
        held("w-all").await,
        locker.lock_all(["w-all", "w-all-b"], WAIT),
    )
    .await;
    all_keys.unwrap().release().await.unwrap();
    let ran = behind(
        held("w-xact").await,
        locker.with_advisory_lock_wait("w-xact", WAIT, async |_conn| Ok::<_, distlock::Error>(())),
    )
    .await;
    ran.unwrap();
    let mut tx = pool.begin().await.unwrap();
    behind(
        held("w-caller").await,
        distlock::lock_xact(&mut tx, "w-caller", WAIT),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let mux = PgLocker::builder(pool.clone())
        .multiplex(1)
        .build()
        .unwrap();
    let lock = behind(held("w-mux").await, mux.lock("w-mux", WAIT)).await;
    lock.unwrap().release().await.unwrap();
    // The waiters of one process wait in the process, not in a statement;
    // a process waits on the server for the queue while another process's
    // head holds it. The holder's process holds the permit and has a
    // waiter (its head, holding the queue); this process's waiter lines up
    // behind it, a statement that waits until the holder's waiter is
    // served and done.
    let held_semaphore = holder.semaphore("w-semaphore", 1).unwrap();
    let exports = locker.semaphore("w-semaphore", 1).unwrap();
    let permit = held_semaphore.try_acquire().await.unwrap().unwrap();
    let release = async {
        tokio::time::sleep(HOLD * 2).await;
        permit.release().await.unwrap();
    };
    let holders_waiter = async {
        let permit = held_semaphore.acquire(WAIT).await.unwrap();
        tokio::time::sleep(HOLD).await;
        permit.release().await.unwrap();
    };
    let waiter = async {
        queue_held(&quiet, "w-semaphore#queue").await;
        exports
            .acquire(WAIT)
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    };
    tokio::join!(Box::pin(holders_waiter), Box::pin(waiter), release);

    // The caller's own slow query.
    sqlx::query("SELECT pg_sleep(0.1)")
        .execute(&pool)
        .await
        .unwrap();

    let every = slow(&all);
    for key in [
        "distlock migrations",
        "w-session",
        "w-shared",
        "w-upgradeable",
        "w-upgrade",
        "w-all",
        "w-xact",
        "w-caller",
        "w-mux",
        "w-semaphore#queue",
    ] {
        let span = format!("distlock.wait{{key={key}}}");
        assert!(
            every.iter().any(|line| line.contains(&span)),
            "no slow statement inside {span}; the slow statements seen:\n{}",
            every.join("\n")
        );
    }
    assert!(
        every
            .iter()
            .any(|line| line.contains("pg_sleep") && !line.contains("distlock.wait")),
        "the caller's slow query is logged outside distlock's span: {every:#?}"
    );
    let left = slow(&filtered);
    assert!(
        left.len() == 1 && left[0].contains("pg_sleep"),
        "with the filter, the caller's slow query alone is left: {left:#?}"
    );
}
