//! What became of one attempt to run a singleton job.

use std::time::SystemTime;

use crate::LossReason;

/// The result of [`SingletonJob::run`](crate::SingletonJob::run).
///
/// Contention is not an error: [`Skipped`](Self::Skipped) and
/// [`AlreadyRanInWindow`](Self::AlreadyRanInWindow) are the normal answers on
/// every replica but one. `run` returns `Err` only when the lock backend (or
/// the run record) could not be reached at all.
///
/// ```
/// # use distlock::JobOutcome;
/// fn describe(outcome: &JobOutcome<u64, std::io::Error>) -> String {
///     match outcome {
///         JobOutcome::Ran(sent) => format!("sent {sent} reminders"),
///         JobOutcome::Skipped => "another replica is on it".into(),
///         JobOutcome::Lost(reason) => format!("stopped: lock lost ({reason})"),
///         JobOutcome::Failed(err) => format!("failed: {err}"),
///         other => other.name().into(),
///     }
/// }
/// ```
#[derive(Debug)]
#[non_exhaustive]
#[must_use = "the outcome says whether the job ran"]
pub enum JobOutcome<T, E> {
    /// The job ran and returned `Ok`.
    Ran(T),
    /// Someone else held the lock; the job did not run here. With a run
    /// record, also: a run started in the current window, or the lock
    /// stayed held until the window ended (see
    /// [`SingletonJob::run`](crate::SingletonJob::run)).
    Skipped,
    /// The lock was free, but the run record shows the job already started in
    /// the current window (see
    /// [`SingletonJobBuilder::once_per_window`](crate::SingletonJobBuilder::once_per_window)).
    AlreadyRanInWindow {
        /// Start of the window, aligned to the Unix epoch.
        window_start: SystemTime,
    },
    /// The lease was lost while the job ran. The job's cancellation token was
    /// cancelled and the job was stopped; whatever it did may be incomplete,
    /// and another replica may be running it now.
    ///
    /// Also the outcome of a job that returned `Ok` when releasing the lease
    /// then showed that the lock was already gone (a loss the heartbeat had
    /// not noticed yet): the job's last steps may have run without the lock,
    /// so its value is not reported.
    Lost(LossReason),
    /// The job returned `Err`.
    Failed(E),
    /// The job panicked (the panic message). The panic was caught so the lock
    /// could be released.
    Panicked(String),
}

impl<T, E> JobOutcome<T, E> {
    /// A short lower-case name for logs and metrics: `ran`, `skipped`,
    /// `already_ran_in_window`, `lost`, `failed` or `panicked`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Ran(_) => "ran",
            Self::Skipped => "skipped",
            Self::AlreadyRanInWindow { .. } => "already_ran_in_window",
            Self::Lost(_) => "lost",
            Self::Failed(_) => "failed",
            Self::Panicked(_) => "panicked",
        }
    }

    /// `true` for [`Ran`](Self::Ran).
    pub fn is_ran(&self) -> bool {
        matches!(self, Self::Ran(_))
    }

    /// `true` when the job did not start here because of another replica:
    /// [`Skipped`](Self::Skipped) or [`AlreadyRanInWindow`](Self::AlreadyRanInWindow).
    pub fn is_skipped(&self) -> bool {
        matches!(self, Self::Skipped | Self::AlreadyRanInWindow { .. })
    }

    /// The job's value if it ran successfully.
    pub fn ran(self) -> Option<T> {
        match self {
            Self::Ran(value) => Some(value),
            _ => None,
        }
    }
}
