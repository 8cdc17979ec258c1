//! `lock(key, timeout)` in multiplexed mode: try on the shared connection,
//! and while the key is busy wait for it to become free on a temporary pooled
//! connection, so a wait never stalls the other locks' statements.

use std::time::{Duration, Instant};

use super::super::conn::HeldConn;
use super::super::holders;
use super::super::session::SessionLock;
use super::{Mux, sql};
use crate::error::{LOCK_NOT_AVAILABLE, locking_error, sqlstate};
use crate::{Error, LockKey};

impl Mux {
    /// Takes `key`, waiting up to `timeout`.
    ///
    /// Costs 1 round trip on the shared connection when the key is free. When
    /// it is busy, each round of waiting costs 1 round trip on a pooled
    /// connection (answered when the holder lets go) plus 1 more try.
    pub(crate) async fn lock(&self, key: LockKey, timeout: Duration) -> Result<SessionLock, Error> {
        let args = key.args()?;
        let started = Instant::now();
        let deadline = tokio::time::Instant::from_std(started + timeout);
        if let Some(lock) = self.try_lock(key.clone()).await? {
            return Ok(lock);
        }
        // Busy: queue behind this process's other waiters for the key, so
        // that only one of them waits on the server (see `gate`).
        let Ok(_pass) = tokio::time::timeout_at(deadline, self.gates.enter(&key)).await else {
            return Err(self.timeout_error(&key, started, None).await);
        };
        // Armed while it is used: a wait dropped mid-statement closes the
        // connection (the server abandons the wait) instead of pooling it.
        let mut waiter: Option<HeldConn> = None;
        loop {
            if let Some(lock) = self.try_lock(key.clone()).await? {
                // Its last wait finished, so it holds nothing: pool it.
                if let Some(conn) = waiter {
                    conn.into_pool();
                }
                return Ok(lock);
            }
            let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
            if remaining.is_zero() {
                return Err(self.timeout_error(&key, started, waiter).await);
            }
            let mut conn = match waiter.take() {
                Some(conn) => conn,
                None => match tokio::time::timeout_at(deadline, self.pool().acquire()).await {
                    Ok(pooled) => HeldConn::new(pooled?, true),
                    Err(_) => return Err(self.timeout_error(&key, started, None).await),
                },
            };
            let wait = sql::wait_until_free(args, remaining).execute(conn.conn());
            // A stalled network must not hang the caller past its deadline.
            let grace = deadline + self.config.heartbeat_timeout;
            match tokio::time::timeout_at(grace, wait).await {
                Ok(Ok(_)) => waiter = Some(conn),
                Ok(Err(err)) if sqlstate(&err).as_deref() == Some(LOCK_NOT_AVAILABLE) => {
                    return Err(self.timeout_error(&key, started, Some(conn)).await);
                }
                Ok(Err(err)) => {
                    tracing::Span::current().record("outcome", "error");
                    return Err(locking_error(err, &key));
                }
                Err(_) => {
                    drop(conn);
                    return Err(self.timeout_error(&key, started, None).await);
                }
            }
        }
    }

    /// Builds [`Error::Timeout`], naming the holder if it can be seen (on the
    /// waiting connection when it is still usable, else on the pool), and
    /// returns a usable waiting connection to the pool.
    async fn timeout_error(
        &self,
        key: &LockKey,
        started: Instant,
        conn: Option<HeldConn>,
    ) -> Error {
        tracing::Span::current().record("outcome", "timeout");
        let holder = match conn {
            Some(mut conn) => {
                let found = holders::first_holder(conn.conn(), key).await;
                if found.is_ok() {
                    conn.into_pool();
                }
                found.ok().flatten()
            }
            None => match self.pool().try_acquire() {
                Some(mut pooled) => holders::first_holder(&mut pooled, key).await.ok().flatten(),
                None => None,
            },
        };
        Error::Timeout {
            key: key.to_string(),
            waited: started.elapsed(),
            holder_pid: holder.as_ref().map(|h| h.pid),
            holder_application: holder.and_then(|h| h.application_name),
        }
    }
}
