//! The task that keeps a lease: renews it every quarter of its TTL and
//! reports loss before the server can grant the key to anyone else.
//!
//! # The deadline
//!
//! A renewal sent at client time `s` reaches the server at or after `s`,
//! and the server sets the expiry one TTL after it *executes* the renewal, on
//! its own clock. So the lease lives on the server at least until one TTL
//! after `s`, as long as the two clocks advance at about the same rate. The
//! holder counts from `s` of its last successful renewal (the grant's send
//! time at first) and gives up at `s + 2/3 TTL`: a third of a TTL before the
//! earliest possible expiry, which absorbs a difference in clock *rates* of
//! up to a third and the scheduling delay of reporting the loss. Absolute
//! clocks are never compared.
//!
//! # Retries
//!
//! Renewals start at `s + 1/4 TTL` and are retried until the deadline, each
//! attempt with a timeout of its own: half of the time left (see
//! [`attempt_budget`]), so an attempt stuck on a connection that will never
//! answer (a proxy still waiting on a node that was switched over) is given
//! up while there is time for another on a new connection. Renewing at a
//! quarter, not a third, leaves `2/3 - 1/4 = 5/12` of a TTL between a
//! renewal falling due and the deadline: an outage of up to a third of a
//! TTL, whenever it starts, ends with at least a twelfth of a TTL to spare
//! (half a second for a 6 s TTL), and the halving guarantees an attempt in
//! that time.
//!
//! An attempt given up here ends on the server too (a moment later) when
//! what held it up was the lease's row, locked by another transaction: the
//! statement waits for the row under a `lock_timeout` of what is left of the
//! attempt's budget (see [`sql::renew`]). The server does not notice the
//! closed connection of an abandoned statement while it waits, so otherwise
//! each attempt would stay behind as a backend waiting on the row, and
//! extend the lease once the row was freed, though its holder was told it
//! is lost.

use std::sync::Arc;
use std::time::Duration;

use sqlx::Row;
use tokio::sync::watch;
use tokio::time::{Instant, sleep_until, timeout_at};

use super::inner::Inner;
use super::sql::{self, KeyExpr, Owner};
use crate::loss_state::Validity;
use crate::postgres::conn::held::HeldConn;
use crate::{Error, LockKey, LossReason};

/// What a lease's task needs.
pub(super) struct Renewal {
    pub(super) inner: Arc<Inner>,
    pub(super) key: LockKey,
    pub(super) expr: KeyExpr,
    pub(super) owner: Owner,
    pub(super) loss: watch::Sender<Option<LossReason>>,
    /// Until when the lease is known held; the guard reads it too.
    pub(super) validity: Validity,
}

/// The shortest time an attempt is given (unless less is left before the
/// deadline): below it not even a healthy server answers reliably.
const MIN_ATTEMPT: Duration = Duration::from_millis(10);

/// How long an attempt sent `left` before the deadline may take: half of
/// what is left (at least [`MIN_ATTEMPT`], at most `left`). Halving keeps a
/// slow but healthy server plenty of time at first, and guarantees that
/// after the network comes back an attempt starts while at least half of
/// the time that was left then remains: one stuck connection (to a node
/// that stopped answering) cannot take the whole budget.
fn attempt_budget(left: Duration) -> Duration {
    (left / 2).max(MIN_ATTEMPT).min(left)
}

