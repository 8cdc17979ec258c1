//! Transaction-scoped locks: `pg_try_advisory_xact_lock` inside a transaction
//! that runs the caller's closure.

use std::time::{Duration, Instant};

use sqlx::Connection;
use sqlx::postgres::PgConnection;
use tracing::Instrument;

use crate::postgres::conn::held::HeldConn;
use crate::postgres::conn::warm::retry_on_pool;
use crate::postgres::conn::watched::WatchedConn;
use crate::postgres::locker::PgLocker;
use crate::postgres::request::fragments::xact_marker;
use crate::postgres::request::key::Bound;
use crate::postgres::request::lock_request::Request;
use crate::postgres::request::prepared_try;
use crate::postgres::request::row::xact_taken;
use crate::postgres::request::{Lock, NotTaken};
use crate::postgres::sqlstate::{
    IN_FAILED_TRANSACTION, UNDEFINED_OBJECT, lock_not_available, locking_error, sqlstate,
};
use crate::{Error, LockKey, span};

/// How a transaction-scoped lock is taken.
#[derive(Debug, Clone, Copy)]
enum Mode {
    Try,
    TryShared,
    Wait(Duration),
    WaitShared(Duration),
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Try => "try",
            Mode::TryShared => "try_shared",
            Mode::Wait(_) => "wait",
            Mode::WaitShared(_) => "wait_shared",
        }
    }

    fn timeout(self) -> Option<Duration> {
        match self {
            Mode::Wait(timeout) | Mode::WaitShared(timeout) => Some(timeout),
            Mode::Try | Mode::TryShared => None,
        }
    }

    fn lock(self) -> Lock {
        match self {
            Mode::TryShared | Mode::WaitShared(_) => Lock::Shared,
            Mode::Try | Mode::Wait(_) => Lock::Exclusive,
        }
    }
}

impl PgLocker {
    /// Runs `f` inside a transaction that holds the exclusive
    /// transaction-scoped advisory lock `key`, or returns `Ok(None)` at once if
    /// another session holds it.
    ///
    /// Begins a transaction, tries `pg_try_advisory_xact_lock`, and on success
    /// runs `f` on the transaction's connection: `Ok` commits, `Err` rolls back
    /// and returns the closure's error unchanged. PostgreSQL releases the lock
    /// at commit or rollback, also when this process dies; there is no TTL and
    /// no heartbeat. The lock interoperates with SQL written by hand:
    /// `LockKey::from("x")` is `pg_try_advisory_xact_lock(hashtext('x'))`.
    ///
    /// `Ok(Some(_))` means exactly one thing: the closure's work committed
    /// while the lock was held. Two ways a closure can return `Ok` without
    /// that are reported as errors instead:
    ///
    /// - it ignored an SQL error, so PostgreSQL aborted the transaction (and
    ///   would answer `COMMIT` with `ROLLBACK`): [`Error::TransactionAborted`],
    ///   nothing was committed;
    /// - it ended the transaction itself with a raw `COMMIT` or `ROLLBACK`,
    ///   which released the lock halfway: [`Error::TransactionEnded`].
    ///
    /// Nested `conn.begin()` calls in the closure are savepoints, as usual
    /// with sqlx.
    ///
    /// Costs 3 round trips plus the closure's own (`BEGIN`, the lock attempt,
    /// `COMMIT`/`ROLLBACK`); contention costs the same 3. With
    /// [`try_with_begin`](crate::PgLockerBuilder::try_with_begin), 2: the
    /// attempt goes with the `BEGIN` (at the price of an `ERROR` line in the
    /// server's log for each busy try). The check above
    /// rides in the `COMMIT` round trip. After a commit, one more statement
    /// (the `ROLLBACK` of the empty transaction sqlx's `Transaction` needs
    /// to end) is sent without waiting for its answer, which the
    /// connection's next user reads. On a connection borrowed from the
    /// pool, sqlx adds its 2 pings; a [warm connection](crate::PgLockerBuilder::keep_warm)
    /// (the default after the first call) skips them. If the server does not
    /// answer the `BEGIN` or the lock attempt within the
    /// [heartbeat deadline](crate::PgLockerBuilder::heartbeat_timeout) (a
    /// stalled network), the call gives up with [`Error::CommandTimedOut`]
    /// and closes its connection, before `f` ran; `f` itself has no
    /// deadline but its own.
    ///
    /// ```no_run
    /// # async fn demo(locker: distlock::PgLocker) -> Result<(), distlock::Error> {
    /// let sent = locker
    ///     .with_advisory_lock("invoice:42", async |conn| {
    ///         sqlx::query("UPDATE invoices SET reminded = true WHERE id = 42")
    ///             .execute(conn)
    ///             .await?;
    ///         Ok::<_, distlock::Error>(())
    ///     })
    ///     .await?;
    /// if sent.is_none() {
    ///     println!("another instance is on it");
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Dropping the future at any `.await` closes its connection instead of
    /// returning it to the pool. The lock statement sets
    /// `client_connection_check_interval = 100ms` (kept by the connection),
    /// so the server notices within 100 ms, aborts whatever statement is
    /// running (also one of the closure's), rolls back and frees the lock.
    pub async fn with_advisory_lock<K, F, T, E>(&self, key: K, f: F) -> Result<Option<T>, E>
    where
        K: Into<LockKey>,
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
        E: From<Error>,
    {
        self.run_in_xact(key.into(), Mode::Try, f).await
    }

