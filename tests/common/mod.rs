//! Helpers shared by the integration tests.
//!
//! Every test runs under `#[sqlx::test(migrations = false)]`, so it has a
//! database of its own; advisory locks are per database, so the helpers here
//! only ever look at locks of the *current* database.
#![allow(dead_code)]

pub mod captured;
pub mod cluster;
pub mod cycle;
pub mod drop_after;
pub mod event_log;
pub mod netns;
pub mod pgbouncer;
pub mod proxy;
pub mod redis;
pub mod roles;
pub mod row_waits;
pub mod txpool;

use std::future::Future;
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool};
use sqlx::{ConnectOptions, Connection, Row};

/// Installs a `tracing` subscriber once (filtered by `RUST_LOG`, silent by default).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

/// Application name of observer connections.
pub const OBSERVER_APP: &str = "distlock-test-observer";

/// A heartbeat deadline for tests that want frequent heartbeats but test no
/// stall: the deadline is also that of a session try's statement, and a
/// busy machine (the suite's tests in parallel on 2 cores) has missed 100 ms
/// (`CommandTimedOut { after: 100ms }` from a plain `try_lock`). A server
/// that ends a session is still noticed at once, by its goodbye.
pub const PATIENT: Duration = Duration::from_secs(5);

/// A separate, direct connection to the same database, for watching and
/// provoking locks from "another process".
pub async fn observer(opts: &PgConnectOptions) -> PgConnection {
    opts.clone()
        .application_name(OBSERVER_APP)
        .connect()
        .await
        .expect("observer connection")
}

/// A URL for the test database `pool` points at (trust authentication, no
/// password), for child processes.
pub fn url_of(pool: &PgPool) -> String {
    let opts = pool.connect_options();
    format!(
        "postgres://{}@{}:{}/{}",
        opts.get_username(),
        opts.get_host(),
        opts.get_port(),
        opts.get_database().unwrap_or("postgres")
    )
}

/// An observer connection to the database `pool` points at.
pub async fn observer_for(pool: &PgPool) -> PgConnection {
    observer(&pool.connect_options()).await
}

/// The backend pid of a connection.
pub async fn backend_pid(conn: &mut PgConnection) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(conn)
        .await
        .expect("pg_backend_pid")
}

/// `hashtext(name)` as the server computes it.
pub async fn hashtext(conn: &mut PgConnection, name: &str) -> i32 {
    sqlx::query_scalar("SELECT hashtext($1)")
        .bind(name)
        .fetch_one(conn)
        .await
        .expect("hashtext")
}

/// One advisory-lock row of `pg_locks` in the current database, raw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockRow {
    pub classid: i64,
    pub objid: i64,
    pub objsubid: i32,
    pub pid: i32,
    pub mode: String,
    pub granted: bool,
}

impl LockRow {
    /// The `(classid, objid, objsubid)` triple identifying the key.
    pub fn triple(&self) -> (i64, i64, i32) {
        (self.classid, self.objid, self.objsubid)
    }
}

/// How PostgreSQL displays a single-`bigint` key in `pg_locks` (documented:
/// high half in `classid`, low half in `objid`, `objsubid = 1`).
pub fn bigint_triple(key: i64) -> (i64, i64, i32) {
    let bits = u64::from_ne_bytes(key.to_ne_bytes());
    ((bits >> 32) as i64, (bits & 0xFFFF_FFFF) as i64, 1)
}

/// How PostgreSQL displays a two-`int4` key (first in `classid`, second in
/// `objid`, `objsubid = 2`).
pub fn pair_triple(a: i32, b: i32) -> (i64, i64, i32) {
    (
        i64::from(u32::from_ne_bytes(a.to_ne_bytes())),
        i64::from(u32::from_ne_bytes(b.to_ne_bytes())),
        2,
    )
}

