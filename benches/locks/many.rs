//! Many keys held at once by one process: how long taking and releasing
//! them takes, and how many connections it needs.

use std::time::{Duration, Instant};

use anyhow::bail;
use distlock::{LockKey, PgLocker, SessionLock};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection};

/// How the keys are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holding {
    /// Hand-written: one connection, `pg_try_advisory_lock` one key after
    /// another (no heartbeat, no re-entrancy protection, no guards).
    RawOneConn,
    /// distlock default mode: one pooled connection (and keeper) per lock.
    Distlock,
    /// distlock `.multiplex(n)`, keys taken by 32 concurrent tasks.
    Mux(usize),
    /// distlock `.multiplex(n)`, keys taken one after another by one task.
    MuxSequential(usize),
}

impl Holding {
    pub fn label(self) -> String {
        match self {
            Holding::RawOneConn => "sqlx hand-written, 1 connection, sequential".into(),
            Holding::Distlock => "distlock default (1 connection per lock)".into(),
            Holding::Mux(n) => format!("distlock multiplex({n}), 32 tasks"),
            Holding::MuxSequential(n) => format!("distlock multiplex({n}), 1 task"),
        }
    }
}

/// What holding `keys` keys cost.
#[derive(Debug, Clone)]
pub struct Held {
    pub keys: usize,
    pub acquire: Duration,
    pub release: Duration,
    pub connections: usize,
    pub note: Option<String>,
}

/// The sessions holding advisory locks in this database right now.
async fn holder_sessions(obs: &mut PgConnection) -> anyhow::Result<usize> {
    let n: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT pid) FROM pg_locks WHERE locktype = 'advisory' AND granted \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_one(obs)
    .await?;
    Ok(usize::try_from(n)?)
}

pub async fn measure(
    opts: &PgConnectOptions,
    holding: Holding,
    keys: usize,
) -> anyhow::Result<Held> {
    let mut obs = opts.connect().await?;
    let base = 50_000_000_i64 + keys as i64 * 10;
    let keys_i64 = i64::try_from(keys)?;
    let held = match holding {
        Holding::RawOneConn => {
            let mut conn = opts.connect().await?;
            let t = Instant::now();
            for k in base..base + keys_i64 {
                let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                    .bind(k)
                    .fetch_one(&mut conn)
                    .await?;
                if !got {
                    bail!("key {k} busy");
                }
            }
            let acquire = t.elapsed();
            let connections = holder_sessions(&mut obs).await?;
            let t = Instant::now();
            for k in base..base + keys_i64 {
                let _: bool = sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
                    .bind(k)
                    .fetch_one(&mut conn)
                    .await?;
            }
            let release = t.elapsed();
            conn.close().await?;
            Held {
                keys,
                acquire,
                release,
                connections,
                note: None,
            }
        }
        Holding::Distlock => {
            // One connection per lock: a pool of 50 shows where that ends
            // without exhausting a shared server's `max_connections`.
            let pool = PgPoolOptions::new()
                .max_connections(50)
                .acquire_timeout(Duration::from_secs(1))
                .connect_with(opts.clone())
                .await?;
            let locker = PgLocker::new(pool.clone());
            let t = Instant::now();
            let mut locks = Vec::new();
            let mut note = None;
            let mut acquire = Duration::ZERO;
            for k in base..base + keys_i64 {
                match locker.try_lock(LockKey::id(k)).await {
                    Ok(Some(lock)) => {
                        locks.push(lock);
                        acquire = t.elapsed(); // up to the last lock taken
                    }
                    Ok(None) => bail!("key {k} busy"),
                    Err(err) => {
                        note = Some(format!("stopped after {} locks: {err}", locks.len()));
                        break;
                    }
                }
            }
            let connections = holder_sessions(&mut obs).await?;
            let n = locks.len();
            let t = Instant::now();
            release_all(locks).await?;
            let release = t.elapsed();
            pool.close().await;
            Held {
                keys: n,
                acquire,
                release,
                connections,
                note,
            }
        }
        Holding::Mux(conns) | Holding::MuxSequential(conns) => {
            let pool = PgPoolOptions::new()
                .max_connections(4)
                .connect_with(opts.clone())
                .await?;
            let locker = PgLocker::builder(pool.clone())
                .multiplex(conns)
                .build()
                .expect("valid settings");
            // Open the shared connections first: a process holds them for
            // its lifetime, so their setup is not part of taking the keys.
            for k in 0..(conns as i64 * 8) {
                if let Some(lock) = locker.try_lock(LockKey::id(base - 1_000 - k)).await? {
                    lock.release().await?;
                }
            }
            let tasks: i64 = if matches!(holding, Holding::Mux(_)) {
                32
            } else {
                1
            };
            let t = Instant::now();
            let mut set = tokio::task::JoinSet::new();
            for task in 0..tasks {
                let locker = locker.clone();
                set.spawn(async move {
                    let mut held = Vec::new();
                    let mut k = base + task;
                    while k < base + keys_i64 {
                        match locker.try_lock(LockKey::id(k)).await? {
                            Some(lock) => held.push(lock),
                            None => bail!("key {k} busy"),
                        }
                        k += tasks;
                    }
                    Ok::<_, anyhow::Error>(held)
                });
            }
            let mut locks = Vec::with_capacity(keys);
            while let Some(part) = set.join_next().await {
                locks.extend(part??);
            }
            let acquire = t.elapsed();
            let connections = holder_sessions(&mut obs).await?;
            let t = Instant::now();
            release_all(locks).await?;
            let release = t.elapsed();
            drop(locker);
            pool.close().await;
            Held {
                keys,
                acquire,
                release,
                connections,
                note: None,
            }
        }
    };
    obs.close().await?;
    Ok(held)
}

/// Releases every lock, 32 at a time.
async fn release_all(locks: Vec<SessionLock>) -> anyhow::Result<()> {
    let mut set = tokio::task::JoinSet::new();
    let mut chunks: Vec<Vec<SessionLock>> = (0..32).map(|_| Vec::new()).collect();
    for (i, lock) in locks.into_iter().enumerate() {
        chunks[i % 32].push(lock);
    }
    for chunk in chunks {
        set.spawn(async move {
            for lock in chunk {
                lock.release().await?;
            }
            Ok::<_, distlock::Error>(())
        });
    }
    while let Some(done) = set.join_next().await {
        done??;
    }
    Ok(())
}
