//! The task that keeps a lease alive: it extends the TTL every TTL/3,
//! reports loss, and performs the release (requested or on drop).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::{Instant, sleep_until, timeout_at};
use tracing::Instrument;

use super::claim::Claim;
use crate::loss_state::{self, LossSender, LossState, Validity};
use crate::{Error, LockKey, LossReason, metrics};

/// The server side of a lease: one Redis instance, or a Redlock quorum.
pub(crate) trait Backend: Clone + Send + Sync + 'static {
    /// A short name for logs: `"redis"` or `"redlock"`.
    const NAME: &'static str;

    /// One attempt to reset the claim's TTL where it still holds its token.
    fn extend(&self, claim: &Claim) -> impl Future<Output = Extension> + Send;

    /// Deletes the claim wherever it still holds its token.
    fn release(&self, claim: &Claim) -> impl Future<Output = Result<(), Error>> + Send;
}

/// What one extension attempt found.
#[derive(Debug)]
pub(crate) enum Extension {
    /// The TTL was reset from the moment the attempt started.
    Extended,
    /// Not extended this time, but it may still work before the lease runs
    /// out (some nodes did not answer).
    Retry(LossReason),
    /// The lease is gone for good.
    Lost(LossReason),
}

/// What `release()` sends: where to put the outcome.
type ReleaseRequest = oneshot::Sender<Result<(), Error>>;

/// The lease's end of its watchdog: loss, validity, and the release channel.
/// Dropping it (with the lease) asks the watchdog to release.
#[derive(Debug)]
pub(crate) struct Handle {
    claim: Arc<Claim>,
    acquired_at: std::time::Instant,
    loss: LossState,
    release: Option<oneshot::Sender<ReleaseRequest>>,
}

impl Handle {
    /// Starts the watchdog of a claim whose write started at `started`.
    pub(crate) fn spawn<B: Backend>(backend: B, claim: Arc<Claim>, started: Instant) -> Self {
        // A watchdog dropped without a reason (its runtime shut down) no
        // longer extends the key; past its validity the lease counts as
        // expired even before the watchdog says so.
        let (loss_tx, validity, loss_rx) = loss_state::channel_with_validity(
            LossReason::KeeperStopped,
            started + claim.window(),
            LossReason::Expired,
        );
        let (release_tx, release_rx) = oneshot::channel();
        let span = tracing::debug_span!("distlock.watchdog", key = %claim.key, backend = B::NAME);
        let acquired_at = std::time::Instant::now();
        let watchdog = Watchdog {
            backend,
            claim: Arc::clone(&claim),
            acquired_at,
            validity,
            loss: loss_tx,
            release: release_rx,
        };
        tokio::spawn(watchdog.run(started).instrument(span));
        Self {
            claim,
            acquired_at,
            loss: loss_rx,
            release: Some(release_tx),
        }
    }

    pub(crate) fn key(&self) -> &LockKey {
        &self.claim.key
    }

    pub(crate) fn ttl(&self) -> Duration {
        self.claim.ttl
    }

    pub(crate) fn held_for(&self) -> Duration {
        self.acquired_at.elapsed()
    }

    /// How long the lease is still known to be held (zero once lost).
    pub(crate) fn validity(&self) -> Duration {
        self.loss.validity().unwrap_or(Duration::ZERO)
    }

    pub(crate) async fn lost(&self) -> LossReason {
        self.loss.lost().await
    }

    /// Also `true` once the validity ran out by the clock, even if the
    /// watchdog has not had a chance to run yet (a starved runtime).
    pub(crate) fn is_lost(&self) -> bool {
        self.loss.is_lost()
    }

    /// What the watchdog reported, or, once the validity ran out by the
    /// clock, the reason the watchdog gives then: the failure of the
    /// extension it was retrying, [`LossReason::HeartbeatTimedOut`] for one
    /// still unanswered, or else [`LossReason::Expired`].
    pub(crate) fn loss(&self) -> Option<LossReason> {
        self.loss.loss()
    }

    /// Asks the watchdog to release and waits for the outcome.
    pub(crate) async fn release(mut self, backend: &'static str) -> Result<(), Error> {
        let span = tracing::debug_span!(
            "distlock.release",
            key = %self.claim.key,
            backend,
            hold_ms = self.acquired_at.elapsed().as_secs_f64() * 1e3,
            outcome = tracing::field::Empty,
        );
        // Lost by the clock before the watchdog noticed, or lost as the
        // watchdog found (its loss ends the validity): the key may be
        // someone else's by now. The handle's drop lets the watchdog delete
        // it where it still holds this lease's token.
        if let Some(reason) = self.loss.ran_out().and_then(|_| self.loss()) {
            span.record("outcome", "error");
            return Err(Error::LockLost {
                key: self.claim.key.clone(),
                reason,
            });
        }
        let (reply, outcome) = oneshot::channel();
        let sent = self.release.take().map(|tx| tx.send(reply).is_ok());
        let result = match (sent, outcome.instrument(span.clone()).await) {
            (Some(true), Ok(result)) => result,
            _ => Err(Error::LockLost {
                key: self.claim.key.clone(),
                reason: self.loss().unwrap_or(LossReason::KeeperStopped),
            }),
        };
        span.record("outcome", if result.is_ok() { "released" } else { "error" });
        result
    }
}

