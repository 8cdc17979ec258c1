//! Running work once across a fleet: the singleton-job runner for cron-style
//! ticks, over any backend.
//!
//! [`SingletonJob`] works on any [`Locker`] (PostgreSQL, Redis, memory), so
//! it takes an `Arc<dyn Locker>`; its optional per-window run record is a
//! trait ([`window`]) that the PostgreSQL backend implements, so nothing
//! here depends on a backend.

mod builder;
mod context;
mod outcome;
pub(crate) mod window;

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

pub use builder::SingletonJobBuilder;
pub use context::JobContext;
pub use outcome::JobOutcome;

use crate::{Error, Lease, LockKey, Locker, LossReason, PoolerEvidence};
use window::{Claim, Current, RunWindow, WindowStart};

/// Runs a job on at most one replica at a time: try the lock, run, release.
///
/// Every replica calls [`run`](Self::run) on its tick; the one that takes the
/// lock runs the job and the others get [`JobOutcome::Skipped`] (logged at
/// `DEBUG`: contention is the normal case on every idle replica, not an
/// error; the `distlock.job` span records the outcome too). While the job runs, the lease
/// is watched: if it is lost, the job's cancellation token fires at once, the
/// job is stopped (after an optional [grace period](SingletonJobBuilder::stop_grace)), and
/// the outcome is [`JobOutcome::Lost`]. The lease is released at the end
/// whatever happened: success, error, or panic (caught and reported as
/// [`JobOutcome::Panicked`]). A job that returned `Ok` is reported
/// [`JobOutcome::Lost`] too if the release shows the lock was already gone.
///
/// Two options close the gaps a lock alone leaves for periodic work:
///
/// - [`min_hold`](SingletonJobBuilder::min_hold): keep the lease until at least that long
///   after it was taken (ShedLock's `lockAtLeastFor`). Without it, a job
///   that takes 5 ms on one replica frees the lock before a slower replica's
///   identical tick arrives, and the job runs twice in one tick.
/// - [`once_per_window`](SingletonJobBuilder::once_per_window): record each run in
///   `distlock.job_runs` keyed by (job, window start), so a replica restarted
///   within the same window does not run the job again (PostgreSQL only;
///   needs [`migrate`](crate::migrate)).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), distlock::Error> {
/// use std::sync::Arc;
/// use std::time::Duration;
/// use distlock::{JobOutcome, PgLocker, SingletonJob};
///
/// let job = SingletonJob::builder(Arc::new(PgLocker::new(pool.clone())), "cron:invoice-reminders")
///     .min_hold(Duration::from_secs(30))
///     .build()?;
/// let mut tick = tokio::time::interval(Duration::from_secs(60));
/// loop {
///     tick.tick().await;
///     let outcome = job
///         .run(async |ctx| {
///             // ... send reminders (dropped at the next .await if the lease
///             // is lost; tasks spawned here watch ctx.cancellation_token()) ...
///             Ok::<_, distlock::Error>(3)
///         })
///         .await?;
///     if let JobOutcome::Ran(sent) = outcome {
///         println!("sent {sent} reminders");
///     }
/// }
/// # }
/// ```
#[derive(Debug, Clone)]
#[must_use = "a SingletonJob does nothing until .run() is called"]
pub struct SingletonJob {
    locker: Arc<dyn Locker>,
    key: LockKey,
    min_hold: Duration,
    stop_grace: Duration,
    window: Option<RunWindow>,
}

/// Whether the run goes on after the window check.
enum Window<T, E> {
    /// Run the job under this lease (in this window, if one is configured).
    Run(Box<dyn Lease>, Option<WindowStart>),
    /// The run is over before the job started.
    Done(JobOutcome<T, E>),
}

/// How a job that started came to an end (before the lease is released).
enum Finished<T, E> {
    Returned(Result<T, E>),
    Panicked(String),
    Lost(LossReason),
}

impl SingletonJob {
    /// A job guarded by the lock `key` taken from `locker`, with the
    /// defaults: no minimum hold, no run record, and a job whose lease is
    /// lost is stopped at once (no grace period). [`builder`](Self::builder)
    /// sets them.
    pub fn new(locker: Arc<dyn Locker>, key: impl Into<LockKey>) -> Self {
        Self {
            locker,
            key: key.into(),
            min_hold: Duration::ZERO,
            stop_grace: Duration::ZERO,
            window: None,
        }
    }

