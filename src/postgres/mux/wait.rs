//! `lock(key, timeout)` in multiplexed mode: try on the shared connection,
//! and while the key is busy wait for it to become free on a temporary pooled
//! connection, so a wait never stalls the other locks' statements.

use std::time::{Duration, Instant};

use super::{Mux, sql};
use crate::postgres::conn::held::HeldConn;
use crate::postgres::pooler::session_locking_error;
use crate::postgres::request::{self, unlimited};
use crate::postgres::session::guard::SessionLock;
use crate::postgres::sqlstate::lock_not_available;
use crate::{Error, LockKey, span};

impl Mux {
    /// Takes `key`, waiting up to `timeout`.
    ///
    /// Costs 1 round trip on the shared connection when the key is free. When
    /// it is busy, each round of waiting costs 1 round trip on a pooled
    /// connection (answered when the holder lets go; 3 where the session has a
    /// `statement_timeout` or `transaction_timeout`, lifted for the wait) plus
    /// 1 more try. No try or wait outlives `timeout` plus the heartbeat
    /// deadline (a stalled network): it is abandoned then and reported as
    /// [`Error::Timeout`], whose holder lookup takes at most two more
    /// deadlines. A shared connection that fails to open before then ends the
    /// call sooner, with [`Error::ConnectTimedOut`], [`Error::ConnectFailed`],
    /// [`Error::TooManyConnections`] or [`Error::MultiplexFailed`].
    ///
    /// Cancel safe: a try dropped mid-way leaves nothing held (see
    /// [`Mux::attempt`]), a dropped wait closes its connection.
    pub(crate) async fn lock(&self, key: LockKey, timeout: Duration) -> Result<SessionLock, Error> {
        let args = key.args()?;
        let started = Instant::now();
        let deadline = crate::deadline::after_std(started, timeout);
        if let Some(lock) = self.attempt_before(&key, started, deadline).await? {
            return Ok(lock);
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
        // With whether its session's limits must be lifted.
        let mut waiter: Option<(HeldConn, bool)> = None;
        loop {
            if let Some(lock) = self.attempt_before(&key, started, deadline).await? {
                // Its last wait finished, so it holds nothing: pool it.
                if let Some((conn, _)) = waiter {
                    conn.into_pool();
                }
                return Ok(lock);
            }
            let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
            if remaining.is_zero() {
                let conn = waiter.map(|(conn, _)| conn);
                return Err(self.timeout_error(&key, started, conn).await);
            }
            let (mut conn, limited) = match waiter.take() {
                Some(waiter) => waiter,
                None => match self.waiting_conn(&key, started, deadline).await {
                    Ok(Some(conn)) => conn,
                    Ok(None) => return Err(self.timeout_error(&key, started, None).await),
                    Err(err) => return Err(err),
                },
            };
            // Measured again: a busy pool may have taken most of it.
            let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
            if remaining.is_zero() {
                return Err(self.timeout_error(&key, started, Some(conn)).await);
            }
            let wait = sql::wait_until_free(args, remaining);
            let wait = unlimited::session_wait(conn.conn(), limited, async |conn| {
                wait.execute(conn).await
            });
            // A stalled network must not hang the caller past its deadline.
            let grace = crate::deadline::after(deadline, self.config.heartbeat_timeout);
            match span::waiting(&key, tokio::time::timeout_at(grace, wait)).await {
                Ok(Ok(_)) => waiter = Some((conn, limited)),
                // PostgreSQL can grant the awaited lock at the instant its
                // lock_timeout fires and still fail the statement, which then
                // never reaches its unlock: the connection may hold the
                // awaited lock, so it is closed, not pooled.
                Ok(Err(err)) if lock_not_available(&err) => {
                    drop(conn);
                    return Err(self.timeout_error(&key, started, None).await);
                }
                Ok(Err(err)) => return Err(session_locking_error(err, &key)),
                Err(_) => {
                    drop(conn);
                    return Err(self.timeout_error(&key, started, None).await);
                }
            }
        }
    }

    /// One try (see [`Mux::attempt`]), abandoned at `deadline` (or now, if
    /// that has passed) plus the heartbeat deadline: a stalled shared
    /// connection fails the try only after the heartbeat deadline, and each
    /// fresh one it moves to may spend twice the pool's acquire timeout
    /// failing to open over the same stalled link. Dropping the try is safe
    /// (its doc says why).
    async fn attempt_before(
        &self,
        key: &LockKey,
        started: Instant,
        deadline: tokio::time::Instant,
    ) -> Result<Option<SessionLock>, Error> {
        let now = tokio::time::Instant::now();
        let grace = crate::deadline::after(deadline.max(now), self.config.heartbeat_timeout);
        match tokio::time::timeout_at(grace, self.attempt(key)).await {
            Ok(tried) => tried,
            Err(_) => Err(self.timeout_error(key, started, None).await),
        }
    }

    /// A pooled connection to wait on ([`Error::NoConnection`] if the pool gave
    /// none before the deadline), or `None` if the deadline passed while it was
    /// being set up. It is told to check for a vanished client every 100 ms
    /// (`client_connection_check_interval`) *before* it waits: the server reads
    /// that setting when a statement starts, so setting it inside the waiting
    /// statement would not apply to that wait. Then a wait whose caller went
    /// away ends within 100 ms instead of at its `lock_timeout`. The setting is
    /// harmless for the connection's later users. 1 round trip, which also
    /// tells whether the session has a `statement_timeout` (or
    /// `transaction_timeout`) that a wait must lift.
    async fn waiting_conn(
        &self,
        key: &LockKey,
        started: Instant,
        deadline: tokio::time::Instant,
    ) -> Result<Option<(HeldConn, bool)>, Error> {
        let pooled =
            crate::postgres::conn::pooled::pooled_before(self.pool(), key, started, deadline);
        let mut conn = HeldConn::new(pooled.await?, true);
        let set =
            sqlx::query_scalar::<_, String>(request::sql::WAIT_SETTINGS).fetch_one(conn.conn());
        match tokio::time::timeout_at(deadline, set).await {
            Ok(Ok(limit)) => Ok(Some((conn, unlimited::limited(Some(&limit))))),
            // The connection's first prepared statement: where a session
            // shared through a pooler shows (42P05).
            Ok(Err(err)) => Err(session_locking_error(err, key)),
            Err(_) => Ok(None),
        }
    }

    async fn timeout_error(
        &self,
        key: &LockKey,
        started: Instant,
        conn: Option<HeldConn>,
    ) -> Error {
        let within = self.config.heartbeat_timeout;
        let key = (key, crate::postgres::holder::LockMode::Exclusive.into());
        crate::postgres::timeout::timeout_error(self.pool(), within, key, started, conn).await
    }
}
