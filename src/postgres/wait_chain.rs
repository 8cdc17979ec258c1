//! Wait chains: whom a waiter waits behind, whom that one waits behind, up
//! to the root holder, or round a cycle.

use std::collections::{HashMap, VecDeque};
use std::fmt;

use crate::postgres::holder::{AdvisoryKey, ChainLink, Holder};

/// Sessions each waiting behind the next: from a waiter (or, in
/// [`Error::Timeout`](crate::Error::Timeout), from the holder of the key
/// that was not granted) to the root holder, a session that waits for
/// nothing.
///
/// Each link is a session with its lock on the key that the link before it
/// waits for: held, or awaited ahead of it in the queue. The first link of
/// [`wait_chain`] is the waiter's own waiting row. Where a session waits
/// behind several (the holders of a shared lock, say), the chain takes the
/// shortest way to a root. Where no way leads to a root, the sessions wait
/// for each other in a cycle, a deadlock that PostgreSQL has not broken yet
/// (it breaks one after `deadlock_timeout`, 1 s by default): the chain then
/// ends where it would repeat, and [`cycle`](Self::cycle) names the session
/// the last link waits behind. Built from one snapshot of the lock table;
/// reading it costs no round trip.
///
/// The links are server sessions, not processes: a process that holds one
/// session lock and waits for another uses two connections, two sessions,
/// and the chain of the one it holds on ends there. A chain crosses keys
/// where one session holds a key and waits for the next (a
/// [`lock_xact`](crate::lock_xact) inside a transaction-scoped lock,
/// [`lock_all`](crate::PgLocker::lock_all), SQL of your own).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WaitChain {
    /// The links, the waiter (or holder) first.
    pub links: Vec<ChainLink>,
    /// `Some(pid)` when the last link waits behind session `pid`, which is
    /// earlier in the chain: a cycle. `None` when the last link is the root
    /// holder.
    pub cycle: Option<i32>,
}

impl WaitChain {
    /// The links' pids, in order.
    pub fn pids(&self) -> Vec<i32> {
        self.links.iter().map(|link| link.pid).collect()
    }

    /// The root holder (the last link), unless the chain is empty or ends in
    /// a cycle.
    pub fn root(&self) -> Option<&ChainLink> {
        self.cycle.is_none().then(|| self.links.last()).flatten()
    }

    /// Whether the chain ends in a cycle.
    pub fn is_cycle(&self) -> bool {
        self.cycle.is_some()
    }

    /// Whether the chain has no link (nobody seen).
    pub fn is_empty(&self) -> bool {
        self.links.is_empty()
    }
}

impl fmt::Display for WaitChain {
    /// `pid 17 → pid 4 (root)`, or `pid 17 → pid 4 → pid 17 (a cycle)`;
    /// each pid followed by its application name where known.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, link) in self.links.iter().enumerate() {
            if i > 0 {
                f.write_str(" → ")?;
            }
            write!(f, "pid {}", link.pid)?;
            if let Some(app) = &link.application_name {
                write!(f, " {app:?}")?;
            }
        }
        match self.cycle {
            Some(pid) => write!(f, " → pid {pid} (a cycle)"),
            None if self.links.is_empty() => f.write_str("nobody"),
            None => f.write_str(" (root)"),
        }
    }
}

/// The wait chain of session `pid` in `holders` (as
/// [`PgLocker::holders`](crate::PgLocker::holders) returned them): its
/// waiting row first, then whom it waits behind, and so on to the root
/// holder or round a cycle (see [`WaitChain`]). A session that waits for
/// nothing is a chain of one link (its first row); a pid without rows an
/// empty chain. No round trip.
pub fn wait_chain(holders: &[Holder], pid: i32) -> WaitChain {
    let start = waiting_row(holders, pid).or_else(|| holders.iter().find(|h| h.pid == pid));
    match start {
        Some(start) => chain_from(holders, start),
        None => WaitChain::default(),
    }
}

