//! Idempotency keys: a `(scope, key)` pair that can be claimed exactly once.
//!
//! A claim is a row in `distlock.idempotency_keys` with a unique constraint
//! on `(scope, key)`. Made in the same transaction as the effect, it commits
//! with the effect or not at all: a second execution becomes impossible even
//! when a lock failed (a retried HTTP request, a job run twice after a
//! failover), and a claim whose transaction rolled back can be claimed again.
//!
//! # Retention
//!
//! Claims are kept until purged. Keep them at least as long as duplicates can
//! arrive (a client's retry window, a queue's redelivery horizon), then call
//! [`purge`] (or the SQL function `distlock.purge_idempotency_keys(interval)`)
//! from a periodic job, e.g. `purge(&pool, Duration::from_secs(7 * 86400))`.

use std::time::{Duration, SystemTime};

use sqlx::{Connection, PgConnection, PgPool, Row};

use crate::Error;
use crate::postgres::conn::held::HeldConn;
use crate::postgres::request::fragments::{client_check, keepalives};

/// The longest `scope`, and the longest `key`, that [`claim`], [`once`],
/// [`once_in`], [`store`] and [`stored`] take, in bytes of UTF-8. Together they form the primary key of
/// `distlock.idempotency_keys`, whose B-tree entries must fit in a third of
/// a page (about 2.7 kB at the default 8 kB page): twice this leaves room
/// whatever the text's compression, so a key is refused before the server
/// sees it rather than with "index row requires ... bytes".
pub const MAX_KEY_LEN: usize = 1024;

/// The longest age [`purge`] takes: a century. An age further back than
/// PostgreSQL's earliest timestamp (4713 BC) would fail on the server with
/// "timestamp out of range", and nothing is older than a century anyway.
pub const MAX_PURGE_AGE: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Inserts the claim of `(scope, key)` (`$1`, `$2`) after setting the
/// session settings every lock statement sets: the claim's row stays locked
/// for the rest of the claimant's transaction, and another claim of the pair
/// waits on it, as a lock's waiter would. The keepalives let the server end
/// the transaction of a claimant cut off by a partition within about 25–30 s,
/// which frees the row, rather than after the operating system's two hours;
/// the client check ends a waiting statement whose client has gone. The CTE
/// is read before the row is inserted, so the keepalives (socket options,
/// in force at once) act during the claim's own wait; the client check is
/// armed as a statement starts, so it acts from the next statement on
/// ([`once`] sets both before its claim, in [`BEGIN`]).
const CLAIM: &str = concat!(
    "WITH s AS (SELECT ",
    client_check!(),
    " AS c, ",
    keepalives!(),
    " AS k) INSERT INTO distlock.idempotency_keys (scope, key) SELECT $1, $2 FROM s \
     ON CONFLICT DO NOTHING"
);

/// Claims `(scope, key)`: `true` exactly once, `false` if it was claimed
/// before.
///
/// If another transaction holds an uncommitted claim on the same pair, this
/// call waits for it to finish: `false` if it committed, `true` if it rolled
/// back. Call it in the transaction that makes the effect. Costs 1 round trip.
/// Needs [`migrate`](crate::migrate).
///
/// Like a lock statement, the claim sets the session's TCP keepalives
/// (idle 10 s, 3 probes 5 s apart, `tcp_user_timeout` 30 s) where they are
/// not set yet: an uncommitted claim holds its row as a lock would, so a
/// claimant cut off by a network partition has its transaction ended by the
/// server within about 25–30 s (and the pair can be claimed again) instead of
/// the operating system's two hours, during which every other claim of the
/// pair would wait. It also sets a 100 ms `client_connection_check_interval`,
/// which the server arms as each statement starts: from the next statement
/// on, a statement whose client has gone is ended within 100 ms. They stay
/// set for the session (harmless for the connection's later users), unless
/// the transaction rolls back.
///
/// `scope` and `key` must be valid key names ([`Error::InvalidKey`]
/// otherwise) of at most [`MAX_KEY_LEN`] bytes each
/// ([`Error::InvalidArgument`] otherwise); refused, they cost no round trip.
///
/// # Cancel safety
///
/// It runs one statement on `conn` and holds no lock of its own. Dropped
/// before the answer, the statement may or may not have run; in your
/// transaction that is settled by your commit or rollback.
pub async fn claim(conn: &mut PgConnection, scope: &str, key: &str) -> Result<bool, Error> {
    validate(scope, key)?;
    let inserted = sqlx::query(CLAIM)
        .bind(scope)
        .bind(key)
        .execute(conn)
        .await?
        .rows_affected();
    Ok(inserted == 1)
}

