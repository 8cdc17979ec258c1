//! `TableLease`: a held row of `distlock.leases`, and the backend-neutral
//! traits for the lease table.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::AbortHandle;
use tracing::Instrument;

use super::inner::Inner;
use super::release::{release_in_background, release_statement};
use super::renew::Renewal;
use super::sql::{KeyExpr, Owner};
use crate::loss_state::{self, LossState};
use crate::{Error, FencingToken, LockKey, LossReason};

/// A lease of a [`TableLocker`](super::TableLocker): a row of `distlock.leases` that a
/// background task renews every quarter of the TTL.
///
/// Treat it as gone once [`lost`](Self::lost) completes: it completes two
/// thirds of a TTL after the last renewal that succeeded was sent (a third
/// of a TTL before the server could grant the key to anyone else), or at
/// once when a renewal finds the row expired or someone else's.
///
/// # Dropping
///
/// Dropping it without [`release`](Self::release) never blocks: the renewal
/// stops and the row is deleted in the background (1 round trip); without a
/// runtime, or if that fails, the row expires after one TTL. A lease already
/// lost (reported, or past its deadline by the clock) is left to its
/// renewal task, which deletes the row when the lease would have expired.
#[must_use = "the lease is released as soon as it is dropped"]
pub struct TableLease {
    key: LockKey,
    token: FencingToken,
    acquired_at: Instant,
    inner: Arc<Inner>,
    expr: KeyExpr,
    owner: Owner,
    loss: LossState,
    renewer: AbortHandle,
    released: bool,
}

impl fmt::Debug for TableLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TableLease")
            .field("key", &self.key)
            .field("fencing_token", &self.token)
            .field("validity", &self.validity())
            .field("lost", &self.is_lost())
            .finish_non_exhaustive()
    }
}

impl TableLease {
    /// Starts the renewal of a granted lease; `sent` is when the granting
    /// statement was sent.
    pub(super) fn start(
        inner: Arc<Inner>,
        key: LockKey,
        expr: KeyExpr,
        owner: Owner,
        token: FencingToken,
        sent: tokio::time::Instant,
    ) -> Self {
        // The renewal task holds the sender: if it stops without a reason
        // (its runtime shut down), nothing renews the row any more. Past
        // the renewal deadline the guard reports the loss by the clock,
        // whether or not the task has run since.
        let (loss, validity, loss_rx) = loss_state::channel_with_validity(
            LossReason::KeeperStopped,
            inner.valid_until(sent),
            LossReason::HeartbeatTimedOut(inner.renewal_deadline()),
        );
        let renewal = Renewal {
            inner: Arc::clone(&inner),
            key: key.clone(),
            expr: expr.clone(),
            owner,
            loss,
            validity,
        };
        let span = tracing::debug_span!("distlock.renew", backend = "table", key = %key);
        let renewer = tokio::spawn(renewal.run(sent).instrument(span)).abort_handle();
        Self {
            key,
            token,
            acquired_at: Instant::now(),
            inner,
            expr,
            owner,
            loss: loss_rx,
            renewer,
            released: false,
        }
    }

    /// The loss the renewal task reported, or is about to report (the
    /// deadline passed by the clock; the task gives up at it too). Either
    /// way the task is left running: it deletes the row when the lease would
    /// have expired, not at once, so that nobody takes the key sooner after
    /// the holder could see the loss than the documented third of a TTL.
    fn left_to_renewal(&self) -> Option<LossReason> {
        if self.loss.reported().is_none() && self.loss.ran_out().is_none() {
            return None;
        }
        // The reason the guard reports (the first it saw).
        self.loss.loss()
    }

    /// The lease's owner, for the leader record of an election.
    pub(super) fn owner(&self) -> Owner {
        self.owner
    }

    /// The key held.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// The lease's fencing token: always `Some`, greater than every token
    /// issued for this key before (by this locker, or by a
    /// [`PgLocker`](crate::PgLocker) with fencing on the same key). Present
    /// it with every protected write ([`fence::check`](crate::fence::check)).
    pub fn fencing_token(&self) -> Option<FencingToken> {
        Some(self.token)
    }

    /// Completes when the lease can no longer be trusted, with the reason:
    /// [`LossReason::Expired`] when a renewal found the row expired or
    /// someone else's (within the deadline), [`LossReason::ConnectionFailed`]
    /// or [`LossReason::HeartbeatTimedOut`] when no renewal succeeded within
    /// two thirds of a TTL (the last renewal's error, or none: unanswered),
    /// [`LossReason::KeeperStopped`] when the renewal task stopped (the
    /// runtime shut down). It watches the clock too: two thirds of a TTL
    /// after the last renewal that succeeded was sent, it completes even if
    /// the renewal task has not run since, with the reason the task gives.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only watches a channel and the clock.
    pub async fn lost(&self) -> LossReason {
        self.loss.lost().await
    }