    /// Like [`with_advisory_lock`](Self::with_advisory_lock) with the *shared*
    /// lock (`pg_try_advisory_xact_lock_shared`): any number of shared holders
    /// run at once, while an exclusive holder excludes them all.
    ///
    /// # Cancel safety
    ///
    /// As for [`with_advisory_lock`](Self::with_advisory_lock).
    pub async fn with_shared_advisory_lock<K, F, T, E>(&self, key: K, f: F) -> Result<Option<T>, E>
    where
        K: Into<LockKey>,
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
        E: From<Error>,
    {
        self.run_in_xact(key.into(), Mode::TryShared, f).await
    }

    /// Like [`with_advisory_lock`](Self::with_advisory_lock), but waits up to
    /// `timeout` for the lock and fails with [`Error::Timeout`] (naming the
    /// holder when PostgreSQL shows it) when the deadline passes.
    ///
    /// The wait happens on the server (`pg_advisory_xact_lock` under a
    /// transaction-local `lock_timeout`), so the lock passes to the waiter the
    /// moment its holder commits; nothing polls. The caller's own
    /// `lock_timeout` is restored before `f` runs. A `timeout` longer than
    /// `lock_timeout` can express (about 24.8 days), up to `Duration::MAX`,
    /// means "as long as the server allows". Costs 3 round trips when the
    /// lock is free (`BEGIN`, the try, `COMMIT`; never sent with the
    /// `BEGIN`, whatever [`try_with_begin`](crate::PgLockerBuilder::try_with_begin)
    /// says), 4 when it has to wait. If
    /// the server does not answer the `BEGIN` or the lock statement by the
    /// deadline plus the heartbeat deadline (a stalled network), it gives up
    /// with [`Error::Timeout`] and closes its connection.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future while it waits closes the connection instead of
    /// returning it to the pool, and the server abandons the wait within
    /// 100 ms (`client_connection_check_interval`, set by the try that
    /// precedes the wait); no lock is left held. Dropped later, the
    /// connection is closed as well, which rolls back.
    pub async fn with_advisory_lock_wait<K, F, T, E>(
        &self,
        key: K,
        timeout: Duration,
        f: F,
    ) -> Result<T, E>
    where
        K: Into<LockKey>,
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
        E: From<Error>,
    {
        self.run_waiting(key.into(), Mode::Wait(timeout), f).await
    }

