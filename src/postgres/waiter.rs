//! Migration-runner mode: wait for a lock with a deadline and say who holds it.

use std::fmt;
use std::time::{Duration, Instant, SystemTime};

use tracing::Instrument;

use crate::postgres::Holder;
use crate::{Error, LockKey, PgLocker, SessionLock};

/// Default interval between two reports of who holds the lock.
const DEFAULT_REPORT_EVERY: Duration = Duration::from_secs(5);
/// The shortest interval between two reports: each costs a round trip.
pub const MIN_REPORT_EVERY: Duration = Duration::from_millis(10);

/// A report callback (boxed so `LockWaiter` stays one concrete type).
type OnReport<'a> = Box<dyn FnMut(&WaitReport) + Send + 'a>;

/// Waits for a session lock up to a deadline, reporting who holds it while it
/// waits: the shape of a migration runner that every pod starts at deploy
/// time.
///
/// The wait itself is [`PgLocker::lock`] (on the server, handed over the
/// moment the holder releases). Every [`report_every`](Self::report_every) it
/// looks up the holders with [`PgLocker::holders_of`] and logs them at
/// `INFO` (pid, application name, since when), and passes a [`WaitReport`] to
/// the [`on_report`](Self::on_report) callback if there is one. At the
/// deadline it fails with [`Error::Timeout`], whose message names the holder
/// and whose `chain` says whom that holder waits behind, up to the root.
///
/// The lookups need a second connection from the locker's pool while the
/// wait occupies one; a lookup that cannot get one within a second is skipped.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), distlock::Error> {
/// use std::time::Duration;
/// let locker = distlock::PgLocker::new(pool.clone());
/// let lock = distlock::postgres::LockWaiter::new(&locker, "app:migrations", Duration::from_secs(300))
///     .lock()
///     .await?; // Err(Timeout): "... (held by pid 4242, application \"deploy-7\")"
/// // apply migrations; the pods that waited find nothing to do
/// lock.release().await?;
/// # Ok(()) }
/// ```
#[must_use = "a LockWaiter does nothing until .lock() is called"]
pub struct LockWaiter<'a> {
    locker: &'a PgLocker,
    key: LockKey,
    timeout: Duration,
    report_every: Duration,
    on_report: Option<OnReport<'a>>,
}

impl fmt::Debug for LockWaiter<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockWaiter")
            .field("key", &self.key)
            .field("timeout", &self.timeout)
            .field("report_every", &self.report_every)
            .field("on_report", &self.on_report.is_some())
            .finish_non_exhaustive()
    }
}

/// Who held the lock at one point of a [`LockWaiter`]'s wait.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct WaitReport {
    /// The awaited key.
    pub key: LockKey,
    /// How long the waiter has waited so far.
    pub waited: Duration,
    /// Sessions holding the lock (usually one).
    pub holders: Vec<Holder>,
    /// How many sessions wait for it, this one included.
    pub waiting: usize,
}

impl fmt::Display for WaitReport {
    /// `held by pid 4242 (application "deploy-7", since 12s ago)`, or
    /// `not held` in the instant between two holders.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(holder) = self.holders.first() else {
            return f.write_str("not held");
        };
        write!(f, "held by pid {}", holder.pid)?;
        let mut details = Vec::new();
        if let Some(app) = &holder.application_name {
            details.push(format!("application {app:?}"));
        }
        if let Some(addr) = &holder.client_addr {
            details.push(format!("client {addr}"));
        }
        if let Some(age) = holder
            .since
            .and_then(|t| SystemTime::now().duration_since(t).ok())
        {
            details.push(format!("since {}s ago", age.as_secs()));
        }
        if !details.is_empty() {
            write!(f, " ({})", details.join(", "))?;
        }
        if self.waiting > 1 {
            write!(f, "; {} sessions waiting", self.waiting)?;
        }
        Ok(())
    }
}

impl<'a> LockWaiter<'a> {
    /// Waits up to `timeout` for `key` on `locker`.
    pub fn new(locker: &'a PgLocker, key: impl Into<LockKey>, timeout: Duration) -> Self {
        Self {
            locker,
            key: key.into(),
            timeout,
            report_every: DEFAULT_REPORT_EVERY,
            on_report: None,
        }
    }

