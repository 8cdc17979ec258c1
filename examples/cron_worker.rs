//! Three replicas of a cron worker send reminders for overdue invoices.
//!
//! Every worker ticks once a second. On each tick exactly one of them takes
//! the lock `cron:invoice-reminders` and sends up to two reminders; the
//! others see the lock held and skip. Each worker has its own connection
//! pool, as separate processes would. The job keeps its lock for at least
//! half a second (`min_hold`), so a worker whose tick comes a little late
//! still skips instead of running the job a second time.
//!
//! ```sh
//! cargo run --example cron_worker              # 5 ticks
//! CRON_WORKER_TICKS=3 cargo run --example cron_worker
//! ```
//!
//! Uses `DATABASE_URL` (default `postgres://postgres@localhost:5432/postgres`)
//! and its own schema `distlock_example_cron`, recreated on every run.

use std::sync::Arc;
use std::time::Duration;

use distlock::{JobOutcome, PgLocker, SingletonJob};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How many workers run side by side.
const WORKERS: usize = 3;
/// How many invoices are overdue when the workers start.
const INVOICES: i32 = 6;
/// How many reminders one run sends at most, so the work spans several ticks.
const BATCH: i64 = 2;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@localhost:5432/postgres".to_owned());
    let ticks = std::env::var("CRON_WORKER_TICKS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(5);
    let summary = run(&url, ticks).await?;
    if !summary.exactly_once() {
        return Err("some invoice did not get exactly one reminder".into());
    }
    Ok(())
}

/// What happened, for the caller (and the test) to check.
#[derive(Debug)]
pub struct Summary {
    /// Ticks on which a worker ran the job.
    pub runs: usize,
    /// Ticks on which a worker skipped because another one held the lock.
    pub skips: usize,
    /// (invoice id, number of reminders sent for it).
    pub reminders: Vec<(i32, i64)>,
}

impl Summary {
    /// Every invoice got exactly one reminder.
    pub fn exactly_once(&self) -> bool {
        self.reminders.len() == INVOICES as usize && self.reminders.iter().all(|(_, n)| *n == 1)
    }
}

/// Sets up the invoices, runs the workers for `ticks` ticks, and reports.
pub async fn run(url: &str, ticks: u32) -> Result<Summary, BoxError> {
    let admin = PgPoolOptions::new().max_connections(2).connect(url).await?;
    setup(&admin).await?;
    println!(
        "{INVOICES} invoices are overdue; {WORKERS} workers tick every second for {ticks} ticks."
    );

    // All workers tick on the same schedule, like replicas of one service
    // driven by the same cron expression.
    let start = tokio::time::Instant::now() + Duration::from_millis(200);
    let mut workers = tokio::task::JoinSet::new();
    for id in 1..=WORKERS {
        let url = url.to_owned();
        workers.spawn(async move { worker(id, &url, ticks, start).await });
    }
    let (mut runs, mut skips) = (0, 0);
    for outcome in workers.join_all().await {
        let (r, s) = outcome?;
        runs += r;
        skips += s;
    }

    let reminders: Vec<(i32, i64)> = sqlx::query_as(
        "SELECT i.id, count(r.id) FROM distlock_example_cron.invoices i \
         LEFT JOIN distlock_example_cron.reminders r ON r.invoice_id = i.id \
         GROUP BY i.id ORDER BY i.id",
    )
    .fetch_all(&admin)
    .await?;
    let summary = Summary {
        runs,
        skips,
        reminders,
    };
    println!();
    println!(
        "{} ticks in all: {} ran the job, {} skipped because another worker had it.",
        runs + skips,
        summary.runs,
        summary.skips
    );
    for (invoice, sent) in &summary.reminders {
        println!("invoice {invoice}: {sent} reminder(s)");
    }
    if summary.exactly_once() {
        println!("Every invoice got exactly one reminder.");
    } else {
        println!("Some invoice did NOT get exactly one reminder (were there too few ticks?).");
    }
    admin.close().await;
    Ok(summary)
}

