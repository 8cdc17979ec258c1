//! The offline checker: reads every process's history and decides whether
//! two holders were ever inside the critical section of one key at once,
//! and whether the register guarded by the lock lost an update or accepted a
//! stale write.
//!
//! # Mutual exclusion
//!
//! Each operation that got the lock has a critical section `[entered,
//! exited]`; one that entered and never exited (its process died, or its
//! history ends) is *possibly holding* until the end of time. Its status:
//!
//! - **clean**: released (or committed) without any sign of loss: the
//!   server confirmed the unlock on the same backend, so it held the lock
//!   from grant to release;
//! - **lost**: `lost()` fired, release failed, or the transaction failed
//!   after the lock was granted;
//! - **unknown**: no outcome recorded; treated like clean (possibly holding).
//! - **killed**: no outcome recorded, and its process was killed (`kill -9`,
//!   a recorded fault) after it entered: its section ended at the kill, no
//!   earlier than the moment the `kill` call was made (or than its entry,
//!   for a section entered while the call was under way: the signal lands
//!   a moment after the call, and a process records nothing after its
//!   death). Its lock is freed
//!   only once the process has died, which is after that moment; when the
//!   call *returned* is no bound, since the caller may be descheduled
//!   between the call and reading the clock (CI once saw a successor enter
//!   3.6 ms before that reading).
//!
//! Two sections of one key that overlap are a **violation** unless one of
//! them, `Z`, was lost, invoked before the other (`W`) was granted, and a
//! recorded fault aimed at `Z` (its backend pid, the key its backend held,
//! or its process) happened after `Z` was invoked and before `W` was
//! granted: then `Z` may have lost its lock before `W` got it. A fault is
//! matched by key only when `Z` never learnt its backend pid *and* no
//! operation that did learn it was on that backend at the time (one backend
//! serves one acquisition at a time, so the fault was aimed at that one).
//!
//! What the excuse cannot tighten: `W`'s grant time is when its client heard
//! the answer, which may be later than the server's grant. So the excuse
//! forgives a `W` granted just before the fault and told just after it. The
//! broken-locker controls (`broken.rs`) measure what these rules forgive:
//! each scenario's fault schedule run with a locker that skips the lock or
//! releases it early must still fail. The order in
//! which the two *entered* does not matter: a holder may learn of its grant
//! late (a terminated backend's last answer), after its successor entered.
//! A lost holder whose loss has no recorded cause (a server-side timeout,
//! or a heartbeat that timed out on a loaded machine) cannot be judged: its
//! overlaps are counted separately as *unattributed*.
//!
//! A holder that keeps working after the server dropped its lock *does*
//! overlap its successor: no lock can prevent that, it can only report it
//! (`lost()`). Those overlaps are counted as *excused*; the register below
//! shows the fence refusing the late holder's writes.
//!
//! # Register
//!
//! Each key guards a register that holders read, sleep, and write back
//! incremented, logging each committed write in the same transaction. If two
//! holders ever read the same value and both committed, the log holds that
//! value twice: a **lost update**. With fencing, the log's tokens must not
//! decrease along the register's values: a decrease is a **stale write
//! accepted**, and one token on two writes of different operations is a
//! **token reused**. A fence refusal of a holder that released cleanly (it
//! held the lock throughout, by the server's account) is a finding too: a
//! newer token was issued while it held the lock.
//!
//! # Tokens
//!
//! Fencing tokens of one key must be issued once each (two acquisitions with
//! one token: **duplicate token**) and grow with the grant order: an
//! acquisition invoked after an earlier one released cleanly must get a
//! higher token (else a **token inversion**).

use std::collections::{BTreeMap, HashMap};

use super::clock::ms;
use super::history::Event;

/// A fault may take a moment to bite (a terminated backend exits
/// asynchronously, a pooled connection was picked just before): faults this
/// long before an operation's invocation still count for it.
const FAULT_GRACE_NS: u64 = 250_000_000;