/// What [`once`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Once {
    /// This call claimed the key and ran the closure; its result was stored.
    Ran(String),
    /// The key had been claimed before; the stored result of that run.
    AlreadyDone {
        /// The result stored by the run that claimed the key (`None` if it
        /// was claimed with [`claim`], which stores none).
        result: Option<String>,
        /// When it was claimed.
        claimed_at: SystemTime,
    },
}

/// Runs `f` at most once per `(scope, key)`: claims the key, runs `f` and
/// stores its result in one transaction.
///
/// If the key was claimed before, `f` does not run and the stored result comes
/// back as [`Once::AlreadyDone`]; if a concurrent call is running it, this
/// call waits for its transaction and then reports its result. An `Err` from
/// `f` rolls back the claim too, so the key can be tried again; so does a
/// result that PostgreSQL text cannot hold (a NUL byte), which fails with
/// [`Error::InvalidArgument`] after `f` ran (what `f` did outside the
/// database is not undone: return text without NUL). Costs 4 round
/// trips plus `f`'s own, on one connection of `pool`; its `BEGIN` sets the
/// settings [`claim`] sets, so that a claim waiting on a concurrent call's is
/// ended within 100 ms when this call is dropped, and a claimant cut off by
/// a partition loses its claim within about 25–30 s. `scope` and `key` are
/// checked as in [`claim`] before a connection is taken. To run it inside a
/// transaction of your own (a `with_advisory_lock` closure's `conn`), use
/// [`once_in`].
///
/// # Cancel safety
///
/// Dropping the future before it commits closes its connection (it is not
/// given back to the pool): the server rolls the transaction back, so
/// neither the claim nor the effect is kept and the key can be claimed
/// again. Dropped while its `COMMIT` is in flight, the transaction may have
/// committed; the pool opens a new connection in its place.
pub async fn once<F, E>(pool: &PgPool, scope: &str, key: &str, f: F) -> Result<Once, E>
where
    F: AsyncFnOnce(&mut PgConnection) -> Result<String, E>,
    E: From<Error>,
{
    validate(scope, key)?;
    let conn = crate::postgres::conn::pooled::acquire(pool)
        .await
        .map_err(Error::from)?;
    // Armed until the transaction has ended: dropped mid-way, the
    // connection is closed and the server rolls back. Given back to the
    // pool, a connection whose `BEGIN` was in flight would carry on in a
    // transaction sqlx does not track (its rollback on drop counts only
    // transactions it saw begin), and its next user's writes with it.
    let mut conn = HeldConn::new(conn, true);
    let ran = run_once(conn.conn(), Some(BEGIN), scope, key, f).await;
    conn.disarm();
    ran
}

