//! Contended hand-offs: `waiters` tasks fight over one hot key; each takes
//! it, gives it back at once and queues again. The latency of a hand-off is
//! measured from the moment the holder starts its release until the next
//! holder's acquisition returns; the rate is hand-offs per second.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::bail;
use distlock::{LockKey, PgLocker};
use sqlx::postgres::{PgAdvisoryLock, PgAdvisoryLockKey, PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, PgConnection, PgPool};

/// One way of waiting for a busy lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handoff {
    /// A dedicated connection per task: `pg_advisory_lock` / `pg_advisory_unlock`.
    Raw,
    /// A dedicated connection per task: `PgAdvisoryLock::acquire` / `release_now`.
    Sqlx,
    /// `locker.lock(key, timeout)` / `release()` (pooled connection per lock).
    Distlock,
    /// `Raw`'s dedicated connections running distlock's own wait and unlock
    /// statements (as `lock()` sends them on a warm connection): separates
    /// what the statements cost from what the client side costs.
    RawDistlockSql,
    /// `Distlock` with `.keep_warm(0, ..)`: every `lock()` borrows from the
    /// pool, which pings the connection on its way back and out again.
    DistlockCold,
    /// The same with `.multiplex(2)` (wake-up on a pooled connection, then a
    /// try on the shared one).
    DistlockMux,
    /// `RedisLocker::lock` / `release()`, one locker shared by the tasks:
    /// waiters woken by the release's signal (`benches/locks/redis_handoff.rs`).
    Redis,
    /// `RedisLocker::try_lock` polled with jittered backoff, 5 ms doubling
    /// to 100 ms: how `lock()` waited before release signals.
    RedisPolled,
}

/// The PostgreSQL alternatives.
pub const POSTGRES: [Handoff; 6] = [
    Handoff::Raw,
    Handoff::Sqlx,
    Handoff::RawDistlockSql,
    Handoff::Distlock,
    Handoff::DistlockCold,
    Handoff::DistlockMux,
];

/// The Redis alternatives (run with the `redis` feature).
pub const REDIS: [Handoff; 2] = [Handoff::Redis, Handoff::RedisPolled];

/// Every alternative this build can run: PostgreSQL's, and with the
/// `redis` feature Redis's.
pub fn all() -> Vec<Handoff> {
    let mut all = POSTGRES.to_vec();
    if cfg!(feature = "redis") {
        all.extend(REDIS);
    }
    all
}

impl Handoff {
    pub fn label(self) -> &'static str {
        match self {
            Handoff::Raw => "sqlx hand-written pg_advisory_lock",
            Handoff::Sqlx => "sqlx PgAdvisoryLock::acquire",
            Handoff::RawDistlockSql => "sqlx hand-written, distlock's statements",
            Handoff::Distlock => "distlock lock()",
            Handoff::DistlockCold => "distlock lock(), keep_warm(0)",
            Handoff::DistlockMux => "distlock multiplexed lock()",
            Handoff::Redis => "distlock RedisLocker lock(), woken by the release",
            Handoff::RedisPolled => "RedisLocker try_lock() polled, 5–100 ms backoff",
        }
    }

    pub fn short(self) -> &'static str {
        match self {
            Handoff::Raw => "sqlx raw",
            Handoff::Sqlx => "PgAdvisoryLock",
            Handoff::RawDistlockSql => "sqlx raw, distlock SQL",
            Handoff::Distlock => "distlock",
            Handoff::DistlockCold => "distlock, no warm conns",
            Handoff::DistlockMux => "distlock mux",
            Handoff::Redis => "Redis, woken",
            Handoff::RedisPolled => "Redis, polled",
        }
    }

    pub fn is_redis(self) -> bool {
        REDIS.contains(&self)
    }

    fn key(self) -> i64 {
        4_200 + POSTGRES.iter().position(|h| *h == self).unwrap_or(0) as i64
    }
}

/// What one run measured.
#[derive(Debug, Clone, Default)]
pub struct Run {
    pub latencies: Vec<Duration>,
    pub per_second: f64,
}

