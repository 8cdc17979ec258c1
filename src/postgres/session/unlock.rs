//! The unlock statement of a session lock, run on the lock's own
//! connection, which goes back to the pool only after a confirmed unlock.

use std::time::Duration;

use sqlx::Row;
use tokio::time::{Instant, timeout_at};

use crate::postgres::conn::held::HeldConn;
use crate::postgres::conn::warm::is_broken;
use crate::postgres::request::fragments::{bind_key, keyed, permit_channel, session_marker};
use crate::postgres::session::hold::Hold;
use crate::{Error, LockKey, LossReason};

/// The unlock statement around the unlock call `$call(<key>)`: `$call`
/// opens it, `end` closes it after the key. Columns: 0 unlocked (NULL: not
/// the lock's session, nothing given back; the marker reset with the
/// unlock), 1 the backend pid.
macro_rules! unlock_sql {
    ($call:literal) => {
        concat!(
            "SELECT CASE WHEN ",
            session_marker!(ours, "$1::pg_catalog.int4"),
            " THEN CASE WHEN ",
            $call
        )
    };
    (end) => {
        concat!(
            " THEN ",
            session_marker!(unmark),
            " IS NOT NULL ELSE false END END, pg_catalog.pg_backend_pid()"
        )
    };
}

/// Unlocks on the lock's own connection: 1 round trip, no durable write.
/// Only a confirmed unlock by the same backend returns the connection to the
/// pool; anything else closes it, which frees the lock on the server.
pub(crate) async fn unlock(
    mut conn: HeldConn,
    (key, hold): (&LockKey, Hold),
    pid: i32,
    deadline: Instant,
    budget: Duration,
) -> Result<(), Error> {
    let args = key.args()?;
    // `$1` the backend that took the lock, then the key: nothing is given
    // back (column 0 NULL) unless the marker and the backend are the lock's.
    let query = match hold {
        Hold::Exclusive => bind_key(
            sqlx::query(keyed!(args; unlock_sql!("pg_catalog.pg_advisory_unlock("), concat!(")", unlock_sql!(end)); "$2", "$3")).bind(pid),
            args,
        ),
        Hold::Shared => bind_key(
            sqlx::query(keyed!(args; unlock_sql!("pg_catalog.pg_advisory_unlock_shared("), concat!(")", unlock_sql!(end)); "$2", "$3")).bind(pid),
            args,
        ),
        // The payload is the slot's name (`$3`: slots are namespaced keys),
        // which the semaphore's waiters recognise.
        Hold::Permit => bind_key(
            sqlx::query(keyed!(args; unlock_sql!("pg_catalog.pg_advisory_unlock("),
                concat!(")", unlock_sql!(end),
                    ", pg_catalog.pg_notify('", permit_channel!(), "', $3::pg_catalog.text)"); "$2", "$3")).bind(pid),
            args,
        ),
        Hold::All | Hold::Upgradeable => sqlx::query(concat!(
            unlock_sql!("(SELECT true FROM pg_catalog.pg_advisory_unlock_all()"),
            ")",
            unlock_sql!(end)
        ))
        .bind(pid),
    };
    let query = query.fetch_one(conn.conn());
    let row = match timeout_at(deadline, query).await {
        Err(_) => {
            return Err(Error::ReleaseTimedOut {
                key: key.clone(),
                after: budget,
            });
        }
        // The connection failed or the server ended the session: the lock
        // cannot be confirmed released, and it is not this caller's any
        // more (the server frees it with the session, at once when it ended
        // it, once it notices otherwise): `release()` reports a loss.
        Ok(Err(err)) if is_broken(&err) => {
            return Err(Error::LockLost {
                key: key.clone(),
                reason: LossReason::ConnectionFailed(err.to_string()),
            });
        }
        // A prepared statement of this connection missing on the session
        // (or another client's in its way): a pooler put the connection on
        // another server session, and the lock went with the first one.
        Ok(Err(err)) if crate::postgres::pooler::shared_session(&err) => {
            return Err(Error::LockLost {
                key: key.clone(),
                reason: crate::postgres::pooler::loss_reason(&err),
            });
        }
        Ok(row) => row?,
    };
    let (unlocked, actual): (Option<bool>, i32) = (row.try_get(0)?, row.try_get(1)?);
    // Another backend answered (a pooler moved the connection): the lock
    // went with the session that took it, as the heartbeat would report.
    if actual != pid {
        return Err(Error::LockLost {
            key: key.clone(),
            reason: LossReason::BackendChanged {
                expected_pid: pid,
                actual_pid: actual,
            },
        });
    }
    match unlocked {
        Some(true) => {}
        Some(false) => {
            return Err(Error::LockLost {
                key: key.clone(),
                reason: LossReason::NotHeld,
            });
        }
        // The lock's backend, but its marker no longer counts the lock:
        // something else changed the session (a pooler's reset, another
        // client's unlock through it). Nothing was given back; closing the
        // connection ends whatever the session still holds.
        None => {
            return Err(Error::LockLost {
                key: key.clone(),
                reason: LossReason::SessionShared(
                    "the session's distlock marker no longer counts this lock".to_owned(),
                ),
            });
        }
    }
    conn.into_pool();
    Ok(())
}