    /// `true` once [`lost`](Self::lost) would complete; exactly when
    /// [`loss`](Self::loss) is `Some`. No round trip.
    pub fn is_lost(&self) -> bool {
        self.loss.is_lost()
    }

    /// Why the lease was lost, if it was: `None` while it is held. Read off
    /// this process's clock as well as the renewal task's reports: two
    /// thirds of a TTL after the last renewal that succeeded was sent, it is
    /// [`LossReason::HeartbeatTimedOut`] even if the task has not run since
    /// (a starved runtime, a process stopped and continued), or
    /// [`LossReason::ConnectionFailed`] if the task's last renewal failed
    /// with an error (the task's own reason then), so a holder
    /// that looks before each protected write never writes on a lease past
    /// its deadline. The first reason seen is kept (the renewal task's, if
    /// it reported before anyone looked). No round trip.
    pub fn loss(&self) -> Option<LossReason> {
        self.loss.loss()
    }

    /// How long the lease is still known to be held: until two thirds of a
    /// TTL after the send of the last renewal that succeeded (or of the
    /// grant), by this process's clock; zero once lost. Work that must
    /// finish while the lease holds should fit into this. No round trip.
    pub fn validity(&self) -> Duration {
        self.loss.validity().unwrap_or(Duration::ZERO)
    }

    /// How long the lease has been held, from its grant as this process saw
    /// it. No round trip.
    pub fn held_for(&self) -> Duration {
        self.acquired_at.elapsed()
    }

    /// Ends the lease: stops its renewal and deletes its row, which wakes
    /// waiters listening for the key. Costs 1 round trip and 1 durable
    /// write, within the release deadline
    /// ([`TableLockerBuilder::release_timeout`](super::TableLockerBuilder::release_timeout)).
    ///
    /// [`Error::LockLost`] if the lease had been lost (no round trip then:
    /// the row, if still ours, is deleted when the lease would have
    /// expired, so that nobody takes the key sooner after `lost()` than the
    /// documented third of a TTL), [`Error::ReleaseTimedOut`] if the server
    /// did not answer in time (the row then expires after one TTL).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes leaves the row to expire
    /// (renewal has stopped), or deleted if the statement got through.
    pub async fn release(mut self) -> Result<(), Error> {
        self.released = true;
        let span = tracing::debug_span!(
            "distlock.release",
            backend = "table",
            key = %self.key,
            hold_ms = self.acquired_at.elapsed().as_secs_f64() * 1e3,
            outcome = tracing::field::Empty,
        );
        // Lost already: the renewal task deletes the row when the lease
        // would have expired (see `Renewal::lose`), not now, a moment after
        // the loss was seen.
        if let Some(reason) = self.left_to_renewal() {
            span.record("outcome", "lost");
            return Err(Error::LockLost {
                key: self.key.clone(),
                reason,
            });
        }
        self.renewer.abort();
        let statement = release_statement(&self.inner, &self.key, &self.expr, self.owner);
        let outcome = statement.instrument(span.clone()).await;
        // A reason the renewal reported, not the renewal's end: it was
        // just aborted above.
        let lost = self.loss.reported();
        let result = match (outcome, lost) {
            (_, Some(reason)) => Err(Error::LockLost {
                key: self.key.clone(),
                reason,
            }),
            (Ok(true), None) => {
                crate::metrics::released("table", &self.key, self.acquired_at.elapsed());
                Ok(())
            }
            (Ok(false), None) => Err(Error::LockLost {
                key: self.key.clone(),
                reason: LossReason::Expired,
            }),
            (Err(err), None) => Err(err),
        };
        let outcome = match &result {
            Ok(()) => "released",
            Err(Error::LockLost { .. }) => "lost",
            Err(_) => "error",
        };
        span.record("outcome", outcome);
        result
    }
}

impl Drop for TableLease {
    fn drop(&mut self) {
        // Released, or lost: the renewal task then deletes the row when the
        // lease would have expired (see `Renewal::lose`).
        if self.released || self.left_to_renewal().is_some() {
            return;
        }
        self.renewer.abort();
        release_in_background(
            Arc::clone(&self.inner),
            self.key.clone(),
            self.expr.clone(),
            self.owner,
        );
    }
}

crate::lease::lease_from_inherent!(TableLease, validity = validity);