impl Renewal {
    /// Runs until the lease is lost (or the task is aborted by `release()`
    /// or the guard's drop). `sent` is when the granting statement was sent.
    pub(super) async fn run(self, sent: Instant) {
        let ttl = self.inner.ttl;
        // After a quick failure (refused, reset): a short pause, so that a
        // server that is back is found soon without spinning.
        let pause = (ttl / 60).max(Duration::from_millis(5));
        let mut last_ok = sent;
        loop {
            let deadline = self.validity.until();
            let unanswered =
                LossReason::HeartbeatTimedOut(deadline.saturating_duration_since(last_ok));
            sleep_until(crate::deadline::after(last_ok, ttl / 4)).await;
            let mut last_error = None;
            let renewed = loop {
                let attempt_sent = Instant::now();
                if attempt_sent >= deadline {
                    break Err(last_error);
                }
                let give_up = attempt_sent + attempt_budget(deadline - attempt_sent);
                // Should the deadline pass with this attempt unanswered,
                // the guard gives what this task then reports.
                self.validity.failing(unanswered.clone());
                match timeout_at(give_up, self.renew_once(give_up)).await {
                    Ok(Ok(Some(true))) => break Ok(attempt_sent),
                    Ok(Ok(Some(false))) => return self.lose(LossReason::Expired, last_ok).await,
                    // The row stayed locked for the attempt's budget: no
                    // answer in time, as below, but the server said so.
                    Ok(Ok(None)) => {
                        tracing::debug!(key = %self.key, after = ?give_up - attempt_sent, "distlock lease renewal waited on a locked row; retrying");
                    }
                    Ok(Err(err)) => {
                        tracing::debug!(key = %self.key, error = %err, "distlock lease renewal failed; retrying");
                        let err = err.to_string();
                        // The guard's reason, should its clock see the
                        // deadline pass before this task reports.
                        self.validity
                            .failing(LossReason::ConnectionFailed(err.clone()));
                        last_error = Some(err);
                        sleep_until((Instant::now() + pause).min(deadline)).await;
                    }
                    // Its connection is closed (see `renew_once`); the next
                    // attempt gets another one.
                    Err(_) => {
                        tracing::debug!(key = %self.key, after = ?give_up - attempt_sent, "distlock lease renewal got no answer in time; retrying");
                    }
                }
            };
            match renewed {
                Ok(at) if self.validity.extend(self.inner.valid_until(at)) => last_ok = at,
                // Confirmed, but read only past the deadline (a starved
                // runtime): the guard may have reported the loss by the
                // clock already. The row lives a TTL from `at`.
                Ok(at) => return self.lose(unanswered, at).await,
                Err(Some(err)) => {
                    return self.lose(LossReason::ConnectionFailed(err), last_ok).await;
                }
                Err(None) => return self.lose(unanswered, last_ok).await,
            }
        }
    }

    /// 1 round trip: `Some(true)` if the lease was ours, unexpired, and is
    /// extended by a TTL from now (server time); `None` if its row stayed
    /// locked by another transaction until about `give_up` (the
    /// statement's `lock_timeout`, what is left once the pool handed out the
    /// connection; see [`sql::renew`]), so that a renewal given up here at
    /// `give_up` ends on the server a moment later, instead of extending the
    /// lease once the row is freed.
    async fn renew_once(&self, give_up: Instant) -> Result<Option<bool>, Error> {
        // Armed: a renewal abandoned at its timeout closes its connection
        // rather than hand a stalled one back to the pool.
        let mut conn = HeldConn::new(
            crate::postgres::conn::pooled::acquire(&self.inner.pool).await?,
            true,
        );
        let renew = |wait| sql::renew(&self.expr, self.owner, self.inner.ttl, wait);
        let row = super::row_wait::answered_by(&mut conn, give_up, renew).await?;
        Ok(row.map(|row| row.try_get(0)).transpose()?)
    }

    /// Publishes the loss, then, unless someone else's lease replaced ours,
    /// deletes our row if it is still there, which wakes the key's waiters
    /// (the row alone would leave them to their poll interval). Not before
    /// the lease would expire anyway (one TTL after `last_ok`, the send of
    /// the last renewal that succeeded): the loss is reported a third of a
    /// TTL earlier so that the holder's code stops before anyone else can
    /// take the key, and deleting the row at once would hand the key over
    /// within milliseconds of the report. A guard released or dropped
    /// after the report leaves this task to it.
    async fn lose(self, reason: LossReason, last_ok: Instant) {
        // The row is gone or another's (the renewal found nothing of ours)
        // only when this task says so itself.
        let expired = reason == LossReason::Expired;
        // Past the deadline, the reason the guard's clock gives; what this
        // task found is logged beside it.
        let found = reason.clone();
        let reason = self.validity.lose(reason);
        tracing::warn!(key = %self.key, %reason, %found, "distlock lease lost");
        crate::metrics::lost("table", &self.key);
        self.loss.send_replace(Some(reason));
        if !expired {
            sleep_until(crate::deadline::after(last_ok, self.inner.ttl)).await;
            let release =
                super::release::release_statement(&self.inner, &self.key, &self.expr, self.owner);
            let _ = release.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attempt_gets_half_of_what_is_left_within_bounds() {
        let ms = Duration::from_millis;
        assert_eq!(attempt_budget(ms(2500)), ms(1250));
        assert_eq!(attempt_budget(ms(15)), ms(10));
        assert_eq!(attempt_budget(ms(4)), ms(4));
        assert_eq!(attempt_budget(Duration::ZERO), Duration::ZERO);
    }
}
