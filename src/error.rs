//! The crate's single error type.

use std::time::Duration;

/// A `Result` whose error defaults to [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in `distlock`.
///
/// Contention is *not* an error: a try-style call that finds the lock held
/// elsewhere returns `Ok(None)`. Variants are meant to be matched on; the enum
/// is `#[non_exhaustive]` so new failure modes can be added without a breaking
/// change.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An error from the database driver (connection, protocol, SQL). A
    /// pool that cannot open a connection in time gives
    /// `sqlx::Error::PoolTimedOut`, also when a connection limit refuses
    /// it (see [`Error::TooManyConnections`]).
    #[error(transparent)]
    Database(#[from] sqlx::Error),

    /// An error from the Redis client (connection, protocol, server reply);
    /// Redis backend only.
    #[cfg(feature = "redis")]
    #[error(transparent)]
    Redis(#[from] redis::RedisError),

    /// Applying the crate's migrations failed.
    #[error(transparent)]
    Migrate(#[from] sqlx::migrate::MigrateError),

    /// The key cannot name a lock (empty, or contains a NUL byte, which
    /// PostgreSQL text cannot hold).
    #[error("invalid lock key {name:?}: {reason}")]
    InvalidKey {
        /// The offending name (truncated to 64 characters).
        name: String,
        /// Why it was rejected.
        reason: &'static str,
    },

    /// The deadline passed before the lock could be taken.
    #[error(
        "timed out after {waited:?} waiting for lock {key}{}",
        holder_suffix(*holder_pid, holder_application.as_deref())
    )]
    Timeout {
        /// The key that was asked for.
        key: String,
        /// How long the caller waited.
        waited: Duration,
        /// Backend pid of a session holding the lock, when PostgreSQL shows it.
        holder_pid: Option<i32>,
        /// `application_name` of that session, when set.
        holder_application: Option<String>,
    },

    /// The server reported that the lock was not held when it was released.
    #[error("lock {key} was not held by this session when released")]
    LockNotHeld {
        /// The key that was released.
        key: String,
    },

    /// The lock can no longer be trusted (connection closed or terminated,
    /// heartbeat failed or stalled, backend changed).
    #[error("lock {key} was lost: {reason}")]
    LockLost {
        /// The key of the lost lock.
        key: String,
        /// Why it was declared lost.
        reason: crate::LossReason,
    },

    /// Statements on one connection ran on different server backends: a
    /// transaction-pooling proxy (such as PgBouncer with
    /// `pool_mode=transaction`) sits between the client and PostgreSQL, so a
    /// session-scoped lock cannot be held. Use the transaction-scoped API or
    /// connect to PostgreSQL directly (or through a session-pooling proxy).
    #[error(
        "backend pid changed from {expected_pid} to {actual_pid}: a transaction-pooling proxy \
         cannot hold session-scoped locks; use with_advisory_lock or a direct connection"
    )]
    PoolerDetected {
        /// The backend pid that took the lock.
        expected_pid: i32,
        /// The backend pid that answered later.
        actual_pid: i32,
    },

    /// PostgreSQL's shared lock table is full (SQLSTATE 53200, "out of shared
    /// memory"); raise `max_locks_per_transaction` or hold fewer locks.
    #[error(
        "PostgreSQL's lock table is full while locking {key} (SQLSTATE 53200); \
         raise max_locks_per_transaction or hold fewer locks"
    )]
    LockTableFull {
        /// The key whose acquisition failed.
        key: String,
    },

    /// PostgreSQL refused a new connection because a connection limit is
    /// reached (SQLSTATE 53300, `too_many_connections`: the server's
    /// `max_connections`, or a `CONNECTION LIMIT` of the role or the
    /// database). Raised where distlock opens a connection itself: the
    /// shared connections of a [multiplexed](crate::PgLockerBuilder::multiplex)
    /// locker. Every try queued for the refused connection gets this error;
    /// locks already held on open connections are not affected.
    ///
    /// Connections from a pool are opened by sqlx, which retries this
    /// refusal until the pool's `acquire_timeout`: a call that needs a new
    /// pooled connection then fails with
    /// `Error::Database(sqlx::Error::PoolTimedOut)`, and a call that waits
    /// (`lock`, `with_advisory_lock_wait`) with [`Error::Timeout`] if its
    /// own deadline comes first.
    #[error("PostgreSQL refused a new connection (SQLSTATE 53300): {message}")]
    TooManyConnections {
        /// The server's message, such as `too many connections for
        /// database "app"`.
        message: String,
    },

    /// A multiplexed locker already holds as many locks as its
    /// [`max_locks`](crate::PgLockerBuilder::max_locks) allows.
    #[error("this locker already holds {limit} locks, its max_locks")]
    TooManyLocks {
        /// The configured cap.
        limit: usize,
    },

    /// Releasing a lock did not finish before its deadline; the connection
    /// was closed so that PostgreSQL frees the lock when it notices.
    #[error("releasing lock {key} did not finish within {after:?}; its connection was closed")]
    ReleaseTimedOut {
        /// The key being released.
        key: String,
        /// The deadline that passed.
        after: Duration,
    },

    /// A fencing token older than the newest one seen for the resource.
    #[error(
        "stale fencing token for {resource}: presented {presented}, but {current} was already seen"
    )]
    StaleFencingToken {
        /// The protected resource.
        resource: String,
        /// The token that was presented.
        presented: i64,
        /// The highest token recorded so far.
        current: i64,
    },

    /// The transaction of a transaction-scoped lock was aborted by an SQL
    /// error that the closure did not return (for example one it ignored):
    /// PostgreSQL would have turned the `COMMIT` into a `ROLLBACK`, so none of
    /// the closure's work was committed. The transaction was rolled back.
    #[error(
        "the transaction holding lock {key} was aborted by an SQL error the closure did not \
         return; nothing was committed"
    )]
    TransactionAborted {
        /// The key of the transaction-scoped lock.
        key: String,
    },

    /// The closure of a transaction-scoped lock ended the lock's transaction
    /// itself (a raw `COMMIT` or `ROLLBACK`), which released the lock in the
    /// middle of the closure: what the closure did after that ran unlocked,
    /// and what it did before may or may not have been committed.
    #[error(
        "the closure ended the transaction holding lock {key} itself (raw COMMIT or ROLLBACK); \
         the rest of the closure ran without the lock"
    )]
    TransactionEnded {
        /// The key of the transaction-scoped lock.
        key: String,
    },

    /// A lock inside the caller's transaction (`try_lock_xact`, `lock_xact`)
    /// was asked for on a connection that is not inside a transaction
    /// begun through sqlx: the lock would end with the statement that took
    /// it.
    #[error(
        "not inside a transaction: a transaction-scoped lock would end with the statement; \
         call it on a sqlx::Transaction (&mut *tx)"
    )]
    NotInTransaction,

    /// Schema `distlock` is owned by a role that is neither the current one,
    /// a superuser, nor allowed by
    /// [`MigrateOptions::allow_schema_owner`](crate::MigrateOptions::allow_schema_owner):
    /// that role could replace the crate's functions (for example a fence
    /// that accepts every token), so `migrate` refuses to use it.
    #[error(
        "schema {schema} is owned by role {owner:?}, which is not trusted;          drop it, change its owner, or allow that owner in MigrateOptions"
    )]
    UntrustedSchema {
        /// The schema (`distlock`).
        schema: String,
        /// The role that owns it.
        owner: String,
    },

    /// A configuration value is out of range.
    #[error("invalid configuration: {0}")]
    InvalidConfig(&'static str),
}

fn holder_suffix(pid: Option<i32>, application: Option<&str>) -> String {
    match (pid, application) {
        (Some(pid), Some(app)) if !app.is_empty() => {
            format!(" (held by pid {pid}, application {app:?})")
        }
        (Some(pid), _) => format!(" (held by pid {pid})"),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync_static<T: Send + Sync + 'static>() {}

    #[test]
    fn error_converts_into_anyhow_and_names_the_holder() {
        assert_send_sync_static::<Error>();
        let err = Error::Timeout {
            key: "jobs:nightly".into(),
            waited: Duration::from_millis(1500),
            holder_pid: Some(4242),
            holder_application: Some("billing-worker".into()),
        };
        let any = anyhow::Error::from(err);
        assert_eq!(
            any.to_string(),
            "timed out after 1.5s waiting for lock jobs:nightly \
             (held by pid 4242, application \"billing-worker\")"
        );
        assert!(any.downcast_ref::<Error>().is_some());
    }
}