/// One acquisition attempt and what became of it.
#[derive(Debug, Clone, Default)]
pub struct Acq {
    pub op: (i64, i64, i64),
    pub key: i64,
    pub method: String,
    pub invoke: u64,
    pub acquired: Option<u64>,
    pub entered: Option<u64>,
    pub exited: Option<u64>,
    pub released: Option<u64>,
    pub lost: Option<(u64, String)>,
    /// The loss was first reported by `lost()` (not by `release()`).
    pub lost_by_watch: bool,
    pub release_failed: Option<(u64, String)>,
    pub failed: Option<(u64, String)>,
    pub busy: bool,
    pub timeout: bool,
    pub token: Option<i64>,
    pub backend_pid: Option<i64>,
    /// The broken locker's mark on this section (`skip`, `early`).
    pub broken: Option<String>,
    /// Its process was killed inside the section, at this time.
    pub killed: Option<u64>,
}

/// How an acquisition that entered its critical section ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Clean,
    Lost,
    Unknown,
    Killed,
}

impl Acq {
    pub fn held(&self) -> bool {
        self.entered.is_some()
    }

    pub fn status(&self) -> Status {
        if self.lost.is_some() || self.release_failed.is_some() || self.failed.is_some() {
            Status::Lost
        } else if self.released.is_some() {
            Status::Clean
        } else if self.killed.is_some() {
            Status::Killed
        } else {
            Status::Unknown
        }
    }

    /// When the holder first learnt that its lock could not be trusted.
    pub fn detected(&self) -> Option<u64> {
        [&self.lost, &self.release_failed, &self.failed]
            .into_iter()
            .flatten()
            .map(|(t, _)| *t)
            .min()
    }

    /// Why, as the holder was told.
    pub fn loss_reason(&self) -> Option<&str> {
        [&self.lost, &self.release_failed, &self.failed]
            .into_iter()
            .flatten()
            .min_by_key(|(t, _)| *t)
            .map(|(_, r)| r.as_str())
    }

    fn end(&self) -> u64 {
        self.exited.or(self.killed).unwrap_or(u64::MAX)
    }

    /// Whether this operation was on backend `pid` at time `t`.
    fn on_backend(&self, pid: i64, t: u64) -> bool {
        let until = [self.detected(), self.released, self.exited.or(self.killed)]
            .into_iter()
            .flatten()
            .max()
            .unwrap_or(u64::MAX);
        self.backend_pid == Some(pid) && self.invoke <= t && t <= until
    }
}

/// A fault injected by the control process.
#[derive(Debug, Clone)]
pub struct Fault {
    /// When the injection began (a `start` field, else the event's time).
    /// For a kill, when `kill` was called: the end of the victim's
    /// sections (the event's `dead` field, when the call returned as read
    /// afterwards, is for the record only; the event's time is the reaping).
    pub t: u64,
    /// When the injection call returned (the event's time).
    pub end: u64,
    /// For a kill, when the `kill` call had returned, as read afterwards
    /// (the event's `dead` field).
    pub returned: Option<u64>,
    pub kind: String,
    /// Aimed at this backend pid only.
    pub backend_pid: Option<i64>,
    /// Aimed at this worker process only.
    pub target: Option<i64>,
    /// The key the targeted backend held, when known.
    pub key: Option<i64>,
    /// An operation that knew its backend pid was on the targeted backend
    /// when the fault began: the fault was aimed at it, not at a holder
    /// that never learnt its pid.
    pub claimed: bool,
}

impl Fault {
    /// Whether the fault may have cost `acq` its lock. A backend pid the
    /// holder never learnt (it died before answering) is matched by key.
    fn affects(&self, acq: &Acq) -> bool {
        let backend = match (self.backend_pid, acq.backend_pid) {
            (None, _) => true,
            (Some(bp), Some(own)) => bp == own,
            (Some(_), None) => !self.claimed && self.key.is_none_or(|k| k == acq.key),
        };
        backend && self.target.is_none_or(|p| acq.op.0 == p)
    }
}

