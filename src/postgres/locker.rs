//! `PgLocker`: the entry point of the PostgreSQL backend, and its builder.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

/// Hands out PostgreSQL advisory locks from a connection pool.
///
/// Cheap to clone (an `Arc` inside); share one per pool. Every method that
/// takes a key takes `impl Into<LockKey>`, so `"invoice:process"` works
/// directly.
///
/// | method | scope | waits | round trips (after the pool hands out a connection) |
/// |---|---|---|---|
/// | [`with_advisory_lock`](Self::with_advisory_lock) | transaction | no | 3 + your statements (`BEGIN`, try, `COMMIT`) |
/// | [`with_advisory_lock_wait`](Self::with_advisory_lock_wait) | transaction | on the server | 3 + your statements |
/// | [`with_shared_advisory_lock`](Self::with_shared_advisory_lock) | transaction, shared | no | 3 + your statements |
/// | [`try_lock`](Self::try_lock) | session | no | 1 (release: 1) |
/// | [`lock`](Self::lock) | session | on the server | 1 (release: 1) |
/// | [`holders`](Self::holders) | — | — | 1 |
///
/// ```no_run
/// # async fn demo() -> Result<(), distlock::Error> {
/// let pool = sqlx::PgPool::connect("postgres://postgres@localhost/postgres").await?;
/// let locker = distlock::PgLocker::new(pool);
/// if let Some(lock) = locker.try_lock("reports:nightly").await? {
///     // ... work with side effects outside the database ...
///     lock.release().await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct PgLocker {
    pub(crate) inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) pool: PgPool,
    pub(crate) config: Config,
    pub(crate) pooler: super::pooler::PoolerCheck,
}

/// Settings shared by every lock of one [`PgLocker`].
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) heartbeat: Duration,
    pub(crate) heartbeat_timeout: Duration,
    pub(crate) release_timeout: Duration,
    pub(crate) fencing: bool,
}

/// Default interval between two heartbeats of a session lock.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(1);
/// Default deadline for releasing a session lock.
pub const DEFAULT_RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

impl Default for Config {
    fn default() -> Self {
        Self {
            heartbeat: DEFAULT_HEARTBEAT,
            heartbeat_timeout: DEFAULT_HEARTBEAT,
            release_timeout: DEFAULT_RELEASE_TIMEOUT,
            fencing: false,
        }
    }
}

impl PgLocker {
    /// A locker with default settings: heartbeat every second (deadline one
    /// second), release deadline five seconds, no fencing tokens.
    pub fn new(pool: PgPool) -> Self {
        Self::builder(pool).build()
    }

    /// Starts a builder to configure heartbeat, deadlines and fencing.
    pub fn builder(pool: PgPool) -> PgLockerBuilder {
        PgLockerBuilder {
            pool,
            config: Config::default(),
            heartbeat_timeout_set: false,
        }
    }

    /// The pool this locker takes connections from.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    pub(crate) fn config(&self) -> &Config {
        &self.inner.config
    }
}

/// Configures a [`PgLocker`]; from [`PgLocker::builder`].
#[derive(Debug)]
#[must_use = "a builder does nothing until .build() is called"]
pub struct PgLockerBuilder {
    pool: PgPool,
    config: Config,
    heartbeat_timeout_set: bool,
}

impl PgLockerBuilder {
    /// How often a session lock checks that its connection still holds it
    /// (default one second). `lost()` completes at most about one interval
    /// plus the heartbeat deadline after the connection dies. Values below
    /// 10 ms are raised to 10 ms.
    pub fn heartbeat(mut self, every: Duration) -> Self {
        self.config.heartbeat = every.max(Duration::from_millis(10));
        if !self.heartbeat_timeout_set {
            self.config.heartbeat_timeout = self.config.heartbeat;
        }
        self
    }

    /// How long a heartbeat may wait for its answer before the lock counts as
    /// lost (default: the heartbeat interval). A holder that cannot reach the
    /// database must stop trusting its lock. Values below 10 ms are raised to
    /// 10 ms.
    pub fn heartbeat_timeout(mut self, deadline: Duration) -> Self {
        self.config.heartbeat_timeout = deadline.max(Duration::from_millis(10));
        self.heartbeat_timeout_set = true;
        self
    }

    /// How long `SessionLock::release` (and a dropped guard's background
    /// release) may take before the connection is closed instead (default
    /// five seconds). Closing the session frees the lock on the server.
    pub fn release_timeout(mut self, deadline: Duration) -> Self {
        self.config.release_timeout = deadline.max(Duration::from_millis(1));
        self
    }

    /// Issue a fencing token with every session lock (default `false`).
    /// Needs the crate's migrations (`distlock::migrate`).
    pub fn fencing(mut self, enabled: bool) -> Self {
        self.config.fencing = enabled;
        self
    }

    /// Builds the locker.
    pub fn build(self) -> PgLocker {
        PgLocker {
            inner: Arc::new(Inner {
                pool: self.pool,
                config: self.config,
                pooler: super::pooler::PoolerCheck::default(),
            }),
        }
    }
}