/// Every advisory lock (granted or awaited) in the current database.
pub async fn advisory_locks(conn: &mut PgConnection) -> Vec<LockRow> {
    let rows = sqlx::query(
        "SELECT classid::int8, objid::int8, objsubid::int4, pid, mode, granted FROM pg_locks \
         WHERE locktype = 'advisory' \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
         ORDER BY granted DESC, pid, classid, objid",
    )
    .fetch_all(conn)
    .await
    .expect("query pg_locks");
    rows.iter()
        .map(|r| LockRow {
            classid: r.get(0),
            objid: r.get(1),
            objsubid: r.get(2),
            pid: r.get(3),
            mode: r.get(4),
            granted: r.get(5),
        })
        .collect()
}

/// Number of granted advisory locks in the current database.
pub async fn granted_count(conn: &mut PgConnection) -> usize {
    advisory_locks(conn)
        .await
        .iter()
        .filter(|r| r.granted)
        .count()
}

/// A key written the way hand-written SQL would.
#[derive(Debug, Clone)]
pub enum Raw {
    /// `hashtext(name)` in the bigint keyspace.
    Text(String),
    /// A bigint.
    BigInt(i64),
    /// `(ns, hashtext(name))` in the two-int keyspace.
    Pair(i32, String),
    /// `(a, b)` in the two-int keyspace.
    IntPair(i32, i32),
}

impl Raw {
    pub fn text(name: &str) -> Self {
        Raw::Text(name.to_owned())
    }
    pub fn pair(ns: i32, name: &str) -> Self {
        Raw::Pair(ns, name.to_owned())
    }
}

macro_rules! raw_call {
    ($conn:expr, $raw:expr, $func:literal) => {{
        let q = match $raw {
            Raw::Text(name) => {
                sqlx::query_scalar::<_, bool>(concat!("SELECT ", $func, "(hashtext($1))"))
                    .bind(name.clone())
            }
            Raw::BigInt(k) => {
                sqlx::query_scalar::<_, bool>(concat!("SELECT ", $func, "($1::int8)")).bind(*k)
            }
            Raw::Pair(ns, name) => {
                sqlx::query_scalar::<_, bool>(concat!("SELECT ", $func, "($1::int4, hashtext($2))"))
                    .bind(*ns)
                    .bind(name.clone())
            }
            Raw::IntPair(a, b) => {
                sqlx::query_scalar::<_, bool>(concat!("SELECT ", $func, "($1::int4, $2::int4)"))
                    .bind(*a)
                    .bind(*b)
            }
        };
        q.fetch_one($conn).await.expect(concat!("raw ", $func))
    }};
}

/// `pg_try_advisory_lock(..)` at session level on `conn`; keeps it if taken.
pub async fn raw_try_lock(conn: &mut PgConnection, raw: &Raw) -> bool {
    raw_call!(conn, raw, "pg_try_advisory_lock")
}

/// `pg_advisory_unlock(..)` on `conn`.
pub async fn raw_unlock(conn: &mut PgConnection, raw: &Raw) -> bool {
    raw_call!(conn, raw, "pg_advisory_unlock")
}

/// Whether `conn` could take `raw` right now (it is unlocked again at once).
pub async fn raw_can_take(conn: &mut PgConnection, raw: &Raw) -> bool {
    let got = raw_try_lock(conn, raw).await;
    if got {
        assert!(raw_unlock(conn, raw).await, "unlock after raw_can_take");
    }
    got
}