    /// A builder for a job guarded by the lock `key` taken from `locker`.
    pub fn builder(locker: Arc<dyn Locker>, key: impl Into<LockKey>) -> SingletonJobBuilder {
        SingletonJobBuilder::new(Self::new(locker, key))
    }

    /// The job's lock key.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// Tries the lock and, if it was free, runs `job` with a [`JobContext`]
    /// (the lease and a cancellation token), then releases the lock.
    ///
    /// Returns `Err` only when the lock backend or the run record fails
    /// before the job starts; everything that happens to the job itself is a
    /// [`JobOutcome`]. Costs the backend's try and release (for PostgreSQL 1
    /// round trip each), plus 2 with a run record. With a run record, a
    /// tick that finds the lock held reads the record (1 round trip) and
    /// skips if a run started in the current window; otherwise the holder
    /// is a run of another window (a replica whose clock is a little ahead
    /// claiming the window that ends, or a long run of an earlier one), and
    /// the tick tries the lock again after jittered pauses (10–20 ms at
    /// first, doubling to 0.5–1 s), reading the record after each busy try,
    /// until the window ends by the server's clock, holding no connection
    /// meanwhile: it runs the window if it takes the lock first, and is
    /// `Skipped` once a run started in the window or the window ended (then
    /// with a warning: nobody ran the window here). So `run` may take until
    /// the window ends behind a holder of another window.
    ///
    /// A record statement with no answer within 5 s of its send (a stalled
    /// network) is given up, its connection closed: the claim of the
    /// window, before the job, makes the call return
    /// [`Error::CommandTimedOut`] naming the job's key once the lock is
    /// released (which under the same stall takes up to the locker's
    /// release deadline; the window may have been recorded all the same,
    /// and is then not run: at most once); a read of the record by a tick
    /// that found the lock held returns it at once (nothing is held); the
    /// note of how the run ended, after the job, only logs a warning and
    /// the outcome is kept. A record read on a pool with no connection to
    /// spare returns [`Error::PoolExhausted`].
    ///
    /// # Cancel safety
    ///
    /// Dropping the future drops the job and the lease; a dropped lease is
    /// released in the background, and the cancellation token fires. A
    /// tick waiting out a holder of another window holds nothing between
    /// its tries.
    pub async fn run<F, T, E>(&self, job: F) -> Result<JobOutcome<T, E>, Error>
    where
        F: AsyncFnOnce(JobContext<'_>) -> Result<T, E>,
    {
        let span = tracing::info_span!(
            "distlock.job",
            job = %self.key,
            backend = self.locker.backend(),
            outcome = tracing::field::Empty,
        );
        let outcome = self.run_inner(job).instrument(span.clone()).await?;
        span.record("outcome", outcome.name());
        Ok(outcome)
    }

    async fn run_inner<F, T, E>(&self, job: F) -> Result<JobOutcome<T, E>, Error>
    where
        F: AsyncFnOnce(JobContext<'_>) -> Result<T, E>,
    {
        let Some(lease) = self.take_lock().await? else {
            // Routine on every idle replica at every tick: not worth INFO.
            tracing::debug!(job = %self.key, "job skipped: another holder has the lock");
            crate::metrics::job_finished(&self.key, "skipped", None);
            return Ok(JobOutcome::Skipped);
        };
        let acquired = Instant::now();

        let (lease, window_start) = match self.claim_window(lease).await? {
            Window::Run(lease, start) => (lease, start),
            Window::Done(outcome) => return Ok(outcome),
        };

        let finished = self.supervise(&*lease, window_start, job).await;
        let took = acquired.elapsed();

        let outcome = match finished {
            Finished::Returned(Ok(value)) => JobOutcome::Ran(value),
            Finished::Returned(Err(err)) => JobOutcome::Failed(err),
            Finished::Panicked(message) => {
                tracing::error!(job = %self.key, panic = %message, "job panicked; releasing its lock");
                JobOutcome::Panicked(message)
            }
            Finished::Lost(reason) => {
                tracing::warn!(job = %self.key, %reason, "job stopped: its lock was lost");
                JobOutcome::Lost(reason)
            }
        };
        let outcome = if matches!(outcome, JobOutcome::Lost(_)) {
            // Nothing to release: drop it (the backend has closed its session).
            drop(lease);
            outcome
        } else {
            match self.release(lease, acquired).await {
                Ok(()) => outcome,
                Err(err) => self.after_failed_release(outcome, &err),
            }
        };
        if let (Some(window), Some(start)) = (&self.window, window_start) {
            let finish = window
                .record
                .finish(&self.key, &window.job, start, outcome.name());
            if let Err(err) = finish.await {
                tracing::warn!(job = %self.key, error = %err, "could not record how the job run ended");
            }
        }
        crate::metrics::job_finished(&self.key, outcome.name(), Some(took));
        Ok(outcome)
    }

    /// Tries the lock; `None` when another holder keeps it.
    ///
    /// With a run record, a tick that finds the lock held makes sure the
    /// holder runs this window: a holder of an earlier one would leave it
    /// to nobody. Such a holder is a replica whose tick reached the server
    /// just before the window began (its clock a little ahead), which
    /// claimed the window that was ending and found it run, or a run of an
    /// earlier window still going. So the tick reads the record; while no
    /// run started in the current window, it tries the lock again after a
    /// pause (`window_wait`), until that window ends by the server's clock.
    /// Between tries it holds no connection. The record, not the lock,
    /// keeps a window to one run: taking the lock late costs no second run.
    async fn take_lock(&self) -> Result<Option<Box<dyn Lease>>, Error> {
        let first = self.locker.try_lock(self.key.clone()).await?;
        let (None, Some(window)) = (&first, &self.window) else {
            return Ok(first);
        };
        let read = || {
            window
                .record
                .current(&self.key, &window.job, window.length_us)
        };
        let Current::Open { left } = read().await? else {
            return Ok(None);
        };
        let window_ends = crate::deadline::from_now(left);
        tracing::debug!(job = %self.key, ?left, "lock held and no run started in this window: trying again until it ends");
        let mut pauses = crate::backoff::exponential(window_wait::FIRST, window_wait::MAX);
        loop {
            let left = window_ends.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                tracing::warn!(job = %self.key, "the window ended with the job's lock held and no run recorded in it: not run here");
                return Ok(None);
            }
            tokio::time::sleep(pauses.next().unwrap_or(window_wait::MAX).min(left)).await;
            if let Some(lease) = self.locker.try_lock(self.key.clone()).await? {
                return Ok(Some(lease));
            }
            if let Current::Started = read().await? {
                return Ok(None);
            }
        }
    }

    /// The outcome once releasing the lease failed with `err`: a job that
    /// ran is reported [`Lost`](JobOutcome::Lost) if the release shows the
    /// lock was already gone (its last steps may have run without the lock).
    /// A failed or panicked job keeps its outcome; the loss is logged.
    fn after_failed_release<T, E>(
        &self,
        outcome: JobOutcome<T, E>,
        err: &Error,
    ) -> JobOutcome<T, E> {
        match (outcome, loss_shown_by(err)) {
            (JobOutcome::Ran(_), Some(reason)) => {
                tracing::warn!(
                    job = %self.key, %reason, error = %err,
                    "the job finished, but its lock was found lost at release"
                );
                JobOutcome::Lost(reason)
            }
            (outcome, _) => {
                tracing::warn!(job = %self.key, error = %err, "releasing the job's lock failed");
                outcome
            }
        }
    }

    /// With a run record configured, claims the current window. Hands the
    /// lease back with the window start, or ends the run with the outcome.
    async fn claim_window<T, E>(&self, lease: Box<dyn Lease>) -> Result<Window<T, E>, Error> {
        let Some(window) = &self.window else {
            return Ok(Window::Run(lease, None));
        };
        let claim = window
            .record
            .claim(&self.key, &window.job, window.length_us);
        match claim.await {
            Ok(Claim::Claimed(start)) => Ok(Window::Run(lease, Some(start))),
            Ok(Claim::AlreadyRan(start)) => {
                tracing::debug!(job = %self.key, "job skipped: it already ran in this window");
                crate::metrics::job_finished(&self.key, "already_ran_in_window", None);
                release_now(lease).await;
                Ok(Window::Done(JobOutcome::AlreadyRanInWindow {
                    window_start: start.to_system_time(),
                }))
            }
            Err(err) => {
                release_now(lease).await;
                Err(err)
            }
        }
    }

    /// Runs the job against the lease's loss.
    async fn supervise<F, T, E>(
        &self,
        lease: &dyn Lease,
        window_start: Option<WindowStart>,
        job: F,
    ) -> Finished<T, E>
    where
        F: AsyncFnOnce(JobContext<'_>) -> Result<T, E>,
    {
        let token = CancellationToken::new();
        // Fires the token however this function ends (including being dropped).
        let _cancel_at_end = token.clone().drop_guard();
        let ctx = JobContext {
            lease,
            token: token.clone(),
            window_start: window_start.map(WindowStart::to_system_time),
        };
        // A panicking job must not unwind through the runner, which still
        // holds the lease and has to release it: neither from the closure's
        // call (a plain closure that returns a future runs code there) nor
        // from its future. AssertUnwindSafe: after a panic the job is never
        // run again (it is dropped), so no broken invariant can be observed.
        let started = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(ctx)));
        let future = match started {
            Ok(future) => future,
            Err(payload) => return Finished::Panicked(panic_message(payload.as_ref())),
        };
        let mut running = Box::pin(std::panic::AssertUnwindSafe(future).catch_unwind());
        tokio::select! {
            // Loss first: a job finishing in the same poll as the loss did its
            // last steps without a lock.
            biased;
            reason = lease.lost() => {
                token.cancel();
                if !self.stop_grace.is_zero() {
                    // Let a job that watches its token stop cleanly; its result
                    // no longer counts.
                    let _ = tokio::time::timeout(self.stop_grace, &mut running).await;
                }
                // Dropping an unfinished job runs its code too (the `Drop`
                // of what it holds), which may panic as its polls may.
                let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(running)));
                if let Err(payload) = dropped {
                    tracing::warn!(job = %self.key, panic = %panic_message(payload.as_ref()), "job panicked as it was dropped after its lease was lost");
                }
                Finished::Lost(reason)
            }
            result = &mut running => match result {
                Ok(returned) => Finished::Returned(returned),
                Err(payload) => Finished::Panicked(panic_message(payload.as_ref())),
            },
        }
    }

    /// Releases the lease now (returning how that went), or in the
    /// background once the minimum hold time has passed (then `Ok`: a
    /// failure there is only logged).
    async fn release(&self, lease: Box<dyn Lease>, acquired: Instant) -> Result<(), Error> {
        // What is left of the hold, not a point in time: `acquired + min_hold`
        // overflows (and panics) for a hold as long as `Duration::MAX`, while
        // `sleep` saturates to "as long as the runtime lives".
        let left = self.min_hold.saturating_sub(acquired.elapsed());
        if left.is_zero() {
            return lease.release().await;
        }
        let span = tracing::debug_span!("distlock.job.min_hold", job = %self.key);
        tokio::spawn(
            async move {
                let lost = {
                    tokio::select! {
                        () = tokio::time::sleep(left) => false,
                        _ = lease.lost() => true,
                    }
                };
                if lost {
                    drop(lease);
                } else {
                    release_now(lease).await;
                }
            }
            .instrument(span),
        );
        Ok(())
    }
}

