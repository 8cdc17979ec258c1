//! Detecting a transaction-pooling proxy before handing out session locks.
//!
//! Behind PgBouncer with `pool_mode=transaction`, each statement may run on a
//! different server backend, so a session-level lock would be taken on one
//! backend and left there for whoever uses it next. Before its first session
//! lock, a locker asks which backend answers a few consecutive statements on
//! the lock's connection; if the answer changes, it refuses with
//! [`Error::PoolerDetected`]. The probe runs once per `PgLocker` (3 round
//! trips) and *before* any lock is taken, so a refused attempt leaves nothing
//! behind. A proxy that happens to keep one backend through the probe is
//! caught later by the heartbeat, which compares the backend pid on every
//! beat and reports the lock lost. A proxy with a *single* server connection
//! that renames prepared statements shows neither signal; the session
//! marker folded into every lock statement (`sql::session_marker`) refuses a
//! lock on a server session that already holds another client's.

use std::sync::atomic::{AtomicBool, Ordering};

use sqlx::PgConnection;

use crate::postgres::evidence::PoolerEvidence;
use crate::postgres::sqlstate::{
    DUPLICATE_PREPARED_STATEMENT, INVALID_STATEMENT_NAME, locking_error,
};
use crate::{Error, LockKey};

/// The refusal for a statement error that [`shared_session`] recognised.
pub(crate) fn shared_session_error(err: &sqlx::Error) -> Error {
    Error::PoolerDetected {
        evidence: PoolerEvidence::SessionShared {
            message: err.to_string(),
        },
    }
}

/// The refusal for a session that carries another client's lock marker.
pub(crate) fn marker_seen(pid: i32) -> Error {
    Error::PoolerDetected {
        evidence: PoolerEvidence::MarkerSeen { pid },
    }
}

/// The refusal for a connection answered by two backends.
pub(crate) fn backend_changed(from: i32, to: i32) -> Error {
    Error::PoolerDetected {
        evidence: PoolerEvidence::BackendChanged { from, to },
    }
}

/// How many statements the probe runs.
const PROBES: usize = 3;

/// Whether a failed statement shows that the server session is shared with
/// other clients or was swapped under the connection: a prepared statement
/// that another client created there, or one of ours that vanished. This is
/// how a transaction-pooling proxy with a *single* server connection gives
/// itself away, which the pid probe cannot see (every statement is answered
/// by the same backend).
pub(crate) fn shared_session(err: &sqlx::Error) -> bool {
    matches!(
        crate::postgres::sqlstate::sqlstate(err).as_deref(),
        Some(DUPLICATE_PREPARED_STATEMENT | INVALID_STATEMENT_NAME)
    )
}

/// Maps an error of a statement that takes session locks (or waits for
/// one) on a connection of its own: a server session shared with other
/// clients ([`shared_session`]) is reported as [`Error::PoolerDetected`]
/// with the server's error, not as a driver error; anything else as
/// [`locking_error`]. Every session path (single key, multi-key, the
/// multiplexed wake-up wait, the semaphore) maps its errors here, but the
/// multiplexed shared connection's try, which checks [`shared_session`]
/// itself because the finding also ends that connection. Whatever
/// the statement may have taken dies with its connection, which the
/// caller closes.
pub(crate) fn session_locking_error(err: sqlx::Error, key: &LockKey) -> Error {
    if shared_session(&err) {
        return shared_session_error(&err);
    }
    locking_error(err, key)
}

/// What a failed statement on a lock's connection means for the lock.
pub(crate) fn loss_reason(err: &sqlx::Error) -> crate::LossReason {
    if shared_session(err) {
        crate::LossReason::SessionShared(err.to_string())
    } else {
        crate::LossReason::ConnectionFailed(err.to_string())
    }
}

/// Whether a locker has verified that its connections are real sessions.
#[derive(Debug, Default)]
pub(crate) struct PoolerCheck {
    passed: AtomicBool,
}

impl PoolerCheck {
    /// Runs the probe on `conn` unless a previous one passed.
    pub(crate) async fn ensure_session(&self, conn: &mut PgConnection) -> Result<(), Error> {
        if self.passed.load(Ordering::Acquire) {
            return Ok(());
        }
        probe(conn).await?;
        self.passed.store(true, Ordering::Release);
        Ok(())
    }
}

async fn probe(conn: &mut PgConnection) -> Result<(), Error> {
    let mut first = None;
    for _ in 0..PROBES {
        // Unnamed statements: a named one could itself be missing on the
        // next backend and hide the real diagnosis.
        let pid = sqlx::query_scalar::<_, i32>("SELECT pg_catalog.pg_backend_pid()")
            .persistent(false)
            .fetch_one(&mut *conn)
            .await;
        let pid = match pid {
            Ok(pid) => pid,
            Err(err)
                if crate::postgres::sqlstate::sqlstate(&err).as_deref()
                    == Some(INVALID_STATEMENT_NAME) =>
            {
                return Err(shared_session_error(&err));
            }
            Err(err) => return Err(err.into()),
        };
        match first {
            None => first = Some(pid),
            Some(expected) if expected != pid => return Err(backend_changed(expected, pid)),
            Some(_) => {}
        }
    }
    Ok(())
}
