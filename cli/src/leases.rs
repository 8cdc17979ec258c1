//! `distlock holders --lease-table`: the live leases of `distlock.leases`.
//!
//! The lease table knows holders only: a waiter retries and leaves no row,
//! so there is no wait to show and nothing to draw as a tree.

use std::time::SystemTime;

use distlock::postgres::{LeaseHolder, TableLocker};
use serde_json::json;

use crate::Failure;
use crate::args::HoldersArgs;
use crate::columns::{aligned, since};

/// Lists the live leases (with `args.key`, the one a run of that name would
/// find, by the key's server-side identity) as a table, or as JSON with
/// `--json`. Exit code 0.
pub(crate) async fn lease_holders(args: &HoldersArgs, table: &TableLocker) -> Result<u8, Failure> {
    let leases = match &args.key {
        Some(key) => table
            .holder_of(key.as_str())
            .await
            .map(|lease| lease.into_iter().collect()),
        None => table.holders().await,
    }
    .map_err(|err| Failure::unavailable(format!("could not list leases: {err}")))?;
    if args.json {
        show!("{}\n", to_json(&leases));
    } else {
        show!("{}", to_table(&leases));
    }
    Ok(0)
}

/// `--tree` draws waits, which the lease table does not have: a usage
/// error, found before connecting.
pub(crate) fn refuse_tree(args: &HoldersArgs) -> Result<(), Failure> {
    if args.conn.lease_table && args.tree {
        return Err(Failure::usage(
            "--tree draws who waits for whom; the lease table has no waiters (they retry), \
             so `holders --lease-table` lists its leases only",
        ));
    }
    Ok(())
}

fn at(time: SystemTime) -> String {
    humantime::format_rfc3339_seconds(time).to_string()
}

/// A JSON array; tokens are strings because they do not fit a JavaScript
/// number.
fn to_json(leases: &[LeaseHolder]) -> String {
    let rows: Vec<_> = leases
        .iter()
        .map(|lease| {
            json!({
                "key": lease.key,
                "fencing_token": lease.fencing_token.value().to_string(),
                "since": at(lease.since),
                "renewed": at(lease.renewed),
                "expires": at(lease.expires),
            })
        })
        .collect();
    serde_json::Value::Array(rows).to_string()
}

/// An aligned text table (or a sentence when there is nothing to show).
fn to_table(leases: &[LeaseHolder]) -> String {
    if leases.is_empty() {
        return "no leases are held in distlock.leases\n".to_owned();
    }
    let header = ["KEY", "TOKEN", "SINCE", "RENEWED", "EXPIRES"];
    let mut rows = vec![header.map(str::to_owned).to_vec()];
    for lease in leases {
        rows.push(vec![
            lease.key.clone(),
            lease.fencing_token.value().to_string(),
            since(lease.since),
            at(lease.renewed),
            at(lease.expires),
        ]);
    }
    aligned(&rows)
}
