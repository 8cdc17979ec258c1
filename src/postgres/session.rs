//! Taking session-scoped locks: `PgLocker::try_lock` and `PgLocker::lock`
//! in the default mode (one pooled connection per lock), and their SQL.

use std::time::{Duration, Instant};

use sqlx::Row;
use sqlx::postgres::PgRow;
use tracing::Instrument;

use super::conn::HeldConn;
use super::keeper::Hold;
use super::locker::PgLocker;
use super::session_lock::SessionLock;
use super::sql::{
    PgQuery, bind_key, client_check, keepalives, keyed, millis_setting, session_marker,
};
use super::warm::retry_on_pool;
use crate::postgres::key_args::KeyArgs;
use crate::postgres::sqlstate::{LOCK_NOT_AVAILABLE, locking_error, sqlstate};
use crate::{Error, FencingToken, LockKey, span};

impl PgLocker {
    /// Takes the session-scoped lock `key` if it is free, without waiting;
    /// `Ok(None)` if another session holds it.
    ///
    /// The lock lives on a connection taken from the pool for as long as the
    /// returned [`SessionLock`] lives. Costs 1 round trip (the backend pid
    /// used by the heartbeat comes back with the lock attempt), plus whatever
    /// the pool spends handing out a connection (nothing when the locker
    /// keeps a [warm connection](super::PgLockerBuilder::keep_warm)). The statement also sets
    /// `client_connection_check_interval = 100ms` on the connection (a
    /// harmless setting that lets the server notice a vanished client during
    /// a statement), which later users of the pooled connection keep. The
    /// first session lock of each `PgLocker` costs 3 round trips more: a
    /// probe for a transaction-pooling proxy (see [`Error::PoolerDetected`]).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it returns leaves no lock held: until the
    /// lock is confirmed and handed to its guard, the connection is closed,
    /// not pooled, if the future is dropped, so the server ends the session
    /// and frees anything it took.
    pub async fn try_lock(&self, key: impl Into<LockKey>) -> Result<Option<SessionLock>, Error> {
        let key = key.into();
        let span = span::acquire(&key, "postgres", "try");
        self.try_lock_inner(key, Hold::Exclusive)
            .instrument(span)
            .await
    }

    /// Takes the *shared* session-scoped lock `key` if no one holds it
    /// exclusively, without waiting; `Ok(None)` if someone does.
    ///
    /// Any number of shared holders (readers) hold `key` at once, while an
    /// exclusive holder ([`try_lock`](Self::try_lock), [`lock`](Self::lock))
    /// excludes them all: a reader-writer lock across processes
    /// (`pg_try_advisory_lock_shared`). A shared lock carries no fencing
    /// token (readers do not write). Costs what [`try_lock`](Self::try_lock)
    /// costs. In multiplexed mode a shared lock takes a connection of its own
    /// from the pool, as in the default mode.
    ///
    /// # Cancel safety
    ///
    /// As for [`try_lock`](Self::try_lock).
    pub async fn try_lock_shared(
        &self,
        key: impl Into<LockKey>,
    ) -> Result<Option<SessionLock>, Error> {
        let key = key.into();
        let span = span::acquire(&key, "postgres", "try_shared");
        self.try_lock_inner(key, Hold::Shared)
            .instrument(span)
            .await
    }

    async fn try_lock_inner(&self, key: LockKey, hold: Hold) -> Result<Option<SessionLock>, Error> {
        if let (Some(mux), Hold::Exclusive) = (&self.inner.mux, hold) {
            return mux.try_lock(key).await;
        }
        // A bad key fails here, before a connection is taken.
        key.args()?;
        let fencing = self.config().fencing && hold == Hold::Exclusive;
        let started = Instant::now();
        let warm = &self.inner.warm;
        let (mut conn, kept) = match warm.checkout() {
            Some(conn) => (conn, true),
            None => (warm.adopt(self.pool().acquire().await?), false),
        };
        let mut row = self.try_statement(&mut conn, &key, fencing, hold).await;
        if retry_on_pool(kept, &row) {
            // Replacing the armed wrapper closes the broken connection.
            conn = warm.adopt(self.pool().acquire().await?);
            row = self.try_statement(&mut conn, &key, fencing, hold).await;
        }
        let row = row?;
        let pid: i32 = row.try_get(1)?;
        let locked = taken(&row, 0, pid)?;
        span::record_wait(started);
        if !locked {
            tracing::Span::current().record("outcome", "busy");
            crate::metrics::busy("postgres", &key);
            conn.into_pool();
            return Ok(None);
        }
        let token = fencing_token(&row, 2, fencing)?;
        tracing::Span::current().record("outcome", "acquired");
        crate::metrics::acquired("postgres", &key, started.elapsed());
        Ok(Some(SessionLock::start(
            conn,
            (key, hold),
            pid,
            token,
            (self.config(), &self.inner.keepers),
        )))
    }

