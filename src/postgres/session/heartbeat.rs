//! The heartbeat of a lock held on a connection: which backend answers,
//! within a deadline, and whether the session still counts this
//! connection's one lock.

use tokio::time::timeout;

use std::time::Duration;

use crate::LossReason;
use crate::postgres::conn::held::HeldConn;
use crate::postgres::request::fragments::session_marker;

/// The heartbeat: which backend answers, and whether the session still
/// counts this connection's one lock (see [`session_marker`]).
pub(crate) const HEARTBEAT: &str = concat!(
    "SELECT pg_catalog.pg_backend_pid(), ",
    session_marker!(read)
);

/// A heartbeat that also sets the TCP keepalives (see
/// [`keepalives`](crate::postgres::request::fragments::keepalives)), for a connection opened without a
/// lock statement (a multiplexed connection). The settings are harmless for
/// the connection's later users; on a Unix-domain socket they are ignored.
pub(crate) const FIRST_HEARTBEAT: &str = concat!(
    "SELECT pg_catalog.pg_backend_pid(), ",
    crate::postgres::request::fragments::keepalives!()
);

/// One heartbeat: the same backend must still answer, within the deadline.
/// 1 round trip, no write.
pub(crate) async fn heartbeat(
    conn: &mut HeldConn,
    sql: &'static str,
    pid: i32,
    deadline: Duration,
) -> Result<(), LossReason> {
    let query = sqlx::query_as::<_, (i32, Option<String>)>(sql).fetch_one(conn.conn());
    match timeout(deadline, query).await {
        Err(_) => Err(LossReason::HeartbeatTimedOut(deadline)),
        Ok(Err(err)) => Err(crate::postgres::pooler::loss_reason(&err)),
        Ok(Ok((actual, _))) if actual != pid => Err(LossReason::BackendChanged {
            expected_pid: pid,
            actual_pid: actual,
        }),
        // Someone reset or changed the session's lock count: the session
        // is not this connection's alone (a pooler's reset query, or
        // another client on the same server session).
        Ok(Ok((_, marker))) if marker.as_deref() != Some("1") => Err(LossReason::SessionShared(
            format!("the session's lock count is {marker:?}, expected this lock's 1"),
        )),
        Ok(Ok(_)) => Ok(()),
    }
}