    /// How often to report who holds the lock (default five seconds; the
    /// first report comes after one interval, so a short wait is silent).
    /// Range: at least [`MIN_REPORT_EVERY`] (10 ms); [`lock`](Self::lock)
    /// refuses a shorter one with [`Error::InvalidSetting`] before it asks
    /// the server anything.
    pub fn report_every(mut self, every: Duration) -> Self {
        self.report_every = every;
        self
    }

    /// Also hands every report to `f` (for a progress line, say).
    pub fn on_report(mut self, f: impl FnMut(&WaitReport) + Send + 'a) -> Self {
        self.on_report = Some(Box::new(f));
        self
    }

    /// Waits for the lock. Costs what [`PgLocker::lock`] costs, plus 1
    /// round trip per report.
    ///
    /// # Cancel safety
    ///
    /// As [`PgLocker::lock`]: dropping the future leaves no lock held.
    pub async fn lock(self) -> Result<SessionLock, Error> {
        crate::setting::at_least("report_every", self.report_every, MIN_REPORT_EVERY)?;
        let span = tracing::info_span!("distlock.waiter", key = %self.key);
        self.lock_inner().instrument(span).await
    }

    async fn lock_inner(self) -> Result<SessionLock, Error> {
        // Taken apart so that nothing borrowed across an `.await` has to be
        // `Sync` (the callback only needs to be `Send`).
        let Self {
            locker,
            key,
            timeout,
            report_every,
            mut on_report,
        } = self;
        let started = Instant::now();
        let attempt = locker.lock(key.clone(), timeout);
        tokio::pin!(attempt);
        let mut next = crate::deadline::from_now(report_every);
        let mut reported = false;
        loop {
            tokio::select! {
                biased;
                result = &mut attempt => {
                    return finish(&key, result, started, reported);
                }
                () = tokio::time::sleep_until(next) => {
                    // While this lookup runs the wait is not polled; that only
                    // delays noticing a grant, the server holds it for us.
                    if let Some(report) = report(locker, &key, started).await {
                        reported = true;
                        tracing::info!(
                            key = %report.key,
                            waited_s = report.waited.as_secs(),
                            holder_pid = report.holders.first().map(|h| h.pid),
                            holder_application = report.holders.first().and_then(|h| h.application_name.as_deref()),
                            "waiting for lock {}: {report}", report.key,
                        );
                        if let Some(callback) = on_report.as_mut() {
                            callback(&report);
                        }
                    }
                    next = crate::deadline::from_now(report_every);
                }
            }
        }
    }
}

/// Looks up who holds the lock; `None` if that fails (it is only a report).
async fn report(locker: &PgLocker, key: &LockKey, started: Instant) -> Option<WaitReport> {
    let lookup = locker.holders_of(key.clone());
    let all = match tokio::time::timeout(Duration::from_secs(1), lookup).await {
        Ok(Ok(all)) => all,
        Ok(Err(err)) => {
            tracing::debug!(error = %err, "could not look up the lock's holders");
            return None;
        }
        Err(_) => {
            tracing::debug!("looking up the lock's holders took too long");
            return None;
        }
    };
    let waiting = all.iter().filter(|h| !h.granted).count();
    Some(WaitReport {
        key: key.clone(),
        waited: started.elapsed(),
        holders: all.into_iter().filter(|h| h.granted).collect(),
        waiting,
    })
}

/// Logs how the wait ended.
fn finish(
    key: &LockKey,
    result: Result<SessionLock, Error>,
    started: Instant,
    reported: bool,
) -> Result<SessionLock, Error> {
    match &result {
        Ok(_) if reported => {
            tracing::info!(%key, waited_s = started.elapsed().as_secs_f64(), "got lock {key} after waiting");
        }
        Err(err @ Error::Timeout { .. }) => tracing::warn!(%key, "gave up: {err}"),
        Ok(_) | Err(_) => {}
    }
    result
}