    /// The try statement of [`try_lock`](Self::try_lock), after the pooler
    /// probe if this locker has not run it yet.
    async fn try_statement(
        &self,
        conn: &mut HeldConn,
        key: &LockKey,
        fencing: bool,
        hold: Hold,
    ) -> Result<PgRow, Error> {
        self.inner.pooler.ensure_session(conn.conn()).await?;
        try_lock_query(key.args()?, fencing, hold)
            .fetch_one(conn.conn())
            .await
            .map_err(|err| session_locking_error(err, key))
    }

    /// Takes the session-scoped lock `key`, waiting up to `timeout`; fails
    /// with [`Error::Timeout`] (naming the holder's pid and application when
    /// PostgreSQL shows them) when the deadline passes.
    ///
    /// It first tries; if the lock is busy, it waits on the server
    /// (`pg_advisory_lock` under a statement-local `lock_timeout`), so the
    /// lock passes to this waiter the moment its holder releases it; nothing
    /// polls. Costs 1 round trip when the lock is free, 2 when it has to wait,
    /// plus 1 to name the holder on timeout. A `timeout` longer than the
    /// server's `lock_timeout` can express (about 24.8 days), up to
    /// `Duration::MAX`, means "as long as the server allows". A wait that times out closes its
    /// connection instead of pooling it: PostgreSQL may grant the lock at the
    /// instant `lock_timeout` fires (or the fencing token's write may time out
    /// after the grant), and a session lock outlives the error of the
    /// statement that took it. The holder is then looked up on another pooled
    /// connection. A `timeout` of zero is a single
    /// try. If the server does not answer within `timeout` plus the heartbeat
    /// deadline (a stalled network), the attempt is abandoned and reported as
    /// a timeout; naming the holder then takes at most two more deadlines.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future while it waits closes its connection rather than
    /// returning it to the pool, and the server abandons the wait within
    /// 100 ms: the try before the wait set `client_connection_check_interval`
    /// on the connection for this. A lock granted in that window dies with
    /// the session. No lock is left held.
    pub async fn lock(
        &self,
        key: impl Into<LockKey>,
        timeout: Duration,
    ) -> Result<SessionLock, Error> {
        let key = key.into();
        let span = span::acquire(&key, "postgres", "wait");
        self.lock_inner(key, timeout, Hold::Exclusive)
            .instrument(span)
            .await
    }

    /// Takes the *shared* session-scoped lock `key`, waiting up to `timeout`
    /// while someone holds it exclusively; fails with [`Error::Timeout`] when
    /// the deadline passes.
    ///
    /// The wait happens on the server (`pg_advisory_lock_shared` under a
    /// statement-local `lock_timeout`). PostgreSQL queues lock requests
    /// first come, first served: a shared request that arrives while an
    /// exclusive request is waiting queues *behind* it, even if only readers
    /// hold the lock now, so a steady stream of readers cannot starve a
    /// writer. Costs and cancel safety as for [`lock`](Self::lock); no
    /// fencing token. In multiplexed mode a shared lock takes a connection of
    /// its own from the pool.
    ///
    /// # Cancel safety
    ///
    /// As for [`lock`](Self::lock).
    pub async fn lock_shared(
        &self,
        key: impl Into<LockKey>,
        timeout: Duration,
    ) -> Result<SessionLock, Error> {
        let key = key.into();
        let span = span::acquire(&key, "postgres", "wait_shared");
        self.lock_inner(key, timeout, Hold::Shared)
            .instrument(span)
            .await
    }

