//! [`SingletonJobBuilder`]: the settings of a [`SingletonJob`], checked
//! once, by `build()`.

use std::sync::Arc;
use std::time::Duration;

use super::SingletonJob;
use super::window::{MAX_JOB_NAME, RunRecord, RunWindow, job_name, length_us};
use crate::Error;

/// Settings of a [`SingletonJob`]; made by [`SingletonJob::builder`].
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), distlock::Error> {
/// use std::sync::Arc;
/// use std::time::Duration;
/// let job = distlock::SingletonJob::builder(Arc::new(distlock::PgLocker::new(pool.clone())), "cron:report")
///     .min_hold(Duration::from_secs(50))
///     .once_per_window(pool, Duration::from_secs(3600))
///     .build()?;
/// # let _ = job; Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until .build() is called"]
pub struct SingletonJobBuilder {
    job: SingletonJob,
    /// A run record and its window as given, checked by `build`.
    window: Option<(Arc<dyn RunRecord>, Duration)>,
}

impl SingletonJobBuilder {
    pub(super) fn new(job: SingletonJob) -> Self {
        Self { job, window: None }
    }

    /// Keeps the lease until at least `min_hold` after it was taken, even if
    /// the job finished sooner (like ShedLock's `lockAtLeastFor`; default
    /// zero).
    ///
    /// Set it somewhat below the tick interval and above the clock skew
    /// between replicas' ticks: then a fast run on one replica still covers
    /// the other replicas' identical ticks. When the job finishes early,
    /// [`run`](SingletonJob::run) returns at once and a background task
    /// releases the lease when the time is up (or drops it if the runtime
    /// shuts down, which frees it too). The outcome is then decided before
    /// that release, so a loss it finds is only logged. Range: any; a hold
    /// too long for the clock (such as `Duration::MAX`) keeps the lease
    /// until it is lost or the runtime shuts down.
    #[must_use = "the setter returns the changed builder"]
    pub fn min_hold(mut self, min_hold: Duration) -> Self {
        self.job.min_hold = min_hold;
        self
    }

    /// How long a job whose lease was lost may go on to wind down after its
    /// cancellation token fired before it is dropped (default zero: dropped
    /// at once). A grace period lets a job that watches the token stop at a
    /// clean point; during it the job runs without a lock. Range: any.
    #[must_use = "the setter returns the changed builder"]
    pub fn stop_grace(mut self, grace: Duration) -> Self {
        self.job.stop_grace = grace;
        self
    }

    /// Keeps a run record per window of `window` in `record` (the
    /// PostgreSQL one is [`once_per_window`](Self::once_per_window)).
    pub(crate) fn run_record(mut self, record: Arc<dyn RunRecord>, window: Duration) -> Self {
        self.window = Some((record, window));
        self
    }

    /// The job, or [`Error::InvalidSetting`] naming the first setting out of
    /// its range; nothing is changed to fit. With a run record, a key whose
    /// name in the record would be longer than 1024 bytes is an
    /// [`Error::InvalidKey`] (the record indexes it). Costs no round trip.
    pub fn build(mut self) -> Result<SingletonJob, Error> {
        if let Some((record, window)) = self.window {
            let length_us = length_us(window).ok_or_else(|| Error::InvalidSetting {
                setting: "once_per_window",
                value: format!("{window:?}"),
                allowed: "between 1µs and i64::MAX µs (about 292,000 years)".to_owned(),
            })?;
            let job = job_name(&self.job.key);
            if job.len() > MAX_JOB_NAME {
                return Err(Error::InvalidKey {
                    key: self.job.key.clone(),
                    reason: "a job run once per window is recorded under its key, \
                             which may be at most 1024 bytes long",
                });
            }
            self.job.window = Some(RunWindow {
                record,
                job: job.into(),
                length_us,
            });
        }
        Ok(self.job)
    }
}
