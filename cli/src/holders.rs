//! `distlock holders`: who holds or awaits advisory locks (with
//! `--lease-table`, the table's leases: `leases.rs`).

use std::time::Duration;

use std::collections::{HashMap, HashSet};

use distlock::LockKey;
use distlock::postgres::{AdvisoryKey, ChainLink, Holder, LockMode};
use serde_json::json;

use crate::Failure;
use crate::args::HoldersArgs;
use crate::backend;
use crate::columns::aligned;
use crate::leases::{lease_holders, refuse_tree};

/// Lists the holders as a table, or as JSON with `--json`. Exit code 0.
pub(crate) async fn holders(args: HoldersArgs) -> Result<u8, Failure> {
    if let Some(key) = &args.key {
        LockKey::from(key.as_str())
            .validate()
            .map_err(|err| Failure::usage(err.to_string()))?;
    }
    refuse_tree(&args)?;
    // Before connecting: a usage error is one whether or not a server answers.
    let conn = args.conn.postgres_only("holders")?;
    let backend =
        backend::connect(&conn, "distlock holders", Duration::from_secs(1), false).await?;
    if let Some(table) = &backend.table {
        return lease_holders(&args, table).await;
    }
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
        show!("{}\n", to_json(&holders, label));
    } else if args.tree {
        show!("{}", to_tree(&holders, label));
    } else {
        show!("{}", to_table(&holders, label));
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
    crate::columns::ago(holder.since?)
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
                "blocked_by": h.blocked_by,
                "waits_for": h.waits_for.iter().map(|w| link_json(h, w, &label)).collect::<Vec<_>>(),
            })
        })
        .collect();
    serde_json::Value::Array(rows).to_string()
}

/// One session a waiter waits behind: its lock on the waiter's key.
fn link_json(
    waiter: &Holder,
    link: &ChainLink,
    label: &impl Fn(&Holder) -> String,
) -> serde_json::Value {
    json!({
        "key": label(waiter),
        "pid": link.pid,
        "application": link.application_name,
        "since": link.since.map(|t| humantime::format_rfc3339_seconds(t).to_string()),
        "state": if link.granted { "held" } else { "waiting" },
        "mode": match link.mode {
            LockMode::Exclusive => "exclusive",
            LockMode::Shared => "shared",
        },
    })
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
        let since = h
            .since
            .map_or_else(|| "-".to_owned(), crate::columns::since);
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
    aligned(&rows)
}

/// One line of the tree: what the session does with one lock.
fn tree_line(holder: &Holder, label: &impl Fn(&Holder) -> String) -> String {
    let verb = if holder.granted { "holds" } else { "waits for" };
    let app = holder
        .application_name
        .as_deref()
        .map(|name| format!(", application \"{name}\""))
        .unwrap_or_default();
    let age = age(holder)
        .map(|age| format!(", for {age}"))
        .unwrap_or_default();
    format!(
        "pid {} {verb} {} ({}{app}{age})",
        holder.pid,
        label(holder),
        mode(holder)
    )
}

