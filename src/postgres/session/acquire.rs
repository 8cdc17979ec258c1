//! Taking session-scoped locks: `PgLocker::try_lock` and `PgLocker::lock`
//! in the default mode (one pooled connection per lock), and their SQL.

use std::time::{Duration, Instant};

use crate::postgres::conn::held::HeldConn;
use crate::postgres::conn::watched::WatchedConn;
use crate::postgres::locker::PgLocker;
use crate::postgres::pooler::session_locking_error;
use crate::postgres::request::fragments::PgQuery;
use crate::postgres::request::key::Bound;
use crate::postgres::request::lock_request::Request;
use crate::postgres::request::row::SessionRow;
use crate::postgres::request::{Lock, Step, unlimited};
use crate::postgres::session::guard::SessionLock;
use crate::postgres::session::hold::Hold;
use crate::postgres::sqlstate::lock_not_available;
use crate::postgres::timeout::answered;
use crate::{Error, FencingToken, LockKey, span};

impl PgLocker {
    /// Takes the session-scoped lock `key` if it is free, without waiting;
    /// `Ok(None)` if another session holds it.
    ///
    /// The lock lives on a connection taken from the pool for as long as the
    /// returned [`SessionLock`] lives. Costs 1 round trip (the backend pid
    /// used by the heartbeat comes back with the lock attempt), plus whatever
    /// the pool spends handing out a connection (nothing when the locker
    /// keeps a [warm connection](crate::PgLockerBuilder::keep_warm)). The statement also sets
    /// `client_connection_check_interval = 100ms` on the connection (a
    /// harmless setting that lets the server notice a vanished client during
    /// a statement), which later users of the pooled connection keep. The
    /// first session lock of each `PgLocker` costs 3 round trips more: a
    /// probe for a transaction-pooling proxy (see [`Error::PoolerDetected`]).
    /// If the server does not answer within the
    /// [heartbeat deadline](crate::PgLockerBuilder::heartbeat_timeout) (a
    /// stalled network), the try is abandoned, its connection closed, and it
    /// fails with [`Error::CommandTimedOut`]. In the multiplexed mode the
    /// shared connection's statements answer within that deadline or end
    /// the connection, and a try then moves to a fresh one, whose opening is
    /// bounded by the pool's acquire timeout instead
    /// ([`Error::ConnectTimedOut`], [`Error::ConnectFailed`],
    /// [`Error::TooManyConnections`], [`Error::MultiplexFailed`]: every try
    /// queued for a connection that fails to open gets its reason).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it returns leaves no lock held: until the
    /// lock is confirmed and handed to its guard, the connection is closed,
    /// not pooled, if the future is dropped, so the server ends the session
    /// and frees anything it took.
    pub async fn try_lock(&self, key: impl Into<LockKey>) -> Result<Option<SessionLock>, Error> {
        self.try_lock_as(key.into(), Hold::Exclusive).await
    }

    /// Takes the *shared* session-scoped lock `key` if no one holds it
    /// exclusively, without waiting; `Ok(None)` if someone does.
    ///
    /// Any number of shared holders (readers) hold `key` at once, while an
    /// exclusive holder ([`try_lock`](Self::try_lock), [`lock`](Self::lock))
    /// excludes them all: a reader-writer lock across processes
    /// (`pg_try_advisory_lock_shared`). A shared lock carries no fencing
    /// token (readers do not write). Costs what [`try_lock`](Self::try_lock)
    /// costs, and is bounded as it is on a stalled network. In multiplexed
    /// mode a shared lock takes a connection of its own from the pool, as in
    /// the default mode.
    ///
    /// # Cancel safety
    ///
    /// As for [`try_lock`](Self::try_lock).
    pub async fn try_lock_shared(
        &self,
        key: impl Into<LockKey>,
    ) -> Result<Option<SessionLock>, Error> {
        self.try_lock_as(key.into(), Hold::Shared).await
    }

    /// A try for `hold` on `key`, in its span, counted in the metrics.
    pub(crate) async fn try_lock_as(
        &self,
        key: LockKey,
        hold: Hold,
    ) -> Result<Option<SessionLock>, Error> {
        let mode = hold.mode(false);
        let tried = self.try_lock_inner(key.clone(), hold);
        span::traced(&key, "postgres", mode, Option::is_some, tried).await
    }

