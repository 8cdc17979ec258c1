//! Deleting a lease's row: the statement within the release deadline, and
//! the background release of a lease dropped without `release()`.

use std::sync::Arc;

use sqlx::Row;
use tokio::time::Instant;

use super::inner::Inner;
use super::sql::{self, KeyExpr, Owner};
use crate::postgres::conn::held::HeldConn;
use crate::{Error, LockKey};

/// `distlock.lease_release` for `owner`, within the locker's release
/// deadline: 1 round trip; `true` if the lease was the owner's and
/// unexpired, [`Error::ReleaseTimedOut`] past the deadline. It runs on one
/// of the locker's warm connections when there is one (once more on a
/// pooled one if that turns out broken: deleting one's own row twice
/// deletes it once), else on one from the pool. Only a connection that
/// answered is kept or pooled.
///
/// The statement's wait for a row another transaction locked ends on the
/// server too, at about the deadline (a statement-local `lock_timeout` of
/// what is left once the connection is in hand): a release given up on
/// does not stay behind as a backend waiting on the row.
pub(super) async fn release_statement(
    inner: &Inner,
    key: &LockKey,
    expr: &KeyExpr,
    owner: Owner,
) -> Result<bool, Error> {
    let deadline = crate::deadline::after(Instant::now(), inner.release_timeout);
    let statement = move |mut conn: HeldConn| async move {
        let released = delete_row(&mut conn, expr, owner, deadline).await;
        (conn, released)
    };
    let released = inner.warm.acquire(|| inner.pooled(key), statement);
    let timed_out = || Error::ReleaseTimedOut {
        key: key.clone(),
        after: inner.release_timeout,
    };
    match tokio::time::timeout_at(deadline, released).await {
        Ok(Ok((_, Some(released)))) => Ok(released),
        Ok(Ok((_, None))) | Err(_) => Err(timed_out()),
        Ok(Err(err)) => Err(err),
    }
}

/// The statement on `conn`, which goes back (disarmed) once answered;
/// `None` if its wait for the row ran into `deadline` on the server.
async fn delete_row(
    conn: &mut HeldConn,
    expr: &KeyExpr,
    owner: Owner,
    deadline: Instant,
) -> Result<Option<bool>, Error> {
    let release = |wait| sql::release(expr, owner, wait);
    let row = super::row_wait::answered_by(conn, deadline, release).await?;
    Ok(row.map(|row| row.try_get(0)).transpose()?)
}

/// Deletes `owner`'s row of `expr` from a task of its own, within the
/// release deadline, if there is a runtime; otherwise the row expires.
pub(super) fn release_in_background(inner: Arc<Inner>, key: LockKey, expr: KeyExpr, owner: Owner) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        match release_statement(&inner, &key, &expr, owner).await {
            Ok(_) => tracing::debug!("distlock lease released in the background"),
            Err(Error::ReleaseTimedOut { after, .. }) => tracing::warn!(
                ?after,
                "background release of a lease timed out; its row expires after one TTL"
            ),
            Err(err) => tracing::warn!(
                error = %err,
                "background release of a lease failed; its row expires after one TTL"
            ),
        }
    });
}