/// The loss a failed release shows, if it shows one: the lock was lost
/// (a session lock's connection that failed ends the session and its
/// locks: its release says `LockLost`), the server no longer held it, or a
/// different backend answered. A release that timed out, could not reach
/// Redis, or failed with a database error shows none: a lease-table row
/// whose delete failed still holds until it expires.
fn loss_shown_by(err: &Error) -> Option<LossReason> {
    match err {
        Error::LockLost { reason, .. } => Some(reason.clone()),
        Error::PoolerDetected { evidence } => Some(match evidence {
            PoolerEvidence::BackendChanged { from, to } => LossReason::BackendChanged {
                expected_pid: *from,
                actual_pid: *to,
            },
            PoolerEvidence::SessionShared { message } => LossReason::SessionShared(message.clone()),
            _ => LossReason::SessionShared(err.to_string()),
        }),
        _ => None,
    }
}

/// The pauses of a tick waiting out a holder of another window: jittered
/// (each between half its bound and its bound), the bound doubling from
/// 20 ms to 1 s, so replicas that tick together do not try together, a
/// holder that is letting go is followed within milliseconds, and one that
/// runs long costs at most about three round trips a second (a try and a
/// read of the record per pause).
mod window_wait {
    use std::time::Duration;

    pub(super) const FIRST: Duration = Duration::from_millis(20);
    pub(super) const MAX: Duration = Duration::from_secs(1);
}

/// Releases a lease, logging (not returning) a failure: by now the job has
/// finished, and the backend frees a lease it cannot release cleanly.
async fn release_now(lease: Box<dyn Lease>) {
    let key = lease.key().clone();
    if let Err(err) = lease.release().await {
        tracing::warn!(job = %key, error = %err, "releasing the job's lock failed");
    }
}

/// The text of a panic payload (`panic!("..")` yields `&str` or `String`).
/// What a caught panic said, for the outcome and the log.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "a panic with a non-string payload".to_owned()
    }
}