/// The chain that starts at `start` (one of `holders`).
pub(crate) fn chain_from(holders: &[Holder], start: &Holder) -> WaitChain {
    let waiting = waiting_rows(holders);
    let mut links = vec![ChainLink::from(start)];
    if let Some(path) = path_to_root(&waiting, start.pid) {
        links.extend(path);
        return WaitChain { links, cycle: None };
    }
    // Every way leads back: follow the first blocker until a session repeats.
    let mut current = start.pid;
    loop {
        let next = waiting.get(&current).and_then(|row| row.waits_for.first());
        let Some(next) = next else {
            return WaitChain { links, cycle: None };
        };
        if links.iter().any(|link| link.pid == next.pid) {
            return WaitChain {
                links,
                cycle: Some(next.pid),
            };
        }
        current = next.pid;
        links.push(next.clone());
    }
}

/// The links after `from` on a shortest way to a session that waits for
/// nobody the snapshot shows, or `None` if every way leads round a cycle.
/// Breadth first, so a blocker that is itself running ends the search at
/// once.
fn path_to_root(waiting: &HashMap<i32, &Holder>, from: i32) -> Option<Vec<ChainLink>> {
    let mut came_by: HashMap<i32, (i32, &ChainLink)> = HashMap::new();
    let mut queue = VecDeque::from([from]);
    let mut end = None;
    while let Some(pid) = queue.pop_front() {
        let Some(row) = waiting.get(&pid).filter(|row| !row.waits_for.is_empty()) else {
            end = Some(pid);
            break;
        };
        for link in &row.waits_for {
            if link.pid == from || came_by.contains_key(&link.pid) {
                continue;
            }
            came_by.insert(link.pid, (pid, link));
            queue.push_back(link.pid);
        }
    }
    let mut path = Vec::new();
    let mut at = end?;
    while let Some(&(before, link)) = came_by.get(&at) {
        path.push(link.clone());
        at = before;
    }
    path.reverse();
    Some(path)
}

/// The row of `pid` that waits, if any (a session waits for one lock at a
/// time).
fn waiting_row(holders: &[Holder], pid: i32) -> Option<&Holder> {
    holders.iter().find(|h| h.pid == pid && !h.granted)
}

/// Every session's waiting row, by pid.
fn waiting_rows(holders: &[Holder]) -> HashMap<i32, &Holder> {
    holders
        .iter()
        .filter(|h| !h.granted)
        .map(|h| (h.pid, h))
        .collect()
}