/// All histories of a run, folded per operation.
#[derive(Debug, Default)]
pub struct History {
    pub acqs: Vec<Acq>,
    pub faults: Vec<Fault>,
    /// `(process, advisory locks still held after all its guards ended)`.
    pub leakchecks: Vec<(i64, i64)>,
    /// Processes that recorded `done`.
    pub done: Vec<i64>,
    /// Register events: reads, acknowledged writes, refusals, unknowns.
    pub reads: usize,
    pub writes_acked: Vec<(i64, i64, i64)>,
    pub read_rejected: Vec<(u64, (i64, i64, i64))>,
    pub write_rejected: Vec<(u64, (i64, i64, i64))>,
    pub reg_failed: usize,
    /// Every event, by time.
    pub events: Vec<Event>,
}

impl History {
    pub fn build(events: Vec<Event>) -> Self {
        let mut h = History::default();
        let mut acqs: HashMap<(i64, i64, i64), Acq> = HashMap::new();
        for ev in &events {
            match ev.e.as_str() {
                "fault" => h.faults.push(Fault {
                    t: ev
                        .int("start")
                        .and_then(|t| u64::try_from(t).ok())
                        .unwrap_or(ev.t),
                    end: ev.t,
                    returned: ev.int("dead").and_then(|t| u64::try_from(t).ok()),
                    kind: ev.text("kind").unwrap_or("?").to_owned(),
                    backend_pid: ev.int("bp"),
                    target: ev.int("target"),
                    key: ev.int("k"),
                    claimed: false,
                }),
                "leakcheck" => h.leakchecks.push((ev.p, ev.int("n").unwrap_or(-1))),
                "done" => h.done.push(ev.p),
                "read" => h.reads += 1,
                "write" => h.writes_acked.extend(ev.op()),
                "read_rejected" => h.read_rejected.extend(ev.op().map(|op| (ev.t, op))),
                "write_rejected" => h.write_rejected.extend(ev.op().map(|op| (ev.t, op))),
                "reg_failed" => h.reg_failed += 1,
                _ => {}
            }
            let Some(op) = ev.op() else { continue };
            let reason = || ev.text("r").unwrap_or("").to_owned();
            let acq = acqs.entry(op).or_insert_with(|| Acq {
                op,
                ..Acq::default()
            });
            match ev.e.as_str() {
                "invoke" => {
                    acq.invoke = ev.t;
                    acq.key = ev.int("k").unwrap_or(-1);
                    acq.method = ev.text("m").unwrap_or("?").to_owned();
                }
                "acquired" => {
                    acq.acquired = Some(ev.t);
                    acq.token = ev.int("tok");
                    acq.backend_pid = acq.backend_pid.or(ev.int("bp"));
                }
                "read" => acq.backend_pid = acq.backend_pid.or(ev.int("bp")),
                "entered" => {
                    acq.entered = Some(ev.t);
                    acq.broken = ev.text("broken").map(str::to_owned);
                }
                "exited" => acq.exited = Some(ev.t),
                "released" => acq.released = Some(ev.t),
                "busy" => acq.busy = true,
                "timeout" => acq.timeout = true,
                "lost" if acq.lost.is_none() => {
                    acq.lost = Some((ev.t, reason()));
                    acq.lost_by_watch = ev.text("via") == Some("lost()");
                }
                "release_failed" => {
                    acq.release_failed.get_or_insert((ev.t, reason()));
                }
                // A failure before the lock was granted holds nothing.
                "failed" if acq.acquired.is_some() => {
                    acq.failed.get_or_insert((ev.t, reason()));
                }
                _ => {}
            }
        }
        h.acqs = acqs.into_values().collect();
        h.acqs.sort_by_key(|a| (a.invoke, a.op));
        // A section without an outcome whose process was killed while in
        // it ended at the kill, or at its entry if it entered after the
        // `kill` call was made but before that call returned (the signal
        // lands a moment after the call: the process may still record its
        // entry, never anything after its death).
        for acq in &mut h.acqs {
            let no_outcome = acq.released.is_none() && acq.detected().is_none();
            let Some(entered) = acq.entered.filter(|_| no_outcome) else {
                continue;
            };
            acq.killed = h
                .faults
                .iter()
                .filter(|f| f.kind == "kill" && f.target == Some(acq.op.0))
                .filter(|f| entered <= f.t.max(f.returned.unwrap_or(0)))
                .map(|f| f.t.max(entered))
                .min();
        }
        for fault in &mut h.faults {
            if let Some(pid) = fault.backend_pid {
                fault.claimed = h.acqs.iter().any(|a| a.on_backend(pid, fault.t));
            }
        }
        h.events = events;
        h
    }

