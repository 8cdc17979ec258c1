//! Folding a run's histories into verdicts and the figures RELIABILITY.md
//! quotes; every scenario prints one block.

use std::collections::BTreeMap;
use std::path::Path;

use super::checker::{
    self, Exclusion, History, Latency, Percentiles, RegisterVerdict, Status, check_exclusion,
    check_register,
};
use super::db::TestDb;
use super::history;

/// The methods of session-lock acquisitions, as histories name them.
pub const SESSION: &[&str] = &["try", "lock"];
/// The methods of transaction-scoped acquisitions.
pub const XACT: &[&str] = &["xact", "xwait"];

/// Everything the checker found in one run.
#[derive(Debug)]
pub struct Outcome {
    pub history: History,
    pub exclusion: Exclusion,
    pub register: RegisterVerdict,
    /// Advisory locks workers still held after all their guards ended.
    pub leaked: i64,
    /// Worker processes that did not report their leak check.
    pub unchecked: usize,
    /// Detection latency from each loss's recorded fault.
    pub latencies: Vec<Latency>,
}

impl Outcome {
    /// Reads the histories in `dir` and the register of `db`.
    pub async fn analyse(db: &TestDb, dir: &Path, workers: usize) -> Self {
        let history = History::build(history::load(dir));
        let exclusion = check_exclusion(&history);
        let (log, finals) = db.register().await;
        let register = check_register(&log, &finals, &history);
        let leaked = history.leakchecks.iter().map(|(_, n)| (*n).max(0)).sum();
        let failed_checks = history.leakchecks.iter().filter(|(_, n)| *n < 0).count();
        let unchecked = workers.saturating_sub(history.leakchecks.len()) + failed_checks;
        let latencies = checker::loss_latencies(&history);
        Self {
            history,
            exclusion,
            register,
            leaked,
            unchecked,
            latencies,
        }
    }

    /// Acquisitions (entered critical sections) by method.
    pub fn acquisitions(&self, methods: &[&str]) -> usize {
        self.history
            .held()
            .filter(|a| methods.contains(&a.method.as_str()))
            .count()
    }

    /// Detection latency of the operations of `methods`: all of them, and
    /// those whose loss `lost()` reported first.
    pub fn latency_for(&self, methods: &[&str]) -> (Percentiles, Percentiles) {
        let wanted: std::collections::HashSet<_> = self
            .history
            .acqs
            .iter()
            .filter(|a| methods.contains(&a.method.as_str()))
            .map(|a| a.op)
            .collect();
        let of = |watch_only: bool| {
            Percentiles::of(
                self.latencies
                    .iter()
                    .filter(|l| wanted.contains(&l.op) && (l.by_watch || !watch_only))
                    .map(|l| l.ns)
                    .collect(),
            )
        };
        (of(false), of(true))
    }

    /// Lost critical sections of the operations of `methods`.
    pub fn lost_for(&self, methods: &[&str]) -> usize {
        self.history
            .held()
            .filter(|a| methods.contains(&a.method.as_str()) && a.status() == Status::Lost)
            .count()
    }

    /// Prints the block RELIABILITY.md is made from.
    pub fn print(&self, title: &str, extra: &[String]) {
        let h = &self.history;
        let mut by_method: BTreeMap<&str, [usize; 5]> = BTreeMap::new();
        for a in &h.acqs {
            let row = by_method.entry(a.method.as_str()).or_default();
            row[0] += 1;
            if a.held() {
                row[1] += 1;
            }
            if a.busy {
                row[2] += 1;
            }
            if a.timeout {
                row[3] += 1;
            }
            if !a.held() && !a.busy && !a.timeout {
                row[4] += 1;
            }
        }
        let ex = &self.exclusion;
        let reg = &self.register;
        println!(
            "=== torture: {title} ({}, DISTLOCK_TORTURE_SEED={}) ===",
            super::scale::name(),
            super::scale::seed()
        );
        for (method, [calls, held, busy, timeout, failed]) in by_method {
            println!(
                "  {method:>5}: {calls} calls, {held} acquired, {busy} busy, {timeout} timed out, {failed} failed before the grant"
            );
        }
        println!(
            "  critical sections: {} ({} clean, {} lost, {} unknown, {} killed)",
            ex.held, ex.clean, ex.lost, ex.unknown, ex.killed
        );
        println!(
            "  fencing tokens: {} duplicates, {} inversions",
            ex.duplicate_tokens, ex.token_inversions
        );
        println!(
            "  mutual exclusion: {} violations; {} overlaps after a holder's fault (excused), {} with an unattributed loss",
            ex.violations.len(),
            ex.excused.len(),
            ex.unattributed.len()
        );
        println!(
            "  register: {} keys, {} committed writes, {} lost updates, {} gaps, {} stale writes accepted, {} tokens reused, {} final mismatches, {} acknowledged but missing",
            reg.keys,
            reg.committed,
            reg.lost_updates,
            reg.gaps,
            reg.stale_accepted,
            reg.token_reused,
            reg.final_mismatch,
            reg.acked_missing
        );
        println!(
            "  fence: {} stale reads and {} stale writes refused ({} of holders that released cleanly); {} register statements with unknown outcome",
            reg.read_rejected, reg.write_rejected, reg.refused_clean, reg.unknown
        );
        println!(
            "  leaked locks: {} (workers without a leak check: {})",
            self.leaked, self.unchecked
        );
        println!("  faults: {}", fault_summary(h));
        let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
        for a in h.held().filter(|a| a.status() == Status::Lost) {
            *reasons
                .entry(reason_class(a.loss_reason().unwrap_or("")))
                .or_default() += 1;
        }
        if !reasons.is_empty() {
            println!("  losses by reason: {reasons:?}");
        }
        let all = Percentiles::of(self.latencies.iter().map(|l| l.ns).collect());
        let watch = Percentiles::of(
            self.latencies
                .iter()
                .filter(|l| l.by_watch)
                .map(|l| l.ns)
                .collect(),
        );
        println!("  detection latency from the fault: {all}; by lost(): {watch}");
        for line in extra {
            println!("  {line}");
        }
        for v in ex.violations.iter().take(5) {
            println!(
                "  VIOLATION on key {}: {:?} and {:?} overlapped for {:.3} ms",
                v.key,
                v.first,
                v.second,
                super::clock::ms(v.ns)
            );
        }
    }

