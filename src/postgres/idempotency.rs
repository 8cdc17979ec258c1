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

use sqlx::{Connection, PgConnection, PgPool};

use crate::Error;

/// Claims `(scope, key)`: `true` exactly once, `false` if it was claimed
/// before.
///
/// If another transaction holds an uncommitted claim on the same pair, this
/// call waits for it to finish: `false` if it committed, `true` if it rolled
/// back. Call it in the transaction that makes the effect. Costs 1 round trip.
/// Needs [`migrate`](crate::migrate).
///
/// # Cancel safety
///
/// It runs one statement on `conn` and holds no lock of its own. Dropped
/// before the answer, the statement may or may not have run; in your
/// transaction that is settled by your commit or rollback.
pub async fn claim(conn: &mut PgConnection, scope: &str, key: &str) -> Result<bool, Error> {
    validate(scope, key)?;
    let inserted = sqlx::query(
        "INSERT INTO distlock.idempotency_keys (scope, key) VALUES ($1, $2) ON CONFLICT DO NOTHING",
    )
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
/// `f` rolls back the claim too, so the key can be tried again. Costs 4 round
/// trips plus `f`'s own.
///
/// # Cancel safety
///
/// Dropping the future before it commits drops the transaction: sqlx rolls
/// it back before the connection is used again, so neither the claim nor
/// the effect is kept and the key can be claimed again.
pub async fn once<F, E>(pool: &PgPool, scope: &str, key: &str, f: F) -> Result<Once, E>
where
    F: AsyncFnOnce(&mut PgConnection) -> Result<String, E>,
    E: From<Error>,
{
    let mut conn = pool.acquire().await.map_err(Error::from)?;
    let mut tx = conn.begin().await.map_err(Error::from)?;
    if !claim(&mut tx, scope, key).await? {
        tx.rollback().await.map_err(Error::from)?;
        return Ok(stored(&mut conn, scope, key)
            .await?
            .unwrap_or(Once::AlreadyDone {
                result: None,
                claimed_at: SystemTime::now(),
            }));
    }
    let result = f(&mut tx).await?;
    sqlx::query("UPDATE distlock.idempotency_keys SET result = $3 WHERE scope = $1 AND key = $2")
        .bind(scope)
        .bind(key)
        .bind(&result)
        .execute(&mut *tx)
        .await
        .map_err(Error::from)?;
    tx.commit().await.map_err(Error::from)?;
    Ok(Once::Ran(result))
}

/// The stored claim of `(scope, key)`, if it was claimed. Costs 1 round trip.
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
        "SELECT result, (extract(epoch FROM claimed_at) * 1000000)::int8 \
         FROM distlock.idempotency_keys WHERE scope = $1 AND key = $2",
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
/// Costs 1 round trip.
///
/// # Cancel safety
///
/// One statement: dropped before the answer, the delete either ran whole or
/// not at all.
pub async fn purge(pool: &PgPool, older_than: Duration) -> Result<u64, Error> {
    let deleted: i64 =
        sqlx::query_scalar("SELECT distlock.purge_idempotency_keys(make_interval(secs => $1))")
            .bind(older_than.as_secs_f64())
            .fetch_one(pool)
            .await?;
    Ok(deleted.unsigned_abs())
}

fn validate(scope: &str, key: &str) -> Result<(), Error> {
    crate::LockKey::from(scope).validate()?;
    crate::LockKey::from(key).validate()
}
