//! `distlock holders`: who holds or awaits advisory locks.

use std::time::{Duration, SystemTime};

use distlock::{AdvisoryKey, Holder, LockKey, LockMode};
use serde_json::json;

use crate::Failure;
use crate::args::HoldersArgs;
use crate::backend;

/// Lists the holders as a table, or as JSON with `--json`. Exit code 0.
pub(crate) async fn holders(args: HoldersArgs) -> Result<u8, Failure> {
    if args.conn.lease_table {
        return Err(Failure::usage(
            "`holders` lists advisory locks; leases of --lease-table are the rows of \
             distlock.leases (SELECT key_text, expires_at FROM distlock.leases)",
        ));
    }
    if let Some(key) = &args.key {
        LockKey::from(key.as_str())
            .validate()
            .map_err(|err| Failure::usage(err.to_string()))?;
    }
    let backend = backend::connect(
        &args.conn,
        "distlock holders",
        Duration::from_secs(1),
        false,
    )
    .await?;
    let Some(locker) = backend.postgres else {
        return Err(Failure::usage("`holders` needs a PostgreSQL backend"));
    };
    let holders = match &args.key {
        Some(key) => locker.holders_of(key.as_str()).await,
        None => locker.holders().await,
    }
    .map_err(|err| Failure::unavailable(format!("could not list holders: {err}")))?;
    // A name cannot be recovered from its hash; with a KEY filter we know it.
    let label = |holder: &Holder| match &args.key {
        Some(name) => name.clone(),
        None => holder.key.to_string(),
    };
    if args.json {
        println!("{}", to_json(&holders, label));
    } else {
        print!("{}", to_table(&holders, label));
    }
    Ok(0)
}

fn state(holder: &Holder) -> &'static str {
    if holder.granted { "held" } else { "waiting" }
}

fn mode(holder: &Holder) -> &'static str {
    match holder.mode {
        LockMode::Exclusive => "exclusive",
        LockMode::Shared => "shared",
    }
}

fn since(holder: &Holder) -> Option<String> {
    holder
        .since
        .map(|t| humantime::format_rfc3339_seconds(t).to_string())
}

fn age(holder: &Holder) -> Option<String> {
    let age = SystemTime::now().duration_since(holder.since?).ok()?;
    Some(humantime::format_duration(Duration::from_secs(age.as_secs())).to_string())
}

/// A JSON array; keys are strings because a `bigint` does not fit a
/// JavaScript number.
fn to_json(holders: &[Holder], label: impl Fn(&Holder) -> String) -> String {
    let rows: Vec<_> = holders
        .iter()
        .map(|h| {
            json!({
                "key": label(h),
                "keyspace": match h.key { AdvisoryKey::BigInt(_) => "bigint", AdvisoryKey::Pair(..) => "pair" },
                "pid": h.pid,
                "application": h.application_name,
                "client": h.client_addr,
                "since": since(h),
                "state": state(h),
                "mode": mode(h),
            })
        })
        .collect();
    serde_json::Value::Array(rows).to_string()
}

/// An aligned text table (or a sentence when there is nothing to show).
fn to_table(holders: &[Holder], label: impl Fn(&Holder) -> String) -> String {
    if holders.is_empty() {
        return "no advisory locks are held or awaited\n".to_owned();
    }
    let header = [
        "KEY",
        "PID",
        "APPLICATION",
        "CLIENT",
        "SINCE",
        "STATE",
        "MODE",
    ];
    let mut rows = vec![header.map(str::to_owned).to_vec()];
    for h in holders {
        let since = match (since(h), age(h)) {
            (Some(at), Some(age)) => format!("{at} ({age} ago)"),
            (Some(at), None) => at,
            _ => "-".to_owned(),
        };
        rows.push(vec![
            label(h),
            h.pid.to_string(),
            h.application_name.clone().unwrap_or_else(|| "-".to_owned()),
            h.client_addr.clone().unwrap_or_else(|| "-".to_owned()),
            since,
            state(h).to_owned(),
            mode(h).to_owned(),
        ]);
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|col| {
            rows.iter()
                .map(|r| r[col].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}