    async fn lock_inner(
        &self,
        key: LockKey,
        timeout: Duration,
        hold: Hold,
    ) -> Result<SessionLock, Error> {
        if let (Some(mux), Hold::Exclusive) = (&self.inner.mux, hold) {
            return mux.lock(key, timeout).await;
        }
        let args = key.args()?;
        let started = Instant::now();
        let deadline = crate::deadline::after_std(started, timeout);
        // A zero timeout is a single try: it still needs a connection, so the
        // pool's own acquire timeout applies then.
        let warm = &self.inner.warm;
        let (mut conn, kept) = match warm.checkout() {
            Some(conn) => (conn, true),
            None => match self.pooled_within(&key, started, timeout).await {
                Ok(pooled) => (warm.adopt(pooled), false),
                Err(err) => return Err(err),
            },
        };
        let fencing = self.config().fencing && hold == Hold::Exclusive;
        let attempt = self.try_then_wait_warm(
            (&mut conn, kept),
            (&key, args),
            (started, timeout, deadline),
            (fencing, hold),
        );
        // The server gives up at the deadline (lock_timeout); no answer a
        // heartbeat deadline later means the network is stalled.
        let grace = crate::deadline::after(
            deadline.max(tokio::time::Instant::now()),
            self.config().heartbeat_timeout,
        );
        let outcome = tokio::time::timeout_at(grace, attempt).await;
        span::record_wait(started);
        match outcome {
            Ok(Ok(Some((pid, token)))) => {
                tracing::Span::current().record("outcome", "acquired");
                crate::metrics::acquired("postgres", &key, started.elapsed());
                Ok(SessionLock::start(
                    conn,
                    (key, hold),
                    pid,
                    token,
                    (self.config(), &self.inner.keepers),
                ))
            }
            // Busy and out of time after the try: nothing was granted.
            Ok(Ok(None)) => Err(self.timeout_error(&key, started, Some(conn)).await),
            // The wait statement failed, and it may have been granted first:
            // the token write can time out after the grant, and PostgreSQL
            // can grant the lock at the instant lock_timeout fires and still
            // fail the statement. Session locks outlive the statement's
            // error, so the connection is closed, never pooled.
            Ok(Err(err)) if is_lock_timeout(&err) => {
                drop(conn);
                Err(self.timeout_error(&key, started, None).await)
            }
            Ok(Err(err)) => {
                tracing::Span::current().record("outcome", "error");
                Err(err)
            }
            // The server did not answer in time: drop (close) the connection.
            Err(_) => {
                drop(conn);
                Err(self.timeout_error(&key, started, None).await)
            }
        }
    }

    /// A connection from the pool within the lock's `timeout` (a zero
    /// timeout: within the pool's own acquire timeout), or the timeout error.
    async fn pooled_within(
        &self,
        key: &LockKey,
        started: Instant,
        timeout: Duration,
    ) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>, Error> {
        if timeout.is_zero() {
            return Ok(self.pool().acquire().await?);
        }
        let deadline = crate::deadline::after_std(started, timeout);
        match tokio::time::timeout_at(deadline, self.pool().acquire()).await {
            Ok(pooled) => Ok(pooled?),
            Err(_) => Err(self.timeout_error(key, started, None).await),
        }
    }