/// [`once`] on a connection you hold, typically inside your own transaction
/// (a `with_advisory_lock` closure's `conn`, a `pool.begin()`).
///
/// In a transaction it works in a savepoint: an `Err` from `f` rolls back the
/// claim and `f`'s writes only, and returns the error; your transaction goes
/// on, and the claim and `f`'s effect commit with it or not at all. On a
/// connection outside a transaction it makes its own, as [`once`] does.
/// Costs 4 round trips plus `f`'s own (`SAVEPOINT`, the claim, storing the
/// result, `RELEASE`), and outside a transaction begun through sqlx 1 more
/// first: a transaction opened by sending `BEGIN` as SQL is one sqlx does
/// not track (its `COMMIT` would commit yours, and its rollback roll back
/// all of yours), so it is refused with [`Error::InvalidArgument`]
/// (argument `conn`) before anything is written; open it with
/// `conn.begin()`. Needs [`migrate`](crate::migrate).
///
/// # Cancel safety
///
/// Dropped while `f` or the claim runs, the savepoint (or transaction) is
/// rolled back by sqlx before the connection is used again: no claim and
/// none of `f`'s writes are kept, and your own transaction is left as it was
/// before the call.
///
/// **Not at the `.await`s of its `SAVEPOINT` and its `RELEASE`**, where
/// sqlx (0.9) itself is not cancel safe. Dropped while the `SAVEPOINT` is
/// in flight, sqlx rolls back two levels of your transaction where it
/// should roll back none: all of it if it is one or two levels deep (the
/// statements after run outside any transaction, and your `COMMIT`
/// answers `Ok` having committed nothing of before), else your two
/// innermost savepoints; on a connection outside a transaction it leaves
/// the `BEGIN` open, untracked (what runs next is never committed).
/// Dropped while the `RELEASE` is in flight, sqlx rolls back to the
/// released savepoint: your next statement fails (SQLSTATE 3B001) and your
/// transaction is aborted. So do not put a timeout or a `select!` around
/// `once_in` in a transaction you go on using; where the call may be
/// dropped, let your transaction go with it (drop it, or the connection),
/// or use [`once`], which closes its connection when dropped.
pub async fn once_in<F, E>(conn: &mut PgConnection, scope: &str, key: &str, f: F) -> Result<Once, E>
where
    F: AsyncFnOnce(&mut PgConnection) -> Result<String, E>,
    E: From<Error>,
{
    validate(scope, key)?;
    if !conn.is_in_transaction() {
        refuse_untracked_transaction(conn).await?;
    }
    run_once(conn, None, scope, key, f).await
}

/// [`Error::InvalidArgument`] if the server has a transaction open on
/// `conn` that sqlx does not track (a `BEGIN` sent as SQL): a statement of
/// such a transaction starts later than the transaction, where the first
/// statement of the implicit transaction a statement outside one runs in
/// starts with it. A simple query: the extended protocol starts the
/// transaction at `Parse` and the statement's clock again at `Execute`.
/// 1 round trip; reads nothing.
async fn refuse_untracked_transaction(conn: &mut PgConnection) -> Result<(), Error> {
    let row = sqlx::raw_sql(
        "SELECT pg_catalog.transaction_timestamp() OPERATOR(pg_catalog.<>) \
         pg_catalog.statement_timestamp()",
    )
    .fetch_one(&mut *conn)
    .await?;
    let open: bool = row.try_get(0)?;
    if open {
        return Err(Error::InvalidArgument {
            argument: "conn",
            reason: "in a transaction opened by sending BEGIN as SQL, which sqlx does not \
                     track; open it with conn.begin()"
                .into(),
        });
    }
    Ok(())
}

/// [`once`]'s transaction begins with the settings of [`CLAIM`], in the
/// round trip of its `BEGIN`: the server arms the client check as a
/// statement starts, so the one the claim sets would be in force from the
/// statement after it only, and a claim that waits on another's row would
/// wait without it. The settings come first: a failure there ends the
/// query before its `BEGIN`, leaving no transaction open (sqlx counts one
/// only once the query has left the session in a block; after a failed
/// `SELECT` behind a `BEGIN` the server would hold an aborted transaction
/// that nothing ends). Statements before a `BEGIN` in one simple query run
/// in the transaction it opens.
const BEGIN: &str = concat!("SELECT ", client_check!(), ", ", keepalives!(), "; BEGIN");

/// [`once`] and [`once_in`] past their checks: the transaction (a savepoint
/// where `conn` is in one) begun with `begin` or sqlx's own `BEGIN`.
async fn run_once<F, E>(
    conn: &mut PgConnection,
    begin: Option<&'static str>,
    scope: &str,
    key: &str,
    f: F,
) -> Result<Once, E>
where
    F: AsyncFnOnce(&mut PgConnection) -> Result<String, E>,
    E: From<Error>,
{
    let tx = match begin {
        Some(begin) => conn.begin_with(begin).await,
        None => conn.begin().await,
    };
    let mut tx = tx.map_err(Error::from)?;
    if !claim(&mut tx, scope, key).await? {
        tx.rollback().await.map_err(Error::from)?;
        return Ok(stored(conn, scope, key)
            .await?
            .unwrap_or(Once::AlreadyDone {
                result: None,
                claimed_at: SystemTime::now(),
            }));
    }
    let result = f(&mut tx).await?;
    store(&mut tx, scope, key, &result).await?;
    tx.commit().await.map_err(Error::from)?;
    Ok(Once::Ran(result))
}