    /// Like [`with_advisory_lock_wait`](Self::with_advisory_lock_wait) with
    /// the *shared* lock (`pg_advisory_xact_lock_shared`): waits up to
    /// `timeout` while someone holds `key` exclusively. PostgreSQL queues a
    /// shared request behind an exclusive one that is already waiting, so
    /// readers cannot starve a writer.
    ///
    /// # Cancel safety
    ///
    /// As for [`with_advisory_lock_wait`](Self::with_advisory_lock_wait).
    pub async fn with_shared_advisory_lock_wait<K, F, T, E>(
        &self,
        key: K,
        timeout: Duration,
        f: F,
    ) -> Result<T, E>
    where
        K: Into<LockKey>,
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
        E: From<Error>,
    {
        self.run_waiting(key.into(), Mode::WaitShared(timeout), f)
            .await
    }

    async fn run_waiting<F, T, E>(&self, key: LockKey, mode: Mode, f: F) -> Result<T, E>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
        E: From<Error>,
    {
        let timeout = mode.timeout().unwrap_or_default();
        match self.run_in_xact(key.clone(), mode, f).await? {
            Some(value) => Ok(value),
            // `run_in_xact` in wait mode reports a missed deadline as an
            // error, never as `None`; keep a typed answer anyway.
            None => Err(Error::Timeout {
                key: key.clone(),
                waited: timeout,
                holder_pid: None,
                holder_application: None,
                chain: Default::default(),
            }
            .into()),
        }
    }

    async fn run_in_xact<F, T, E>(&self, key: LockKey, mode: Mode, f: F) -> Result<Option<T>, E>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
        E: From<Error>,
    {
        let span = tracing::debug_span!(
            "distlock.xact",
            key = %key,
            mode = mode.name(),
            outcome = tracing::field::Empty,
            wait_ms = tracing::field::Empty,
            hold_ms = tracing::field::Empty,
        );
        self.run_in_xact_inner(key, mode, f).instrument(span).await
    }

