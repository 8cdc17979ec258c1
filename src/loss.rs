//! Why a held lock stopped being trustworthy.

use std::fmt;
use std::time::Duration;

/// Why a lease was declared lost.
///
/// Reported by `SessionLock::loss` and inside [`Error::LockLost`](crate::Error::LockLost).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LossReason {
    /// The connection holding the lock failed (closed, reset, or the backend
    /// was terminated). The text is the driver's error message.
    ConnectionFailed(String),
    /// A heartbeat got no answer within its deadline. The holder can no longer
    /// tell whether the server still holds its lock, so it must stop trusting it.
    HeartbeatTimedOut(Duration),
    /// The backend answering on the lock's connection is not the one that took
    /// the lock: a transaction-pooling proxy moved the session.
    BackendChanged {
        /// The backend pid that took the lock.
        expected_pid: i32,
        /// The backend pid that answered the heartbeat.
        actual_pid: i32,
    },
    /// The server session answering on the lock's connection is shared with
    /// other clients: a prepared statement appeared or vanished between two
    /// statements, the signature of a transaction-pooling proxy that kept
    /// the same backend. The text is the server's error.
    SessionShared(String),
    /// A lock statement on a connection shared by many locks (multiplexed
    /// mode) failed after it may have taken its lock, so the session may
    /// hold a lock no guard owns. The session was closed, which frees it,
    /// and with it every lock on that connection. A failed statement that
    /// the session shows to have taken nothing (one more lookup, 1 round
    /// trip) costs no other lock. The text is the error.
    SessionAbandoned(String),
    /// The lease's time to live ran out or its key now holds another owner's
    /// token (lease-based backends such as Redis).
    Expired,
    /// A release found the lock not held by the session that took it: the
    /// server answered that it had nothing to unlock, so the lock had
    /// already gone (how and when is not known).
    NotHeld,
    /// The background task keeping the lock stopped (for example because the
    /// runtime shut down); the connection was closed.
    KeeperStopped,
    /// An operation that changes what a held lock holds (an
    /// [`UpgradeableLock`](crate::UpgradeableLock)'s upgrade or downgrade)
    /// was dropped before it finished, its statement perhaps still running:
    /// the lock's connection was closed, which frees everything the lock
    /// held, rather than leave the server holding something no guard knows.
    Interrupted,
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ConnectionFailed(msg) => write!(f, "connection failed: {msg}"),
            Self::HeartbeatTimedOut(after) => {
                write!(f, "heartbeat got no answer within {after:?}")
            }
            Self::BackendChanged {
                expected_pid,
                actual_pid,
            } => write!(
                f,
                "backend pid changed from {expected_pid} to {actual_pid} (transaction-pooling proxy?)"
            ),
            Self::SessionShared(msg) => write!(
                f,
                "the server session is shared with other clients (transaction-pooling proxy?): {msg}"
            ),
            Self::SessionAbandoned(msg) => write!(
                f,
                "a lock statement on the shared connection failed after it may have taken \
                 its lock, so the session was closed: {msg}"
            ),
            Self::Expired => f.write_str("the lease expired or was taken over"),
            Self::NotHeld => f.write_str("the server did not hold it at release"),
            Self::KeeperStopped => f.write_str("the task keeping the lock stopped"),
            Self::Interrupted => f.write_str(
                "an upgrade or downgrade was dropped midway, so the lock's connection was closed",
            ),
        }
    }
}