    async fn try_lock_inner(&self, key: LockKey, hold: Hold) -> Result<Option<SessionLock>, Error> {
        if let (Some(mux), Hold::Exclusive) = (&self.inner.mux, hold) {
            return mux.try_lock(key).await;
        }
        // A bad key fails here, before a connection is taken.
        key.args()?;
        let fencing = self.config().fencing && hold == Hold::Exclusive;
        let key_ref = &key;
        let statement = move |mut conn: HeldConn| async move {
            let row = self.try_statement(&mut conn, key_ref, fencing, hold).await;
            (conn, row)
        };
        let (conn, row) = self
            .inner
            .warm
            .acquire(|| self.pooled(&key), statement)
            .await?;
        let pid = row.pid;
        if !row.taken()? {
            conn.into_pool();
            return Ok(None);
        }
        let token = row.token;
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
    ) -> Result<SessionRow, Error> {
        // The probe (a locker's first lock only) and the try each get the
        // whole deadline: on a slow link the probe's statements alone take
        // several round trips.
        let within = self.config().heartbeat_timeout;
        let probe = self.inner.pooler.ensure_session(conn.conn());
        answered(key, within, probe).await?;
        let row =
            statement(Step::Try, key.args()?.into(), (fencing, hold), None).fetch_one(conn.conn());
        let row = async { row.await.map_err(|err| session_locking_error(err, key)) };
        SessionRow::decode(&answered(key, within, row).await?, key, fencing)
    }