/// Polls `check` every few milliseconds until it returns `true`; panics with
/// `what` if that does not happen within `limit`. Returns the time it took.
pub async fn eventually(
    what: &str,
    limit: Duration,
    mut check: impl AsyncFnMut() -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        if check().await {
            return start.elapsed();
        }
        if start.elapsed() > limit {
            panic!("{what}: still not true after {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits (bounded) until no advisory lock, granted or awaited, remains in the
/// current database.
pub async fn assert_no_advisory_locks_eventually(
    conn: &mut PgConnection,
    limit: Duration,
) -> Duration {
    eventually("no advisory lock left", limit, async || {
        advisory_locks(conn).await.is_empty()
    })
    .await
}

/// Waits (bounded) until at least `n` sessions wait (granted = false) for an
/// advisory lock in the current database.
pub async fn wait_for_waiters(conn: &mut PgConnection, n: usize, limit: Duration) {
    eventually(&format!("{n} waiter(s) in pg_locks"), limit, async || {
        advisory_locks(conn)
            .await
            .iter()
            .filter(|r| !r.granted)
            .count()
            >= n
    })
    .await;
}

/// Waits (bounded) until no session waits for an advisory lock in the
/// current database (granted locks may remain). Returns the time it took.
pub async fn wait_for_no_waiters(conn: &mut PgConnection, limit: Duration) -> Duration {
    eventually("no waiter left in pg_locks", limit, async || {
        advisory_locks(conn).await.iter().all(|r| r.granted)
    })
    .await
}

/// Terminates backend `pid` (`pg_terminate_backend`, waiting up to 5 s for
/// it to exit); panics if there was no such backend.
pub async fn terminate(conn: &mut PgConnection, pid: i32) {
    let done: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 5000)")
        .bind(pid)
        .fetch_one(&mut *conn)
        .await
        .expect("pg_terminate_backend");
    assert!(done, "backend {pid} was not terminated");
}

/// Terminates `lock`'s backend and waits (bounded) until `lost()` says so.
pub async fn terminate_and_await_loss(conn: &mut PgConnection, lock: &distlock::SessionLock) {
    terminate(conn, lock.backend_pid()).await;
    bounded(
        "lost() after the backend was terminated",
        Duration::from_secs(5),
        lock.lost(),
    )
    .await;
}

/// A pool of `connect`'s database for a locker shared between runtimes,
/// which keeps no connection given back, so that no connection of one
/// runtime is used on another. A sqlx connection belongs to the runtime
/// that opened it: once that runtime is gone, its socket fails every
/// statement ("A Tokio 1.x context was found, but it is being shutdown").
/// A connection back in the pool could be taken by a lock on the next
/// runtime (seen on a busy machine: a `try_lock` failing so, or a lock
/// lost at once by its keeper), so every connection is closed when given
/// back.
pub fn pool_for_runtimes(connect: &PgConnectOptions) -> PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .after_release(|_, _| Box::pin(async { Ok(false) }))
        .connect_lazy_with(connect.clone())
}

/// Blocks every thread of the current runtime for at least `duration`, so
/// that none of its tasks runs meanwhile (as in a long blocking call, or a
/// process stopped and continued), and keeps the workers blocked until the
/// returned [`Starved`] is dropped: the caller looks first. To be called
/// from the future the runtime was started with (a test's body): on a
/// current-thread runtime that thread runs every task, and blocking it is
/// enough; on a multi-thread runtime it runs none, and one task per worker
/// blocks that worker, each spawned from outside the runtime so that any
/// idle worker takes it, all of them held at a barrier until every worker
/// is blocked.
pub fn starve_runtime(duration: Duration) -> Starved {
    assert_ne!(
        std::thread::current().name(),
        Some("tokio-runtime-worker"),
        "called from a worker: the barrier would wait for it forever"
    );
    let runtime = tokio::runtime::Handle::current();
    let workers = match runtime.runtime_flavor() {
        tokio::runtime::RuntimeFlavor::CurrentThread => 0,
        _ => runtime.metrics().num_workers(),
    };
    let blocked = std::sync::Arc::new(std::sync::Barrier::new(workers + 1));
    let released = std::sync::Arc::new(std::sync::Barrier::new(workers + 1));
    for _ in 0..workers {
        let runtime = runtime.clone();
        let (blocked, released) = (blocked.clone(), released.clone());
        std::thread::spawn(move || {
            runtime.spawn(async move {
                blocked.wait();
                released.wait();
            })
        });
    }
    blocked.wait();
    std::thread::sleep(duration);
    Starved(Some(released))
}

/// The workers [`starve_runtime`] blocked, let go when dropped.
#[must_use = "the runtime's workers stay blocked until this is dropped"]
pub struct Starved(Option<std::sync::Arc<std::sync::Barrier>>);

impl Drop for Starved {
    fn drop(&mut self) {
        if let Some(released) = self.0.take() {
            released.wait();
        }
    }
}

/// Runs `fut` with a hard upper bound so a hang fails the test instead of
/// stalling the suite.
pub async fn bounded<F: Future>(what: &str, limit: Duration, fut: F) -> F::Output {
    match tokio::time::timeout(limit, fut).await {
        Ok(out) => out,
        Err(_) => panic!("{what}: did not finish within {limit:?}"),
    }
}

/// Closes an observer connection politely (so the test database can be dropped).
pub async fn close(conn: PgConnection) {
    let _ = conn.close().await;
}

/// A transaction on its own connection that keeps fencing tokens from being
/// issued (until the connection is dropped or the transaction ends), so a
/// token's issue waits, and times out, *after* its lock was granted. The
/// lock statement names the counter only by its oid and the epoch table not
/// at all, so planning the statement does not wait for these locks.
pub async fn block_fencing_counters(pool: &PgPool) -> PgConnection {
    let mut conn = observer_for(pool).await;
    // Every token is a draw from the counter (`nextval`, which takes the
    // sequence in ROW EXCLUSIVE mode), and the token function reads the
    // epoch row: a no-op ALTER SEQUENCE (SHARE ROW EXCLUSIVE) and an
    // exclusive table lock make both wait (and fail at the session's
    // lock_timeout).
    sqlx::raw_sql(
        "BEGIN; LOCK TABLE distlock.token_epoch IN ACCESS EXCLUSIVE MODE; \
         ALTER SEQUENCE distlock.token_counter NO CYCLE",
    )
    .execute(&mut conn)
    .await
    .expect("block the fencing counters");
    conn
}

/// Ends a [`block_fencing_counters`] transaction and waits for the server to
/// answer, so the next token is issued at once. Closing the connection alone
/// is not enough: the server ends a closed session's transaction a moment
/// after the client has moved on.
pub async fn unblock_fencing_counters(mut blocker: PgConnection) {
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut blocker)
        .await
        .expect("unblock the fencing counters");
    close(blocker).await;
}

