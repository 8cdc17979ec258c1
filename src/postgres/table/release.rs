//! Deleting a lease's row: the statement, and the background release of a
//! lease dropped without `release()`.

use std::sync::Arc;

use sqlx::{AssertSqlSafe, Row};

use super::inner::Inner;
use super::sql::{self, KeyExpr, Owner};
use crate::postgres::conn::held::HeldConn;
use crate::{Error, LockKey};

/// `distlock.lease_release` for `owner`: 1 round trip; `true` if the lease
/// was the owner's and unexpired. It runs on one of the locker's warm
/// connections when there is one (once more on a pooled one if that turns
/// out broken: deleting one's own row twice deletes it once), else on one
/// from the pool. Only a connection that answered is kept or pooled.
pub(super) async fn release_statement(
    inner: &Inner,
    key: &LockKey,
    expr: &KeyExpr,
    owner: Owner,
) -> Result<bool, Error> {
    let statement = move |mut conn: HeldConn| async move {
        let released = delete_row(&mut conn, expr, owner).await;
        (conn, released)
    };
    let (_conn, released) = inner.warm.acquire(|| inner.pooled(key), statement).await?;
    Ok(released)
}

/// The statement on `conn`, which goes back (disarmed) once answered.
async fn delete_row(conn: &mut HeldConn, expr: &KeyExpr, owner: Owner) -> Result<bool, Error> {
    let row = sqlx::raw_sql(AssertSqlSafe(sql::release(expr, owner)))
        .fetch_one(conn.conn())
        .await?;
    conn.disarm();
    Ok(row.try_get(0)?)
}

/// Deletes `owner`'s row of `expr` from a task of its own, within the
/// release deadline, if there is a runtime; otherwise the row expires.
pub(super) fn release_in_background(inner: Arc<Inner>, key: LockKey, expr: KeyExpr, owner: Owner) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        let budget = inner.release_timeout;
        let release = release_statement(&inner, &key, &expr, owner);
        match tokio::time::timeout(budget, release).await {
            Ok(Ok(_)) => tracing::debug!("distlock lease released in the background"),
            Ok(Err(err)) => tracing::warn!(
                error = %err,
                "background release of a lease failed; its row expires after one TTL"
            ),
            Err(_) => tracing::warn!(
                after = ?budget,
                "background release of a lease timed out; its row expires after one TTL"
            ),
        }
    });
}