/// Shared between the tasks of one run.
pub struct Baton {
    released_at: Mutex<Option<Instant>>,
    latencies: Mutex<Vec<Duration>>,
    done: AtomicUsize,
    inside: AtomicUsize,
    violations: AtomicUsize,
    stop: AtomicBool,
}

impl Baton {
    /// Called right after acquiring; returns whether the task should stop.
    pub fn acquired(&self, target: usize) -> bool {
        let now = Instant::now();
        if self.inside.fetch_add(1, Ordering::SeqCst) != 0 {
            self.violations.fetch_add(1, Ordering::SeqCst);
        }
        if let Some(at) = self.released_at.lock().expect("baton").take() {
            self.latencies.lock().expect("baton").push(now - at);
            if self.done.fetch_add(1, Ordering::SeqCst) + 1 >= target {
                self.stop.store(true, Ordering::SeqCst);
            }
        }
        self.stop.load(Ordering::SeqCst)
    }

    /// Called right before releasing.
    pub fn releasing(&self) {
        self.inside.fetch_sub(1, Ordering::SeqCst);
        *self.released_at.lock().expect("baton") = Some(Instant::now());
    }
}

/// Runs `waiters` tasks until `target` hand-offs (or `limit` elapsed).
pub async fn run(
    opts: &PgConnectOptions,
    variant: Handoff,
    waiters: usize,
    target: usize,
    limit: Duration,
) -> anyhow::Result<Run> {
    let baton = Arc::new(Baton {
        released_at: Mutex::new(None),
        latencies: Mutex::new(Vec::with_capacity(target)),
        done: AtomicUsize::new(0),
        inside: AtomicUsize::new(0),
        violations: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
    });
    let key = variant.key();
    let mut pool: Option<PgPool> = None;
    let mut tasks = tokio::task::JoinSet::new();
    match variant {
        Handoff::Raw | Handoff::Sqlx | Handoff::RawDistlockSql => {
            // The statements `lock()` and `release()` send today, read off
            // the wire (keys of their own, away from the hot one).
            let statements = if variant == Handoff::RawDistlockSql {
                let captured = crate::cold::capture(opts, key + 1_000).await?;
                Some(Arc::new((captured.try_or_wait, captured.unlock)))
            } else {
                None
            };
            let mut conns = Vec::new();
            for _ in 0..waiters {
                conns.push(opts.connect().await?);
            }
            for conn in conns {
                let (baton, statements) = (baton.clone(), statements.clone());
                tasks.spawn(async move {
                    match (variant, statements) {
                        (Handoff::Raw, _) => raw_loop(conn, key, &baton, target).await,
                        (Handoff::RawDistlockSql, Some(statements)) => {
                            distlock_sql_loop(conn, key, &statements, &baton, target).await
                        }
                        (Handoff::RawDistlockSql, None) => bail!("no captured statements"),
                        _ => sqlx_loop(conn, key, &baton, target).await,
                    }
                });
            }
        }
        Handoff::Distlock | Handoff::DistlockCold | Handoff::DistlockMux => {
            let p = PgPoolOptions::new()
                .max_connections(u32::try_from(waiters + 4)?)
                .min_connections(u32::try_from(waiters + 1)?)
                .connect_with(opts.clone())
                .await?;
            let mut builder = PgLocker::builder(p.clone());
            match variant {
                Handoff::DistlockMux => builder = builder.multiplex(2),
                Handoff::DistlockCold => builder = builder.keep_warm(0, Duration::ZERO),
                _ => {}
            }
            let locker = builder.build().expect("valid settings");
            // Warm up: pooler probe, shared connections, prepared statements.
            for _ in 0..waiters + 2 {
                if let Some(lock) = locker.try_lock(LockKey::id(key)).await? {
                    lock.release().await?;
                }
            }
            for _ in 0..waiters {
                let (locker, baton) = (locker.clone(), baton.clone());
                tasks.spawn(async move {
                    loop {
                        let lock = locker
                            .lock(LockKey::id(key), Duration::from_secs(120))
                            .await?;
                        let stop = baton.acquired(target);
                        baton.releasing();
                        lock.release().await?;
                        if stop {
                            return Ok::<_, anyhow::Error>(());
                        }
                    }
                });
            }
            pool = Some(p);
        }
        Handoff::Redis | Handoff::RedisPolled => {
            #[cfg(feature = "redis")]
            crate::redis_handoff::spawn(variant, waiters, target, &baton, &mut tasks).await?;
            #[cfg(not(feature = "redis"))]
            bail!("{} needs the `redis` feature", variant.label());
        }
    }
    let started = Instant::now();
    let watchdog = {
        let baton = baton.clone();
        tokio::spawn(async move {
            tokio::time::sleep(limit).await;
            baton.stop.store(true, Ordering::SeqCst);
        })
    };
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    watchdog.abort();
    let elapsed = started.elapsed();
    if let Some(pool) = pool {
        pool.close().await;
    }
    if baton.violations.load(Ordering::SeqCst) != 0 {
        bail!("{}: two holders at once", variant.label());
    }
    let latencies = std::mem::take(&mut *baton.latencies.lock().expect("baton"));
    Ok(Run {
        per_second: latencies.len() as f64 / elapsed.as_secs_f64(),
        latencies,
    })
}

