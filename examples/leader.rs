//! Three replicas of a scheduler; only the elected leader schedules.
//!
//! Every replica campaigns for `scheduler` with [`distlock::LeaderElection`],
//! proclaiming its name. The leader writes one scheduling round every 100 ms
//! into a table while its term lasts, and each write carries the term's
//! fencing token through `distlock::fence::check`, so a deposed leader that
//! is still running cannot write after its successor. An observer (not a
//! candidate) prints who leads. Halfway through, the leader's database
//! session is terminated, as if its process had died: another replica takes
//! over (waiting on the server, then the takeover grace, since the dead
//! leader could not step down), under a higher term.
//!
//! ```sh
//! cargo run --example leader
//! ```
//!
//! Uses `DATABASE_URL` (default `postgres://postgres@localhost:5432/postgres`)
//! and its own schema `distlock_example_leader`, recreated on every run.

use std::sync::Arc;
use std::time::Duration;

use distlock::{Campaign, FencingToken, LeaderElection, PgLocker};
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
    /// Who led, as an observer saw it: (identity, term number).
    pub observed: Vec<(String, u64)>,
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

    // An observer, not a candidate: who leads, as the server sees it.
    let watcher = LeaderElection::builder(Arc::new(PgLocker::new(admin.clone())), "scheduler")
        .poll(Duration::from_millis(100))
        .build()?;
    let (stop_observing, observer_stopped) = tokio::sync::oneshot::channel();
    let observing = tokio::spawn(observe(watcher, observer_stopped));

    let mut replicas = Vec::new();
    for id in 1..=REPLICAS as i32 {
        // Each replica has its own pool, as separate processes would.
        let pool = PgPoolOptions::new().max_connections(4).connect(url).await?;
        let locker = PgLocker::builder(pool.clone())
            .fencing(true)
            .heartbeat(Duration::from_millis(200))
            .heartbeat_timeout(Duration::from_millis(500))
            .build()?;
        let campaign = LeaderElection::builder(Arc::new(locker), "scheduler")
            .identity(format!("replica-{id}"))
            .build()?
            .campaign();
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
    // The takeover waits out the grace (1.25 x (heartbeat + deadline)).
    tokio::time::sleep(Duration::from_secs(2)).await;

    let mut fenced_off = 0;
    for replica in &replicas {
        replica.abort();
    }
    for replica in replicas {
        if let Ok(refused) = replica.await {
            fenced_off += refused?;
        }
    }
    let _ = stop_observing.send(());
    let observed = observing.await?;
    let rounds: Vec<(i32, i64)> =
        sqlx::query_as("SELECT replica, term FROM distlock_example_leader.rounds ORDER BY id")
            .fetch_all(&admin)
            .await?;
    let summary = Summary {
        rounds,
        fenced_off,
        observed,
    };
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

/// One replica: in each term it leads, it schedules a round per tick
/// under the term's token, and stops the moment the term ends. Returns how
/// many of its writes were fenced off.
async fn schedule(id: i32, pool: PgPool, campaign: Campaign) -> Result<usize, BoxError> {
    let mut refused = 0;
    loop {
        // Err once the campaign ends (resigned, or an error no retry cures).
        let term = campaign.elected().await?;
        let token = term
            .fencing_token()
            .ok_or("the locker issues fencing tokens")?;
        println!("replica {id} leads term {:?}, token {token}", term.number());
        tokio::select! {
            // Deposed: stop at once (an unfinished round's transaction
            // rolls back), and campaign on.
            () = term.ended() => println!("replica {id}: its term ended"),
            failed = rounds(id, &pool, token, &mut refused) => failed?,
        }
        if refused > 100 {
            return Ok(refused);
        }
    }
}

/// Scheduling rounds under `token`, one per tick, until an error.
async fn rounds(
    id: i32,
    pool: &PgPool,
    token: FencingToken,
    refused: &mut usize,
) -> Result<(), BoxError> {
    loop {
        let mut tx = pool.begin().await?;
        match distlock::fence::check(&mut tx, "scheduler", token).await {
            Ok(()) => {
                sqlx::query(
                    "INSERT INTO distlock_example_leader.rounds (replica, term) VALUES ($1, $2)",
                )
                .bind(id)
                .bind(token.value())
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
            }
            Err(distlock::Error::StaleFencingToken { .. }) => *refused += 1,
            Err(err) => return Err(err.into()),
        }
        tokio::time::sleep(TICK).await;
    }
}

/// Prints every change of who leads until `stop`; returns what it saw.
async fn observe(
    election: LeaderElection,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) -> Vec<(String, u64)> {
    let mut observer = election.observe();
    let mut seen = Vec::new();
    loop {
        let change = tokio::select! {
            _ = &mut stop => return seen,
            change = observer.changed() => change,
        };
        match change {
            Ok(Some(leader)) => {
                println!("observer: {} leads, term {}", leader.identity, leader.term);
                seen.push((leader.identity, leader.term));
            }
            Ok(None) => println!("observer: nobody leads"),
            Err(err) => {
                println!("observer ended: {err}");
                return seen;
            }
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
