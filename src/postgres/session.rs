//! Session-scoped locks: a guard that keeps a dedicated connection holding
//! `pg_advisory_lock` until it is released.

use std::fmt;
use std::time::{Duration, Instant};

use sqlx::Row;
use sqlx::postgres::PgRow;
use tokio::sync::{oneshot, watch};
use tracing::Instrument;

use super::conn::HeldConn;
use super::holders;
use super::keeper::{Keeper, ReleaseRequest, Slot, release_from_slot};
use super::locker::PgLocker;
use super::sql::{bind_key, keepalives, keyed, millis_setting, session_marker};
use crate::error::{LOCK_NOT_AVAILABLE, locking_error, sqlstate};
use crate::key::KeyArgs;
use crate::{Error, FencingToken, LockKey, LossReason};

/// A session-scoped advisory lock, held on a dedicated pooled connection until
/// [`release`](Self::release) or drop.
///
/// A background task keeps the connection: every heartbeat interval it checks
/// that the same backend still answers within the heartbeat deadline, and if
/// not, [`lost`](Self::lost) completes and the connection is closed. Treat a
/// lost lock as gone: another process may hold it already.
///
/// There is no `Deref` to the connection: run the protected work on your own
/// connections (the lock protects *work*, not a connection).
///
/// # Dropping
///
/// Dropping the guard without [`release`](Self::release) never blocks: the
/// background task unlocks and returns the connection to the pool, or closes
/// the connection if that fails or does not finish within the release
/// deadline. If the runtime has shut down, the connection is closed, so
/// PostgreSQL frees the lock when the session ends.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct SessionLock {
    key: LockKey,
    token: Option<FencingToken>,
    pid: i32,
    acquired_at: Instant,
    loss: watch::Receiver<Option<LossReason>>,
    holding: Holding,
}

/// Where the lock's connection is, and so how `release()` works.
enum Holding {
    /// Its own connection, shared with its keeper task: `release()` unlocks
    /// on the caller's task; a guard dropped without it asks the keeper to.
    Own {
        slot: Slot,
        released: bool,
        release_timeout: Duration,
    },
    /// A connection shared by many locks (multiplexed mode), driven by
    /// another task: `release()` and `Drop` are messages to it.
    Shared(Option<oneshot::Sender<ReleaseRequest>>),
}

impl fmt::Debug for SessionLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionLock")
            .field("key", &self.key)
            .field("fencing_token", &self.token)
            .field("backend_pid", &self.pid)
            .field("lost", &self.is_lost())
            .finish()
    }
}

impl Drop for SessionLock {
    fn drop(&mut self) {
        if let Holding::Own { slot, released, .. } = &self.holding {
            // Never blocks: the keeper task does the unlock. A `release()`
            // dropped before it took the connection leaves it in the slot,
            // so the keeper is asked in that case too.
            let still_held = !*released || slot.holds_connection();
            if still_held {
                slot.guard_dropped();
            }
        }
    }
}

impl SessionLock {
    fn start(
        conn: HeldConn,
        key: LockKey,
        pid: i32,
        token: Option<FencingToken>,
        locker: &PgLocker,
    ) -> Self {
        let (keeper, guard) = Keeper::new(conn, key.clone(), pid, locker.config());
        let span = tracing::debug_span!("distlock.keeper", key = %key, pid);
        tokio::spawn(keeper.run().instrument(span));
        Self {
            key,
            token,
            pid,
            acquired_at: Instant::now(),
            loss: guard.loss,
            holding: Holding::Own {
                slot: guard.slot,
                released: false,
                release_timeout: locker.config().release_timeout,
            },
        }
    }

    /// A guard for a lock kept by someone else (a multiplexed connection's
    /// driver): `release` is where `release()` and `Drop` are sent.
    pub(crate) fn from_parts(
        key: LockKey,
        token: Option<FencingToken>,
        pid: i32,
        loss: watch::Receiver<Option<LossReason>>,
        release: oneshot::Sender<ReleaseRequest>,
    ) -> Self {
        Self {
            key,
            token,
            pid,
            acquired_at: Instant::now(),
            loss,
            holding: Holding::Shared(Some(release)),
        }
    }

    /// The key this lock holds.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// The fencing token issued with this lock, when the locker was built with
    /// `.fencing(true)`; `None` otherwise.
    pub fn fencing_token(&self) -> Option<FencingToken> {
        self.token
    }