/// Stores `result` with the claim of `(scope, key)`, for [`stored`] (and a
/// later [`once`]) to return: the way to record what a [`claim`]ed effect
/// produced (a response body, a charge id). Call it in the transaction that
/// made the claim, so the result commits with the claim and the effect.
///
/// A pair that was never claimed is refused with
/// [`Error::InvalidArgument`]: there is nothing to store it with; so is a
/// `result` with a NUL byte, which PostgreSQL text cannot hold (before any
/// round trip). Costs 1
/// round trip; one row updated, durable at your commit. `scope` and `key`
/// are checked as in [`claim`].
///
/// # Cancel safety
///
/// One statement on `conn`: dropped before the answer, it may or may not
/// have run; in your transaction that is settled by your commit or rollback.
pub async fn store(
    conn: &mut PgConnection,
    scope: &str,
    key: &str,
    result: &str,
) -> Result<(), Error> {
    validate(scope, key)?;
    if result.contains('\0') {
        return Err(Error::InvalidArgument {
            argument: "result",
            reason: "contains a NUL byte, which PostgreSQL text cannot hold".to_owned(),
        });
    }
    let updated = sqlx::query(
        "UPDATE distlock.idempotency_keys SET result = $3 WHERE scope OPERATOR(pg_catalog.=) $1 AND key OPERATOR(pg_catalog.=) $2",
    )
    .bind(scope)
    .bind(key)
    .bind(result)
    .execute(conn)
    .await?
    .rows_affected();
    if updated == 0 {
        return Err(Error::InvalidArgument {
            argument: "key",
            reason: format!(
                "({scope}, {key}) was never claimed: claim it before storing its result"
            ),
        });
    }
    Ok(())
}

/// The stored claim of `(scope, key)`, if it was claimed. Costs 1 round trip.
/// `scope` and `key` are checked as in [`claim`].
///
/// # Cancel safety
///
/// Cancel safe: a read.
pub async fn stored(
    conn: &mut PgConnection,
    scope: &str,
    key: &str,
) -> Result<Option<Once>, Error> {
    validate(scope, key)?;
    let row: Option<(Option<String>, i64)> = sqlx::query_as(
        "SELECT result, (extract(epoch FROM claimed_at) OPERATOR(pg_catalog.*) 1000000)::pg_catalog.int8 \
         FROM distlock.idempotency_keys WHERE scope OPERATOR(pg_catalog.=) $1 AND key OPERATOR(pg_catalog.=) $2",
    )
    .bind(scope)
    .bind(key)
    .fetch_optional(conn)
    .await?;
    Ok(row.map(|(result, micros)| Once::AlreadyDone {
        result,
        claimed_at: SystemTime::UNIX_EPOCH + Duration::from_micros(micros.unsigned_abs()),
    }))
}

/// Deletes claims older than `older_than`; returns how many were deleted.
/// Costs 1 round trip. An `older_than` above [`MAX_PURGE_AGE`] (a century)
/// is refused with [`Error::InvalidArgument`], without a round trip.
///
/// # Cancel safety
///
/// One statement: dropped before the answer, the delete either ran whole or
/// not at all.
pub async fn purge(pool: &PgPool, older_than: Duration) -> Result<u64, Error> {
    if older_than > MAX_PURGE_AGE {
        return Err(Error::InvalidArgument {
            argument: "older_than",
            reason: format!("{older_than:?} is more than the limit of 100 years"),
        });
    }
    let deleted: i64 = sqlx::query_scalar(
        "SELECT distlock.purge_idempotency_keys(pg_catalog.make_interval(secs => $1))",
    )
    .bind(older_than.as_secs_f64())
    .fetch_one(pool)
    .await?;
    Ok(deleted.unsigned_abs())
}

fn validate(scope: &str, key: &str) -> Result<(), Error> {
    crate::LockKey::from(scope).validate()?;
    crate::LockKey::from(key).validate()?;
    for (argument, text) in [("scope", scope), ("key", key)] {
        if text.len() > MAX_KEY_LEN {
            return Err(Error::InvalidArgument {
                argument,
                reason: format!(
                    "{} bytes, more than the limit of {MAX_KEY_LEN} bytes",
                    text.len()
                ),
            });
        }
    }
    Ok(())
}
