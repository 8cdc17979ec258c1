//! The task that keeps a lease: renews it every third of its TTL and
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
//! clocks are never compared. Renewals start at `s + 1/3 TTL` and are
//! retried until the deadline.

use std::sync::Arc;
use std::time::Duration;

use sqlx::{AssertSqlSafe, Row};
use tokio::sync::watch;
use tokio::time::{Instant, sleep_until, timeout_at};

use super::inner::Inner;
use super::sql::{self, KeyExpr, Owner};
use crate::postgres::conn::HeldConn;
use crate::{Error, LockKey, LossReason};

/// What a lease's task needs.
pub(super) struct Renewal {
    pub(super) inner: Arc<Inner>,
    pub(super) key: LockKey,
    pub(super) expr: KeyExpr,
    pub(super) owner: Owner,
    pub(super) loss: watch::Sender<Option<LossReason>>,
}

impl Renewal {
    /// Runs until the lease is lost (or the task is aborted by `release()`
    /// or the guard's drop). `sent` is when the granting statement was sent.
    pub(super) async fn run(self, sent: Instant) {
        let ttl = self.inner.ttl;
        let retry = (ttl / 15).max(Duration::from_millis(10));
        let mut last_ok = sent;
        loop {
            let deadline = crate::deadline::after(last_ok, ttl * 2 / 3);
            sleep_until(crate::deadline::after(last_ok, ttl / 3)).await;
            let mut last_error = None;
            let renewed = loop {
                let attempt_sent = Instant::now();
                if attempt_sent >= deadline {
                    break Err(last_error);
                }
                match timeout_at(deadline, self.renew_once()).await {
                    Ok(Ok(true)) => break Ok(attempt_sent),
                    Ok(Ok(false)) => return self.lose(LossReason::Expired).await,
                    Ok(Err(err)) => {
                        tracing::debug!(key = %self.key, error = %err, "distlock lease renewal failed; retrying");
                        last_error = Some(err.to_string());
                        sleep_until((Instant::now() + retry).min(deadline)).await;
                    }
                    Err(_) => break Err(last_error),
                }
            };
            match renewed {
                Ok(at) => last_ok = at,
                Err(Some(err)) => return self.lose(LossReason::ConnectionFailed(err)).await,
                Err(None) => {
                    let waited = last_ok.elapsed();
                    return self.lose(LossReason::HeartbeatTimedOut(waited)).await;
                }
            }
        }
    }

    /// 1 round trip: `true` if the lease was ours, unexpired, and is
    /// extended by a TTL from now (server time).
    async fn renew_once(&self) -> Result<bool, Error> {
        // Armed: a renewal abandoned at the deadline closes its connection
        // rather than hand a stalled one back to the pool.
        let mut conn = HeldConn::new(self.inner.pool.acquire().await?, true);
        let sql = sql::renew(&self.expr, self.owner, self.inner.ttl);
        let row = sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_one(conn.conn())
            .await?;
        conn.into_pool();
        Ok(row.try_get(0)?)
    }

    /// Publishes the loss, then, unless someone else's lease replaced ours,
    /// deletes our row if it is still there, so the key is free before it
    /// expires.
    async fn lose(self, reason: LossReason) {
        tracing::warn!(key = %self.key, %reason, "distlock lease lost");
        crate::metrics::lost("table", &self.key);
        let expired = reason == LossReason::Expired;
        self.loss.send_replace(Some(reason));
        if !expired {
            let release = super::release::release_statement(&self.inner, &self.expr, self.owner);
            let _ = tokio::time::timeout(self.inner.release_timeout, release).await;
        }
    }
}
