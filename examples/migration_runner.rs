//! Several processes start at once and each wants to migrate the database:
//! one applies the migrations, the others wait for it and then find nothing
//! to do.
//!
//! The example starts three copies of itself (`migration_runner child N`),
//! as three pods of one deployment would start. Each waits for the lock
//! `example:migrations` with a deadline (`LockWaiter`), reporting who holds
//! it while it waits; the first to get it applies three demo migrations
//! (slowly, to make the waiting visible) and records them; the others get the
//! lock afterwards and see every migration recorded.
//!
//! ```sh
//! cargo run --example migration_runner
//! ```
//!
//! Uses `DATABASE_URL` (default `postgres://postgres@localhost:5432/postgres`)
//! and its own schema `distlock_example_migrations`, recreated on every run.

use std::process::{Command, ExitStatus};
use std::time::Duration;

use distlock::PgLocker;
use distlock::postgres::LockWaiter;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgPool};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How many processes start at once.
pub const RUNNERS: usize = 3;
/// The lock every runner takes before looking at the schema.
const LOCK: &str = "example:migrations";

/// The demo migrations: version, description, SQL.
const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "create table accounts",
        "CREATE TABLE distlock_example_migrations.accounts (id bigserial PRIMARY KEY, email text NOT NULL UNIQUE)",
    ),
    (
        2,
        "add accounts.created_at",
        "ALTER TABLE distlock_example_migrations.accounts ADD COLUMN created_at timestamptz NOT NULL DEFAULT now()",
    ),
    (
        3,
        "index accounts by created_at",
        "CREATE INDEX accounts_created_at ON distlock_example_migrations.accounts (created_at)",
    ),
];

fn main() -> Result<(), BoxError> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@localhost:5432/postgres".to_owned());
    let args: Vec<String> = std::env::args().skip(1).collect();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    match args.as_slice() {
        [mode, id] if mode == "child" => {
            let id = id.parse()?;
            runtime.block_on(run_child(&url, id))
        }
        _ => {
            let exe = std::env::current_exe()?;
            let summary = runtime.block_on(run_parent(&url, |id| {
                let mut child = Command::new(&exe);
                child.arg("child").arg(id.to_string());
                child
            }))?;
            if summary.applied_once() {
                Ok(())
            } else {
                Err("the migrations were not applied exactly once".into())
            }
        }
    }
}

/// What the parent found after all runners finished.
#[derive(Debug)]
pub struct Summary {
    /// How each runner process exited.
    pub exits: Vec<ExitStatus>,
    /// (version, applied by) as recorded, in version order.
    pub applied: Vec<(i32, String)>,
}

impl Summary {
    /// Every migration recorded once, all by one runner, and every runner
    /// succeeded.
    pub fn applied_once(&self) -> bool {
        let versions: Vec<i32> = self.applied.iter().map(|(v, _)| *v).collect();
        let expected: Vec<i32> = MIGRATIONS.iter().map(|(v, _, _)| *v).collect();
        versions == expected
            && self.applied.iter().all(|(_, by)| *by == self.applied[0].1)
            && self.exits.iter().all(ExitStatus::success)
    }
}

/// Resets the demo schema, starts `RUNNERS` processes made by `command(id)`
/// at once, waits for them and reports what was recorded.
pub async fn run_parent(
    url: &str,
    command: impl Fn(usize) -> Command,
) -> Result<Summary, BoxError> {
    let mut admin = sqlx::PgConnection::connect(url).await?;
    sqlx::query("DROP SCHEMA IF EXISTS distlock_example_migrations CASCADE")
        .execute(&mut admin)
        .await?;
    println!("starting {RUNNERS} migration runners at once");
    let mut children = Vec::new();
    for id in 1..=RUNNERS {
        children.push(command(id).env("DATABASE_URL", url).spawn()?);
    }
    let exits = tokio::task::spawn_blocking(move || {
        children
            .into_iter()
            .map(|mut child| child.wait())
            .collect::<Result<Vec<_>, _>>()
    })
    .await??;
    let applied: Vec<(i32, String)> = sqlx::query_as(
        "SELECT version, applied_by FROM distlock_example_migrations.schema_migrations ORDER BY version",
    )
    .fetch_all(&mut admin)
    .await?;
    admin.close().await?;
    println!();
    for (version, by) in &applied {
        println!("migration {version} was applied by {by}");
    }
    let summary = Summary { exits, applied };
    if summary.applied_once() {
        println!(
            "Every migration was applied exactly once; the other runners found nothing to do."
        );
    }
    Ok(summary)
}

/// One runner: wait for the lock, apply what is missing, release.
pub async fn run_child(url: &str, id: usize) -> Result<(), BoxError> {
    let name = format!("migration-runner-{id}");
    let options: PgConnectOptions = url.parse::<PgConnectOptions>()?.application_name(&name);
    // Two connections: one holds the lock, one looks up who holds it.
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await?;
    let locker = PgLocker::new(pool.clone());

    let lock = LockWaiter::new(&locker, LOCK, Duration::from_secs(30))
        .report_every(Duration::from_millis(500))
        .on_report(|report| println!("{name}: waiting, the lock is {report}"))
        .lock()
        .await?;
    println!("{name}: got the lock");

    let applied = apply_missing(&pool, &name).await?;
    if applied == 0 {
        println!(
            "{name}: nothing to do, all {} migrations are already applied",
            MIGRATIONS.len()
        );
    }
    lock.release().await?;
    pool.close().await;
    Ok(())
}

/// Applies the migrations not yet recorded; returns how many it applied.
async fn apply_missing(pool: &PgPool, runner: &str) -> Result<usize, BoxError> {
    sqlx::query("CREATE SCHEMA IF NOT EXISTS distlock_example_migrations")
        .execute(pool)
        .await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS distlock_example_migrations.schema_migrations ( \
           version int PRIMARY KEY, description text NOT NULL, applied_by text NOT NULL, \
           applied_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(pool)
    .await?;
    let done: Vec<i32> =
        sqlx::query_scalar("SELECT version FROM distlock_example_migrations.schema_migrations")
            .fetch_all(pool)
            .await?;
    let mut applied = 0;
    for (version, description, sql) in MIGRATIONS {
        if done.contains(version) {
            continue;
        }
        // Each migration and its record commit together.
        let mut tx = pool.begin().await?;
        sqlx::query(*sql).execute(&mut *tx).await?;
        sqlx::query(
            "INSERT INTO distlock_example_migrations.schema_migrations (version, description, applied_by) \
             VALUES ($1, $2, $3)",
        )
        .bind(version)
        .bind(description)
        .bind(runner)
        .execute(&mut *tx)
        .await?;
        // A real migration takes a while; this makes the others' wait visible.
        tokio::time::sleep(Duration::from_millis(400)).await;
        tx.commit().await?;
        println!("{runner}: applied migration {version} ({description})");
        applied += 1;
    }
    Ok(applied)
}
