//! Helpers for `tests/multiplex.rs`: observing advisory locks from another
//! session, and a loopback proxy that can stall a connection.
//!
//! Every test runs under `#[sqlx::test(migrations = false)]` with a database
//! of its own; advisory locks are per database, so these helpers only look
//! at locks of the *current* database.
#![allow(dead_code)]

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool};
use sqlx::{ConnectOptions, Connection, Row};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::AbortHandle;

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
pub const OBSERVER_APP: &str = "distlock-mux-observer";

/// A direct connection to the same database, acting as "another process".
pub async fn observer(opts: &PgConnectOptions) -> PgConnection {
    opts.clone()
        .application_name(OBSERVER_APP)
        .connect()
        .await
        .expect("observer connection")
}

/// An observer connection to the database `pool` points at.
pub async fn observer_for(pool: &PgPool) -> PgConnection {
    observer(&pool.connect_options()).await
}

/// Closes an observer connection politely (so the test database can be dropped).
pub async fn close(conn: PgConnection) {
    let _ = conn.close().await;
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

/// One advisory-lock row of `pg_locks` in the current database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockRow {
    pub pid: i32,
    pub granted: bool,
}

/// Every advisory lock (granted or awaited) in the current database.
pub async fn advisory_locks(conn: &mut PgConnection) -> Vec<LockRow> {
    let rows = sqlx::query(
        "SELECT pid, granted FROM pg_locks WHERE locktype = 'advisory' \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_all(conn)
    .await
    .expect("query pg_locks");
    rows.iter()
        .map(|r| LockRow {
            pid: r.get(0),
            granted: r.get(1),
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

/// `pg_try_advisory_lock(hashtext(name))` on `conn`; keeps it if taken.
pub async fn raw_try_lock(conn: &mut PgConnection, name: &str) -> bool {
    sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtext($1))")
        .bind(name)
        .fetch_one(conn)
        .await
        .expect("raw try lock")
}

/// `pg_advisory_unlock(hashtext(name))` on `conn`.
pub async fn raw_unlock(conn: &mut PgConnection, name: &str) -> bool {
    sqlx::query_scalar("SELECT pg_advisory_unlock(hashtext($1))")
        .bind(name)
        .fetch_one(conn)
        .await
        .expect("raw unlock")
}

/// Whether `conn` could take `name` right now (it is unlocked again at once).
pub async fn raw_can_take(conn: &mut PgConnection, name: &str) -> bool {
    let got = raw_try_lock(conn, name).await;
    if got {
        assert!(raw_unlock(conn, name).await, "unlock after raw_can_take");
    }
    got
}

/// Polls `check` until it returns `true`; panics with `what` after `limit`.
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
        assert!(
            start.elapsed() <= limit,
            "{what}: still not true after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits (bounded) until no advisory lock, granted or awaited, remains.
pub async fn assert_no_advisory_locks_eventually(conn: &mut PgConnection, limit: Duration) {
    eventually("no advisory lock left", limit, async || {
        advisory_locks(conn).await.is_empty()
    })
    .await;
}

/// Waits (bounded) until at least `n` sessions wait for an advisory lock.
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

/// Runs `fut` with a hard upper bound so a hang fails the test.
pub async fn bounded<F: Future>(what: &str, limit: Duration, fut: F) -> F::Output {
    match tokio::time::timeout(limit, fut).await {
        Ok(out) => out,
        Err(_) => panic!("{what}: did not finish within {limit:?}"),
    }
}

/// A loopback TCP proxy (on `127.0.0.1:0`) that can *stall* (stop
/// forwarding both ways, closing nothing, as a partition would) and *cut*
/// (close every proxied connection). Stops when dropped.
#[derive(Debug)]
pub struct Proxy {
    port: u16,
    flowing: watch::Sender<bool>,
    conns: Arc<Mutex<Vec<AbortHandle>>>,
    listener: AbortHandle,
}

impl Proxy {
    /// Starts a proxy forwarding to `host:port`.
    pub async fn start(host: &str, port: u16) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let local = listener.local_addr()?.port();
        let (flowing, _) = watch::channel(true);
        let conns: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let upstream = (host.to_owned(), port);
        let task = {
            let (flowing, conns) = (flowing.clone(), conns.clone());
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let task = tokio::spawn(forward(client, upstream.clone(), flowing.subscribe()));
                    conns.lock().expect("proxy mutex").push(task.abort_handle());
                }
            })
        };
        Ok(Self {
            port: local,
            flowing,
            conns,
            listener: task.abort_handle(),
        })
    }

    /// The port to connect to on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stops forwarding in both directions; nothing is closed.
    pub fn stall(&self) {
        self.flowing.send_replace(false);
    }

    /// Resumes forwarding.
    pub fn pass(&self) {
        self.flowing.send_replace(true);
    }

    /// Closes every proxied connection on both sides.
    pub fn cut(&self) {
        for handle in self.conns.lock().expect("proxy mutex").drain(..) {
            handle.abort();
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.listener.abort();
        self.cut();
    }
}

async fn forward(client: TcpStream, upstream: (String, u16), flowing: watch::Receiver<bool>) {
    let Ok(server) = TcpStream::connect((upstream.0.as_str(), upstream.1)).await else {
        return;
    };
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::join!(
        pump(client_read, server_write, flowing.clone()),
        pump(server_read, client_write, flowing),
    );
}

/// Copies bytes while flowing; a read completed during a stall is held back
/// until forwarding resumes.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut flowing: watch::Receiver<bool>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if flowing.wait_for(|f| *f).await.is_err() {
            return;
        }
        let n = from.read(&mut buf).await.unwrap_or(0);
        if flowing.wait_for(|f| *f).await.is_err() {
            return;
        }
        if n == 0 || to.write_all(&buf[..n]).await.is_err() {
            let _ = to.shutdown().await;
            return;
        }
    }
}