    /// The backend process id of the session holding the lock.
    pub fn backend_pid(&self) -> i32 {
        self.pid
    }

    /// Completes when the lock can no longer be trusted: the connection
    /// closed or was terminated, a heartbeat failed or got no answer in time,
    /// or a different backend answered. Returns why.
    ///
    /// Typical use is racing the work against it:
    ///
    /// ```no_run
    /// # async fn demo(lock: distlock::SessionLock) -> Result<(), distlock::Error> {
    /// # async fn work() {}
    /// tokio::select! {
    ///     () = work() => lock.release().await?,
    ///     reason = lock.lost() => eprintln!("stopped: lock lost ({reason})"),
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only watches a channel.
    pub async fn lost(&self) -> LossReason {
        let mut loss = self.loss.clone();
        match loss.wait_for(Option::is_some).await {
            Ok(reason) => reason.clone().unwrap_or(LossReason::KeeperStopped),
            Err(_) => LossReason::KeeperStopped,
        }
    }

    /// `true` once [`lost`](Self::lost) would complete.
    pub fn is_lost(&self) -> bool {
        self.loss.borrow().is_some() || self.loss.has_changed().is_err()
    }

    /// Why the lock was lost, if it was.
    pub fn loss(&self) -> Option<LossReason> {
        if let Some(reason) = self.loss.borrow().clone() {
            return Some(reason);
        }
        self.loss
            .has_changed()
            .is_err()
            .then_some(LossReason::KeeperStopped)
    }

    /// How long the lock has been held.
    pub fn held_for(&self) -> Duration {
        self.acquired_at.elapsed()
    }

    /// Releases the lock and returns its connection to the pool.
    ///
    /// Costs 1 round trip. Fails with [`Error::LockLost`] if the lock had been
    /// lost (it may be held by someone else now), and with
    /// [`Error::ReleaseTimedOut`] if the server did not answer within the
    /// release deadline; in both cases, and on any other error, the
    /// connection is closed, so PostgreSQL frees whatever the session held.
    ///
    /// # Cancel safety
    ///
    /// The unlock runs on the caller's task. Dropping this future after it
    /// took the connection closes the connection, so the server frees the
    /// lock; dropped earlier, it drops the guard, whose background task then
    /// releases the lock.
    pub async fn release(mut self) -> Result<(), Error> {
        let span = tracing::debug_span!(
            "distlock.release",
            key = %self.key,
            hold_ms = self.acquired_at.elapsed().as_secs_f64() * 1e3,
            outcome = tracing::field::Empty,
        );
        let result = match &mut self.holding {
            Holding::Own {
                slot,
                released,
                release_timeout,
            } => {
                // From here on the keeper is not woken: it finds the slot
                // empty at its next beat, or the connection still there if
                // this future is dropped before taking it (see `Drop`).
                *released = true;
                let result =
                    release_from_slot(slot, &self.loss, &self.key, self.pid, *release_timeout)
                        .await;
                if result.is_ok() {
                    crate::metrics::released("postgres", &self.key, self.acquired_at.elapsed());
                }
                result
            }
            Holding::Shared(request) => {
                let (reply, outcome) = oneshot::channel();
                let sent = request.take().map(|tx| tx.send(reply).is_ok());
                match (sent, outcome.await) {
                    (Some(true), Ok(result)) => result,
                    _ => Err(Error::LockLost {
                        key: self.key.to_string(),
                        reason: self.loss().unwrap_or(LossReason::KeeperStopped),
                    }),
                }
            }
        };
        span.record("outcome", if result.is_ok() { "released" } else { "error" });
        result
    }
}