    /// [`try_then_wait`](Self::try_then_wait) on `conn`; once more on a
    /// connection from the pool if `conn` was a kept one found broken.
    async fn try_then_wait_warm(
        &self,
        (conn, kept): (&mut HeldConn, bool),
        (key, args): (&LockKey, KeyArgs<'_>),
        (started, timeout, deadline): (Instant, Duration, tokio::time::Instant),
        how: (bool, Hold),
    ) -> Result<Option<(i32, Option<FencingToken>)>, Error> {
        let outcome = self.try_then_wait(conn, key, args, deadline, how).await;
        if !retry_on_pool(kept, &outcome) {
            return outcome;
        }
        // Replacing the armed wrapper closes the broken connection.
        *conn = self
            .inner
            .warm
            .adopt(self.pooled_within(key, started, timeout).await?);
        self.try_then_wait(conn, key, args, deadline, how).await
    }

    /// Takes the lock within `deadline`, waiting on the server. `Ok(None)`:
    /// busy, no time left.
    ///
    /// A wait must run on a connection that already checks for a vanished
    /// client (`client_connection_check_interval` is read when a statement
    /// starts), so that a dropped caller's wait ends within 100 ms. The first
    /// statement therefore waits at once where the connection has the check
    /// (every pooled connection after its first lock statement: 1 round trip
    /// when the lock is contended), and elsewhere only tries, setting the
    /// check, and waits with a second statement if the lock was busy.
    async fn try_then_wait(
        &self,
        conn: &mut HeldConn,
        key: &LockKey,
        args: KeyArgs<'_>,
        deadline: tokio::time::Instant,
        (fencing, hold): (bool, Hold),
    ) -> Result<Option<(i32, Option<FencingToken>)>, Error> {
        self.inner.pooler.ensure_session(conn.conn()).await?;
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        let first = if remaining.is_zero() {
            try_lock_query(args, fencing, hold)
        } else {
            try_or_wait_query(args, (fencing, hold), remaining)
        };
        let row = first
            .fetch_one(conn.conn())
            .await
            .map_err(|err| session_locking_error(err, key))?;
        let pid: i32 = row.try_get(1)?;
        if taken(&row, 0, pid)? {
            return Ok(Some((pid, fencing_token(&row, 2, fencing)?)));
        }
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        if remaining.is_zero() {
            return Ok(None);
        }
        match wait_for_lock(conn, args, remaining, (fencing, hold)).await {
            Ok(locked) => Ok(Some(locked)),
            Err(Error::Database(err)) => Err(session_locking_error(err, key)),
            Err(err) => Err(err),
        }
    }
}

/// Maps an error of a session lock statement: a server session shared with
/// other clients (see `pooler::shared_session`) is reported as
/// [`Error::PoolerDetected`] (pids unknown, so 0), not as a driver error.
/// Whatever the statement may have taken dies with its connection, which
/// the caller closes.
fn session_locking_error(err: sqlx::Error, key: &LockKey) -> Error {
    if super::pooler::shared_session(&err) {
        return Error::PoolerDetected {
            expected_pid: 0,
            actual_pid: 0,
        };
    }
    locking_error(err, key)
}

/// Whether `err` is PostgreSQL's `lock_timeout` expiring.
fn is_lock_timeout(err: &Error) -> bool {
    match err {
        Error::Database(err) => sqlstate(err).as_deref() == Some(LOCK_NOT_AVAILABLE),
        _ => false,
    }
}

/// The try statement: lock attempt and backend pid in one round trip; with
/// fencing, the token is issued by the same statement, only if the lock was
/// taken (`distlock.next_token()`: a sequence draw, no durable write).
///
/// The lock is attempted only on a session that holds no distlock lock yet
/// (see [`session_marker`]); on any other the first column is NULL and
/// nothing is taken. Columns: taken (NULL: refused), pid, token, marker.
fn try_lock_query(args: KeyArgs<'_>, fencing: bool, hold: Hold) -> PgQuery<'_> {
    let sql = match (hold, fencing) {
        (Hold::Shared, _) => keyed!(args;
            concat!("WITH l AS (SELECT ", session_marker!(unmarked),
                " THEN pg_try_advisory_lock_shared("),
            concat!(") END AS ok, pg_backend_pid() AS pid, \
             ", client_check!(session), ", ", keepalives!(session),
             ") SELECT l.ok, l.pid, NULL::int8, ", session_marker!(mark), " FROM l");
            "$1", "$2"),
        (_, true) => keyed!(args;
            concat!("WITH l AS (SELECT ", session_marker!(unmarked), " THEN pg_try_advisory_lock("),
            concat!(") END AS ok, pg_backend_pid() AS pid, \
             ", client_check!(session), ", ", keepalives!(session),
             ") SELECT l.ok, l.pid, CASE WHEN l.ok THEN distlock.next_token() END, ",
             session_marker!(mark), " FROM l");
            "$1", "$2"),
        (_, false) => keyed!(args;
            concat!("WITH l AS (SELECT ", session_marker!(unmarked), " THEN pg_try_advisory_lock("),
            concat!(") END AS ok, pg_backend_pid() AS pid, \
             ", client_check!(session), ", ", keepalives!(session),
             ") SELECT l.ok, l.pid, NULL::int8, ", session_marker!(mark), " FROM l");
            "$1", "$2"),
    };
    bind_key(sqlx::query(sql), args)
}

/// The first statement of a wait: waits at once (under a statement-local
/// `lock_timeout` of `$1`) on a connection that already checks for a
/// vanished client, and only tries elsewhere (setting the check for the
/// wait that follows). Columns as [`try_lock_query`]'s; "taken" is `false`
/// only after a try.
fn try_or_wait_query(
    args: KeyArgs<'_>,
    (fencing, hold): (bool, Hold),
    timeout: Duration,
) -> PgQuery<'_> {
    let sql = match (hold, fencing) {
        (Hold::Shared, _) => keyed!(args;
            concat!("WITH l AS (SELECT pg_backend_pid() AS pid, set_config('lock_timeout', $1, true), \
               CASE WHEN NOT ", session_marker!(free), " THEN NULL \
               WHEN current_setting('client_connection_check_interval') = '100ms' \
               THEN (SELECT true FROM pg_advisory_lock_shared("),
            ")) ELSE pg_try_advisory_lock_shared(",
            concat!(") END AS ok, ", client_check!(session), ", ", keepalives!(session),
               ") SELECT l.ok, l.pid, NULL::int8, ", session_marker!(mark), " FROM l");
            "$2", "$3"),
        (_, true) => keyed!(args;
            concat!("WITH l AS (SELECT pg_backend_pid() AS pid, set_config('lock_timeout', $1, true), \
               CASE WHEN NOT ", session_marker!(free), " THEN NULL \
               WHEN current_setting('client_connection_check_interval') = '100ms' \
               THEN (SELECT true FROM pg_advisory_lock("),
            ")) ELSE pg_try_advisory_lock(",
            concat!(") END AS ok, ", client_check!(session), ", ", keepalives!(session),
               ") SELECT l.ok, l.pid, CASE WHEN l.ok THEN distlock.next_token() END, ",
             session_marker!(mark), " FROM l");
            "$2", "$3"),
        (_, false) => keyed!(args;
            concat!("WITH l AS (SELECT pg_backend_pid() AS pid, set_config('lock_timeout', $1, true), \
               CASE WHEN NOT ", session_marker!(free), " THEN NULL \
               WHEN current_setting('client_connection_check_interval') = '100ms' \
               THEN (SELECT true FROM pg_advisory_lock("),
            ")) ELSE pg_try_advisory_lock(",
            concat!(") END AS ok, ", client_check!(session), ", ", keepalives!(session),
               ") SELECT l.ok, l.pid, NULL::int8, ", session_marker!(mark), " FROM l");
            "$2", "$3"),
    };
    bind_key(sqlx::query(sql).bind(millis_setting(timeout)), args)
}

/// Reads a lock statement's "taken" column: NULL means the session already
/// holds a distlock lock, so it is shared with another client.
fn taken(row: &PgRow, column: usize, pid: i32) -> Result<bool, Error> {
    match row.try_get::<Option<bool>, _>(column)? {
        Some(locked) => Ok(locked),
        None => Err(Error::PoolerDetected {
            expected_pid: pid,
            actual_pid: pid,
        }),
    }
}

/// Waits on the server for the session lock; returns the backend pid and,
/// with fencing, the token issued in the same statement.
async fn wait_for_lock(
    conn: &mut HeldConn,
    args: KeyArgs<'_>,
    timeout: Duration,
    (fencing, hold): (bool, Hold),
) -> Result<(i32, Option<FencingToken>), Error> {
    // Outside a transaction block, `set_config(.., true)` lasts for this one
    // statement: the session's own lock_timeout is untouched afterwards. The
    // try before this statement set client_connection_check_interval, so the
    // server abandons this wait soon after the client goes away. The session
    // marker is checked again: another client sharing the session could have
    // taken a lock since the try.
    // With fencing, the token is issued after the wait, while the lock is
    // held, and under the same statement-local lock_timeout.
    let sql = match (hold, fencing) {
        (Hold::Shared, _) => keyed!(args;
            concat!("WITH l AS (SELECT pg_backend_pid() AS pid, set_config('lock_timeout', $1, true), ",
                session_marker!(unmarked), " THEN (SELECT true FROM pg_advisory_lock_shared("),
            concat!(")) END AS ok) SELECT l.pid, NULL::int8, l.ok, ", session_marker!(mark), " FROM l");
            "$2", "$3"),
        (_, true) => keyed!(args;
            concat!("WITH l AS (SELECT pg_backend_pid() AS pid, set_config('lock_timeout', $1, true), ",
                session_marker!(unmarked), " THEN (SELECT true FROM pg_advisory_lock("),
            concat!(")) END AS ok) SELECT l.pid, CASE WHEN l.ok THEN distlock.next_token() END, \
                l.ok, ", session_marker!(mark), " FROM l");
            "$2", "$3"),
        (_, false) => keyed!(args;
            concat!("WITH l AS (SELECT pg_backend_pid() AS pid, set_config('lock_timeout', $1, true), ",
                session_marker!(unmarked), " THEN (SELECT true FROM pg_advisory_lock("),
            concat!(")) END AS ok) SELECT l.pid, NULL::int8, l.ok, ", session_marker!(mark), " FROM l");
            "$2", "$3"),
    };
    let query = sqlx::query(sql).bind(millis_setting(timeout));
    let row = bind_key(query, args).fetch_one(conn.conn()).await?;
    let pid = row.try_get(0)?;
    if !taken(&row, 2, pid)? {
        return Err(Error::Database(sqlx::Error::Protocol(
            "pg_advisory_lock returned without the lock".into(),
        )));
    }
    let token = fencing_token(&row, 1, fencing)?;
    Ok((pid, token))
}

/// Reads the fencing token column; a lock taken with fencing on must have one.
fn fencing_token(row: &PgRow, column: usize, fencing: bool) -> Result<Option<FencingToken>, Error> {
    if !fencing {
        return Ok(None);
    }
    match row.try_get::<Option<i64>, _>(column)? {
        Some(token) => Ok(Some(FencingToken::new(token))),
        None => Err(Error::Database(sqlx::Error::Protocol(
            "the lock statement issued no fencing token".into(),
        ))),
    }
}
