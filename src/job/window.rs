//! The per-window run record a [`SingletonJob`](super::SingletonJob) may
//! keep: what claiming a window found, and the record itself as a trait,
//! which the PostgreSQL backend implements (`distlock.job_runs`), so that
//! this folder depends on no backend.

use std::fmt::Debug;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use crate::Error;
use crate::LockKey;
use crate::key::Repr;

/// What claiming the current window found.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Claim {
    /// This run recorded the window and may run the job.
    Claimed(WindowStart),
    /// A row for the window exists: the job already started in it.
    AlreadyRan(WindowStart),
}

/// What the record says of the current window, read without the lock.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Current {
    /// A run started in it, here or elsewhere.
    Started,
    /// No run started in it yet; it ends in `left`, by the server's clock.
    Open { left: Duration },
}

/// A window's start in microseconds since the Unix epoch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WindowStart(pub(crate) i64);

impl WindowStart {
    pub(crate) fn to_system_time(self) -> SystemTime {
        let micros = Duration::from_micros(self.0.unsigned_abs());
        if self.0 >= 0 {
            SystemTime::UNIX_EPOCH + micros
        } else {
            SystemTime::UNIX_EPOCH - micros
        }
    }
}

/// How long a record's statement may go unanswered once sent: no answer by
/// then (a stalled network) is
/// [`Error::CommandTimedOut`](crate::Error::CommandTimedOut) naming the
/// job's key, instead of holding the job's lock until TCP gives up.
/// Generous for one durable write, as the leader election's withdrawal is.
pub(crate) const RECORD_WITHIN: Duration = Duration::from_secs(5);

/// Where runs are recorded per (job, window start). Each statement answers
/// within [`RECORD_WITHIN`] or fails, its connection closed.
#[async_trait]
pub(crate) trait RunRecord: Debug + Send + Sync {
    /// Records (job, the current window of `length_us` microseconds) unless
    /// a record exists; errors name `key`, the job's lock.
    async fn claim(&self, key: &LockKey, job: &str, length_us: i64) -> Result<Claim, Error>;

    /// What the record says of (job, the current window of `length_us`
    /// microseconds), read without the job's lock.
    async fn current(&self, key: &LockKey, job: &str, length_us: i64) -> Result<Current, Error>;

    /// Notes how the run in the window starting at `start` ended.
    async fn finish(
        &self,
        key: &LockKey,
        job: &str,
        start: WindowStart,
        outcome: &str,
    ) -> Result<(), Error>;
}

/// A configured run record, the job's name in it and the windows' length
/// in microseconds.
#[derive(Debug, Clone)]
pub(crate) struct RunWindow {
    pub(crate) record: std::sync::Arc<dyn RunRecord>,
    pub(crate) job: std::sync::Arc<str>,
    pub(crate) length_us: i64,
}

/// The longest job name a run record keeps, in bytes: the name is part of
/// the primary key of `distlock.job_runs`, and a B-tree entry must fit in
/// a third of a page (about 2.7 kB); as for fenced resources, the limit
/// leaves room below that whatever the text's compression.
pub(crate) const MAX_JOB_NAME: usize = 1024;

/// Marks a job name that is not a plain text key's own name.
const TAGGED: &str = "distlock-key:";

/// The job's name in a run record: one name per lock, never one for two.
///
/// A plain text key is recorded under its name, as it always was. Every
/// other kind of key is tagged with its kind, so that two different locks
/// never share a record: `LockKey::id(42)` and `"42"`, or one name in two
/// namespaces (`distlock-key:ns:1:report`, `distlock-key:ns:2:report`). A
/// text name that itself starts with the tag is tagged too
/// (`distlock-key:text:...`), which keeps the mapping one to one.
pub(crate) fn job_name(key: &LockKey) -> String {
    match &key.repr {
        Repr::Text(name) if !name.starts_with(TAGGED) => name.to_string(),
        Repr::Text(name) => format!("{TAGGED}text:{name}"),
        Repr::Id(id) => format!("{TAGGED}id:{id}"),
        Repr::Namespaced(ns, name) => format!("{TAGGED}ns:{ns}:{name}"),
        Repr::Hashed64(name, _) => format!("{TAGGED}hashed64:{name}"),
    }
}

/// The window length in microseconds, if it is one a record can keep: at
/// least 1 µs, at most `i64::MAX` µs (about 292,000 years).
pub(crate) fn length_us(window: Duration) -> Option<i64> {
    i64::try_from(window.as_micros()).ok().filter(|us| *us > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_lock_has_its_own_job_name() {
        let keys = [
            LockKey::from("report"),
            LockKey::from("42"),
            LockKey::id(42),
            LockKey::namespaced(1, "report"),
            LockKey::namespaced(2, "report"),
            LockKey::namespaced(1, "2:report"),
            LockKey::namespaced(12, "report"),
            LockKey::hashed64("report"),
            LockKey::from("distlock-key:id:42"),
            LockKey::from("distlock-key:text:distlock-key:id:42"),
        ];
        let names: Vec<String> = keys.iter().map(job_name).collect();
        for (i, a) in names.iter().enumerate() {
            for (j, b) in names.iter().enumerate().skip(i + 1) {
                assert_ne!(a, b, "{:?} and {:?}", keys[i], keys[j]);
            }
        }
        // Plain names keep the records they already have.
        assert_eq!(names[0], "report");
        assert_eq!(names[1], "42");
    }
}