/// One replica: its own pool and locker, a one-second tick.
async fn worker(
    id: usize,
    url: &str,
    ticks: u32,
    start: tokio::time::Instant,
) -> Result<(usize, usize), BoxError> {
    let pool = PgPoolOptions::new().max_connections(2).connect(url).await?;
    let locker = Arc::new(PgLocker::new(pool.clone()));
    let job = SingletonJob::builder(locker, "cron:invoice-reminders")
        .min_hold(Duration::from_millis(500))
        .build()?;
    let mut tick = tokio::time::interval_at(start, Duration::from_secs(1));
    let (mut runs, mut skips) = (0, 0);
    for n in 1..=ticks {
        tick.tick().await;
        // Replicas' clocks and schedulers are never exactly in step: each
        // tick arrives up to 90 ms late, a different worker first each time.
        let skew = (id as u64 * 37 + u64::from(n) * 53) % 90;
        tokio::time::sleep(Duration::from_millis(skew)).await;
        let outcome = job
            .run(async |_ctx| send_reminders(&pool, id).await)
            .await?;
        match outcome {
            JobOutcome::Ran(sent) if sent.is_empty() => {
                runs += 1;
                println!("worker {id}, tick {n}: ran the job; no overdue invoice left");
            }
            JobOutcome::Ran(sent) => {
                runs += 1;
                let list: Vec<String> = sent.iter().map(|i| format!("invoice {i}")).collect();
                println!(
                    "worker {id}, tick {n}: sent reminders for {}",
                    list.join(", ")
                );
            }
            JobOutcome::Skipped => {
                skips += 1;
                println!("worker {id}, tick {n}: skipped, another worker is on it");
            }
            other => println!("worker {id}, tick {n}: {}", other.name()),
        }
    }
    pool.close().await;
    Ok((runs, skips))
}

/// The job: remind up to `BATCH` overdue invoices, in one transaction.
async fn send_reminders(pool: &PgPool, worker: usize) -> Result<Vec<i32>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let due: Vec<i32> = sqlx::query_scalar(
        "SELECT id FROM distlock_example_cron.invoices \
         WHERE due < now() AND reminded_at IS NULL ORDER BY id LIMIT $1",
    )
    .bind(BATCH)
    .fetch_all(&mut *tx)
    .await?;
    for invoice in &due {
        // A real worker would send an email here.
        sqlx::query(
            "INSERT INTO distlock_example_cron.reminders (invoice_id, worker) VALUES ($1, $2)",
        )
        .bind(invoice)
        .bind(i32::try_from(worker).unwrap_or(i32::MAX))
        .execute(&mut *tx)
        .await?;
        sqlx::query("UPDATE distlock_example_cron.invoices SET reminded_at = now() WHERE id = $1")
            .bind(invoice)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(due)
}

/// Recreates the example's schema with `INVOICES` overdue invoices.
async fn setup(pool: &PgPool) -> Result<(), sqlx::Error> {
    // No unique constraint on reminders.invoice_id on purpose: a double
    // reminder must show up in the count, not as an error.
    for statement in [
        "DROP SCHEMA IF EXISTS distlock_example_cron CASCADE",
        "CREATE SCHEMA distlock_example_cron",
        "CREATE TABLE distlock_example_cron.invoices ( \
           id int PRIMARY KEY, customer text NOT NULL, due timestamptz NOT NULL, \
           reminded_at timestamptz)",
        "CREATE TABLE distlock_example_cron.reminders ( \
           id bigserial PRIMARY KEY, invoice_id int NOT NULL, worker int NOT NULL, \
           sent_at timestamptz NOT NULL DEFAULT now())",
    ] {
        sqlx::query(statement).execute(pool).await?;
    }
    sqlx::query(
        "INSERT INTO distlock_example_cron.invoices (id, customer, due) \
         SELECT n, 'customer ' || n, now() - n * interval '1 day' FROM generate_series(1, $1) n",
    )
    .bind(INVOICES)
    .execute(pool)
    .await?;
    Ok(())
}
