//! The crate's single error type.

use std::time::Duration;

use crate::LockKey;
use crate::PoolerEvidence;

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
    /// it (see [`Error::TooManyConnections`]); where distlock itself asks
    /// a full pool for a connection it says so ([`Error::PoolExhausted`]).
    ///
    /// Converting a `sqlx::Error` (`From`, so `?`) turns a missing
    /// `distlock` schema, table or function into [`Error::NotMigrated`]
    /// and a missing grant (SQLSTATE 42501) into
    /// [`Error::PermissionDenied`]; every other driver error stays as it
    /// is.
    #[error(transparent)]
    Database(sqlx::Error),

    /// An error from the Redis client (connection, protocol, server reply);
    /// Redis backend only.
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    #[error(transparent)]
    Redis(#[from] redis::RedisError),

    /// The server did not answer a try's lock command within its deadline:
    /// a stalled network or server. A Redis or lease-table grant whose
    /// answer came in time but was read only after the lease's validity (a
    /// runtime that ran the call too late) counts as none: it is not handed
    /// out, already lost by the clock, and is given back. The deadline is Redis's command deadline
    /// (`RedisLockerBuilder::command_timeout`), or for a PostgreSQL try
    /// (`try_lock`, `try_lock_shared`, `try_lock_upgradeable`,
    /// `try_lock_all`, `with_advisory_lock`, `Semaphore::try_acquire` and
    /// `available_permits`, the election records `proclaim`, `withdraw` and
    /// `leader`, `TableLocker::try_lock`) the heartbeat deadline (5 s for
    /// the run record of `SingletonJob::run`; for `PgLocker::holders_of`,
    /// a read, 5 s or the heartbeat deadline when longer)
    /// ([`PgLockerBuilder::heartbeat_timeout`](crate::PgLockerBuilder::heartbeat_timeout),
    /// the lease table's renewal deadline). The command may still take
    /// effect, and nothing is held for the caller: Redis deletes a key it
    /// set again in the background, PostgreSQL's connection is closed (which
    /// frees a session lock it took) and a lease it took is released in the
    /// background. A waiting `lock` reports a stall as [`Error::Timeout`]
    /// (PostgreSQL) or tries again until its own deadline (Redis).
    #[error("no reply within {after:?} to the command for lock {}", key.shown())]
    CommandTimedOut {
        /// The key of the command.
        key: LockKey,
        /// The deadline that passed.
        after: Duration,
    },

    /// The server did not answer a call that takes no lock within its
    /// deadline, once the pool had handed out a connection: a stalled
    /// network or server. The calls are [`PgLocker::holders`](crate::PgLocker::holders)
    /// (5 s, or the heartbeat deadline when longer) and
    /// [`TableLocker::holders`](crate::postgres::TableLocker::holders) (5 s,
    /// or the lease table's renewal deadline when longer); `call` names
    /// the one that failed. Its connection was closed, not given back to
    /// the pool. A call about one lock that gets no answer reports
    /// [`Error::CommandTimedOut`], naming the lock.
    #[error("no reply within {after:?} to {call}")]
    NoReply {
        /// The call, as `Type::method`.
        call: &'static str,
        /// The deadline that passed.
        after: Duration,
    },

    /// So many Redlock nodes failed (down, refusing connections, too slow,
    /// or refusing the command) that the others could not grant the lock
    /// even if all of them did. Whatever the attempt set was deleted again.
    /// A waiting `lock` keeps trying while the failures may pass (a node
    /// down or slow) and reports this at once when nodes that refuse for
    /// good (failed authentication, a missing ACL permission, …) alone
    /// leave no quorum. Redis backend only.
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    #[error(
        "Redlock quorum unreachable for lock {}: {} of {nodes} nodes failed and {quorum} must grant ({})",
        key.shown(),
        failures.len(),
        failures.join("; ")
    )]
    QuorumUnreachable {
        /// The key that was to be locked.
        key: LockKey,
        /// How many nodes were asked.
        nodes: usize,
        /// How many must grant: N/2 + 1.
        quorum: usize,
        /// Each failing node and why, as `host:port/db: error`.
        failures: Vec<String>,
        /// Whether the failures may pass: the nodes that refuse for good
        /// would still leave room for a quorum once the others (down,
        /// slow, restarting) answer again. A waiting call (`lock`, a
        /// semaphore's `acquire`) then keeps trying until its deadline.
        passing: bool,
    },

    /// Applying the crate's migrations failed.
    #[error(transparent)]
    Migrate(#[from] sqlx::migrate::MigrateError),

    /// The key cannot name a lock (empty, or contains a NUL byte, which
    /// PostgreSQL text cannot hold).
    #[error("invalid lock key {}: {reason}", key.shown())]
    InvalidKey {
        /// The offending key.
        key: LockKey,
        /// Why it was rejected.
        reason: &'static str,
    },

    /// A multi-key call (`try_lock_all`, `lock_all`) was given no keys.
    /// Nothing was sent to the server.
    #[error("no keys to lock")]
    NoKeys,

    /// A multi-key call was given the same key twice. Nothing was sent to
    /// the server.
    #[error("lock {} is listed twice", key.shown())]
    DuplicateKey {
        /// The key listed more than once.
        key: LockKey,
    },

    /// Two different keys of a multi-key call name the same server lock
    /// (for example `LockKey::from("x")` and `LockKey::id` of
    /// `hashtext('x')`): PostgreSQL would grant it twice to one session
    /// and count it once. Found by the lock statement's answer; whatever
    /// it took is freed with its connection, which is closed, not returned
    /// to the pool.
    #[error("two of the keys {} name the same server lock", shown_all(keys))]
    SameServerLock {
        /// The keys as given.
        keys: Vec<LockKey>,
    },

    /// The deadline passed before the lock could be taken.
    ///
    /// On PostgreSQL advisory locks the error says whom the caller waited
    /// behind: `chain` runs from a session holding `key` (its first link,
    /// also in `holder_pid` and `holder_application`) through whomever that
    /// session waits for, to the root holder, or round a cycle (see
    /// [`WaitChain`](crate::postgres::WaitChain)). The chain is looked up
    /// only after the deadline passed, in 1 round trip bounded by the
    /// heartbeat timeout, on the waiting connection when it is still usable,
    /// else on one from the pool; what could not be seen in time is left
    /// empty (`None`, an empty chain). [`lock_xact`](crate::lock_xact)
    /// carries no chain: the timeout aborted the caller's transaction, its
    /// only connection. The lease table, Redis and the in-memory backend
    /// know no waiters and no sessions: their timeouts carry no holder and
    /// no chain.
    #[error(
        "timed out after {waited:?} waiting for lock {}{}{}",
        key.shown(),
        holder_suffix(*holder_pid, holder_application.as_deref()),
        chain_suffix(chain)
    )]
    Timeout {
        /// The key that was asked for.
        key: LockKey,
        /// How long the caller waited.
        waited: Duration,
        /// Backend pid of the session the caller waited for, when PostgreSQL
        /// shows it: the first link of `chain`. A session holding the key;
        /// for a shared wait, a writer holding it or queued ahead of it,
        /// never a reader.
        holder_pid: Option<i32>,
        /// `application_name` of that session, when set.
        holder_application: Option<String>,
        /// Whom the caller waited behind, from the holder of `key` to the
        /// root holder (empty where nothing could be seen).
        chain: crate::postgres::WaitChain,
    },

    /// The lock can no longer be trusted (connection closed or terminated,
    /// heartbeat failed or stalled, backend changed), or a release found it
    /// no longer held (a lease that expired, a server session that did not
    /// hold it: [`LossReason::NotHeld`](crate::LossReason::NotHeld)).
    /// Whatever the caller did after the loss ran without the lock.
    #[error("lock {} was lost: {reason}", key.shown())]
    LockLost {
        /// The key of the lost lock.
        key: LockKey,
        /// Why it was declared lost.
        reason: crate::LossReason,
    },

    /// Statements on one connection ran on different server backends: a
    /// transaction-pooling proxy (such as PgBouncer with
    /// `pool_mode=transaction`) sits between the client and PostgreSQL, so a
    /// session-scoped lock cannot be held. Use the transaction-scoped API or
    /// connect to PostgreSQL directly (or through a session-pooling proxy).
    ///
    /// Nothing was taken for the refused call.
    #[error(
        "a transaction-pooling proxy shares the connection ({evidence}), so it cannot hold \
         session-scoped locks; use with_advisory_lock or a direct connection"
    )]
    PoolerDetected {
        /// What showed the proxy.
        evidence: PoolerEvidence,
    },

    /// PostgreSQL's shared lock table is full (SQLSTATE 53200, "out of shared
    /// memory"); raise `max_locks_per_transaction` or hold fewer locks.
    #[error(
        "the server's lock table is full while locking {} (SQLSTATE 53200); \
         raise max_locks_per_transaction or hold fewer locks",
        key.shown()
    )]
    LockTableFull {
        /// The key whose acquisition failed.
        key: LockKey,
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
    #[error("the server refused a new connection (SQLSTATE 53300): {message}")]
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

    /// Releasing a lock did not finish before its deadline. On PostgreSQL
    /// the connection was closed, so that the server frees the lock when it
    /// notices; where a heartbeat was using the connection at the deadline,
    /// the lock ends when that heartbeat does (unlocked in the background,
    /// or the connection closed if the heartbeat times out too). On Redis
    /// the key expires with its TTL if the delete did not land.
    #[error(
        "releasing lock {} did not finish within {after:?}; it is freed when the server notices or the lease expires",
        key.shown()
    )]
    ReleaseTimedOut {
        /// The key being released.
        key: LockKey,
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
    ///
    /// "Nothing was committed" holds for the lock's own transaction. A
    /// closure that ended it itself (a raw `COMMIT`) and then began another
    /// which an error aborted is reported so too, since the aborted
    /// transaction hides the sign it ended the first
    /// ([`TransactionEnded`](Self::TransactionEnded)): what it did before its
    /// own `COMMIT` stays committed.
    #[error(
        "the transaction holding lock {} was aborted by an SQL error the closure did not \
         return; nothing was committed",
        key.shown()
    )]
    TransactionAborted {
        /// The key of the transaction-scoped lock.
        key: LockKey,
    },

    /// The closure of a transaction-scoped lock ended the lock's transaction
    /// itself (a raw `COMMIT` or `ROLLBACK`), which released the lock in the
    /// middle of the closure: what the closure did after that ran unlocked,
    /// and what it did before may or may not have been committed.
    #[error(
        "the closure ended the transaction holding lock {} itself (raw COMMIT or ROLLBACK); \
         the rest of the closure ran without the lock",
        key.shown()
    )]
    TransactionEnded {
        /// The key of the transaction-scoped lock.
        key: LockKey,
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
    /// [`Migrator::allow_schema_owner`](crate::Migrator::allow_schema_owner):
    /// that role could replace the crate's functions (for example a fence
    /// that accepts every token), so `migrate` refuses to use it.
    #[error(
        "schema {schema} is owned by role {owner:?}, which is not trusted; \
         drop it, change its owner, or allow that owner with Migrator::allow_schema_owner"
    )]
    UntrustedSchema {
        /// The schema (`distlock`).
        schema: String,
        /// The role that owns it.
        owner: String,
    },

    /// The server is a hot standby (in recovery): its advisory locks are its
    /// own, apart from the primary's, so no lock is taken there. Point the
    /// locker's pool at the primary (for example `target_session_attrs`-style
    /// routing in a proxy, or the primary's own address).
    #[error(
        "lock {} refused: the server is a hot standby, whose locks are not the primary's",
        key.shown()
    )]
    HotStandby {
        /// The key that was to be locked.
        key: LockKey,
    },

    /// A waiting call got no connection from the pool before its deadline,
    /// so it never asked the server for the lock: nobody need hold `key`.
    /// `cause` says what the pool looked like at the deadline: every
    /// connection in use (each held session lock, each waiting `lock()` and
    /// each open `with_advisory_lock` transaction keeps one), or no
    /// connection could be opened (server down or unreachable, a connection
    /// limit reached).
    #[error("no connection to take lock {} within {waited:?}: {cause}", key.shown())]
    NoConnection {
        /// The key that was to be locked.
        key: LockKey,
        /// How long the call waited for a connection.
        waited: Duration,
        /// What kept the pool from handing one out, as far as it shows.
        cause: &'static str,
    },

    /// A call that is not waiting (`try_lock`, `with_advisory_lock`, ...)
    /// asked the pool for a connection, and the pool had every one of its
    /// connections in use and none came before the pool's
    /// `acquire_timeout`. A pool belongs to one process, so those
    /// connections are this process's: each held session lock, each open
    /// `with_advisory_lock` transaction and each waiting `lock()` keeps one,
    /// and so does work that takes another connection from the pool while
    /// holding a lock (for example a `with_advisory_lock` closure that runs
    /// its queries on `&pool` instead of the connection it is given). Size
    /// the pool for the locks held plus the work inside them. A waiting call
    /// whose own deadline comes first reports [`Error::NoConnection`]. Work
    /// of your own that waits on the pool gets sqlx's `PoolTimedOut`, which
    /// distlock never sees.
    #[error(
        "no connection for lock {}: every connection of the pool (max_connections {size}) is \
         in use in this process; held locks and open lock transactions keep one each, and so \
         does work inside them that takes its own, so size the pool for both",
        key.shown()
    )]
    PoolExhausted {
        /// The key that was to be locked.
        key: LockKey,
        /// The pool's `max_connections`.
        size: u32,
    },

    /// A transaction-scoped lock (`with_advisory_lock` and its variants)
    /// was asked for on a key that an enclosing call of the same Tokio task
    /// already holds on the same database, in any mode: a shared call inside
    /// a shared one too, since a writer that queues for the key between
    /// them would wait for the outer one, and the inner one behind the
    /// writer (PostgreSQL queues a new request behind the waiting ones).
    /// The inner call could never get
    /// it (the outer one only ends after the inner one), so it fails at
    /// once instead of answering "busy" or waiting for itself until its
    /// timeout. Nothing was sent to the server. Two branches of one task
    /// (`join!`, `select!`) are one task here. Session locks follow the
    /// re-entrancy rule instead: a second `try_lock` of a key the process
    /// holds is `Ok(None)`.
    #[error(
        "lock {} is already held by this task through an enclosing call; \
         a nested lock on the same key would wait for itself",
        key.shown()
    )]
    NestedLock {
        /// The key held by the enclosing call.
        key: LockKey,
    },

    /// A statement found the `distlock` schema, or one of its tables or
    /// functions, missing: the database has not been migrated. Raised by
    /// fencing tokens, [`fence`](crate::fence), [`idempotency`](crate::idempotency),
    /// [`SingletonJob::once_per_window`](crate::SingletonJobBuilder::once_per_window)
    /// and the lease table. Run [`migrate`](crate::migrate) once per
    /// database before using them. Only the schema's own objects count: an
    /// application's missing table called `distlock` stays
    /// [`Error::Database`].
    #[error("the distlock schema is not set up ({message}); call distlock::migrate first")]
    NotMigrated {
        /// The server's message, such as `schema "distlock" does not
        /// exist`.
        message: String,
    },

    /// The server refused a statement for want of a privilege (SQLSTATE
    /// 42501): the role lacks a grant, such as one of those the README's
    /// recipe gives an application role on the `distlock` schema (the
    /// leader record's table, the lease table, the token counter) or one on
    /// the application's own tables. A retry cannot cure it: a leader
    /// election's campaign ends with it.
    #[error(
        "{message}: the role lacks a grant (for distlock's own schema, see the README's recipe)"
    )]
    PermissionDenied {
        /// The server's message, such as `permission denied for table
        /// leaders`.
        message: String,
    },

    /// A lock was granted with fencing on, but the statement that took it
    /// issued no token (the schema's token function returned null: a
    /// changed or damaged `distlock` schema). The lock was not handed out;
    /// its connection was closed, which frees it.
    #[error(
        "lock {} was granted without a fencing token; nothing was handed out",
        key.shown()
    )]
    MissingFencingToken {
        /// The key that was locked.
        key: LockKey,
    },

    /// The server ended a wait for the lock without an error and without
    /// granting it, which `pg_advisory_lock` never does: the connection is
    /// not what it seems. It was closed, which frees whatever it held.
    #[error(
        "the server ended the wait for lock {} without granting it",
        key.shown()
    )]
    NotGranted {
        /// The key that was waited for.
        key: LockKey,
    },

    /// A multiplexed locker's shared connection failed under every attempt
    /// of one `try_lock`, so the try got no answer. Nothing is held for it.
    #[error(
        "the multiplexed connection for lock {} failed on each of {attempts} attempts",
        key.shown()
    )]
    MultiplexFailed {
        /// The key that was tried.
        key: LockKey,
        /// How many connections were tried.
        attempts: usize,
    },

    /// A multiplexed locker could not open its shared connection (and check
    /// its session) within the deadline, the pool's `acquire_timeout`. The
    /// tries queued for it got no lock. That connection is opened outside the
    /// pool, so this is not the pool's `PoolTimedOut`.
    #[error("opening the multiplexed connection did not finish within {after:?}")]
    ConnectTimedOut {
        /// The deadline that passed.
        after: Duration,
    },

    /// A multiplexed locker could not open its shared connection: the
    /// server refused it (a database that does not exist, a failed
    /// password), or its port refused the connection (nothing listening).
    /// `cause` is the driver's error, one for every try queued for that
    /// connection (each gets the same one; a driver error cannot be
    /// copied). The tries got no lock. A connection limit is
    /// [`Error::TooManyConnections`], a missing `CONNECT` right
    /// [`Error::PermissionDenied`], and a connection that did not open in
    /// time (a host that does not answer) [`Error::ConnectTimedOut`].
    #[error("opening the multiplexed connection failed: {cause}")]
    ConnectFailed {
        /// The driver's error.
        #[source]
        cause: std::sync::Arc<sqlx::Error>,
    },

    /// A background task that carries out part of a call stopped before it
    /// answered, which only happens when the Tokio runtime shuts down.
    #[error(
        "the task running {task} for lock {} stopped before it answered",
        key.shown()
    )]
    TaskStopped {
        /// The key of the call.
        key: LockKey,
        /// What the task was doing.
        task: &'static str,
    },

    /// A builder was given a setting outside its documented range (or one
    /// that contradicts another setting); `build()` refuses it rather than
    /// change it. Nothing was sent to a server.
    #[error("invalid setting {setting} = {value}: must be {allowed}")]
    InvalidSetting {
        /// The setting, as its builder method is named (two joined by `+`
        /// when their combination is out of range).
        setting: &'static str,
        /// The value given, as `Debug` prints it.
        value: String,
        /// The range the setting takes.
        allowed: String,
    },

    // Misuse of the kinds, the job runner, the fence and idempotency keys.
    /// An argument is outside what the call accepts, for example a fence
    /// resource or an idempotency key longer than its documented limit, or a
    /// purge age too large for a timestamp. Nothing was sent to the server.
    #[error("invalid argument {argument}: {reason}")]
    InvalidArgument {
        /// The parameter's name, as the function's documentation spells it.
        argument: &'static str,
        /// Why it was refused, naming the limit.
        reason: String,
    },

    /// The backend cannot do what was asked: for example
    /// [`LeaderElection::leader`](crate::LeaderElection::leader) on a
    /// backend that keeps no record of who leads (see
    /// [`ElectionLocker`](crate::ElectionLocker) for which do). Nothing was
    /// sent to a server.
    #[error("{what} is not supported by the {backend} backend")]
    Unsupported {
        /// The call, as its documentation names it.
        what: &'static str,
        /// The backend, as [`Locker::backend`](crate::Locker::backend) names it.
        backend: &'static str,
    },

    /// A campaign for leadership ended because it was resigned (or every
    /// handle of it was dropped), so it will not lead again; from
    /// [`Campaign::elected`](crate::Campaign::elected).
    #[error("the campaign for {} has ended", key.shown())]
    CampaignEnded {
        /// The election's key.
        key: LockKey,
    },

    /// A call that starts background work was made outside a Tokio runtime
    /// (for example [`LeaderElection::campaign`](crate::LeaderElection::campaign)
    /// from synchronous code): the payload names the call.
    #[error("{0} needs a Tokio runtime; call it from async code or within Runtime::enter")]
    NoRuntime(&'static str),
}

