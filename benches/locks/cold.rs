//! Where an interleaved cycle's time goes: each statement of a session lock
//! cycle, timed as the first round trip on a backend that sat idle for the
//! other work's 1 ms, and again right after another round trip on it.
//!
//! Back to back, a backend answers within a warm CPU cache and without a
//! wake-up; after other work, the first round trip pays both, whatever it
//! carries. `PgAdvisoryLock` pays it in the pool's ping, distlock in its lock
//! statement, so comparing whole cycles hides where each spends. Here
//! distlock's own statements are recorded on the wire during a real
//! `try_lock` and `release`, and sent raw on a connection of their own,
//! beside the bare `pg_try_advisory_lock` and a ping, so that the
//! difference between rows is the price of what the statement checks (the
//! pooler marker, the standby guard, the keepalive and connection-check
//! settings, the key resolved in SQL) and of the library around it.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use distlock::{LockKey, PgLocker};
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, PgPool};

use crate::stats::median_f64;

/// One step's medians, in µs; `None` where a step has no cold form (an
/// unlock always follows its lock's round trip).
#[derive(Debug, Clone)]
pub struct Step {
    pub label: &'static str,
    pub cold: Option<f64>,
    pub warm: f64,
}

/// Samples of one step.
#[derive(Default)]
struct Samples {
    cold: Vec<f64>,
    warm: Vec<f64>,
}

impl Samples {
    fn push(&mut self, cold: Option<Duration>, warm: Duration) {
        if let Some(cold) = cold {
            self.cold.push(cold.as_secs_f64() * 1e6);
        }
        self.warm.push(warm.as_secs_f64() * 1e6);
    }

    fn step(self, label: &'static str) -> Step {
        Step {
            label,
            cold: (!self.cold.is_empty()).then(|| median_f64(&self.cold)),
            warm: median_f64(&self.warm),
        }
    }
}

/// distlock's statements for a bigint key, as the server saw them.
pub struct Statements {
    /// `try_lock`'s (binds the key as `$1`–`$3`).
    pub try_lock: String,
    /// `lock`'s first statement, which waits where the connection checks
    /// for a vanished client and tries elsewhere (the key as `$1`–`$3`,
    /// the `lock_timeout` as `$4`).
    pub try_or_wait: String,
    /// `release`'s (binds the lock's backend pid as `$1`, which the
    /// statement checks before it unlocks, and the key as `$2`).
    pub unlock: String,
}

/// Takes and releases two locks, one with `try_lock` on `key` and one with
/// `lock` on `key + 1`, through a locker whose pool reaches the server
/// through a recording proxy, and reads the statements it prepared from the
/// recorded bytes (`pg_stat_activity` truncates long statements).
pub async fn capture(opts: &PgConnectOptions, key: i64) -> anyhow::Result<Statements> {
    let (port, sent) = recording_proxy(opts.get_host(), opts.get_port())?;
    let through = opts.clone().host("127.0.0.1").port(port);
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(through)
        .await?;
    let locker = PgLocker::builder(pool.clone())
        .keep_warm(0, Duration::ZERO)
        .build()?;
    let lock = locker
        .try_lock(LockKey::id(key))
        .await?
        .context("the capture key was busy")?;
    lock.release().await?;
    let lock = locker
        .lock(LockKey::id(key + 1), Duration::from_secs(5))
        .await?;
    lock.release().await?;
    drop(locker);
    pool.close().await;
    let bytes = sent
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .clone();
    let parsed = parse_messages(&bytes);
    // The first lock statement sent that contains every needle.
    let find = |needles: &[&str]| {
        parsed
            .iter()
            .find(|sql| sql.contains("distlock.locks") && needles.iter().all(|n| sql.contains(n)))
            .cloned()
            .with_context(|| format!("no statement with {needles:?} was sent"))
    };
    Ok(Statements {
        // `try_lock` ran first: `lock`'s statement tries too, but later.
        try_lock: find(&["pg_try_advisory_lock"])?,
        // The wait's lock call (`pg_try_advisory_lock(` does not contain it).
        try_or_wait: find(&["pg_advisory_lock(", "lock_timeout"])?,
        unlock: find(&["pg_advisory_unlock"])?,
    })
}