    async fn run_in_xact_inner<F, T, E>(
        &self,
        key: LockKey,
        mode: Mode,
        f: F,
    ) -> Result<Option<T>, E>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
        E: From<Error>,
    {
        let args = key.args()?;
        // Before any connection: a nested call could only wait for itself.
        let database = crate::postgres::xact::nesting::database_of(self.pool());
        crate::postgres::xact::nesting::refuse_nested(&database, &key)?;
        let started = Instant::now();
        let deadline = mode
            .timeout()
            .map(|timeout| crate::deadline::after_std(started, timeout));
        let failed = |err: Error| span::failed(&key, "postgres", started, err);
        let warm = &self.inner.warm;
        let (mut held, kept) = match warm.checkout() {
            Some(held) => (held, true),
            None => (
                warm.adopt(
                    self.xact_pooled(&key, mode, started)
                        .await
                        .map_err(failed)?,
                ),
                false,
            ),
        };
        // Armed until the transaction has ended: if this future is dropped,
        // the connection is closed rather than pooled. The lock statement
        // sets client_connection_check_interval (if the connection has not
        // kept it from an earlier lock), so the server then aborts a
        // statement still running (a lock wait, or the closure's own)
        // within 100 ms and frees the lock, instead of finishing it first
        // as a pooled connection's clean-up would.
        // The server answers a try at once and gives a wait up at its
        // deadline (lock_timeout); no answer a heartbeat deadline later, to
        // the `BEGIN` or the lock statement, means the network is stalled:
        // give up too, and close the armed connection.
        let within = self.config().heartbeat_timeout;
        let now = tokio::time::Instant::now();
        let mut grace = crate::deadline::after(
            deadline.unwrap_or(now).max(now),
            self.config().heartbeat_timeout,
        );
        // With `try_with_begin`, a try goes out with the `BEGIN`, in its
        // round trip ([`prepared_try`]); a wait begins first and waits in a
        // statement of its own.
        let fused = (mode.timeout().is_none() && self.config().try_with_begin)
            .then(|| prepared_try::begin_and_try(mode.lock(), args.into()));
        let Ok(began) = tokio::time::timeout_at(grace, begin(held.conn(), fused.as_deref())).await
        else {
            return Err(failed(self.stalled(&key, mode, started, held).await).into());
        };
        let began = began.map_err(Error::from);
        let began = if retry_on_pool(kept, &began) {
            drop(began);
            // Replacing the armed wrapper closes the broken connection.
            held = warm.adopt(
                self.xact_pooled(&key, mode, started)
                    .await
                    .map_err(failed)?,
            );
            // A try's budget starts again on the new connection (the pool
            // may have taken a while to hand it out).
            if deadline.is_none() {
                grace = crate::deadline::from_now(self.config().heartbeat_timeout);
            }
            let begin = begin(held.conn(), fused.as_deref());
            let Ok(began) = tokio::time::timeout_at(grace, begin).await else {
                return Err(failed(self.stalled(&key, mode, started, held).await).into());
            };
            began.map_err(Error::from)
        } else {
            began
        };
        // A try that failed in the `BEGIN`'s round trip says why.
        let refused = fused.is_some() && began.is_err();
        let began = if refused {
            // Consumed whole: no part of `began`, which borrows the
            // connection, is left to drop after `held` is used.
            let err = match began_error(began) {
                Error::Database(err) => err,
                err => return Err(failed(err).into()),
            };
            if let Some(not_taken) = prepared_try::answer(err) {
                // The try's transaction failed: end it.
                let rollback = rollback_conn_within(held.conn(), within).await;
                return self
                    .not_taken(not_taken, rollback, &key, mode, started, held)
                    .await
                    .map_err(E::from);
            }
            // This session lacks the prepared try: prepare it, and take the
            // lock as a wait does, in a statement of its own.
            let prepare = prepared_try::rollback_and_prepare(mode.lock());
            let prepare = sqlx::raw_sql(sqlx::AssertSqlSafe(prepare)).execute(held.conn());
            let Ok(prepared) = tokio::time::timeout_at(grace, prepare).await else {
                return Err(failed(self.stalled(&key, mode, started, held).await).into());
            };
            prepared.map_err(|err| failed(err.into()))?;
            let Ok(began) = tokio::time::timeout_at(grace, held.conn().begin()).await else {
                return Err(failed(self.stalled(&key, mode, started, held).await).into());
            };
            began.map_err(Error::from)
        } else {
            began
        };
        let mut tx = began.map_err(failed)?;
        let taken = fused.is_some() && !refused;
        if !taken {
            let attempt = lock_in_xact(&mut tx, args.into(), mode, deadline);
            let attempt = tokio::time::timeout_at(grace, attempt);
            let attempt = match deadline {
                Some(_) => span::waiting(&key, attempt).await,
                None => attempt.await,
            };
            let Ok(attempt) = attempt else {
                drop(tx);
                return Err(failed(self.stalled(&key, mode, started, held).await).into());
            };
            let not_taken = match attempt {
                Ok(Ok(true)) => None,
                Ok(Ok(false)) => Some(NotTaken::Busy),
                // Nothing was taken on a session a pooler shares.
                Ok(Err(pid)) => Some(NotTaken::MarkerSeen(pid)),
                Err(err) => Some(NotTaken::Failed(err)),
            };
            if let Some(not_taken) = not_taken {
                let rollback = rollback_within(tx, within).await;
                return self
                    .not_taken(not_taken, rollback, &key, mode, started, held)
                    .await
                    .map_err(E::from);
            }
        }
        span::ended(&key, "postgres", started, true);
        let span = tracing::Span::current();
        let hold = Instant::now();
        let result = crate::postgres::xact::nesting::holding(database, &key, f(&mut tx)).await;
        let end = match &result {
            Ok(_) => commit_checked(tx, within).await,
            Err(_) => match rollback_within(tx, within).await {
                Ok(true) => End::RolledBack,
                Ok(false) => End::Unanswered,
                Err(err) => End::Failed(err),
            },
        };
        span.record("hold_ms", hold.elapsed().as_secs_f64() * 1e3);
        crate::metrics::released("postgres", &key, hold.elapsed());
        span.record("outcome", end.outcome(result.is_ok()));
        let value = match result {
            Ok(value) => value,
            Err(err) => {
                match &end {
                    End::Failed(rollback) => {
                        tracing::warn!(%rollback, "rollback after closure error failed; connection closed");
                    }
                    End::Unanswered => {
                        tracing::warn!(
                            "rollback after closure error got no answer within the heartbeat deadline; connection closed"
                        );
                    }
                    _ => held.into_pool(),
                }
                return Err(err);
            }
        };
        match end {
            End::Committed => {
                // The `ROLLBACK` that `commit_checked` leaves queued.
                held.send_queued();
                held.into_pool();
                Ok(Some(value))
            }
            End::Aborted { rolled_back } => {
                if rolled_back {
                    held.into_pool();
                }
                Err(Error::TransactionAborted { key: key.clone() }.into())
            }
            // The session's state is not what sqlx believes: close it.
            End::EndedInClosure => Err(Error::TransactionEnded { key: key.clone() }.into()),
            End::Failed(err) => Err(Error::from(err).into()),
            End::RolledBack | End::Unanswered => {
                Err(Error::TransactionAborted { key: key.clone() }.into())
            }
        }
    }

