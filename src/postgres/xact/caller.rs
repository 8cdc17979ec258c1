//! A lock inside the caller's own transaction: [`try_lock_xact`] and
//! [`lock_xact`], for code that already has a `sqlx::Transaction` and wants
//! the lock to end exactly when that transaction does.

use std::time::{Duration, Instant};

use sqlx::postgres::PgRow;
use sqlx::{Connection, PgConnection, Row};

use crate::postgres::pooler::marker_seen;
use crate::postgres::request::fragments::millis_setting;
use crate::postgres::request::key::Bound;
use crate::postgres::request::literal::with_literals;
use crate::postgres::request::lock_request::Request;
use crate::postgres::request::row::xact_taken;
use crate::postgres::request::{Lock, sql, unlimited};
use crate::postgres::sqlstate::{lock_not_available, locking_error};
use crate::{Error, LockKey, span};

/// Takes the transaction-scoped advisory lock `key` inside the transaction
/// open on `conn`, without waiting: `Ok(true)` if taken, `Ok(false)` if
/// another session holds it. The lock lives until that transaction commits
/// or rolls back.
///
/// Called on a `sqlx::Transaction` as `try_lock_xact(&mut *tx, "k")`; nested
/// transactions (savepoints) work too. A connection that is not in a
/// transaction begun through sqlx is refused with
/// [`Error::NotInTransaction`]: the lock would end with the statement that
/// took it. (A transaction opened by sending `BEGIN` as SQL is not seen by
/// sqlx and is refused as well; use `conn.begin()`.) So is one that the
/// server has ended while sqlx still counts it open (a `COMMIT` sent as
/// SQL): the statement asks the server whether a transaction block is
/// open, and takes nothing if not.
///
/// Costs 1 round trip; it takes the same server lock as hand-written
/// `SELECT pg_try_advisory_xact_lock(hashtext('k'))`. The statement goes as
/// a simple query, with the key written into its text (the server can tell
/// an open block from the statement's own transaction only there), so the
/// server plans it on each call. Changes none of the
/// transaction's settings, nor the connection's: unlike the statements on
/// connections distlock takes from the pool, it sets no TCP keepalives, so
/// a holder cut off by a partition keeps the lock until the server's own
/// keepalive settings notice (hours by default) unless the application set
/// them in its connect options. Writes nothing. Like every lock statement
/// it takes nothing on a session that carries another client's session
/// lock (a transaction pooler sharing one server session, which would
/// grant the key again): that is [`Error::PoolerDetected`].
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), distlock::Error> {
/// let mut tx = pool.begin().await?;
/// if distlock::try_lock_xact(&mut *tx, "invoice:42").await? {
///     sqlx::query("UPDATE invoices SET sent = true WHERE id = 42")
///         .execute(&mut *tx)
///         .await?;
/// }
/// tx.commit().await?; // releases the lock
/// # Ok(()) }
/// ```
///
/// # Cancel safety
///
/// As cancel safe as the caller's transaction: dropped mid-statement, sqlx
/// rolls the transaction back when it is dropped, which releases whatever
/// the statement took.
pub async fn try_lock_xact(
    conn: &mut PgConnection,
    key: impl Into<LockKey>,
) -> Result<bool, Error> {
    let key = key.into();
    let tried = try_in_caller(conn, &key);
    span::traced(&key, "postgres", "try_xact", |locked| *locked, tried).await
}

async fn try_in_caller(conn: &mut PgConnection, key: &LockKey) -> Result<bool, Error> {
    let args = key.args()?;
    in_transaction(conn)?;
    // On a standby the check fails the statement, and with it the caller's
    // transaction, which then holds nothing.
    let statement = with_literals(sql::CALLER_XACT_TRY, args.into(), None);
    let row = sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
        .fetch_one(&mut *conn)
        .await
        .map_err(|err| locking_error(err, key))?;
    in_block(&row)?;
    xact_taken(&row)?.map_err(marker_seen)
}

/// Whether the statement in `row` (its last column but one) found a
/// transaction block open; refuses it as [`Error::NotInTransaction`]
/// otherwise: the lock, had it been taken, ended with the statement.
fn in_block(row: &PgRow) -> Result<(), Error> {
    let at = row.len().saturating_sub(2);
    if row.try_get::<bool, _>(at)? {
        Ok(())
    } else {
        Err(Error::NotInTransaction)
    }
}

/// Takes the transaction-scoped advisory lock `key` inside the transaction
/// open on `conn`, waiting up to `timeout` on the server; the lock lives
/// until that transaction ends.
///
/// One statement, 1 round trip: it remembers the transaction's own
/// `lock_timeout`, waits under one of `timeout`, and puts the caller's back,
/// so the transaction's settings are as they were afterwards. On a session
/// with a `statement_timeout` (which would end the wait at its limit), the
/// statement only tries; a busy key then costs a second statement, which
/// waits with the limit lifted and puts it back. A `timeout`
/// longer than `lock_timeout` can express (about 24.8 days) means "as long
/// as the server allows". Refuses a connection outside a transaction as
/// [`try_lock_xact`] does, and sends its first statement as a simple
/// query as that does.
///
/// **A timeout aborts the caller's transaction**: PostgreSQL fails the
/// statement with `lock_not_available`, and a failed statement inside a
/// transaction block aborts the block, so the caller must roll back (this
/// returns [`Error::Timeout`]). To keep the transaction usable, take the
/// lock inside a savepoint, which costs 2 round trips more (`SAVEPOINT`,
/// `RELEASE`): on success release the savepoint (the lock then belongs to
/// the enclosing transaction), on a timeout roll the savepoint back.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), distlock::Error> {
/// use std::time::Duration;
/// use sqlx::Connection;
/// let mut tx = pool.begin().await?;
/// let mut savepoint = tx.begin().await?;
/// match distlock::lock_xact(&mut *savepoint, "ledger", Duration::from_secs(2)).await {
///     Ok(()) => savepoint.commit().await?, // the lock stays with `tx`
///     Err(distlock::Error::Timeout { .. }) => savepoint.rollback().await?, // `tx` goes on
///     Err(other) => return Err(other),
/// }
/// tx.commit().await?;
/// # Ok(()) }
/// ```
///
/// # Cancel safety
///
/// As for [`try_lock_xact`]: the caller's transaction, rolled back when
/// dropped, ends whatever the statement was doing. Drop the transaction
/// with the future (as `?` on a timeout wrapper does): this call does not
/// cancel its wait on the server, so a transaction used on after a dropped
/// `lock_xact` first waits for that statement to end (it may still be
/// granted the lock), and, if the session has a `statement_timeout` and the
/// future was dropped between its two statements, runs without that limit
/// (the second statement is the one that puts it back).
pub async fn lock_xact(
    conn: &mut PgConnection,
    key: impl Into<LockKey>,
    timeout: Duration,
) -> Result<(), Error> {
    let key = key.into();
    let waited = span::waiting(&key, wait_in_caller(conn, &key, timeout));
    span::traced(&key, "postgres", "wait_xact", |()| true, waited).await
}

async fn wait_in_caller(
    conn: &mut PgConnection,
    key: &LockKey,
    timeout: Duration,
) -> Result<(), Error> {
    let args = key.args()?;
    in_transaction(conn)?;
    let started = Instant::now();
    match wait_in_xact(conn, args.into(), timeout).await {
        Ok(taken) => taken,
        // The timeout aborted the caller's transaction, the one connection
        // there is: nothing can look for the holder.
        Err(err) if lock_not_available(&err) => {
            Err(crate::postgres::timeout::timed_out(key, started))
        }
        Err(err) => Err(locking_error(err, key)),
    }
}

/// The lock would end with the statement outside a transaction block.
fn in_transaction(conn: &PgConnection) -> Result<(), Error> {
    if conn.is_in_transaction() {
        Ok(())
    } else {
        Err(Error::NotInTransaction)
    }
}

/// Waits for the lock under our `lock_timeout`, putting the caller's back;
/// `Ok(Err(..))` when nothing was attempted: the session carries another
/// client's lock marker ([`Error::PoolerDetected`]), or no transaction
/// block is open ([`Error::NotInTransaction`]). The first statement is a
/// simple query (see [`in_block`]).
/// A session without `statement_timeout` waits in the first statement; one
/// with it only tries there (the timer is armed when a statement starts,
/// so a wait under it would end at the session's limit), lifts the limit
/// for a second statement that waits and puts it back, so the caller's own
/// statements keep it. A failed wait aborts the caller's transaction (or
/// savepoint), which puts both settings back as well.
async fn wait_in_xact(
    conn: &mut PgConnection,
    key: Bound<'_>,
    timeout: Duration,
) -> Result<Result<(), Error>, sqlx::Error> {
    let started = tokio::time::Instant::now();
    let timeout_setting = millis_setting(timeout);
    let statement = with_literals(sql::CALLER_XACT_FIRST, key, Some(&timeout_setting));
    let row = sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
        .fetch_one(&mut *conn)
        .await?;
    if let Err(refused) = in_block(&row) {
        return Ok(Err(refused));
    }
    match xact_taken(&row)? {
        Ok(true) => return Ok(Ok(())),
        Ok(false) => {}
        Err(pid) => return Ok(Err(marker_seen(pid))),
    }
    let limit: Option<String> = sqlx::Row::try_get(&row, 1)?;
    let restore = limit.filter(|limit| unlimited::limited(Some(limit)));
    let remaining = timeout.saturating_sub(started.elapsed());
    let request = Request {
        key,
        lock: Lock::Exclusive,
        fencing: false,
    };
    request
        .xact_wait(remaining, restore)
        .execute(conn)
        .await
        .map(|_| Ok(()))
}