/// A proxy to `host:port` for one connection, keeping every byte the
/// client sent.
fn recording_proxy(host: &str, port: u16) -> anyhow::Result<(u16, Arc<Mutex<Vec<u8>>>)> {
    let listener = TcpListener::bind(("127.0.0.1", 0))?;
    let local = listener.local_addr()?.port();
    let sent = Arc::new(Mutex::new(Vec::new()));
    let record = sent.clone();
    let upstream = (host.to_owned(), port);
    std::thread::spawn(move || -> std::io::Result<()> {
        let (client, _) = listener.accept()?;
        let server = TcpStream::connect((upstream.0.as_str(), upstream.1))?;
        let (mut from_client, mut to_server) = (client.try_clone()?, server.try_clone()?);
        let (mut from_server, mut to_client) = (server, client);
        std::thread::spawn(move || std::io::copy(&mut from_server, &mut to_client));
        let mut buf = [0_u8; 8192];
        loop {
            let n = from_client.read(&mut buf)?;
            if n == 0 {
                return to_server.shutdown(std::net::Shutdown::Write);
            }
            if let Ok(mut sent) = record.lock() {
                sent.extend_from_slice(&buf[..n]);
            }
            to_server.write_all(&buf[..n])?;
        }
    });
    Ok((local, sent))
}

/// The query text of every Parse message in `bytes`, a client's side of a
/// PostgreSQL connection (an SSL request, the startup message, then typed
/// messages).
fn parse_messages(bytes: &[u8]) -> Vec<String> {
    let int = |at: usize| {
        bytes
            .get(at..at + 4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
    };
    let mut at = 0;
    // Untyped: an SSL request (8 bytes, code 80877103), then the startup.
    while let (Some(len), Some(code)) = (int(at), int(at + 4)) {
        at += len;
        if !(len == 8 && code == 80_877_103) {
            break;
        }
    }
    let mut queries = Vec::new();
    while let (Some(&kind), Some(len)) = (bytes.get(at), int(at + 1)) {
        let body = bytes.get(at + 5..at + 1 + len).unwrap_or_default();
        if kind == b'P' {
            // Statement name, then the query, each NUL-terminated.
            let mut parts = body.split(|b| *b == 0);
            if let (Some(_), Some(query)) = (parts.next(), parts.next()) {
                queries.push(String::from_utf8_lossy(query).into_owned());
            }
        }
        at += 1 + len;
    }
    queries
}

/// Times `f`.
async fn timed<T>(f: impl Future<Output = anyhow::Result<T>>) -> anyhow::Result<(T, Duration)> {
    let start = Instant::now();
    let value = f.await?;
    Ok((value, start.elapsed()))
}

/// The bench's connections and statements.
struct Ctx {
    pool: PgPool,
    locker: PgLocker,
    statements: Statements,
    raw: PgConnection,
    theirs: PgConnection,
    /// The backend of `theirs`, which its unlock statement names.
    their_pid: i32,
}

impl Ctx {
    /// The other work of the interleaved cycles: a query on the pool, then
    /// 1 ms of sleep.
    async fn other_work(&self) -> anyhow::Result<()> {
        let _: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&self.pool).await?;
        tokio::time::sleep(Duration::from_millis(1)).await;
        Ok(())
    }

    async fn bare_try(&mut self, key: i64) -> anyhow::Result<bool> {
        let sql = "SELECT pg_catalog.pg_try_advisory_lock($1)";
        Ok(sqlx::query_scalar(sql)
            .bind(key)
            .fetch_one(&mut self.raw)
            .await?)
    }

    async fn bare_unlock(&mut self, key: i64) -> anyhow::Result<bool> {
        let sql = "SELECT pg_catalog.pg_advisory_unlock($1)";
        Ok(sqlx::query_scalar(sql)
            .bind(key)
            .fetch_one(&mut self.raw)
            .await?)
    }

    /// distlock's try statement, its parameters those of a bigint key
    /// (space 1, the key, no text).
    async fn their_try(&mut self, key: i64) -> anyhow::Result<()> {
        let sql = AssertSqlSafe(self.statements.try_lock.clone());
        let row = sqlx::query(sql)
            .bind(1_i32)
            .bind(key)
            .bind(None::<String>)
            .fetch_one(&mut self.theirs)
            .await?;
        let taken: Option<bool> = sqlx::Row::try_get(&row, 0)?;
        if taken != Some(true) {
            bail!("distlock's try statement, sent raw, did not take key {key}");
        }
        Ok(())
    }

    async fn their_unlock(&mut self, key: i64) -> anyhow::Result<()> {
        let sql = AssertSqlSafe(self.statements.unlock.clone());
        let row = sqlx::query(sql)
            .bind(self.their_pid)
            .bind(key)
            .fetch_one(&mut self.theirs)
            .await?;
        let unlocked: Option<bool> = sqlx::Row::try_get(&row, 0)?;
        if unlocked != Some(true) {
            bail!("distlock's unlock statement, sent raw, did not unlock key {key}");
        }
        Ok(())
    }

    async fn api_cycle(&self, key: i64) -> anyhow::Result<(Duration, Duration)> {
        let (lock, took) = timed(async {
            let lock = self.locker.try_lock(LockKey::id(key)).await?;
            lock.context("key busy")
        })
        .await?;
        let ((), released) = timed(async { Ok(lock.release().await?) }).await?;
        Ok((took, released))
    }
}

