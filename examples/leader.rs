//! Three replicas of a scheduler; only the elected leader schedules.
//!
//! Every replica campaigns for `scheduler` with [`distlock::LeaderElection`].
//! The leader writes one scheduling round every 100 ms into a table, and
//! each write carries the leader's term (its fencing token) through
//! `distlock::fence::check`, so a deposed leader that is still running
//! cannot write after its successor. Halfway through, the leader's database
//! session is terminated, as if its process had died: another replica takes
//! over, waiting on the server (no poll), and its term is higher.
//!
//! ```sh
//! cargo run --example leader
//! ```
//!
//! Uses `DATABASE_URL` (default `postgres://postgres@localhost:5432/postgres`)
//! and its own schema `distlock_example_leader`, recreated on every run.

use std::sync::Arc;
use std::time::Duration;

use distlock::{Campaign, LeaderElection, PgLocker};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const REPLICAS: usize = 3;
/// How often the leader schedules a round.
const TICK: Duration = Duration::from_millis(100);

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@localhost:5432/postgres".to_owned());
    let summary = run(&url).await?;
    if !summary.one_leader_at_a_time() {
        return Err("two leaders scheduled in one term, or terms went backwards".into());
    }
    Ok(())
}

/// What happened, for the caller (and the test) to check.
#[derive(Debug)]
pub struct Summary {
    /// Every scheduled round: (replica, term), in the order written.
    pub rounds: Vec<(i32, i64)>,
    /// Writes refused because a newer term had written first.
    pub fenced_off: usize,
}

impl Summary {
    /// Terms never go backwards, each term belongs to one replica, and more
    /// than one term led (the takeover happened).
    pub fn one_leader_at_a_time(&self) -> bool {
        let ordered = self.rounds.windows(2).all(|w| w[0].1 <= w[1].1);
        let mut terms: Vec<(i64, i32)> = self.rounds.iter().map(|(r, t)| (*t, *r)).collect();
        terms.sort_unstable();
        terms.dedup();
        let one_replica_per_term = terms.windows(2).all(|w| w[0].0 != w[1].0);
        ordered && one_replica_per_term && terms.len() >= 2
    }
}

/// Runs the replicas for about two seconds, kills the first leader's
/// session halfway, and reports.
pub async fn run(url: &str) -> Result<Summary, BoxError> {
    let admin = PgPoolOptions::new().max_connections(2).connect(url).await?;
    setup(&admin).await?;

    let mut replicas = Vec::new();
    for id in 1..=REPLICAS as i32 {
        // Each replica has its own pool, as separate processes would.
        let pool = PgPoolOptions::new().max_connections(4).connect(url).await?;
        let locker = PgLocker::builder(pool.clone())
            .fencing(true)
            .heartbeat(Duration::from_millis(200))
            .heartbeat_timeout(Duration::from_millis(500))
            .build();
        let campaign = LeaderElection::new(Arc::new(locker), "scheduler").campaign();
        replicas.push(tokio::spawn(schedule(id, pool, campaign)));
    }

    tokio::time::sleep(Duration::from_secs(1)).await;
    // The leader "dies": its lock's session is terminated.
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(l.pid)) FROM pg_locks l \
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
         AND l.objid::bigint = hashtext('scheduler')::bigint & 4294967295 \
         AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_one(&admin)
    .await?;
    println!("terminated the leader's session ({killed} backend)");
    tokio::time::sleep(Duration::from_secs(1)).await;

    let mut fenced_off = 0;
    for replica in &replicas {
        replica.abort();
    }
    for replica in replicas {
        if let Ok(refused) = replica.await {
            fenced_off += refused?;
        }
    }
    let rounds: Vec<(i32, i64)> =
        sqlx::query_as("SELECT replica, term FROM distlock_example_leader.rounds ORDER BY id")
            .fetch_all(&admin)
            .await?;
    let summary = Summary { rounds, fenced_off };
    let mut terms: Vec<i64> = summary.rounds.iter().map(|r| r.1).collect();
    terms.dedup();
    println!(
        "{} rounds scheduled in {} terms; {} writes of a deposed leader fenced off",
        summary.rounds.len(),
        terms.len(),
        summary.fenced_off
    );
    admin.close().await;
    Ok(summary)
}

/// One replica: while it leads, it schedules a round per tick under its
/// term. Returns how many of its writes were fenced off.
async fn schedule(id: i32, pool: PgPool, campaign: Campaign) -> Result<usize, BoxError> {
    let mut leadership = campaign.leadership();
    let mut refused = 0;
    loop {
        leadership.wait_for(|leader| *leader).await?;
        let Some(term) = campaign.fencing_token() else {
            continue;
        };
        println!("replica {id} leads, term {term}");
        while *leadership.borrow() {
            let mut tx = pool.begin().await?;
            match distlock::fence::check(&mut tx, "scheduler", term).await {
                Ok(()) => {
                    sqlx::query(
                        "INSERT INTO distlock_example_leader.rounds (replica, term) VALUES ($1, $2)",
                    )
                    .bind(id)
                    .bind(term.value())
                    .execute(&mut *tx)
                    .await?;
                    tx.commit().await?;
                }
                Err(distlock::Error::StaleFencingToken { .. }) => refused += 1,
                Err(err) => return Err(err.into()),
            }
            tokio::time::sleep(TICK).await;
        }
        println!("replica {id} no longer leads");
        if refused > 100 {
            return Ok(refused);
        }
    }
}

async fn setup(admin: &PgPool) -> Result<(), BoxError> {
    distlock::migrate(admin).await?;
    sqlx::raw_sql(
        "DROP SCHEMA IF EXISTS distlock_example_leader CASCADE;
         CREATE SCHEMA distlock_example_leader;
         CREATE TABLE distlock_example_leader.rounds (
             id      bigserial PRIMARY KEY,
             replica int    NOT NULL,
             term    bigint NOT NULL
         );
         DELETE FROM distlock.fence_seen WHERE resource = 'scheduler';",
    )
    .execute(admin)
    .await?;
    Ok(())
}
