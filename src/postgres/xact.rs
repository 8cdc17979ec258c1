//! Transaction-scoped locks: `pg_try_advisory_xact_lock` inside a transaction
//! that runs the caller's closure.

use std::time::{Duration, Instant};

use sqlx::Connection;
use sqlx::postgres::PgConnection;
use tracing::Instrument;

use super::conn::HeldConn;
use super::locker::PgLocker;
use super::sql::{bind_key, keyed, millis_setting};
use crate::error::{LOCK_NOT_AVAILABLE, locking_error, sqlstate};
use crate::key::KeyArgs;
use crate::{Error, LockKey};

/// How a transaction-scoped lock is taken.
#[derive(Debug, Clone, Copy)]
enum Mode {
    Try,
    TryShared,
    Wait(Duration),
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Try => "try",
            Mode::TryShared => "try_shared",
            Mode::Wait(_) => "wait",
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
    /// Costs 3 round trips plus the closure's own (`BEGIN`, the lock attempt,
    /// `COMMIT`/`ROLLBACK`); contention costs the same 3.
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
    /// `client_connection_check_interval = 100ms` for the transaction, so the
    /// server notices within 100 ms, aborts whatever statement is running
    /// (also one of the closure's), rolls back and frees the lock.
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
    /// `lock_timeout` is restored before `f` runs. Costs the same 3 round trips
    /// as the try variant when the lock is free, 4 when it has to wait.
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
        let key = key.into();
        match self
            .run_in_xact(key.clone(), Mode::Wait(timeout), f)
            .await?
        {
            Some(value) => Ok(value),
            // `run_in_xact` in wait mode reports a missed deadline as an
            // error, never as `None`; keep a typed answer anyway.
            None => Err(Error::Timeout {
                key: key.to_string(),
                waited: timeout,
                holder_pid: None,
                holder_application: None,
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
        let started = Instant::now();
        let deadline = match mode {
            Mode::Wait(timeout) => Some(tokio::time::Instant::from_std(started + timeout)),
            Mode::Try | Mode::TryShared => None,
        };
        let pooled = match deadline {
            // A zero timeout is a single try: it still needs a connection,
            // so the pool's own acquire timeout applies then.
            Some(_) if matches!(mode, Mode::Wait(timeout) if timeout.is_zero()) => {
                self.pool().acquire().await
            }
            Some(deadline) => {
                match tokio::time::timeout_at(deadline, self.pool().acquire()).await {
                    Ok(pooled) => pooled,
                    Err(_) => return Err(self.timeout_error(&key, started, None).await.into()),
                }
            }
            None => self.pool().acquire().await,
        };
        // Armed until the transaction has ended: if this future is dropped,
        // the connection is closed rather than pooled. The lock statement
        // sets client_connection_check_interval for the transaction, so the
        // server then aborts a statement still running (a lock wait, or the
        // closure's own) within 100 ms and frees the lock, instead of
        // finishing it first as a pooled connection's clean-up would.
        let mut held = HeldConn::new(pooled.map_err(Error::from)?, true);
        let mut tx = held.conn().begin().await.map_err(Error::from)?;
        let attempt = lock_in_xact(&mut tx, args, mode, deadline);
        let attempt = match deadline {
            // The server gives up at the deadline (lock_timeout); if it does
            // not answer shortly after, the network is stalled: give up too,
            // and let the armed connection close.
            Some(deadline) => {
                let grace =
                    deadline.max(tokio::time::Instant::now()) + self.config().heartbeat_timeout;
                match tokio::time::timeout_at(grace, attempt).await {
                    Ok(result) => result,
                    Err(_) => {
                        drop(tx);
                        held.close();
                        return Err(self.timeout_error(&key, started, None).await.into());
                    }
                }
            }
            None => attempt.await,
        };
        let locked = match attempt {
            Ok(locked) => locked,
            Err(err) => {
                let rolled_back = tx.rollback().await.is_ok();
                let err = self.xact_lock_failed(err, &key, mode, started, held, rolled_back);
                return Err(err.await.into());
            }
        };
        let span = tracing::Span::current();
        span.record("wait_ms", started.elapsed().as_secs_f64() * 1e3);
        if !locked {
            tx.rollback().await.map_err(Error::from)?;
            if deadline.is_some() {
                return Err(self.timeout_error(&key, started, Some(held)).await.into());
            }
            span.record("outcome", "busy");
            crate::metrics::busy("postgres", &key);
            held.into_pool();
            return Ok(None);
        }
        let hold = Instant::now();
        crate::metrics::acquired("postgres", &key, started.elapsed());
        let result = f(&mut tx).await;
        let end = match &result {
            Ok(_) => tx.commit().await,
            Err(_) => tx.rollback().await,
        };
        span.record("hold_ms", hold.elapsed().as_secs_f64() * 1e3);
        crate::metrics::released("postgres", &key, hold.elapsed());
        span.record(
            "outcome",
            if result.is_ok() {
                "committed"
            } else {
                "rolled_back"
            },
        );
        match (result, end) {
            (Ok(value), Ok(())) => {
                held.into_pool();
                Ok(Some(value))
            }
            (Ok(_), Err(err)) => Err(Error::from(err).into()),
            (Err(err), end) => {
                if let Err(rollback) = end {
                    tracing::warn!(%rollback, "rollback after closure error failed; connection closed");
                } else {
                    held.into_pool();
                }
                Err(err)
            }
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
        if let (Mode::Wait(_), Some(LOCK_NOT_AVAILABLE)) = (mode, sqlstate(&err).as_deref()) {
            return self
                .timeout_error(key, started, rolled_back.then_some(held))
                .await;
        }
        tracing::Span::current().record("outcome", "error");
        locking_error(err, key)
    }
}

/// Takes the lock inside the open transaction; `Ok(false)` means busy (and,
/// when waiting, that the deadline passed).
async fn lock_in_xact(
    conn: &mut PgConnection,
    args: KeyArgs<'_>,
    mode: Mode,
    deadline: Option<tokio::time::Instant>,
) -> Result<bool, sqlx::Error> {
    let try_sql = match mode {
        Mode::TryShared => keyed!(args; "SELECT pg_try_advisory_xact_lock_shared(",
            "), set_config('client_connection_check_interval', '100ms', true)"; "$1", "$2"),
        Mode::Try | Mode::Wait(_) => keyed!(args; "SELECT pg_try_advisory_xact_lock(",
            "), set_config('client_connection_check_interval', '100ms', true)"; "$1", "$2"),
    };
    let row = bind_key(sqlx::query(try_sql), args)
        .fetch_one(&mut *conn)
        .await?;
    let locked: bool = sqlx::Row::try_get(&row, 0)?;
    let Some(deadline) = deadline.filter(|_| !locked) else {
        return Ok(locked);
    };
    let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
    if remaining.is_zero() {
        return Ok(false);
    }
    // One statement: remember the caller's lock_timeout, wait under ours,
    // then put theirs back (OFFSET 0 keeps the inner select from being
    // flattened, so it runs first).
    let sql = keyed!(args;
        "SELECT set_config('lock_timeout', s.prev, true) FROM (SELECT \
         current_setting('lock_timeout') AS prev, \
         set_config('lock_timeout', $1, true), \
         pg_advisory_xact_lock(",
        ") OFFSET 0) s"; "$2", "$3");
    let query = sqlx::query(sql).bind(millis_setting(remaining));
    bind_key(query, args)
        .execute(&mut *conn)
        .await
        .map(|_| true)
}