/// The steps, each cold then warm, `rounds` times, on a current-thread
/// runtime (no hops between threads, so what remains is round trips and
/// the server's work).
pub async fn measure(opts: &PgConnectOptions, rounds: usize) -> anyhow::Result<Vec<Step>> {
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(opts.clone())
        .await?;
    let locker = PgLocker::new(pool.clone());
    let statements = capture(opts, 95_000_000).await?;
    let mut theirs = PgConnection::connect_with(opts).await?;
    let their_pid = sqlx::query_scalar("SELECT pg_catalog.pg_backend_pid()")
        .fetch_one(&mut theirs)
        .await?;
    let mut ctx = Ctx {
        raw: PgConnection::connect_with(opts).await?,
        theirs,
        their_pid,
        pool,
        locker,
        statements,
    };
    let mut ping = Samples::default();
    let (mut bare_try, mut bare_unlock) = (Samples::default(), Samples::default());
    let (mut their_try, mut their_unlock) = (Samples::default(), Samples::default());
    let (mut api_try, mut api_release) = (Samples::default(), Samples::default());
    for round in 0..rounds + rounds / 5 {
        let key = 95_000_001 + round as i64 * 4;
        let keep = round >= rounds / 5;

        ctx.other_work().await?;
        let ((), cold) = timed(async { Ok(ctx.raw.ping().await?) }).await?;
        let ((), warm) = timed(async { Ok(ctx.raw.ping().await?) }).await?;
        if keep {
            ping.push(Some(cold), warm);
        }

        ctx.other_work().await?;
        let (got, cold) = timed(ctx.bare_try(key)).await?;
        let (_, unlock) = timed(ctx.bare_unlock(key)).await?;
        let (again, warm) = timed(ctx.bare_try(key + 1)).await?;
        ctx.bare_unlock(key + 1).await?;
        if !(got && again) {
            bail!("a bare try found its key busy");
        }
        if keep {
            bare_try.push(Some(cold), warm);
            bare_unlock.push(None, unlock);
        }

        ctx.other_work().await?;
        let ((), cold) = timed(ctx.their_try(key + 2)).await?;
        let ((), unlock) = timed(ctx.their_unlock(key + 2)).await?;
        let ((), warm) = timed(ctx.their_try(key + 3)).await?;
        ctx.their_unlock(key + 3).await?;
        if keep {
            their_try.push(Some(cold), warm);
            their_unlock.push(None, unlock);
        }

        ctx.other_work().await?;
        let (cold, release) = ctx.api_cycle(key + 2).await?;
        let (warm, _) = ctx.api_cycle(key + 3).await?;
        if keep {
            api_try.push(Some(cold), warm);
            api_release.push(None, release);
        }
    }
    drop(ctx.locker);
    ctx.pool.close().await;
    Ok(vec![
        ping.step("ping (an empty round trip, what `pool.acquire()` sends first)"),
        bare_try.step("`SELECT pg_try_advisory_lock($1)`"),
        bare_unlock.step("`SELECT pg_advisory_unlock($1)`, right after the try"),
        their_try.step("distlock's try statement, sent raw"),
        their_unlock.step("distlock's unlock statement, sent raw, right after the try"),
        api_try.step("distlock `try_lock()` (a warm connection: 1 round trip)"),
        api_release.step("distlock `release()`, right after the try"),
    ])
}

/// The table, with the differences that say where the time goes.
pub fn table(steps: &[Step]) -> String {
    let mut out = String::from(
        "\n### Where an interleaved cycle's time goes (current-thread runtime)\n\n\
         Each step timed as the first round trip on a backend idle for the other work's 1 ms \
         (the interleaved cycles' other work: a query on the pool, then `sleep(1 ms)`), and \
         again right after another round trip on the same backend. distlock's statements \
         are recorded on the wire during a real `try_lock` and `release`, and \
         sent raw on a connection of their own.\n\n\
         | step | after 1 ms idle, median µs | right after another round trip, median µs |\n\
         |---|---:|---:|\n",
    );
    for step in steps {
        let cold = step.cold.map_or("—".to_owned(), |c| format!("{c:.0}"));
        out.push_str(&format!("| {} | {cold} | {:.0} |\n", step.label, step.warm));
    }
    out
}