    /// Acquisitions that entered their critical section.
    pub fn held(&self) -> impl Iterator<Item = &Acq> {
        self.acqs.iter().filter(|a| a.held())
    }

    /// The first recorded fault aimed at `acq` between its invocation (less
    /// a grace) and the moment it learnt of its loss.
    pub fn first_fault(&self, acq: &Acq) -> Option<u64> {
        self.first_fault_of(acq).map(|f| f.t)
    }

    fn first_fault_of(&self, acq: &Acq) -> Option<&Fault> {
        let detected = acq.detected()?;
        self.faults
            .iter()
            .filter(|f| f.affects(acq))
            .filter(|f| f.end + FAULT_GRACE_NS >= acq.invoke && f.t <= detected)
            .min_by_key(|f| f.t)
    }

    /// When the server may first have dropped `acq`'s lock: its first fault,
    /// but not before it was granted. `None`: no recorded cause.
    pub fn loss_start(&self, acq: &Acq) -> Option<u64> {
        let granted = acq.acquired.or(acq.entered)?;
        self.first_fault(acq).map(|f| f.max(granted))
    }

    /// Whether lost `z` may have lost its lock before `w` was granted:
    /// `Some(false)` if not (or `z` was not lost), `None` if `z`'s loss has
    /// no recorded cause.
    fn excuses(&self, z: &Acq, w: &Acq) -> Option<bool> {
        if z.status() != Status::Lost {
            return Some(false); // a killed holder's section ended at the kill
        }
        let w_granted = w.acquired.or(w.entered).unwrap_or(0);
        let fault = self.first_fault(z)?;
        Some(z.invoke <= w_granted && fault <= w_granted)
    }
}

/// Two critical sections of one key that overlapped.
#[derive(Debug, Clone)]
pub struct Overlap {
    pub key: i64,
    pub first: (i64, i64, i64),
    pub second: (i64, i64, i64),
    /// How long they overlapped.
    pub ns: u64,
    /// One of them was the broken locker's.
    pub broken: bool,
}

/// The mutual-exclusion verdict.
#[derive(Debug, Default)]
pub struct Exclusion {
    pub held: usize,
    pub clean: usize,
    pub lost: usize,
    pub unknown: usize,
    pub killed: usize,
    pub violations: Vec<Overlap>,
    /// Overlaps after the first holder's recorded fault: expected.
    pub excused: Vec<Overlap>,
    /// Overlaps with a lost holder whose loss has no recorded cause.
    pub unattributed: Vec<Overlap>,
    /// Fencing tokens of one key issued to two acquisitions.
    pub duplicate_tokens: usize,
    /// Acquisitions invoked after an earlier one released cleanly whose
    /// token is not higher than that one's.
    pub token_inversions: usize,
}

impl Exclusion {
    /// Overlaps with a broken-locker section: (caught as violations,
    /// forgiven as excused, forgiven as unattributed).
    pub fn broken_overlaps(&self) -> (usize, usize, usize) {
        let count = |v: &[Overlap]| v.iter().filter(|o| o.broken).count();
        (
            count(&self.violations),
            count(&self.excused),
            count(&self.unattributed),
        )
    }
}