    /// The error of a call whose `BEGIN` or lock statement got no answer
    /// within the heartbeat deadline (past its own deadline, for a wait): a
    /// stalled network. `held`, which may hold the lock, is closed; a wait
    /// reports [`Error::Timeout`] (naming the holder if another connection
    /// can), a try [`Error::CommandTimedOut`].
    async fn stalled(&self, key: &LockKey, mode: Mode, started: Instant, held: HeldConn) -> Error {
        held.close();
        if mode.timeout().is_none() {
            return Error::CommandTimedOut {
                key: key.clone(),
                after: self.config().heartbeat_timeout,
            };
        }
        let wanted = mode.lock().wanted();
        self.timeout_error_as(key, wanted, started, None).await
    }

    /// A connection from the pool for `mode`: within its timeout if it has
    /// one (a zero timeout, a single try: within the pool's own acquire
    /// timeout), or [`Error::NoConnection`]. The locker's warm connections
    /// are all of one kind, one a session lock's keeper can watch.
    async fn xact_pooled(
        &self,
        key: &LockKey,
        mode: Mode,
        started: Instant,
    ) -> Result<WatchedConn, Error> {
        match mode.timeout() {
            Some(timeout) if !timeout.is_zero() => {
                let deadline = crate::deadline::after_std(started, timeout);
                crate::postgres::conn::pooled::watched_before(self.pool(), key, started, deadline)
                    .await
            }
            _ => crate::postgres::conn::pooled::watched(self.pool(), key).await,
        }
    }

    /// Turns a failed lock statement into the error to report: a missed
    /// deadline becomes [`Error::Timeout`] naming the holder.
    async fn xact_lock_failed(
        &self,
        err: sqlx::Error,
        key: &LockKey,
        mode: Mode,
        started: Instant,
        held: HeldConn,
        rolled_back: bool,
    ) -> Error {
        if mode.timeout().is_some() && lock_not_available(&err) {
            return self
                .timeout_error_as(
                    key,
                    mode.lock().wanted(),
                    started,
                    rolled_back.then_some(held),
                )
                .await;
        }
        locking_error(err, key)
    }

    /// The answer of a call whose lock was not taken, its transaction
    /// already rolled back (`rollback`: `Ok(true)` clean, `Ok(false)` no
    /// answer in time, which closes the connection; the server rolls back
    /// when the session ends): `Ok(None)` for a busy try.
    async fn not_taken<T>(
        &self,
        not_taken: NotTaken,
        rollback: Result<bool, sqlx::Error>,
        key: &LockKey,
        mode: Mode,
        started: Instant,
        held: HeldConn,
    ) -> Result<Option<T>, Error> {
        let err = match not_taken {
            NotTaken::Busy => {
                let held = match rollback {
                    Ok(clean) => clean.then_some(held),
                    Err(err) => return Err(span::failed(key, "postgres", started, err.into())),
                };
                if mode.timeout().is_none() {
                    span::ended(key, "postgres", started, false);
                    if let Some(held) = held {
                        held.into_pool();
                    }
                    return Ok(None);
                }
                let wanted = mode.lock().wanted();
                self.timeout_error_as(key, wanted, started, held).await
            }
            NotTaken::MarkerSeen(pid) => {
                if matches!(rollback, Ok(true)) {
                    held.into_pool();
                }
                crate::postgres::pooler::marker_seen(pid)
            }
            NotTaken::Failed(err) => {
                let rolled_back = matches!(rollback, Ok(true));
                self.xact_lock_failed(err, key, mode, started, held, rolled_back)
                    .await
            }
        };
        Err(span::failed(key, "postgres", started, err))
    }
}

