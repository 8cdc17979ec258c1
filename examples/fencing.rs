//! Why fencing tokens: a holder that pauses past the life of its lock is
//! overtaken, and its late write is rejected.
//!
//! ```sh
//! cargo run --example fencing
//! ```
//!
//! Holder A takes the lock and pauses (think of a long GC pause or a frozen
//! VM). While it sleeps, its session dies (here: `pg_terminate_backend`, as a
//! server does when a partition outlasts TCP keepalives), so PostgreSQL frees
//! the lock. Holder B takes it over and writes with a newer token. A wakes up,
//! never having looked at `lost()`, and writes with its old token: the fence
//! rejects it.

use std::time::Duration;

use distlock::{Error, PgLocker};
use sqlx::Connection;

const RESOURCE: &str = "example:report";

async fn write_report(
    pool: &sqlx::PgPool,
    who: &str,
    token: distlock::FencingToken,
) -> Result<(), Error> {
    let mut conn = pool.acquire().await?;
    let mut tx = conn.begin().await?;
    distlock::fence::check(&mut tx, RESOURCE, token).await?;
    sqlx::query(
        "INSERT INTO fencing_example_report (id, body) VALUES (1, $1) \
                 ON CONFLICT (id) DO UPDATE SET body = EXCLUDED.body",
    )
    .bind(format!("written by {who} with token {token}"))
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@localhost:5432/postgres".to_owned());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(6)
        .connect(&url)
        .await?;
    distlock::migrate(&pool).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS fencing_example_report (id int PRIMARY KEY, body text)",
    )
    .execute(&pool)
    .await?;
    let locker = PgLocker::builder(pool.clone())
        .fencing(true)
        .heartbeat(Duration::from_millis(200))
        .build()?;

    let a = locker
        .lock("example:nightly-report", Duration::from_secs(10))
        .await?;
    let a_token = a.fencing_token().ok_or("fencing is on")?;
    println!("A holds the lock with fencing token {a_token} and starts a long pause...");

    // While A is paused, its session dies and the server frees the lock.
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(a.backend_pid())
        .execute(&pool)
        .await?;
    let b = locker
        .lock("example:nightly-report", Duration::from_secs(10))
        .await?;
    let b_token = b.fencing_token().ok_or("fencing is on")?;
    println!("A's session died; B took the lock over with token {b_token}.");
    write_report(&pool, "B", b_token).await?;
    println!("B wrote the report (token {b_token} accepted).");
    b.release().await?;

    // A wakes up and, not having looked at lost(), writes with its old token.
    tokio::time::sleep(Duration::from_millis(500)).await;
    println!("A wakes up; its lock was lost: {}", a.is_lost());
    match write_report(&pool, "A", a_token).await {
        Err(Error::StaleFencingToken {
            presented, current, ..
        }) => println!(
            "A's late write was rejected: token {presented} is older than {current}, which the report already saw."
        ),
        Ok(()) => return Err("A's stale write was accepted".into()),
        Err(other) => return Err(other.into()),
    }
    let body: String = sqlx::query_scalar("SELECT body FROM fencing_example_report WHERE id = 1")
        .fetch_one(&pool)
        .await?;
    println!("The report still reads: {body:?}.");
    let _ = a.release().await; // reports LockLost; the lock is long gone
    Ok(())
}