    /// Takes the session-scoped lock `key`, waiting up to `timeout`; fails
    /// with [`Error::Timeout`] (naming the holder's pid and application when
    /// PostgreSQL shows them) when the deadline passes.
    ///
    /// It first tries; if the lock is busy, it waits on the server
    /// (`pg_advisory_lock` under a statement-local `lock_timeout`), so the lock
    /// passes to this waiter the moment its holder releases it; nothing polls.
    /// Costs 1 round trip when the lock is free, 2 when it has to wait (4 on a
    /// session with a `statement_timeout` or a `transaction_timeout`, which the
    /// wait lifts for itself, in a transaction of its own, so that they cannot
    /// end the wait before `timeout`), plus 1 to name the holder on timeout. A
    /// `timeout` longer than the server's `lock_timeout` can express (about
    /// 24.8 days), up to `Duration::MAX`, means "as long as the server allows".
    /// A wait that times out closes its connection instead of pooling it:
    /// PostgreSQL may grant the lock at the instant `lock_timeout` fires (or
    /// the fencing token's write may time out after the grant), and a session
    /// lock outlives the error of the statement that took it. The holder is
    /// then looked up on another pooled connection. A `timeout` of zero is a
    /// single try. If the server does not answer within `timeout` plus the
    /// heartbeat deadline (a stalled network), the attempt is abandoned and
    /// reported as a timeout; naming the holder then takes at most two more
    /// deadlines.
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
        self.lock_as(key.into(), timeout, Hold::Exclusive).await
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
        self.lock_as(key.into(), timeout, Hold::Shared).await
    }

    /// A wait for `hold` on `key` up to `timeout`, in its span, counted in
    /// the metrics.
    pub(crate) async fn lock_as(
        &self,
        key: LockKey,
        timeout: Duration,
        hold: Hold,
    ) -> Result<SessionLock, Error> {
        let mode = hold.mode(true);
        let waited = self.lock_inner(key.clone(), timeout, hold);
        span::traced(&key, "postgres", mode, |_| true, waited).await
    }

    async fn lock_inner(
        &self,
        key: LockKey,
        timeout: Duration,
        hold: Hold,
    ) -> Result<SessionLock, Error> {
        if let (Some(mux), Hold::Exclusive) = (&self.inner.mux, hold) {
            // Boxed: the multiplexed wait is the larger future, and inline it
            // would size every waiting call's future (`LockWaiter`'s too).
            return Box::pin(mux.lock(key, timeout)).await;
        }
        let args = key.args()?;
        let started = Instant::now();
        let deadline = crate::deadline::after_std(started, timeout);
        // A zero timeout is a single try: it still needs a connection, so the
        // pool's own acquire timeout applies then.
        let warm = &self.inner.warm;
        let pooled = || self.pooled_within(&key, started, timeout);
        let taken = warm.connection(pooled()).await?;
        let fencing = self.config().fencing && hold == Hold::Exclusive;
        let args = Bound::from(args);
        // A kept connection found broken: the whole attempt once more on a
        // pooled one, within the same deadline.
        let key_ref = &key;
        let attempt = warm.first_statement(taken, pooled, move |mut conn: HeldConn| async move {
            let how = (fencing, hold);
            let outcome = self
                .try_then_wait(&mut conn, key_ref, args, deadline, how)
                .await;
            (conn, outcome)
        });
        // The server gives up at the deadline (lock_timeout); no answer a
        // heartbeat deadline later means the network is stalled.
        let grace = crate::deadline::after(
            deadline.max(tokio::time::Instant::now()),
            self.config().heartbeat_timeout,
        );
        let outcome = span::waiting(&key, tokio::time::timeout_at(grace, attempt)).await;
        match outcome {
            Ok(Ok((conn, Some((pid, token))))) => Ok(SessionLock::start(
                conn,
                (key, hold),
                pid,
                token,
                (self.config(), &self.inner.keepers),
            )),
            // Busy and out of time after the try: nothing was granted.
            Ok(Ok((conn, None))) => Err(self
                .timeout_error_as(&key, hold.wanted(), started, Some(conn))
                .await),
            // The wait statement failed, and it may have been granted first:
            // the token write can time out after the grant, and PostgreSQL
            // can grant the lock at the instant lock_timeout fires and still
            // fail the statement. Session locks outlive the statement's
            // error, so the connection was closed, never pooled.
            Ok(Err(err)) if is_lock_timeout(&err) => Err(self
                .timeout_error_as(&key, hold.wanted(), started, None)
                .await),
            Ok(Err(err)) => Err(err),
            // The server did not answer in time: the connection was dropped
            // (closed) with the attempt.
            Err(_) => Err(self
                .timeout_error_as(&key, hold.wanted(), started, None)
                .await),
        }
    }

    /// A connection from the pool (one its keeper can watch) within the
    /// pool's own acquire timeout, or [`Error::PoolExhausted`] when every
    /// connection is in use.
    pub(crate) async fn pooled(&self, key: &LockKey) -> Result<WatchedConn, Error> {
        crate::postgres::conn::pooled::watched(self.pool(), key).await
    }

    /// A connection from the pool (one its keeper can watch) within the
    /// lock's `timeout` (a zero timeout: within the pool's own acquire
    /// timeout), or [`Error::NoConnection`].
    async fn pooled_within(
        &self,
        key: &LockKey,
        started: Instant,
        timeout: Duration,
    ) -> Result<WatchedConn, Error> {
        if timeout.is_zero() {
            return self.pooled(key).await;
        }
        let deadline = crate::deadline::after_std(started, timeout);
        crate::postgres::conn::pooled::watched_before(self.pool(), key, started, deadline).await
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
        args: Bound<'_>,
        deadline: tokio::time::Instant,
        (fencing, hold): (bool, Hold),
    ) -> Result<Option<(i32, Option<FencingToken>)>, Error> {
        self.inner.pooler.ensure_session(conn.conn()).await?;
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        let step = if remaining.is_zero() {
            Step::Try
        } else {
            Step::TryOrWait
        };
        let row = statement(step, args, (fencing, hold), Some(remaining))
            .fetch_one(conn.conn())
            .await
            .map_err(|err| session_locking_error(err, key))?;
        let first = SessionRow::decode(&row, key, fencing)?;
        if first.taken()? {
            return Ok(Some((first.pid, first.token)));
        }
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        if remaining.is_zero() {
            return Ok(None);
        }
        // The try set client_connection_check_interval, so the server
        // abandons this wait soon after the client goes away; a session
        // statement_timeout is lifted for it.
        let wait = statement(Step::Wait, args, (fencing, hold), Some(remaining));
        let row = unlimited::session_wait(conn.conn(), first.limited, async |conn| {
            wait.fetch_one(conn).await
        })
        .await
        .map_err(|err| session_locking_error(err, key))?;
        let granted = SessionRow::decode(&row, key, fencing)?;
        if !granted.taken()? {
            return Err(Error::NotGranted { key: key.clone() });
        }
        Ok(Some((granted.pid, granted.token)))
    }
}

/// Whether `err` is PostgreSQL's `lock_timeout` expiring.
fn is_lock_timeout(err: &Error) -> bool {
    match err {
        Error::Database(err) => lock_not_available(err),
        _ => false,
    }
}

/// The session lock statement of `step` for `args` (see
/// [`Request::session`]).
fn statement<'q>(
    step: Step,
    key: Bound<'q>,
    (fencing, hold): (bool, Hold),
    timeout: Option<Duration>,
) -> PgQuery<'q> {
    let lock = Lock::from(hold);
    let request = Request { key, lock, fencing };
    let timeout = timeout.unwrap_or_default();
    match hold {
        Hold::Upgradeable => request.upgradeable(step, timeout),
        Hold::Exclusive | Hold::Shared | Hold::All | Hold::Permit => request.session(step, timeout),
    }
}
