//! Latencies of the lock kinds built over `Locker`: how long a freed permit
//! takes to reach a waiting `Semaphore::acquire`, and how long a waiting
//! campaign takes to lead after the leader's backend is terminated.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use distlock::{LeaderElection, PgLocker, Semaphore};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::stats::us;

/// Latencies in µs of one measurement, sorted.
pub struct Latencies {
    pub what: &'static str,
    pub from: &'static str,
    pub sorted_us: Vec<f64>,
}

impl Latencies {
    fn new(what: &'static str, from: &'static str, samples: Vec<Duration>) -> Self {
        let mut sorted_us: Vec<f64> = samples.into_iter().map(us).collect();
        sorted_us.sort_by(f64::total_cmp);
        Self {
            what,
            from,
            sorted_us,
        }
    }

    fn at(&self, q: f64) -> f64 {
        let n = self.sorted_us.len();
        if n == 0 {
            return f64::NAN;
        }
        self.sorted_us[((n - 1) as f64 * q).round() as usize]
    }
}

async fn pool(opts: &PgConnectOptions, size: u32) -> anyhow::Result<PgPool> {
    Ok(PgPoolOptions::new()
        .max_connections(size)
        .connect_with(opts.clone())
        .await?)
}

/// A 2-permit semaphore, both held by one process; another process waits
/// in `acquire`; one permit is released. From the release's return to the
/// waiter holding a permit.
pub async fn permit_handoff(opts: &PgConnectOptions, trials: usize) -> anyhow::Result<Latencies> {
    let holder_pool = pool(opts, 4).await?;
    let waiter_pool = pool(opts, 4).await?;
    let holder = PgLocker::new(holder_pool.clone()).semaphore("bench-permits", 2)?;
    let waiter = PgLocker::new(waiter_pool.clone()).semaphore("bench-permits", 2)?;
    let mut samples = Vec::with_capacity(trials);
    for _ in 0..trials {
        // The waiter of the round before may still be letting go of the
        // queue: wait for both permits to be free.
        let a = acquire_now(&holder).await?;
        let b = acquire_now(&holder).await?;
        let waiting = {
            let waiter = waiter.clone();
            tokio::spawn(async move {
                let permit = waiter.acquire(Duration::from_secs(10)).await;
                (Instant::now(), permit)
            })
        };
        // Let the waiter reach the server.
        tokio::time::sleep(Duration::from_millis(20)).await;
        a.release().await?;
        let freed = Instant::now();
        let (got, permit) = waiting.await?;
        samples.push(got.saturating_duration_since(freed));
        permit?.release().await?;
        b.release().await?;
    }
    drop((holder, waiter));
    holder_pool.close().await;
    waiter_pool.close().await;
    Ok(Latencies::new(
        "Semaphore(2) permit to a waiting acquire",
        "the holder's release() returned",
        samples,
    ))
}

async fn acquire_now(semaphore: &Semaphore) -> anyhow::Result<distlock::SemaphorePermit> {
    for _ in 0..100 {
        if let Some(permit) = semaphore.try_acquire().await? {
            return Ok(permit);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    anyhow::bail!("no permit free within 1 s")
}

/// A leader and one waiting campaign, each with its own pool; the leader's
/// backend is terminated. From `pg_terminate_backend` returning to the
/// waiting campaign's flag turning true.
pub async fn leader_takeover(opts: &PgConnectOptions, trials: usize) -> anyhow::Result<Latencies> {
    let admin = pool(opts, 1).await?;
    let mut samples = Vec::with_capacity(trials);
    for trial in 0..trials {
        let key = format!("bench-leader-{trial}");
        let leader_pool = pool(opts, 2).await?;
        let follower_pool = pool(opts, 2).await?;
        // Grace 0: the server's hand-off itself. By default a takeover from
        // a leader that did not step down waits 1.25 x (heartbeat +
        // deadline) on top, so the deposed leader knows first.
        let election = |pool: &PgPool| {
            LeaderElection::builder(Arc::new(PgLocker::new(pool.clone())), key.as_str())
                .grace(Duration::ZERO)
                .build()
        };
        let leader = election(&leader_pool)?.campaign();
        leader
            .leadership()
            .wait_for(|l| *l)
            .await
            .context("leader campaign ended")?;
        let follower = election(&follower_pool)?.campaign();
        let mut following = follower.leadership();
        // Let the follower's wait reach the server.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let killed: i64 = sqlx::query_scalar(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_locks \
             WHERE locktype = 'advisory' AND granted AND objsubid = 1 \
             AND objid::bigint = hashtext($1)::bigint & 4294967295 \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .bind(&key)
        .fetch_one(&admin)
        .await?;
        anyhow::ensure!(killed == 1, "expected one leader backend, found {killed}");
        let freed = Instant::now();
        tokio::time::timeout(Duration::from_secs(10), following.wait_for(|l| *l))
            .await
            .context("no takeover within 10 s")?
            .context("follower campaign ended")?;
        samples.push(freed.elapsed());
        let _ = tokio::join!(leader.resign(), follower.resign());
        leader_pool.close().await;
        follower_pool.close().await;
    }
    admin.close().await;
    Ok(Latencies::new(
        "LeaderElection takeover by a waiting campaign (grace 0)",
        "pg_terminate_backend(leader) returned",
        samples,
    ))
}

/// The report's table.
pub fn table(rows: &[Latencies]) -> String {
    let mut out = String::from(
        "\n### Lock kinds: hand-over latencies\n\n\
         | what | measured from | trials | p50 µs | p99 µs | max µs |\n\
         |---|---|---:|---:|---:|---:|\n",
    );
    for row in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {:.0} | {:.0} | {:.0} |\n",
            row.what,
            row.from,
            row.sorted_us.len(),
            row.at(0.5),
            row.at(0.99),
            row.at(1.0)
        ));
    }
    out
}
