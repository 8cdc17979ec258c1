//! `lock(key, timeout)` in multiplexed mode: try on the shared connection,
//! and while the key is busy wait for it to become free on a temporary pooled
//! connection, so a wait never stalls the other locks' statements.

use std::time::{Duration, Instant};

use super::{Mux, sql};
use crate::postgres::conn::HeldConn;
use crate::postgres::session_lock::SessionLock;
use crate::postgres::sql::{client_check, keepalives};
use crate::postgres::sqlstate::{LOCK_NOT_AVAILABLE, locking_error, sqlstate};
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
        let deadline = crate::deadline::after_std(started, timeout);
        if let Some(lock) = self.attempt(&key).await? {
            return Ok(self.acquired(lock, started));
        }
        if timeout.is_zero() {
            return Err(self.timeout_error(&key, started, None).await);
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
            if let Some(lock) = self.attempt(&key).await? {
                // Its last wait finished, so it holds nothing: pool it.
                if let Some(conn) = waiter {
                    conn.into_pool();
                }
                return Ok(self.acquired(lock, started));
            }
            let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
            if remaining.is_zero() {
                return Err(self.timeout_error(&key, started, waiter).await);
            }
            let mut conn = match waiter.take() {
                Some(conn) => conn,
                None => match self.waiting_conn(deadline).await {
                    Ok(Some(conn)) => conn,
                    Ok(None) => return Err(self.timeout_error(&key, started, None).await),
                    Err(err) => return Err(err),
                },
            };
            let wait = sql::wait_until_free(args, remaining).execute(conn.conn());
            // A stalled network must not hang the caller past its deadline.
            let grace = crate::deadline::after(deadline, self.config.heartbeat_timeout);
            match tokio::time::timeout_at(grace, wait).await {
                Ok(Ok(_)) => waiter = Some(conn),
                // PostgreSQL can grant the awaited lock at the instant its
                // lock_timeout fires and still fail the statement, which then
                // never reaches its unlock: the connection may hold the
                // shared lock, so it is closed, not pooled.
                Ok(Err(err)) if sqlstate(&err).as_deref() == Some(LOCK_NOT_AVAILABLE) => {
                    drop(conn);
                    return Err(self.timeout_error(&key, started, None).await);
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

    /// A pooled connection to wait on, or `None` if the deadline passed
    /// first. It is told to check for a vanished client every 100 ms
    /// (`client_connection_check_interval`) *before* it waits: the server
    /// reads that setting when a statement starts, so setting it inside the
    /// waiting statement would not apply to that wait. Then a wait whose
    /// caller went away ends within 100 ms instead of at its `lock_timeout`.
    /// The setting is harmless for the connection's later users. 1 round trip.
    async fn waiting_conn(
        &self,
        deadline: tokio::time::Instant,
    ) -> Result<Option<HeldConn>, Error> {
        let Ok(pooled) = tokio::time::timeout_at(deadline, self.pool().acquire()).await else {
            return Ok(None);
        };
        let mut conn = HeldConn::new(pooled?, true);
        let set = sqlx::query(concat!(
            "SELECT ",
            client_check!(session),
            ", ",
            keepalives!(session)
        ))
        .execute(conn.conn());
        match tokio::time::timeout_at(deadline, set).await {
            Ok(Ok(_)) => Ok(Some(conn)),
            Ok(Err(err)) => Err(err.into()),
            Err(_) => Ok(None),
        }
    }

    fn acquired(&self, lock: SessionLock, started: Instant) -> SessionLock {
        let span = tracing::Span::current();
        span.record("outcome", "acquired");
        span.record("wait_ms", started.elapsed().as_secs_f64() * 1e3);
        crate::metrics::acquired("postgres", lock.key(), started.elapsed());
        lock
    }

    async fn timeout_error(
        &self,
        key: &LockKey,
        started: Instant,
        conn: Option<HeldConn>,
    ) -> Error {
        let within = self.config.heartbeat_timeout;
        crate::postgres::timeout::timeout_error(self.pool(), within, key, started, conn).await
    }
}