    /// The guarantees every scenario must keep.
    pub fn assert_sound(&self) {
        let ex = &self.exclusion;
        assert!(
            ex.violations.is_empty(),
            "{} mutual-exclusion violations, first: {:?}",
            ex.violations.len(),
            &ex.violations[..ex.violations.len().min(5)]
        );
        assert_eq!(ex.unknown, 0, "critical sections without an outcome");
        assert_eq!(ex.duplicate_tokens, 0, "one fencing token issued twice");
        assert_eq!(ex.token_inversions, 0, "fencing tokens out of grant order");
        assert!(self.register.is_sound(), "register: {:?}", self.register);
        assert_eq!(self.leaked, 0, "advisory locks leaked by workers");
        assert_eq!(self.unchecked, 0, "workers that did not check for leaks");
    }
}

impl Outcome {
    /// For scenarios where every fault is recorded: no overlap with a loss
    /// that has no recorded cause.
    pub fn assert_attributed(&self) {
        let un = &self.exclusion.unattributed;
        assert!(
            un.is_empty(),
            "{} overlaps with a loss that has no recorded cause, first: {:?}",
            un.len(),
            &un[..un.len().min(5)]
        );
    }

    /// Whether the checker found anything wrong.
    pub fn failed(&self) -> bool {
        let ex = &self.exclusion;
        !ex.violations.is_empty()
            || ex.unknown > 0
            || ex.duplicate_tokens > 0
            || ex.token_inversions > 0
            || !self.register.is_sound()
    }

    /// For the broken-locker controls: the run must fail. Prints how many
    /// of the broken sections' overlaps the excuse rules forgave.
    pub fn assert_caught(&self, scenario: &str) {
        let broken = self.history.held().filter(|a| a.broken.is_some()).count();
        let (caught, excused, unattributed) = self.exclusion.broken_overlaps();
        println!(
            "  broken locker under {scenario}: {broken} broken sections; their overlaps: {caught} violations, {excused} forgiven as excused, {unattributed} forgiven as unattributed; register: {} lost updates, {} refusals of clean holders",
            self.register.lost_updates, self.register.refused_clean
        );
        assert!(broken > 0, "the broken locker never broke a rule");
        assert!(
            self.failed(),
            "a locker that skips or drops the lock passed under {scenario}: the scenario cannot fail"
        );
    }
}

/// Groups loss reasons into a few classes for the report.
pub fn reason_class(reason: &str) -> String {
    let classes = [
        ("heartbeat got no answer", "heartbeat timed out"),
        ("backend pid changed", "backend changed"),
        (
            "terminating connection due to administrator command",
            "terminated",
        ),
        ("idle-session timeout", "idle_session_timeout"),
        (
            "idle-in-transaction timeout",
            "idle_in_transaction_session_timeout",
        ),
        ("did not finish within", "release timed out"),
        ("connection failed", "connection failed"),
    ];
    for (needle, class) in classes {
        if reason.contains(needle) {
            return class.to_owned();
        }
    }
    let short: String = reason.chars().take(60).collect();
    short
}

fn fault_summary(h: &History) -> String {
    let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
    for f in &h.faults {
        *kinds.entry(f.kind.as_str()).or_default() += 1;
    }
    if kinds.is_empty() {
        "none".into()
    } else {
        format!("{kinds:?}")
    }
}
