//! Deleting a lease's row: the statement, and the background release of a
//! lease dropped without `release()`.

use std::sync::Arc;

use sqlx::{AssertSqlSafe, Row};

use super::inner::Inner;
use super::sql::{self, KeyExpr, Owner};
use crate::Error;
use crate::postgres::conn::HeldConn;

/// `distlock.lease_release` for `owner`: 1 round trip; `true` if the lease
/// was the owner's and unexpired. Only a connection that answered goes back
/// to the pool.
pub(super) async fn release_statement(
    inner: &Inner,
    expr: &KeyExpr,
    owner: Owner,
) -> Result<bool, Error> {
    let mut conn = HeldConn::new(inner.pool.acquire().await?, true);
    let row = sqlx::raw_sql(AssertSqlSafe(sql::release(expr, owner)))
        .fetch_one(conn.conn())
        .await?;
    conn.into_pool();
    Ok(row.try_get(0)?)
}

/// Deletes `owner`'s row of `expr` from a task of its own, within the
/// release deadline, if there is a runtime; otherwise the row expires.
pub(super) fn release_in_background(inner: Arc<Inner>, expr: KeyExpr, owner: Owner) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        let budget = inner.release_timeout;
        match tokio::time::timeout(budget, release_statement(&inner, &expr, owner)).await {
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
