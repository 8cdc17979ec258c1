//! What showed that a transaction-pooling proxy shares a lock's
//! connection: the evidence an [`Error::PoolerDetected`](crate::Error::PoolerDetected)
//! carries (the detection itself is in `pooler.rs`).

use std::fmt;

/// What showed that a transaction-pooling proxy shares a lock's connection,
/// carried by [`Error::PoolerDetected`](crate::Error::PoolerDetected).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PoolerEvidence {
    /// Two statements on one connection were answered by different server
    /// backends (the proxy moved the connection between them).
    BackendChanged {
        /// The backend pid that answered first (or took the lock).
        from: i32,
        /// The backend pid that answered later.
        to: i32,
    },
    /// A statement failed in a way only a shared server session produces: a
    /// prepared statement that another client created there (SQLSTATE
    /// 42P05), or one of this connection's that vanished (26000).
    SessionShared {
        /// The server's error.
        message: String,
    },
    /// The server session already carried distlock's lock marker when this
    /// connection had taken no lock on it: another client's lock is held on
    /// the same session (a proxy with a single server connection).
    MarkerSeen {
        /// The backend pid of that session.
        pid: i32,
    },
}

impl fmt::Display for PoolerEvidence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BackendChanged { from, to } => {
                write!(f, "backend pid changed from {from} to {to}")
            }
            Self::SessionShared { message } => {
                write!(
                    f,
                    "the server session is shared with other clients: {message}"
                )
            }
            Self::MarkerSeen { pid } => write!(
                f,
                "server session {pid} already holds another client's lock"
            ),
        }
    }
}
