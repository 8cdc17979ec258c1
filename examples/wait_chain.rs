//! Who blocks me: a wait chain across two keys and three processes.
//!
//! `nightly-export` holds `reports` for a long job. `ledger-close` takes
//! `ledger` in a transaction and, inside it, waits for `reports`. `invoice-api` wants `ledger` for a
//! second and times out: its `Error::Timeout` names `ledger-close` as the
//! holder and carries the chain behind it up to the root holder,
//! `nightly-export`. `PgLocker::holders()` and `wait_chain` show the same
//! from outside, as `distlock holders --tree` draws it.
//!
//! ```sh
//! cargo run --example wait_chain
//! ```
//!
//! Uses `DATABASE_URL` (default `postgres://postgres@localhost:5432/postgres`)
//! and the advisory locks `example:reports` and `example:ledger` there.

use std::time::Duration;

use distlock::postgres::wait_chain;
use distlock::{Error, PgLocker};
use sqlx::ConnectOptions;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const REPORTS: &str = "example:reports";
const LEDGER: &str = "example:ledger";

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@localhost:5432/postgres".to_owned());
    let summary = run(&url).await?;
    if summary.timeout_chain != ["ledger-close", "nightly-export"] {
        return Err(format!("unexpected chain: {:?}", summary.timeout_chain).into());
    }
    Ok(())
}

/// What the example saw, for the caller (and the test) to check.
#[derive(Debug)]
pub struct Summary {
    /// The applications along the timeout's chain, holder first.
    pub timeout_chain: Vec<String>,
    /// The applications along `wait_chain` of the waiting `ledger-close`.
    pub holders_chain: Vec<String>,
}

/// A locker of its own, as a separate process would have, named `app`.
async fn process(url: &str, app: &str) -> Result<PgLocker, BoxError> {
    let options: PgConnectOptions = url.parse()?;
    let pool = PgPoolOptions::new()
        .max_connections(3)
        .connect_with(options.application_name(app).disable_statement_logging())
        .await?;
    Ok(PgLocker::new(pool))
}

fn apps(links: &[distlock::postgres::ChainLink]) -> Vec<String> {
    let app = |l: &distlock::postgres::ChainLink| l.application_name.clone().unwrap_or_default();
    links.iter().map(app).collect()
}

/// Builds the chain, times out behind it, and lets it go again.
pub async fn run(url: &str) -> Result<Summary, BoxError> {
    let export = process(url, "nightly-export").await?;
    let close = process(url, "ledger-close").await?;
    let api = process(url, "invoice-api").await?;

    let reports = export.try_lock(REPORTS).await?.ok_or("reports is busy")?;
    // ledger-close takes the ledger, then waits for the reports in the same
    // transaction: one server session holds one key and waits for the other,
    // which is what links the chain.
    let closing = tokio::spawn({
        let close = close.clone();
        async move {
            close
                .with_advisory_lock(LEDGER, async |conn| {
                    distlock::lock_xact(conn, REPORTS, Duration::from_secs(30)).await
                })
                .await
        }
    });
    // Let ledger-close's wait begin.
    while !close.holders_of(REPORTS).await?.iter().any(|h| !h.granted) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let timeout_chain = match api.lock(LEDGER, Duration::from_secs(1)).await {
        Err(err @ Error::Timeout { .. }) => {
            println!("invoice-api: {err}");
            let Error::Timeout { chain, .. } = err else {
                unreachable!()
            };
            println!("  the chain: {chain}");
            apps(&chain.links)
        }
        Ok(_) => return Err("invoice-api got the ledger".into()),
        Err(other) => return Err(other.into()),
    };

    let holders = api.holders().await?;
    let waiter = holders
        .iter()
        .find(|h| !h.granted && h.application_name.as_deref() == Some("ledger-close"))
        .ok_or("ledger-close is not waiting")?;
    let chain = wait_chain(&holders, waiter.pid);
    println!("holders(): ledger-close waits: {chain}");

    reports.release().await?;
    closing.await??.ok_or("the ledger was taken")?;
    Ok(Summary {
        timeout_chain,
        holders_chain: apps(&chain.links),
    })
}