pub fn check_exclusion(h: &History) -> Exclusion {
    let mut verdict = Exclusion::default();
    let mut by_key: BTreeMap<i64, Vec<&Acq>> = BTreeMap::new();
    for acq in h.held() {
        verdict.held += 1;
        match acq.status() {
            Status::Clean => verdict.clean += 1,
            Status::Lost => verdict.lost += 1,
            Status::Unknown => verdict.unknown += 1,
            Status::Killed => verdict.killed += 1,
        }
        by_key.entry(acq.key).or_default().push(acq);
    }
    let (duplicates, inversions) = check_tokens(h);
    verdict.duplicate_tokens = duplicates;
    verdict.token_inversions = inversions;
    for (key, mut sections) in by_key {
        sections.sort_by_key(|a| a.entered);
        let mut active: Vec<&Acq> = Vec::new();
        for b in sections {
            let start = b.entered.unwrap_or(0);
            active.retain(|a| a.end() > start);
            for a in &active {
                let overlap = Overlap {
                    key,
                    first: a.op,
                    second: b.op,
                    ns: a.end().min(b.end()).saturating_sub(start),
                    broken: a.broken.is_some() || b.broken.is_some(),
                };
                match (h.excuses(a, b), h.excuses(b, a)) {
                    (Some(true), _) | (_, Some(true)) => verdict.excused.push(overlap),
                    (None, _) | (_, None) => verdict.unattributed.push(overlap),
                    (Some(false), Some(false)) => verdict.violations.push(overlap),
                }
            }
            active.push(b);
        }
    }
    verdict
}

/// Duplicate tokens and token inversions among the acquisitions of each key.
fn check_tokens(h: &History) -> (usize, usize) {
    let mut by_key: BTreeMap<i64, Vec<&Acq>> = BTreeMap::new();
    for acq in h.acqs.iter().filter(|a| a.token.is_some()) {
        by_key.entry(acq.key).or_default().push(acq);
    }
    let (mut duplicates, mut inversions) = (0, 0);
    for acqs in by_key.values() {
        let mut tokens: Vec<i64> = acqs.iter().filter_map(|a| a.token).collect();
        tokens.sort_unstable();
        duplicates += tokens.windows(2).filter(|p| p[0] == p[1]).count();
        // Cleanly released ones by release time; every acquisition invoked
        // later must have a higher token than all of them.
        let mut released: Vec<(u64, i64)> = acqs
            .iter()
            .filter(|a| a.status() == Status::Clean)
            .filter_map(|a| Some((a.released?, a.token?)))
            .collect();
        released.sort_unstable();
        let mut by_invoke: Vec<&&Acq> = acqs.iter().collect();
        by_invoke.sort_by_key(|a| a.invoke);
        let (mut next, mut highest) = (0, i64::MIN);
        for acq in by_invoke {
            while next < released.len() && released[next].0 < acq.invoke {
                highest = highest.max(released[next].1);
                next += 1;
            }
            if acq.token.is_some_and(|t| t <= highest) {
                inversions += 1;
            }
        }
    }
    (duplicates, inversions)
}

/// How long a holder took to learn that its lock was gone.
#[derive(Debug, Clone)]
pub struct Latency {
    pub op: (i64, i64, i64),
    /// From the fault that cost the lock (or from the grant, if later).
    pub ns: u64,
    /// That fault's kind.
    pub kind: String,
    /// First reported by `lost()` rather than by `release()` or the
    /// transaction failing.
    pub by_watch: bool,
}

/// Detection latency of every lost holder with a recorded cause.
pub fn loss_latencies(h: &History) -> Vec<Latency> {
    h.held()
        .filter(|a| a.status() == Status::Lost)
        .filter_map(|a| {
            let start = h.loss_start(a)?;
            let detected = a.detected()?;
            Some(Latency {
                op: a.op,
                ns: detected.saturating_sub(start),
                kind: h
                    .first_fault_of(a)
                    .map(|f| f.kind.clone())
                    .unwrap_or_default(),
                by_watch: a.lost_by_watch && a.lost.as_ref().is_some_and(|(t, _)| *t == detected),
            })
        })
        .collect()
}

/// p50 / p99 / max of a set of nanosecond durations, in milliseconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct Percentiles {
    pub n: usize,
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}

impl Percentiles {
    pub fn of(mut ns: Vec<u64>) -> Self {
        if ns.is_empty() {
            return Self::default();
        }
        ns.sort_unstable();
        let at = |q: f64| {
            let idx = ((ns.len() as f64 - 1.0) * q).round() as usize;
            ms(ns[idx.min(ns.len() - 1)])
        };
        Self {
            n: ns.len(),
            p50: at(0.5),
            p99: at(0.99),
            max: ms(*ns.last().unwrap_or(&0)),
        }
    }
}

