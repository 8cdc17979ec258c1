//! The per-window run record a [`SingletonJob`](super::SingletonJob) may
//! keep: what claiming a window found, and the record itself as a trait,
//! which the PostgreSQL backend implements (`distlock.job_runs`), so that
//! this folder depends on no backend.

use std::fmt::Debug;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use crate::Error;

/// What claiming the current window found.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Claim {
    /// This run recorded the window and may run the job.
    Claimed(WindowStart),
    /// A row for the window exists: the job already started in it.
    AlreadyRan(WindowStart),
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

/// Where runs are recorded per (job, window start).
#[async_trait]
pub(crate) trait RunRecord: Debug + Send + Sync {
    /// Records (job, the current window of `length_us` microseconds) unless
    /// a record exists.
    async fn claim(&self, job: &str, length_us: i64) -> Result<Claim, Error>;

    /// Notes how the run in the window starting at `start` ended.
    async fn finish(&self, job: &str, start: WindowStart, outcome: &str) -> Result<(), Error>;
}

/// A configured run record and the windows' length in microseconds.
#[derive(Debug, Clone)]
pub(crate) struct RunWindow {
    pub(crate) record: std::sync::Arc<dyn RunRecord>,
    pub(crate) length_us: i64,
}

/// The window length in microseconds, if it is one a record can keep: at
/// least 1 µs, at most `i64::MAX` µs (about 292,000 years).
pub(crate) fn length_us(window: Duration) -> Option<i64> {
    i64::try_from(window.as_micros()).ok().filter(|us| *us > 0)
}