impl PgLocker {
    /// Takes the session-scoped lock `key` if it is free, without waiting;
    /// `Ok(None)` if another session holds it.
    ///
    /// The lock lives on a connection taken from the pool for as long as the
    /// returned [`SessionLock`] lives. Costs 1 round trip (the backend pid
    /// used by the heartbeat comes back with the lock attempt), plus whatever
    /// the pool spends handing out a connection. The statement also sets
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
        let span = acquire_span(&key, "try");
        self.try_lock_inner(key).instrument(span).await
    }

    async fn try_lock_inner(&self, key: LockKey) -> Result<Option<SessionLock>, Error> {
        if let Some(mux) = &self.inner.mux {
            return mux.try_lock(key).await;
        }
        let args = key.args()?;
        let fencing = self.config().fencing;
        let started = Instant::now();
        let mut conn = HeldConn::new(self.pool().acquire().await?, true);
        self.inner.pooler.ensure_session(conn.conn()).await?;
        let row = try_lock_query(args, fencing)
            .fetch_one(conn.conn())
            .await
            .map_err(|err| session_locking_error(err, &key))?;
        let pid: i32 = row.try_get(1)?;
        let locked = taken(&row, 0, pid)?;
        record_wait(started);
        if !locked {
            tracing::Span::current().record("outcome", "busy");
            crate::metrics::busy("postgres", &key);
            conn.into_pool();
            return Ok(None);
        }
        let token = fencing_token(&row, 2, fencing)?;
        tracing::Span::current().record("outcome", "acquired");
        crate::metrics::acquired("postgres", &key, started.elapsed());
        Ok(Some(SessionLock::start(conn, key, pid, token, self)))
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
    /// a timeout.
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
        let span = acquire_span(&key, "wait");
        self.lock_inner(key, timeout).instrument(span).await
    }

    async fn lock_inner(&self, key: LockKey, timeout: Duration) -> Result<SessionLock, Error> {
        if let Some(mux) = &self.inner.mux {
            return mux.lock(key, timeout).await;
        }
        let args = key.args()?;
        let started = Instant::now();
        let deadline = crate::deadline::after_std(started, timeout);
        // A zero timeout is a single try: it still needs a connection, so the
        // pool's own acquire timeout applies then.
        let pooled = if timeout.is_zero() {
            Ok(self.pool().acquire().await)
        } else {
            tokio::time::timeout_at(deadline, self.pool().acquire()).await
        };
        let Ok(pooled) = pooled else {
            return Err(self.timeout_error(&key, started, None).await);
        };
        let mut conn = HeldConn::new(pooled?, true);
        let fencing = self.config().fencing;
        let attempt = self.try_then_wait(&mut conn, &key, args, deadline, fencing);
        // The server gives up at the deadline (lock_timeout); no answer a
        // heartbeat deadline later means the network is stalled.
        let grace = crate::deadline::after(
            deadline.max(tokio::time::Instant::now()),
            self.config().heartbeat_timeout,
        );
        let outcome = tokio::time::timeout_at(grace, attempt).await;
        record_wait(started);
        match outcome {
            Ok(Ok(Some((pid, token)))) => {
                tracing::Span::current().record("outcome", "acquired");
                crate::metrics::acquired("postgres", &key, started.elapsed());
                Ok(SessionLock::start(conn, key, pid, token, self))
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

    /// Tries first (1 round trip, the common uncontended case, and it tells
    /// the server to watch for this client going away); if busy and time is
    /// left, waits on the server until `deadline`. `Ok(None)`: busy, no time.
    async fn try_then_wait(
        &self,
        conn: &mut HeldConn,
        key: &LockKey,
        args: KeyArgs<'_>,
        deadline: tokio::time::Instant,
        fencing: bool,
    ) -> Result<Option<(i32, Option<FencingToken>)>, Error> {
        self.inner.pooler.ensure_session(conn.conn()).await?;
        let row = try_lock_query(args, fencing)
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
        match wait_for_lock(conn, args, remaining, fencing).await {
            Ok(locked) => Ok(Some(locked)),
            Err(Error::Database(err)) => Err(session_locking_error(err, key)),
            Err(err) => Err(err),
        }
    }

    /// Builds [`Error::Timeout`], naming the holder if it can be seen
    /// (looked up on `conn` when it is still usable, else on an idle pooled
    /// connection). The look-up has a deadline of its own, so a stalled
    /// network cannot hang the caller here either.
    pub(super) async fn timeout_error(
        &self,
        key: &LockKey,
        started: Instant,
        conn: Option<HeldConn>,
    ) -> Error {
        tracing::Span::current().record("outcome", "timeout");
        crate::metrics::timeout("postgres", key, started.elapsed());
        let conn = match conn {
            Some(conn) => Some(conn),
            None => lookup_conn(self.pool(), self.config().heartbeat_timeout).await,
        };
        let holder = match conn {
            Some(conn) => self.first_holder(conn, key).await,
            None => None,
        };
        Error::Timeout {
            key: key.to_string(),
            waited: started.elapsed(),
            holder_pid: holder.as_ref().map(|h| h.pid),
            holder_application: holder.and_then(|h| h.application_name),
        }
    }

    /// Looks up the first holder of `key` on `conn` within the heartbeat
    /// deadline; the connection goes back to the pool only if that worked.
    async fn first_holder(&self, mut conn: HeldConn, key: &LockKey) -> Option<holders::Holder> {
        let lookup = holders::first_holder(conn.conn(), key);
        match tokio::time::timeout(self.config().heartbeat_timeout, lookup).await {
            Ok(Ok(holder)) => {
                conn.into_pool();
                holder
            }
            _ => None,
        }
    }
}

/// A connection to look up a lock's holder on, from the pool within
/// `deadline` (the waiting connection itself may have had to be closed).
pub(super) async fn lookup_conn(pool: &sqlx::PgPool, deadline: Duration) -> Option<HeldConn> {
    match tokio::time::timeout(deadline, pool.acquire()).await {
        Ok(Ok(pooled)) => Some(HeldConn::new(pooled, true)),
        _ => None,
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
/// taken (`distlock.issue_token`, one counter per server lock).
///
/// The lock is attempted only on a session that holds no distlock lock yet
/// (see [`session_marker`]); on any other the first column is NULL and
/// nothing is taken. Columns: taken (NULL: refused), pid, token, marker.
fn try_lock_query(args: KeyArgs<'_>, fencing: bool) -> PgQuery<'_> {
    let sql = if fencing {
        keyed!(args;
            concat!("WITH l AS (SELECT ", session_marker!(unmarked), " THEN pg_try_advisory_lock("),
            concat!(") END AS ok, pg_backend_pid() AS pid, \
             set_config('client_connection_check_interval', '100ms', false), ", keepalives!(session),
             ") SELECT l.ok, l.pid, CASE WHEN l.ok THEN distlock.issue_token("),
            concat!(") END, ", session_marker!(mark), " FROM l");
            "$1", "$2")
    } else {
        keyed!(args;
            concat!("WITH l AS (SELECT ", session_marker!(unmarked), " THEN pg_try_advisory_lock("),
            concat!(") END AS ok, pg_backend_pid() AS pid, \
             set_config('client_connection_check_interval', '100ms', false), ", keepalives!(session),
             ") SELECT l.ok, l.pid, NULL::int8, ", session_marker!(mark), " FROM l");
            "$1", "$2")
    };
    bind_key(sqlx::query(sql), args)
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
    fencing: bool,
) -> Result<(i32, Option<FencingToken>), Error> {
    // Outside a transaction block, `set_config(.., true)` lasts for this one
    // statement: the session's own lock_timeout is untouched afterwards. The
    // try before this statement set client_connection_check_interval, so the
    // server abandons this wait soon after the client goes away. The session
    // marker is checked again: another client sharing the session could have
    // taken a lock since the try.
    // With fencing, the token is issued after the wait, while the lock is
    // held, and under the same statement-local lock_timeout.
    let sql = if fencing {
        keyed!(args;
            concat!("WITH l AS (SELECT pg_backend_pid() AS pid, set_config('lock_timeout', $1, true), ",
                session_marker!(unmarked), " THEN (SELECT true FROM pg_advisory_lock("),
            concat!(")) END AS ok) SELECT l.pid, CASE WHEN l.ok THEN distlock.issue_token("),
            concat!(") END, l.ok, ", session_marker!(mark), " FROM l");
            "$2", "$3")
    } else {
        keyed!(args;
            concat!("WITH l AS (SELECT pg_backend_pid() AS pid, set_config('lock_timeout', $1, true), ",
                session_marker!(unmarked), " THEN (SELECT true FROM pg_advisory_lock("),
            concat!(")) END AS ok) SELECT l.pid, NULL::int8, l.ok, ", session_marker!(mark), " FROM l");
            "$2", "$3")
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

type PgQuery<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;

fn acquire_span(key: &LockKey, mode: &'static str) -> tracing::Span {
    tracing::debug_span!(
        "distlock.acquire",
        key = %key,
        mode,
        outcome = tracing::field::Empty,
        wait_ms = tracing::field::Empty,
    )
}

fn record_wait(started: Instant) {
    tracing::Span::current().record("wait_ms", started.elapsed().as_secs_f64() * 1e3);
}