/// How the lock's transaction ended after the closure.
#[derive(Debug)]
enum End {
    /// The closure's work committed while the lock was held.
    Committed,
    /// An SQL error had aborted the transaction without the closure
    /// returning it; nothing was committed. `rolled_back`: the connection is
    /// clean again and may go back to the pool.
    Aborted { rolled_back: bool },
    /// The closure ended the transaction itself (raw `COMMIT`/`ROLLBACK`).
    EndedInClosure,
    /// The closure returned an error and the transaction was rolled back.
    RolledBack,
    /// `COMMIT` (or the rollback after a closure error) failed.
    Failed(sqlx::Error),
    /// The rollback after a closure error got no answer within the
    /// heartbeat deadline (a stalled network): the connection is closed,
    /// and the server rolls back when the session ends.
    Unanswered,
}

impl End {
    fn outcome(&self, closure_ok: bool) -> &'static str {
        match self {
            End::Committed => "committed",
            End::RolledBack => "rolled_back",
            End::Aborted { .. } => "aborted",
            End::EndedInClosure => "ended_in_closure",
            End::Failed(_) if closure_ok => "commit_failed",
            End::Failed(_) | End::Unanswered => "rollback_failed",
        }
    }
}

/// Whether the checked commit failed at its marker check because the
/// lock's transaction had ended ([`xact_marker`]): SQLSTATE 42704 raised
/// where the server looks a setting up (the routine is named in every
/// server language; the message is translated), by the check itself, a
/// top-level statement, so with no context. The same error from the
/// application's deferred trigger at `COMMIT` carries the trigger
/// function's context, and is the commit's own failure.
fn ended_in_closure(err: &sqlx::Error) -> bool {
    err.as_database_error()
        .and_then(|db| db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>())
        .is_some_and(|db| {
            db.code() == UNDEFINED_OBJECT
                && db.routine() == Some("find_option")
                && db.r#where().is_none()
        })
}

/// Commits only the transaction that took the lock, and only if it is
/// healthy, in the one round trip a plain `COMMIT` costs.
///
/// PostgreSQL answers `COMMIT` of an aborted transaction with `ROLLBACK`,
/// which sqlx reports as success; and a closure that sent its own `COMMIT`
/// or `ROLLBACK` has already released the lock. So the commit is one simple
/// query of three statements: the marker check ([`xact_marker`]), which
/// fails if the transaction is aborted (every statement does, SQLSTATE
/// 25P02) or is not the lock's (42704); then `COMMIT`; then `BEGIN`, so
/// that the connection is in a transaction again as sqlx's `Transaction`
/// still believes. Dropping that
/// `Transaction` queues a `ROLLBACK` of the empty transaction, which the
/// caller sends without waiting for its answer
/// ([`HeldConn::send_queued`]): it costs the caller no round trip, and the
/// next lock on the kept connection finds it answered. An error
/// skips the rest of the query string, so nothing after a failed check runs.
async fn commit_checked(mut tx: sqlx::Transaction<'_, sqlx::Postgres>, within: Duration) -> End {
    const COMMIT_CHECKED: &str = concat!(xact_marker!(check), "; COMMIT; BEGIN");
    let Err(err) = sqlx::raw_sql(COMMIT_CHECKED).execute(&mut *tx).await else {
        drop(tx);
        return End::Committed;
    };
    if ended_in_closure(&err) {
        return End::EndedInClosure;
    }
    match sqlstate(&err).as_deref() {
        Some(IN_FAILED_TRANSACTION) => End::Aborted {
            rolled_back: matches!(rollback_within(tx, within).await, Ok(true)),
        },
        _ => End::Failed(err),
    }
}

