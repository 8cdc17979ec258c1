//! The Redis rows of the hot-key hand-off: tasks that share one
//! `RedisLocker` fight over one key, on the Redis at
//! `DISTLOCK_BENCH_REDIS_URL` (default `redis://127.0.0.1:6379`). Measured
//! as the PostgreSQL rows are (`handoff.rs`): from the start of a release
//! to the next holder's acquisition returning.

use std::sync::Arc;
use std::time::Duration;

use distlock::redis::{RedisLease, RedisLocker};
use rand::Rng;

use crate::handoff::{Baton, Handoff};

/// The Redis server of the benchmark.
pub fn url() -> String {
    std::env::var("DISTLOCK_BENCH_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// Starts `waiters` tasks on one locker.
pub async fn spawn(
    variant: Handoff,
    waiters: usize,
    target: usize,
    baton: &Arc<Baton>,
    tasks: &mut tokio::task::JoinSet<anyhow::Result<()>>,
) -> anyhow::Result<()> {
    // A short TTL: a key left by an interrupted run is gone by the next.
    let locker = RedisLocker::builder(url())
        .ttl(Duration::from_secs(5))
        .build()
        .await?;
    let key = format!("distlock-bench:handoff:{}", variant.short());
    warm_up(&locker, &key).await?;
    for _ in 0..waiters {
        let (locker, key, baton) = (locker.clone(), key.clone(), Arc::clone(baton));
        tasks.spawn(async move {
            loop {
                let lease = match variant {
                    Handoff::RedisPolled => polled(&locker, &key).await?,
                    _ => locker.lock(key.as_str(), Duration::from_secs(120)).await?,
                };
                let stop = baton.acquired(target);
                baton.releasing();
                lease.release().await?;
                if stop {
                    return Ok::<_, anyhow::Error>(());
                }
            }
        });
    }
    Ok(())
}

/// One contended hand-off, so that the subscriber connection is open and
/// the scripts are warm before the measured ones.
async fn warm_up(locker: &RedisLocker, key: &str) -> anyhow::Result<()> {
    let held = locker.lock(key, Duration::from_secs(10)).await?;
    let waiter = {
        let (locker, key) = (locker.clone(), key.to_owned());
        tokio::spawn(async move { locker.lock(key.as_str(), Duration::from_secs(10)).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    held.release().await?;
    waiter.await??.release().await?;
    Ok(())
}

/// `try_lock` until granted, sleeping between tries a random time in
/// `[d/2, d]`, `d` doubling from 5 ms to 100 ms: the wait of `lock()`
/// before releases were signalled.
async fn polled(locker: &RedisLocker, key: &str) -> anyhow::Result<RedisLease> {
    let mut ceiling = Duration::from_millis(5);
    loop {
        if let Some(lease) = locker.try_lock(key).await? {
            return Ok(lease);
        }
        let half = ceiling / 2;
        let jitter = rand::rng().random_range(0..=half.as_micros() as u64);
        tokio::time::sleep(half + Duration::from_micros(jitter)).await;
        ceiling = (ceiling * 2).min(Duration::from_millis(100));
    }
}
