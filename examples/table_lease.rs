//! Leases in a table: three workers take turns on one key through
//! `TableLocker`, each writing with its fencing token.
//!
//! ```sh
//! cargo run --example table_lease
//! # through a transaction pooler: DATABASE_URL at PgBouncer, and a direct
//! # URL for waiters to LISTEN on
//! DATABASE_URL=postgres://postgres@localhost:6432/postgres \
//! LISTEN_URL=postgres://postgres@localhost:5432/postgres cargo run --example table_lease
//! ```
//!
//! Every statement is one short transaction sent as a simple query, so the
//! same code runs directly against PostgreSQL or through PgBouncer in
//! transaction mode. Each worker waits for the key with `lock()`, which a
//! release wakes at once (`LISTEN`/`NOTIFY`), keeps the lease while it works
//! (renewed in the background every quarter of the TTL), and stops if the
//! lease is lost.

use std::time::Duration;

use distlock::postgres::TableLocker;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@localhost:5432/postgres".into());
    // The README's PgBouncer recipe: no statement cache.
    let options: PgConnectOptions = url.parse::<PgConnectOptions>()?.statement_cache_capacity(0);
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await?;
    distlock::migrate(&pool).await?;

    let mut builder = TableLocker::builder(pool).ttl(Duration::from_secs(3));
    if let Ok(listen_url) = std::env::var("LISTEN_URL") {
        builder = builder.listen_options(listen_url.parse()?);
    }
    let locker = builder.build()?;

    let mut workers = tokio::task::JoinSet::new();
    for worker in 1..=3 {
        let locker = locker.clone();
        workers.spawn(async move {
            let lease = locker
                .lock("example:table-lease", Duration::from_secs(30))
                .await?;
            let token = lease
                .fencing_token()
                .expect("TableLocker always issues one");
            tokio::select! {
                // The work: pass `token` with every write it protects.
                () = tokio::time::sleep(Duration::from_millis(200)) => {
                    println!("worker {worker} worked with token {token}");
                    lease.release().await?;
                }
                reason = lease.lost() => println!("worker {worker} stopped: {reason}"),
            }
            Ok::<_, distlock::Error>(())
        });
    }
    while let Some(done) = workers.join_next().await {
        done??;
    }
    Ok(())
}