/// `ROLLBACK` of `tx`, answered within `within` (the heartbeat deadline):
/// `Ok(true)` rolled back, `Ok(false)` no answer in time (a stalled
/// network must not hang the call: the caller closes the connection, and
/// the server rolls back when the session ends), `Err` the server's error.
async fn rollback_within(
    tx: sqlx::Transaction<'_, sqlx::Postgres>,
    within: Duration,
) -> Result<bool, sqlx::Error> {
    match tokio::time::timeout(within, tx.rollback()).await {
        Ok(Ok(())) => Ok(true),
        Ok(Err(err)) => Err(err),
        Err(_) => Ok(false),
    }
}

/// `ROLLBACK` of a failed transaction that sqlx does not count as open
/// (a try that failed in the `BEGIN`'s round trip), answered within
/// `within`; as [`rollback_within`].
async fn rollback_conn_within(
    conn: &mut PgConnection,
    within: Duration,
) -> Result<bool, sqlx::Error> {
    match tokio::time::timeout(within, sqlx::raw_sql("ROLLBACK").execute(conn)).await {
        Ok(Ok(_)) => Ok(true),
        Ok(Err(err)) => Err(err),
        Err(_) => Ok(false),
    }
}

/// The error of a `begin` that failed (the value has no other use). A
/// function rather than a `match` in place: matching `Err(err)` there
/// leaves the borrow checker dropping `began`, whose `Ok` type borrows the
/// connection, at the end of the scope, after the connection is used
/// again. The `Ok` arm is never taken (the caller checked `is_err`).
fn began_error<T>(began: Result<T, Error>) -> Error {
    match began {
        Err(err) => err,
        Ok(_) => Error::Database(sqlx::Error::BeginFailed),
    }
}

/// Begins the transaction: with `fused` (the `BEGIN` and a try,
/// [`prepared_try::begin_and_try`]) as its statement, or a plain `BEGIN`.
async fn begin<'c>(
    conn: &'c mut PgConnection,
    fused: Option<&str>,
) -> Result<sqlx::Transaction<'c, sqlx::Postgres>, sqlx::Error> {
    match fused {
        Some(fused) => conn.begin_with(sqlx::AssertSqlSafe(fused.to_owned())).await,
        None => conn.begin().await,
    }
}

/// Takes the lock inside the open transaction; `Ok(false)` means busy (and,
/// when waiting, that the deadline passed), `Err(pid)` that the session carries
/// another client's lock marker (nothing was attempted). A wait after a busy
/// try runs with the session's `statement_timeout` lifted by the try and put
/// back by the wait (see [`unlimited`](crate::postgres::request::unlimited)),
/// and the caller's `lock_timeout` put back too, before the closure runs.
async fn lock_in_xact(
    conn: &mut PgConnection,
    key: Bound<'_>,
    mode: Mode,
    deadline: Option<tokio::time::Instant>,
) -> Result<Result<bool, i32>, sqlx::Error> {
    let request = Request {
        key,
        lock: mode.lock(),
        fencing: false,
    };
    let row = request
        .xact_try(deadline.is_some())
        .fetch_one(&mut *conn)
        .await?;
    let locked = match xact_taken(&row)? {
        Ok(locked) => locked,
        Err(pid) => return Ok(Err(pid)),
    };
    let Some(deadline) = deadline.filter(|_| !locked) else {
        return Ok(Ok(locked));
    };
    let limit: Option<String> = sqlx::Row::try_get(&row, 1)?;
    let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
    if remaining.is_zero() {
        // The caller rolls back, which puts a lifted statement_timeout back.
        return Ok(Ok(false));
    }
    let restore = limit.filter(|limit| crate::postgres::request::unlimited::limited(Some(limit)));
    request
        .xact_wait(remaining, restore)
        .execute(&mut *conn)
        .await
        .map(|_| Ok(true))
}