impl std::fmt::Display for Percentiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.n == 0 {
            return f.write_str("n=0");
        }
        write!(
            f,
            "n={} p50={:.0} ms p99={:.0} ms max={:.0} ms",
            self.n, self.p50, self.p99, self.max
        )
    }
}

/// One committed register write, as logged in its own transaction.
#[derive(Debug, Clone)]
pub struct LoggedWrite {
    pub key: i64,
    pub value: i64,
    pub token: Option<i64>,
    pub op: (i64, i64, i64),
}

/// The register verdict.
#[derive(Debug, Default)]
pub struct RegisterVerdict {
    pub keys: usize,
    pub committed: usize,
    /// Values committed more than once: two holders read the same value.
    pub lost_updates: usize,
    /// Values missing from the sequence 1..=n of a key.
    pub gaps: usize,
    /// Writes accepted with a token older than an earlier accepted one.
    pub stale_accepted: usize,
    /// Consecutive writes of two operations with one token.
    pub token_reused: usize,
    /// Fence refusals (reads or writes) of holders that released cleanly.
    pub refused_clean: usize,
    /// Keys whose final value is not the number of committed writes.
    pub final_mismatch: usize,
    /// Writes acknowledged to the client that are not in the log.
    pub acked_missing: usize,
    /// Refusals by the fence, as the clients saw them.
    pub read_rejected: usize,
    pub write_rejected: usize,
    /// Register statements that failed with an unknown outcome.
    pub unknown: usize,
}

impl RegisterVerdict {
    pub fn is_sound(&self) -> bool {
        self.lost_updates == 0
            && self.gaps == 0
            && self.stale_accepted == 0
            && self.token_reused == 0
            && self.refused_clean == 0
            && self.final_mismatch == 0
            && self.acked_missing == 0
    }
}

pub fn check_register(log: &[LoggedWrite], finals: &[(i64, i64)], h: &History) -> RegisterVerdict {
    let mut verdict = RegisterVerdict {
        keys: finals.len(),
        committed: log.len(),
        read_rejected: h.read_rejected.len(),
        write_rejected: h.write_rejected.len(),
        unknown: h.reg_failed,
        ..RegisterVerdict::default()
    };
    let mut by_key: BTreeMap<i64, Vec<&LoggedWrite>> = BTreeMap::new();
    for w in log {
        by_key.entry(w.key).or_default().push(w);
    }
    for writes in by_key.values_mut() {
        writes.sort_by_key(|w| w.value);
        let mut newest_token = i64::MIN;
        let mut newest_op = None;
        let mut expected = 1;
        for pair in writes.windows(2) {
            if pair[0].value == pair[1].value {
                verdict.lost_updates += 1;
            }
        }
        for w in writes.iter() {
            if w.value > expected {
                verdict.gaps += usize::try_from(w.value - expected).unwrap_or(0);
            }
            expected = expected.max(w.value + 1);
            if let Some(token) = w.token {
                if token < newest_token {
                    verdict.stale_accepted += 1;
                } else if token == newest_token && newest_op != Some(w.op) {
                    verdict.token_reused += 1;
                }
                if token >= newest_token {
                    newest_token = token;
                    newest_op = Some(w.op);
                }
            }
        }
    }
    for (key, value) in finals {
        let n = by_key.get(key).map_or(0, Vec::len);
        let top = by_key
            .get(key)
            .and_then(|w| w.last())
            .map_or(0, |w| w.value);
        if i64::try_from(n).ok() != Some(*value) || top != *value {
            verdict.final_mismatch += 1;
        }
    }
    let clean: std::collections::HashSet<_> = h
        .acqs
        .iter()
        .filter(|a| a.held() && a.status() == Status::Clean)
        .map(|a| a.op)
        .collect();
    verdict.refused_clean = h
        .read_rejected
        .iter()
        .chain(&h.write_rejected)
        .filter(|(_, op)| clean.contains(op))
        .count();
    let logged: std::collections::HashSet<_> = log.iter().map(|w| w.op).collect();
    verdict.acked_missing = h
        .writes_acked
        .iter()
        .filter(|op| !logged.contains(op))
        .count();
    verdict
}
