//! Fencing tokens: numbers that grow with every acquisition of a lock, so a
//! protected resource can reject writes from a holder that was overtaken.
//!
//! A lock alone cannot rule out two holders: a holder whose process pauses
//! (GC, swapping, SIGSTOP, a VM migration) or whose network stalls for longer
//! than its lock lives keeps running code that believes it holds the lock,
//! while the server has already freed it and handed it to someone else. With
//! `PgLocker::builder(pool).fencing(true)`, every session-lock acquisition
//! gets a token higher than the last of its server lock (issued in the same
//! statement as the lock, so it costs no extra round trip). The protected
//! resource remembers the highest token it has accepted and rejects older
//! ones ([`check`]): the paused holder's late write fails instead of
//! overwriting its successor's.

use sqlx::PgConnection;

use crate::{Error, FencingToken};

/// The longest resource name [`check`] and [`current`] take, in bytes of
/// UTF-8. A resource is the primary key of `distlock.fence_seen`, and a
/// B-tree index entry must fit in a third of a page (about 2.7 kB at the
/// default 8 kB page); the limit leaves room below that whatever the text's
/// compression, so a resource is refused before the server sees it rather
/// than with "index row requires ... bytes".
pub const MAX_RESOURCE_LEN: usize = 1024;

/// Validates a resource name the way lock keys are validated, and its length.
fn validate_resource(resource: &str) -> Result<(), Error> {
    crate::LockKey::from(resource).validate()?;
    if resource.len() > MAX_RESOURCE_LEN {
        return Err(Error::InvalidArgument {
            argument: "resource",
            reason: format!(
                "{} bytes, more than the limit of {MAX_RESOURCE_LEN} bytes",
                resource.len()
            ),
        });
    }
    Ok(())
}

/// Records `token` for `resource` and fails with
/// [`Error::StaleFencingToken`] if a newer token was already seen there.
///
/// An equal token (the same holder writing again) and a newer one are
/// accepted; the newest token is remembered in `distlock.fence_seen`. Run it
/// in the same transaction as the protected write, so the write commits only
/// with a current token, and so a concurrent newer holder's check waits for
/// this transaction to finish. On `Err` the transaction stays usable: roll it
/// back. Costs 1 round trip (none when the arguments are refused). Needs
/// [`migrate`](crate::migrate).
///
/// `resource` must be a valid key name ([`Error::InvalidKey`] otherwise) of
/// at most [`MAX_RESOURCE_LEN`] bytes ([`Error::InvalidArgument`] otherwise).
///
/// The SQL function `distlock.fence_check(resource, token)` applies the same
/// rule for triggers and other languages, raising SQLSTATE `DL001`.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, lock: distlock::SessionLock) -> Result<(), distlock::Error> {
/// use sqlx::Connection;
/// let token = lock.fencing_token().expect("locker built with .fencing(true)");
/// let mut tx = pool.begin().await?;
/// distlock::fence::check(&mut tx, "report:2026-11", token).await?;
/// sqlx::query("UPDATE reports SET body = $1 WHERE month = '2026-11'")
///     .bind("...")
///     .execute(&mut *tx)
///     .await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
///
/// # Guarding your own table
///
/// Where the protected rows live in your own table, keep the token in the row
/// and let the `UPDATE` itself compare it; no call to this function is needed:
///
/// ```sql
/// UPDATE accounts SET balance = $1, fence = $2
///  WHERE id = $3 AND fence <= $2;   -- 0 rows updated: a newer holder wrote first
/// ```
///
/// # Cancel safety
///
/// It runs one statement on `conn` and holds no lock of its own. Dropped
/// before the answer, the statement may or may not have run; in your
/// transaction that is settled by your commit or rollback.
pub async fn check(
    conn: &mut PgConnection,
    resource: &str,
    token: FencingToken,
) -> Result<(), Error> {
    validate_resource(resource)?;
    let newest: i64 = sqlx::query_scalar("SELECT distlock.fence_advance($1, $2)")
        .bind(resource)
        .bind(token.value())
        .fetch_one(conn)
        .await?;
    if newest > token.value() {
        return Err(Error::StaleFencingToken {
            resource: resource.to_owned(),
            presented: token.value(),
            current: newest,
        });
    }
    Ok(())
}

/// The newest token `resource` has accepted, if any. Costs 1 round trip.
/// `resource` is checked as in [`check`], without a round trip.
///
/// # Cancel safety
///
/// Cancel safe: a read.
pub async fn current(
    conn: &mut PgConnection,
    resource: &str,
) -> Result<Option<FencingToken>, Error> {
    validate_resource(resource)?;
    let token: Option<i64> = sqlx::query_scalar(
        "SELECT token FROM distlock.fence_seen WHERE resource OPERATOR(pg_catalog.=) $1",
    )
    .bind(resource)
    .fetch_optional(conn)
    .await?;
    Ok(token.map(FencingToken::new))
}