/// Fills each waiting row's [`Holder::waits_for`] from its
/// [`blocked_by`](Holder::blocked_by) pids: each blocker's row on the same
/// key (the held one where it both holds and awaits it). A blocker without
/// a row on that key in the snapshot (it let go while the statement ran) is
/// left out.
pub(crate) fn resolve(holders: &mut [Holder]) {
    // Each session's row on each key, the held one where there are two.
    let mut on_key: HashMap<(i32, AdvisoryKey), &Holder> = HashMap::new();
    for row in holders.iter() {
        let slot = on_key.entry((row.pid, row.key)).or_insert(row);
        if row.granted && !slot.granted {
            *slot = row;
        }
    }
    let resolved: Vec<Vec<ChainLink>> = holders
        .iter()
        .map(|row| {
            let blocker = |pid: &i32| on_key.get(&(*pid, row.key)).map(|h| ChainLink::from(*h));
            row.blocked_by.iter().filter_map(blocker).collect()
        })
        .collect();
    for (row, waits_for) in holders.iter_mut().zip(resolved) {
        row.waits_for = waits_for;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::postgres::holder::LockMode;

    /// A row of session `pid` on key `key`, waiting behind `blocked_by`
    /// (empty: granted).
    fn row(pid: i32, key: i64, blocked_by: Vec<i32>) -> Holder {
        Holder {
            key: AdvisoryKey::BigInt(key),
            pid,
            application_name: None,
            client_addr: None,
            since: None,
            granted: blocked_by.is_empty(),
            mode: LockMode::Exclusive,
            blocked_by,
            waits_for: Vec::new(),
        }
    }

    fn resolved(mut rows: Vec<Holder>) -> Vec<Holder> {
        resolve(&mut rows);
        rows
    }

    /// 3 waits for key 2 held by 2, which waits for key 1 held by 1.
    #[test]
    fn a_chain_crosses_keys_to_the_root() {
        let rows = resolved(vec![
            row(1, 1, vec![]),
            row(2, 2, vec![]),
            row(2, 1, vec![1]),
            row(3, 2, vec![2]),
        ]);
        let chain = wait_chain(&rows, 3);
        assert_eq!(chain.pids(), [3, 2, 1]);
        assert_eq!(chain.cycle, None);
        let keys: Vec<_> = chain.links.iter().map(|l| (l.key, l.granted)).collect();
        assert_eq!(
            keys,
            [
                (AdvisoryKey::BigInt(2), false),
                (AdvisoryKey::BigInt(2), true),
                (AdvisoryKey::BigInt(1), true),
            ]
        );
        assert_eq!(chain.root().map(|l| l.pid), Some(1));
        assert_eq!(wait_chain(&rows, 1).pids(), [1]);
        assert!(wait_chain(&rows, 99).is_empty());
        assert_eq!(rows[2].waits_for.len(), 1);
        assert_eq!(rows[2].waits_for[0].pid, 1);
        assert!(rows[0].waits_for.is_empty());
    }

    /// 1 and 2 wait for each other: the chain goes round once and says so.
    #[test]
    fn a_cycle_is_marked_not_cut() {
        let rows = resolved(vec![
            row(1, 1, vec![]),
            row(2, 2, vec![]),
            row(1, 2, vec![2]),
            row(2, 1, vec![1]),
        ]);
        let chain = wait_chain(&rows, 1);
        assert_eq!(chain.pids(), [1, 2]);
        assert_eq!(chain.cycle, Some(1));
        assert!(chain.is_cycle() && chain.root().is_none());
        assert_eq!(chain.to_string(), "pid 1 → pid 2 → pid 1 (a cycle)");
        // A session stuck behind the cycle: its chain ends in the cycle.
        let mut behind = rows.clone();
        behind.push(row(3, 1, vec![1]));
        let behind = resolved(behind);
        let chain = wait_chain(&behind, 3);
        assert_eq!(chain.pids(), [3, 1, 2]);
        assert_eq!(chain.cycle, Some(1));
    }

    /// Of several blockers, the chain takes the shortest way to a root, also
    /// when the first blocker leads into a cycle.
    #[test]
    fn the_chain_takes_the_shortest_way_to_a_root() {
        let rows = resolved(vec![
            row(5, 5, vec![]),
            row(4, 4, vec![]),
            row(4, 5, vec![5]),
            row(3, 5, vec![4, 5]),
        ]);
        assert_eq!(wait_chain(&rows, 3).pids(), [3, 5]);
        let rows = resolved(vec![
            row(1, 1, vec![]),
            row(2, 2, vec![]),
            row(1, 2, vec![2]),
            row(2, 1, vec![1]),
            row(9, 9, vec![]),
            // 3 waits for key 7, held shared by 1 (in the cycle) and 9.
            row(1, 7, vec![]),
            row(9, 7, vec![]),
            row(3, 7, vec![1, 9]),
        ]);
        let chain = wait_chain(&rows, 3);
        assert_eq!(chain.pids(), [3, 9]);
        assert_eq!(chain.cycle, None);
    }

    /// A blocker that both holds and awaits the key is named by its held
    /// row; one that left the snapshot is left out.
    #[test]
    fn blockers_resolve_to_their_rows_on_the_key() {
        let rows = resolved(vec![
            row(2, 1, vec![]),
            row(2, 1, vec![7]),
            row(3, 1, vec![2, 42]),
        ]);
        let waits = &rows[2].waits_for;
        assert_eq!(waits.len(), 1, "{waits:?}");
        assert!(waits[0].granted && waits[0].pid == 2);
    }
}
