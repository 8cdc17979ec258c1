//! `PgLocker`: the entry point of the PostgreSQL backend, and its builder.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use super::config::Config;
use super::holders::Holder;
use crate::{Error, LockKey};

/// Hands out PostgreSQL advisory locks from a connection pool.
///
/// Cheap to clone (an `Arc` inside); share one per pool. Every method that
/// takes a key takes `impl Into<LockKey>`, so `"invoice:process"` works
/// directly.
///
/// | method | scope | waits | round trips (plus the pool's 2 pings when no [warm connection](PgLockerBuilder::keep_warm) is kept) |
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
    /// Starts session locks' keepers when their first heartbeat is due.
    pub(crate) keepers: super::timer::Timer,
    /// Present when built with `.multiplex(n)`, n > 0.
    pub(crate) mux: Option<super::mux::Mux>,
    /// Connections kept between locks, so the next skips the pool.
    pub(crate) warm: Arc<super::warm::Warm>,
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

    /// The interval between two heartbeats of a session lock, as the
    /// builder settled it.
    pub fn heartbeat(&self) -> Duration {
        self.inner.config.heartbeat
    }

    /// How long a heartbeat may wait for its answer before the lock counts
    /// as lost, as the builder settled it.
    pub fn heartbeat_timeout(&self) -> Duration {
        self.inner.config.heartbeat_timeout
    }

    /// Builds [`Error::Timeout`](crate::Error::Timeout) for a missed
    /// deadline, naming the holder where PostgreSQL shows it.
    pub(crate) async fn timeout_error(
        &self,
        key: &crate::LockKey,
        started: std::time::Instant,
        conn: Option<super::conn::HeldConn>,
    ) -> crate::Error {
        let within = self.config().heartbeat_timeout;
        super::timeout::timeout_error(self.pool(), within, key, started, conn).await
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

    /// Hold session locks over `connections` shared connections instead of
    /// one pooled connection per lock (default 0: one per lock).
    ///
    /// With `.multiplex(4)`, a process holding 5,000 session locks uses 4
    /// connections to PostgreSQL, with one heartbeat per connection instead
    /// of one per lock. The connections are opened lazily from the pool's
    /// connect options (outside the pool: they take none of its slots, and
    /// the pool's `after_connect` hooks do not run on them) and each key is
    /// pinned to one of them by its hash. [`SessionLock`](crate::SessionLock)
    /// behaves as in the default mode, with these differences:
    ///
    /// - **Shared fate.** When a shared connection fails (terminated, a
    ///   heartbeat or any statement on it gets no answer within the
    ///   heartbeat deadline, a different backend answers), *all* locks on it
    ///   are lost at once; the next acquisition pinned there opens a fresh
    ///   connection.
    /// - **Queueing.** The statements of the locks on one connection run one
    ///   after another, so a try or release may wait behind the others' (each
    ///   is still 1 round trip).
    /// - **Waiting.** [`PgLocker::lock`] never waits on a shared connection:
    ///   while the key is busy it waits on a temporary connection from the
    ///   pool until the holder lets go, then tries on the shared connection,
    ///   until the deadline. A hand-off costs 2 round trips more than in the
    ///   default mode and is not first-come-first-served (another process
    ///   may take the key between the wake-up and the try).
    /// - **One holder per process and key.** A key held through this locker
    ///   is busy for its other callers, as in the default mode, although
    ///   PostgreSQL itself would grant it again on the same session.
    /// - **Connection limits.** A shared connection that PostgreSQL refuses
    ///   (SQLSTATE 53300: `max_connections`, or a role's or database's
    ///   `CONNECTION LIMIT`) fails every try queued for it with
    ///   [`Error::TooManyConnections`]; locks on shared connections already
    ///   open are not affected.
    /// - **Sizing.** PostgreSQL walks a session's table of held locks at
    ///   the end of every transaction, so each statement on a session that
    ///   holds *n* locks costs about *n* × 0.1 µs more (1 ms at 10,000 locks,
    ///   measured on PostgreSQL 15; see BENCHMARKS.md). Allow one connection
    ///   per one or two thousand locks.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), distlock::Error> {
    /// let locker = distlock::PgLocker::builder(pool).multiplex(4).build();
    /// let mut held = Vec::new();
    /// for shard in 0..5_000 {
    ///     held.extend(locker.try_lock(format!("shard:{shard}")).await?);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn multiplex(mut self, connections: usize) -> Self {
        self.config.multiplex = connections;
        self
    }

    /// Multiplexed mode: at most `limit` session locks held at once through
    /// this locker (and its clones). An acquisition beyond it fails at once
    /// with [`Error::TooManyLocks`], without a round trip, instead of growing
    /// PostgreSQL's shared lock table (`max_locks_per_transaction` ×
    /// connections, shared by the whole cluster) until it is full for
    /// everyone. A released or dropped guard frees its place once its unlock
    /// has been handed to its connection. No effect without
    /// [`multiplex`](Self::multiplex); default: no cap.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), distlock::Error> {
    /// let locker = distlock::PgLocker::builder(pool).multiplex(2).max_locks(1_000).build();
    /// match locker.try_lock("shard:1").await {
    ///     Err(distlock::Error::TooManyLocks { limit }) => eprintln!("holding {limit} already"),
    ///     other => drop(other?),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn max_locks(mut self, limit: usize) -> Self {
        self.config.max_locks = Some(limit);
        self
    }

    /// Keep up to `connections` connections between locks, each for at
    /// most `idle_timeout`, and take the next locks on them instead of
    /// borrowing from the pool (default: 2 connections, 20 ms; `0`
    /// connections turns it off).
    ///
    /// sqlx's pool pings a connection when it takes it back and again when
    /// it hands it out (`test_before_acquire`), so a session lock or
    /// [`with_advisory_lock`](PgLocker::with_advisory_lock) on a borrowed
    /// connection costs 2 round trips on top of its statements. A connection
    /// whose lock was released (or whose try found the key busy, or whose
    /// `with_advisory_lock` transaction ended cleanly) is kept instead, but
    /// only while the pool has an idle connection or room to open one, so no
    /// one is waiting for it when it is kept. It goes back to the pool after
    /// `idle_timeout` without use, or at once when the pool is closed; a pool
    /// user who starts waiting while a connection is kept waits at most
    /// `idle_timeout` for it. Loops that take the next lock at once (a
    /// worker draining a queue, waiters handing a hot key to each other)
    /// gain the most: see BENCHMARKS.md.
    ///
    /// A kept connection is not pinged: if the server ended its session
    /// meanwhile, the lock statement fails on it with a connection error and
    /// is run once more on a connection from the pool, which costs the
    /// failed round trip. This also holds when the session ends *during* a
    /// [`lock`](PgLocker::lock) wait on a kept connection: the wait goes on,
    /// on the new connection, within the same deadline (on a borrowed
    /// connection, that call fails instead). The failed connection is closed,
    /// so whatever its statement may have taken ends with its session, as
    /// for any connection distlock closes.
    ///
    /// Only connections that hold no lock are kept. Session state that your
    /// own code sets on pooled connections (distlock sets none beyond the
    /// settings its lock statements document) is as it would be after a
    /// return to the pool: sqlx does not reset connections either.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) {
    /// use std::time::Duration;
    /// let locker = distlock::PgLocker::builder(pool)
    ///     .keep_warm(4, Duration::from_millis(500))
    ///     .build();
    /// # }
    /// ```
    pub fn keep_warm(mut self, connections: usize, idle_timeout: Duration) -> Self {
        self.config.warm = connections;
        self.config.warm_idle = idle_timeout;
        self
    }

    /// Builds the locker.
    ///
    /// A holder must give up its lock before the server frees it: a holder
    /// cut off by a partition notices at most `heartbeat + heartbeat_timeout`
    /// after its last answered heartbeat, while the server ends its session
    /// about 25 s after that (TCP keepalives, set by every lock statement).
    /// Settings whose sum exceeds 20 s are therefore lowered (with a
    /// warning): the heartbeat to at most 10 s, and its deadline to what is
    /// left of the 20 s.
    pub fn build(mut self) -> PgLocker {
        self.config.clamp_to_server_cutoff();
        let mux = (self.config.multiplex > 0).then(|| {
            super::mux::Mux::new(
                self.pool.clone(),
                self.config.clone(),
                self.config.multiplex,
            )
        });
        let warm =
            super::warm::Warm::new(self.pool.clone(), self.config.warm, self.config.warm_idle);
        PgLocker {
            inner: Arc::new(Inner {
                warm,
                pool: self.pool,
                config: self.config,
                pooler: super::pooler::PoolerCheck::default(),
                keepers: super::timer::Timer::default(),
                mux,
            }),
        }
    }
}

/// Introspection: who holds advisory locks.
impl PgLocker {
    /// Every advisory lock held or awaited in this database right now, from
    /// `pg_locks` joined with `pg_stat_activity`. Granted locks come first.
    ///
    /// Costs 1 round trip. Seeing other roles' `application_name` and client
    /// address needs the `pg_read_all_stats` role (or superuser); without it
    /// PostgreSQL shows `None` there.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a read on a pooled connection; no lock is taken.
    pub async fn holders(&self) -> Result<Vec<Holder>, Error> {
        super::holders::all(self.pool()).await
    }

    /// The sessions holding or awaiting the lock `key`. Costs 1 round trip.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a read on a pooled connection; no lock is taken.
    pub async fn holders_of(&self, key: impl Into<LockKey>) -> Result<Vec<Holder>, Error> {
        let key = key.into();
        let mut conn = self.pool().acquire().await?;
        super::holders::holders_of(&mut conn, &key).await
    }
}