/// Makes every delete of a lease-table row fail with a database error (a
/// trigger that raises), so a `TableLease`'s release fails while the lease
/// itself still holds: unlike a session lock's connection, a pooled
/// connection's failure frees nothing.
pub async fn refuse_lease_deletes(pool: &PgPool) {
    sqlx::raw_sql(
        "CREATE FUNCTION public.keep_leases() RETURNS trigger LANGUAGE plpgsql
             AS $$ BEGIN RAISE EXCEPTION 'leases are kept'; END $$;
         CREATE TRIGGER keep_leases BEFORE DELETE ON distlock.leases
             FOR EACH ROW EXECUTE FUNCTION public.keep_leases();",
    )
    .execute(pool)
    .await
    .expect("a trigger that refuses lease deletes");
}

/// Waits until a session holds the queue lock of the `PgLocker::semaphore`
/// named `name` exclusively and is idle: a head whose line-up has answered
/// (it found every permit held), not a try in flight.
pub async fn semaphore_head_idle_with_queue(obs: &mut PgConnection, name: &str) {
    let queue = format!("{name}#queue");
    eventually(
        "a head holds the queue, idle",
        Duration::from_secs(20),
        async || {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
             WHERE l.locktype = 'advisory' AND l.granted AND l.mode = 'ExclusiveLock' \
             AND l.objsubid = 2 AND l.objid = (hashtext($1)::int8 & 4294967295)::oid \
             AND a.state = 'idle'",
            )
            .bind(&queue)
            .fetch_one(&mut *obs)
            .await
            .expect("pg_locks")
                == 1
        },
    )
    .await;
}