impl From<sqlx::Error> for Error {
    fn from(err: sqlx::Error) -> Self {
        crate::postgres::sqlstate::driver_error(err)
    }
}

impl Error {
    /// The same error naming `key` where it names one lock: a kind built
    /// from internal locks (the semaphore's slots) reports the name its
    /// caller gave, not the internal key. `InvalidKey` and `NestedLock`
    /// keep theirs: they describe that key itself.
    pub(crate) fn naming(mut self, key: &LockKey) -> Self {
        if let Some(named) = self.key_mut() {
            named.clone_from(key);
        }
        self
    }

    /// Whether a try that failed with this error may succeed if made
    /// again: no answer within the command deadline, or a Redis failure
    /// that passes (a connection refused or reset, a server loading its
    /// data or in a failover; Redlock nodes that do so on a quorum). A
    /// waiting kind built from plain tries (the semaphore over any locker)
    /// treats it as a busy try until its deadline, as a backend's own
    /// waiting `lock` does.
    pub(crate) fn passes(&self) -> bool {
        match self {
            Self::CommandTimedOut { .. } => true,
            #[cfg(feature = "redis")]
            Self::Redis(err) => crate::redis::node::is_transient(err),
            #[cfg(feature = "redis")]
            Self::QuorumUnreachable { passing, .. } => *passing,
            _ => false,
        }
    }