async fn raw_loop(
    mut conn: PgConnection,
    key: i64,
    baton: &Baton,
    target: usize,
) -> anyhow::Result<()> {
    loop {
        sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(key)
            .execute(&mut conn)
            .await?;
        let stop = baton.acquired(target);
        baton.releasing();
        sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(key)
            .execute(&mut conn)
            .await?;
        if stop {
            return Ok(conn.close().await?);
        }
    }
}

/// `lock()`'s first statement and `release()`'s, as `cold::capture` read
/// them off the wire, sent on a dedicated connection: what the statements
/// cost without the client side of `PgLocker`. The wait binds the key as
/// `$1`–`$3` (space 1, the id, no name) and the `lock_timeout` as `$4`;
/// the unlock binds the connection's backend pid (which it checks before it
/// unlocks) and the id.
async fn distlock_sql_loop(
    mut conn: PgConnection,
    key: i64,
    (wait, unlock): &(String, String),
    baton: &Baton,
    target: usize,
) -> anyhow::Result<()> {
    let pid: i32 = sqlx::query_scalar("SELECT pg_catalog.pg_backend_pid()")
        .fetch_one(&mut conn)
        .await?;
    loop {
        let row = sqlx::query(AssertSqlSafe(wait.as_str()))
            .bind(1_i32)
            .bind(key)
            .bind(None::<String>)
            .bind("120000ms")
            .fetch_one(&mut conn)
            .await?;
        let ok: Option<bool> = sqlx::Row::try_get(&row, 0)?;
        // A fresh connection only tries (its client check is not set yet).
        if ok != Some(true) {
            continue;
        }
        let stop = baton.acquired(target);
        baton.releasing();
        let row = sqlx::query(AssertSqlSafe(unlock.as_str()))
            .bind(pid)
            .bind(key)
            .fetch_one(&mut conn)
            .await?;
        let unlocked: Option<bool> = sqlx::Row::try_get(&row, 0)?;
        if unlocked != Some(true) {
            anyhow::bail!("distlock's unlock statement, sent raw, did not unlock key {key}");
        }
        if stop {
            return Ok(conn.close().await?);
        }
    }
}

async fn sqlx_loop(
    mut conn: PgConnection,
    key: i64,
    baton: &Baton,
    target: usize,
) -> anyhow::Result<()> {
    let lock = PgAdvisoryLock::with_key(PgAdvisoryLockKey::BigInt(key));
    loop {
        let guard = lock.acquire(&mut conn).await?;
        let stop = baton.acquired(target);
        baton.releasing();
        guard.release_now().await?;
        if stop {
            return Ok(conn.close().await?);
        }
    }
}