/// The watchdog task's state.
struct Watchdog<B> {
    backend: B,
    claim: Arc<Claim>,
    acquired_at: std::time::Instant,
    validity: Validity,
    loss: LossSender,
    release: oneshot::Receiver<ReleaseRequest>,
}

impl<B: Backend> Watchdog<B> {
    /// Runs until the lease is released (on request or because it was
    /// dropped). If the runtime shuts down instead, the key simply expires
    /// after its TTL.
    async fn run(mut self, started: Instant) {
        // `sleep_until` rather than `interval`: an interval's first tick fires
        // at once and would put an extension in front of a quick release.
        let mut next = started + self.claim.ttl / 3;
        loop {
            tokio::select! {
                biased;
                request = &mut self.release => return self.release(request.ok()).await,
                () = sleep_until(next) => match self.extend().await {
                    Ok(at) => next = at,
                    Err(reason) => return self.lost(reason).await,
                },
            }
        }
    }

    /// One extension; returns when to run the next, or why the lease is lost.
    /// It never waits past the lease's validity: a lease whose extension has
    /// not been confirmed by then is lost.
    async fn extend(&mut self) -> Result<Instant, LossReason> {
        let started = Instant::now();
        let valid_until = self.validity.until();
        let unanswered =
            LossReason::HeartbeatTimedOut(valid_until.saturating_duration_since(started));
        // Should the validity run out with this extension unanswered, the
        // guard gives what this task then reports, not a bare `Expired`.
        self.validity.failing(unanswered.clone());
        let outcome = timeout_at(valid_until, self.backend.extend(&self.claim)).await;
        match outcome {
            // `extend` refuses a reply read only after the validity ran out
            // (a starved runtime: the timeout looks at its future before
            // its timer): the guard may have reported the loss already, as
            // an extension unanswered in time.
            Ok(Extension::Extended) => {
                if self.validity.extend(started + self.claim.window()) {
                    Ok(started + self.claim.ttl / 3)
                } else {
                    Err(unanswered)
                }
            }
            Ok(Extension::Retry(reason)) => {
                let retry_at = Instant::now() + self.claim.ttl / 10;
                if retry_at < valid_until {
                    tracing::debug!(%reason, "distlock lease extension incomplete; retrying");
                    // Should the validity run out before a retry lands, the
                    // guard reports this, not a bare `Expired`.
                    self.validity.failing(reason);
                    Ok(retry_at)
                } else {
                    Err(reason)
                }
            }
            Ok(Extension::Lost(reason)) => Err(reason),
            Err(_) => Err(unanswered),
        }
    }

    /// Publishes the loss, deletes whatever is still ours (so others need not
    /// wait for the TTL), then waits for the lease to be released or dropped
    /// so `release()` can report the loss.
    async fn lost(self, found: LossReason) {
        // Past the validity, the reason the guard's clock gives; what this
        // task found is logged beside it.
        let reason = self.validity.lose(found.clone());
        tracing::warn!(key = %self.claim.key, %reason, %found, "distlock lease lost");
        metrics::lost(B::NAME, &self.claim.key);
        self.loss.send_replace(Some(reason.clone()));
        if let Err(err) = self.backend.release(&self.claim).await {
            tracing::debug!(error = %err, "cleanup after a lost lease found nothing to delete");
        }
        if let Ok(reply) = self.release.await {
            let _ = reply.send(Err(Error::LockLost {
                key: self.claim.key.clone(),
                reason,
            }));
        }
    }

    async fn release(self, reply: Option<ReleaseRequest>) {
        let outcome = self.backend.release(&self.claim).await;
        if outcome.is_ok() {
            metrics::released(B::NAME, &self.claim.key, self.acquired_at.elapsed());
            tracing::debug!(key = %self.claim.key, "distlock lease released");
        }
        // A caller that went away (a dropped lease, or a `release()` future
        // dropped after its first poll) learns nothing: log what it missed.
        let unheard = match reply {
            Some(reply) => reply.send(outcome).err(),
            None => Some(outcome),
        };
        if let Some(Err(err)) = unheard {
            tracing::warn!(
                key = %self.claim.key,
                error = %err,
                "background release of a lease whose caller went away failed; \
                 the key expires with its TTL"
            );
        }
    }
}

/// Deletes a claim in the background if the acquiring future is dropped
/// before the lease is handed out (or fails after a write may have landed):
/// no key outlives a cancelled acquisition by more than a round trip.
pub(crate) struct InFlight<B: Backend> {
    armed: Option<(B, Arc<Claim>)>,
}

impl<B: Backend> InFlight<B> {
    pub(crate) fn new(backend: &B, claim: &Arc<Claim>) -> Self {
        Self {
            armed: Some((backend.clone(), Arc::clone(claim))),
        }
    }

    /// The claim is settled: handed to a lease, or known not to be held.
    pub(crate) fn disarm(mut self) {
        self.armed = None;
    }
}

impl<B: Backend> Drop for InFlight<B> {
    fn drop(&mut self) {
        let Some((backend, claim)) = self.armed.take() else {
            return;
        };
        // Without a runtime there is nothing to run on: the key expires.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = backend.release(&claim).await;
            });
        }
    }
}
