//! The error of a missed deadline, naming who holds the lock: shared by the
//! session, transaction-scoped and multiplexed waits.

use std::time::{Duration, Instant};

use sqlx::PgPool;

use super::conn::HeldConn;
use super::holders;
use crate::{Error, LockKey};

/// Builds [`Error::Timeout`] for `key`, naming the holder if it can be seen:
/// looked up on `conn` when the caller still has a usable connection, else
/// on one from `pool`. Every step has the deadline `within`, so a stalled
/// network cannot hang the caller here either; only a connection that
/// answered goes back to the pool.
pub(crate) async fn timeout_error(
    pool: &PgPool,
    within: Duration,
    key: &LockKey,
    started: Instant,
    conn: Option<HeldConn>,
) -> Error {
    tracing::Span::current().record("outcome", "timeout");
    crate::metrics::timeout("postgres", key, started.elapsed());
    let conn = match conn {
        Some(conn) => Some(conn),
        None => match tokio::time::timeout(within, pool.acquire()).await {
            Ok(Ok(pooled)) => Some(HeldConn::new(pooled, true)),
            _ => None,
        },
    };
    let holder = match conn {
        Some(conn) => first_holder(conn, key, within).await,
        None => None,
    };
    Error::Timeout {
        key: key.to_string(),
        waited: started.elapsed(),
        holder_pid: holder.as_ref().map(|h| h.pid),
        holder_application: holder.and_then(|h| h.application_name),
    }
}

async fn first_holder(
    mut conn: HeldConn,
    key: &LockKey,
    within: Duration,
) -> Option<holders::Holder> {
    let lookup = holders::first_holder(conn.conn(), key);
    match tokio::time::timeout(within, lookup).await {
        Ok(Ok(holder)) => {
            conn.into_pool();
            holder
        }
        _ => None,
    }
}
