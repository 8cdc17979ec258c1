//! A tour of distlock against `DATABASE_URL`
//! (default `postgres://postgres@localhost:5432/postgres`):
//! a transaction-scoped lock that skips on contention, a session lock, and
//! `holders()`.
//!
//! ```sh
//! cargo run --example quickstart
//! ```

use std::time::Duration;

use distlock::{LockKey, PgLocker};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@localhost:5432/postgres".to_owned());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await?;
    let locker = PgLocker::new(pool.clone());

    // 1. A cron-style job: run once, skip if another instance is already on it.
    //    Another "replica" holds the lock while we try.
    let other = locker.try_lock("quickstart:nightly-report").await?;
    let outcome = locker
        .with_advisory_lock("quickstart:nightly-report", async |_conn| {
            Ok::<_, distlock::Error>("ran the report")
        })
        .await?;
    match outcome {
        Some(what) => println!("1. {what}"),
        None => println!(
            "1. another instance holds \"quickstart:nightly-report\": skipped (not an error)"
        ),
    }
    if let Some(lock) = other {
        lock.release().await?;
    }
    let outcome = locker
        .with_advisory_lock("quickstart:nightly-report", async |conn| {
            let n: i32 = sqlx::query_scalar("SELECT 1").fetch_one(conn).await?;
            Ok::<_, distlock::Error>(n)
        })
        .await?;
    println!(
        "   after the other instance finished: ran = {}",
        outcome.is_some()
    );

    // 2. A session lock for work outside the database, with a heartbeat.
    let lock = locker
        .lock("quickstart:upload", Duration::from_secs(5))
        .await?;
    println!(
        "2. holding {:?} on backend {} (lost: {})",
        lock.key().to_string(),
        lock.backend_pid(),
        lock.is_lost()
    );

    // 3. Who holds advisory locks in this database right now?
    for holder in locker.holders().await? {
        println!(
            "3. key {} held={} by pid {} ({})",
            holder.key,
            holder.granted,
            holder.pid,
            holder
                .application_name
                .as_deref()
                .unwrap_or("no application_name")
        );
    }
    let mine = locker
        .holders_of(LockKey::from("quickstart:upload"))
        .await?;
    println!(
        "   holders of \"quickstart:upload\": {:?}",
        mine.iter().map(|h| h.pid).collect::<Vec<_>>()
    );

    lock.release().await?;
    println!(
        "   released; holders now: {}",
        locker.holders_of("quickstart:upload").await?.len()
    );
    Ok(())
}