    fn key_mut(&mut self) -> Option<&mut LockKey> {
        match self {
            #[cfg(feature = "redis")]
            Self::QuorumUnreachable { key, .. } => Some(key),
            Self::CommandTimedOut { key, .. }
            | Self::DuplicateKey { key }
            | Self::Timeout { key, .. }
            | Self::LockLost { key, .. }
            | Self::LockTableFull { key }
            | Self::ReleaseTimedOut { key, .. }
            | Self::TransactionAborted { key }
            | Self::TransactionEnded { key }
            | Self::HotStandby { key }
            | Self::NoConnection { key, .. }
            | Self::PoolExhausted { key, .. }
            | Self::MissingFencingToken { key }
            | Self::NotGranted { key }
            | Self::MultiplexFailed { key, .. }
            | Self::TaskStopped { key, .. }
            | Self::CampaignEnded { key } => Some(key),
            _ => None,
        }
    }
}

fn shown_all(keys: &[LockKey]) -> String {
    let each: Vec<String> = keys.iter().map(LockKey::shown).collect();
    each.join(", ")
}

/// `, which waits behind pid 11 (application "b")`, for each link after the
/// holder; `..., which waits behind pid 10 again: a cycle` at a cycle.
fn chain_suffix(chain: &crate::postgres::WaitChain) -> String {
    let mut out = String::new();
    for link in chain.links.iter().skip(1) {
        out.push_str(&format!(", which waits behind pid {}", link.pid));
        if let Some(app) = link.application_name.as_deref().filter(|a| !a.is_empty()) {
            out.push_str(&format!(" (application {app:?})"));
        }
    }
    if let Some(pid) = chain.cycle {
        out.push_str(&format!(
            ", which waits behind pid {pid} again: a cycle, a deadlock not broken yet"
        ));
    }
    out
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
            chain: Default::default(),
        };
        let any = anyhow::Error::from(err);
        assert_eq!(
            any.to_string(),
            "timed out after 1.5s waiting for lock \"jobs:nightly\" \
             (held by pid 4242, application \"billing-worker\")"
        );
        assert!(any.downcast_ref::<Error>().is_some());
    }

    #[test]
    fn untrusted_schema_message_reads_as_one_sentence() {
        let err = Error::UntrustedSchema {
            schema: "distlock".into(),
            owner: "mallory".into(),
        };
        assert_eq!(
            err.to_string(),
            "schema distlock is owned by role \"mallory\", which is not trusted; \
             drop it, change its owner, or allow that owner with Migrator::allow_schema_owner"
        );
    }

    #[test]
    fn keys_of_different_kinds_read_differently() {
        let lost = |key: LockKey| {
            Error::LockLost {
                key,
                reason: crate::LossReason::KeeperStopped,
            }
            .to_string()
        };
        assert_eq!(
            lost(LockKey::from("42")),
            "lock \"42\" was lost: the task keeping the lock stopped"
        );
        assert_eq!(
            lost(LockKey::id(42)),
            "lock 42 was lost: the task keeping the lock stopped"
        );
        assert!(lost(LockKey::namespaced(3, "a")).starts_with("lock \"a\" in namespace 3 "));
        assert!(lost(LockKey::hashed64("a")).starts_with("lock \"a\" (hashed64) "));
        assert!(
            lost(LockKey::from("x".repeat(100))).contains(&format!("\"{}\"...", "x".repeat(64)))
        );
    }

    #[test]
    fn conditions_that_cannot_be_staged_read_as_one_sentence() {
        let key = LockKey::from("k");
        for (err, text) in [
            (
                Error::NotGranted { key: key.clone() },
                "the server ended the wait for lock \"k\" without granting it",
            ),
            (
                Error::MultiplexFailed {
                    key: key.clone(),
                    attempts: 2,
                },
                "the multiplexed connection for lock \"k\" failed on each of 2 attempts",
            ),
            (
                Error::NoReply {
                    call: "PgLocker::holders",
                    after: Duration::from_secs(5),
                },
                "no reply within 5s to PgLocker::holders",
            ),
            (
                Error::ConnectTimedOut {
                    after: Duration::from_secs(3),
                },
                "opening the multiplexed connection did not finish within 3s",
            ),
            (
                Error::TaskStopped {
                    key: key.clone(),
                    task: "lease_acquire",
                },
                "the task running lease_acquire for lock \"k\" stopped before it answered",
            ),
            (
                Error::PoolerDetected {
                    evidence: PoolerEvidence::BackendChanged { from: 10, to: 11 },
                },
                "a transaction-pooling proxy shares the connection (backend pid changed from 10 \
                 to 11), so it cannot hold session-scoped locks; use with_advisory_lock or a \
                 direct connection",
            ),
        ] {
            assert_eq!(err.to_string(), text);
        }
    }
}
