//! What the lock table says of one session and one advisory lock: the key
//! as `pg_locks` shows it, the mode, a row of [`PgLocker::holders`](crate::PgLocker::holders)
//! and a link of a wait chain. The queries that fill them are in
//! `holders.rs`, the chains in `wait_chain.rs`.

use std::fmt;
use std::time::SystemTime;

/// An advisory lock key as PostgreSQL's `pg_locks` shows it.
///
/// Server-hashed keys (`LockKey::from("name")`) appear as the `bigint` that
/// `hashtext('name')` yields; the name itself is not recoverable, so use
/// [`PgLocker::holders_of`](crate::PgLocker::holders_of) to look one up by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AdvisoryKey {
    /// The single-`bigint` keyspace.
    BigInt(i64),
    /// The two-`int4` keyspace.
    Pair(i32, i32),
}

impl fmt::Display for AdvisoryKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BigInt(k) => write!(f, "{k}"),
            Self::Pair(a, b) => write!(f, "({a}, {b})"),
        }
    }
}

/// Whether a lock is exclusive or shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LockMode {
    /// Held alone (`pg_advisory_lock`, `pg_try_advisory_xact_lock`, ...).
    Exclusive,
    /// Held alongside other shared holders (`..._shared` functions).
    Shared,
}

/// One row of [`PgLocker::holders`](crate::PgLocker::holders): a session holding or awaiting an
/// advisory lock.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Holder {
    /// The lock's key.
    pub key: AdvisoryKey,
    /// Backend process id of the session; 0 for a lock kept by a prepared
    /// transaction (`PREPARE TRANSACTION`), which has no session (as
    /// `pg_blocking_pids` names it too).
    pub pid: i32,
    /// The session's `application_name`, if set.
    pub application_name: Option<String>,
    /// The client's address, if connected over TCP.
    pub client_addr: Option<String>,
    /// When waiting: when the wait began. When granted: the start of the
    /// holder's transaction or, outside a transaction, of its session.
    /// PostgreSQL does not record when a lock was granted: for a
    /// transaction-scoped lock this is the earliest moment it can have been
    /// taken; a session lock may be older than the transaction its session
    /// is in now (only the session's start bounds it).
    pub since: Option<SystemTime>,
    /// `true` if held, `false` if waiting for it.
    pub granted: bool,
    /// Exclusive or shared.
    pub mode: LockMode,
    /// For a waiting row, the sessions it waits for (PostgreSQL's
    /// `pg_blocking_pids`): the holders of a conflicting lock, and waiters
    /// ahead of it in the queue whose request conflicts with its own. Empty
    /// for a granted row. [`waits_for`](Self::waits_for) says who they are;
    /// [`wait_chain`](super::wait_chain) follows them to the root holder.
    pub blocked_by: Vec<i32>,
    /// [`blocked_by`](Self::blocked_by) resolved from the same answer: each
    /// blocking session's lock on this key (held, or awaited ahead of this
    /// waiter), with its pid, application name and since when. Empty for a
    /// granted row. A blocker that let go between PostgreSQL's two looks
    /// (the lock table, then `pg_blocking_pids`) has no row to resolve to and
    /// stays only in `blocked_by`.
    pub waits_for: Vec<ChainLink>,
}

// Every relation and function below by its `pg_catalog` name, so a
// `search_path` with look-alikes ahead of `pg_catalog` changes nothing.

/// A session and its lock on one key, as one link of a [`WaitChain`](super::WaitChain) or
/// one entry of [`Holder::waits_for`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChainLink {
    /// The lock's key.
    pub key: AdvisoryKey,
    /// Backend process id of the session.
    pub pid: i32,
    /// The session's `application_name`, if set (and visible to the role
    /// that looked: see [`PgLocker::holders`](crate::PgLocker::holders)).
    pub application_name: Option<String>,
    /// As [`Holder::since`]: when the wait began, or when granted the start
    /// of the holder's transaction (or of its session, outside one).
    pub since: Option<SystemTime>,
    /// `true` if the session holds the lock, `false` if it waits for it
    /// (queued ahead of the waiter with a conflicting request).
    pub granted: bool,
    /// Exclusive or shared.
    pub mode: LockMode,
}

impl From<&Holder> for ChainLink {
    fn from(row: &Holder) -> Self {
        Self {
            key: row.key,
            pid: row.pid,
            application_name: row.application_name.clone(),
            since: row.since,
            granted: row.granted,
            mode: row.mode,
        }
    }
}