/// The wait forest: every session that waits for nothing at the root (its
/// rows: what it holds), and below each session the waiting rows of the
/// sessions that wait for it ([`drawn_below`]). A session that waits for
/// several holders appears below each. A cycle (a deadlock the server has
/// not broken yet) has no such root: it is drawn from its lowest pid (what
/// it holds and what it waits for), round to that pid again, marked as a
/// cycle; so is what waits behind it.
fn to_tree(holders: &[Holder], label: impl Fn(&Holder) -> String) -> String {
    if holders.is_empty() {
        return "no advisory locks are held or awaited\n".to_owned();
    }
    let waiting = |pid: i32| holders.iter().any(|h| h.pid == pid && !h.granted);
    let mut tops: Vec<i32> = holders
        .iter()
        .filter(|h| !waiting(h.pid))
        .map(|h| h.pid)
        .collect();
    tops.dedup();
    let tree = Tree {
        below: drawn_below(holders),
        label: &label,
    };
    let mut drawn = HashSet::new();
    let mut out = String::new();
    for top in tops {
        tree.draw_from(holders, top, &mut drawn, &mut out);
    }
    // What no root reaches waits in (or behind) a cycle.
    while let Some(left) = holders.iter().find(|h| !drawn.contains(&h.pid)) {
        let chain = distlock::postgres::wait_chain(holders, left.pid);
        let top = match chain.cycle {
            Some(back) => {
                let from = chain.links.iter().position(|l| l.pid == back);
                let ring = &chain.links[from.unwrap_or(0)..];
                ring.iter().map(|l| l.pid).min().unwrap_or(left.pid)
            }
            None => chain.links.last().map_or(left.pid, |l| l.pid),
        };
        // A top already drawn cannot repeat the loop: draw the row's own
        // session then.
        let top = if drawn.contains(&top) { left.pid } else { top };
        tree.draw_from(holders, top, &mut drawn, &mut out);
    }
    out
}

/// The waiting rows to draw below each session. `pg_blocking_pids` names
/// the holders of a conflicting lock and also every conflicting request
/// queued ahead: drawn below all of them, the n-th waiter of a queue would
/// appear below each of the n - 1 ahead of it, and the tree would double
/// with every waiter. So a waiting row goes below each session that
/// *holds* a conflicting lock on its key, and only where none does (a
/// shared request behind a queued writer) below the request just ahead of
/// it. A row whose blockers let go between the server's two looks (left
/// unresolved) goes below the first of them.
fn drawn_below(holders: &[Holder]) -> HashMap<i32, Vec<&Holder>> {
    let mut below: HashMap<i32, Vec<&Holder>> = HashMap::new();
    for row in holders.iter().filter(|h| !h.granted) {
        let held: Vec<i32> = row
            .waits_for
            .iter()
            .filter(|link| link.granted)
            .map(|link| link.pid)
            .collect();
        let parents = if !held.is_empty() {
            held
        } else if let Some(ahead) = row.waits_for.iter().max_by_key(|link| link.since) {
            vec![ahead.pid]
        } else {
            row.blocked_by.first().copied().into_iter().collect()
        };
        for parent in parents {
            below.entry(parent).or_default().push(row);
        }
    }
    // In the order they began to wait: a queue's order.
    for rows in below.values_mut() {
        rows.sort_by_key(|row| (row.since, row.pid));
    }
    below
}

/// What the tree is drawn from: the rows below each session, and how a key
/// is named.
struct Tree<'a, L> {
    below: HashMap<i32, Vec<&'a Holder>>,
    label: &'a L,
}

impl<L: Fn(&Holder) -> String> Tree<'_, L> {
    /// Draws session `top`'s rows at the left margin and its waiters below.
    fn draw_from(&self, holders: &[Holder], top: i32, drawn: &mut HashSet<i32>, out: &mut String) {
        drawn.insert(top);
        for row in holders.iter().filter(|h| h.pid == top) {
            out.push_str(&tree_line(row, self.label));
            out.push('\n');
        }
        self.waiters_below(top, 1, &mut vec![top], drawn, out);
    }

    fn waiters_below(
        &self,
        pid: i32,
        depth: usize,
        path: &mut Vec<i32>,
        drawn: &mut HashSet<i32>,
        out: &mut String,
    ) {
        for row in self.below.get(&pid).into_iter().flatten() {
            out.push_str(&"   ".repeat(depth - 1));
            out.push_str("└─ ");
            out.push_str(&tree_line(row, self.label));
            if path.contains(&row.pid) {
                out.push_str(" (a cycle: a deadlock)\n");
                continue;
            }
            out.push('\n');
            drawn.insert(row.pid);
            path.push(row.pid);
            self.waiters_below(row.pid, depth + 1, path, drawn, out);
            path.pop();
        }
    }
}
