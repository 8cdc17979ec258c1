//! `PgLocker`: the entry point of the PostgreSQL backend, and its builder.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use crate::postgres::config::Config;
use crate::postgres::holder::{Holder, LockMode};
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
    pub(crate) pooler: crate::postgres::pooler::PoolerCheck,
    /// Starts session locks' keepers shortly after their grant.
    pub(crate) keepers: crate::postgres::session::timer::Timer,
    /// Present when built with `.multiplex(n)`, n > 0.
    pub(crate) mux: Option<crate::postgres::mux::Mux>,
    /// Connections kept between locks, so the next skips the pool.
    pub(crate) warm: Arc<crate::postgres::conn::warm::Warm>,
}

impl PgLocker {
    /// A locker with default settings: heartbeat every second (deadline one
    /// second), release deadline five seconds, no fencing tokens.
    ///
    /// Cannot fail: the defaults are within every setting's range.
    pub fn new(pool: PgPool) -> Self {
        Self::assemble(pool, Config::default())
    }

    /// The locker for settings already checked by [`Config::validate`].
    fn assemble(pool: PgPool, config: Config) -> Self {
        let mux = (config.multiplex > 0).then(|| {
            crate::postgres::mux::Mux::new(pool.clone(), config.clone(), config.multiplex)
        });
        let warm =
            crate::postgres::conn::warm::Warm::new(pool.clone(), config.warm, config.warm_idle);
        PgLocker {
            inner: Arc::new(Inner {
                warm,
                pool,
                config,
                pooler: crate::postgres::pooler::PoolerCheck::default(),
                keepers: crate::postgres::session::timer::Timer::default(),
                mux,
            }),
        }
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

    /// The interval between two heartbeats of a session lock, as given to
    /// the builder.
    pub fn heartbeat(&self) -> Duration {
        self.inner.config.heartbeat
    }

    /// How long a heartbeat may wait for its answer before the lock counts
    /// as lost, as given to the builder (or the interval when it was not).
    pub fn heartbeat_timeout(&self) -> Duration {
        self.inner.config.heartbeat_timeout
    }

    /// Builds [`Error::Timeout`](crate::Error::Timeout) for a missed
    /// exclusive deadline, naming the holder where PostgreSQL shows it.
    pub(crate) async fn timeout_error(
        &self,
        key: &crate::LockKey,
        started: std::time::Instant,
        conn: Option<crate::postgres::conn::held::HeldConn>,
    ) -> crate::Error {
        self.timeout_error_as(key, LockMode::Exclusive, started, conn)
            .await
    }

    /// Builds [`Error::Timeout`](crate::Error::Timeout) for a missed
    /// deadline of a wait in `mode`, naming whom it waited for.
    pub(crate) async fn timeout_error_as(
        &self,
        key: &crate::LockKey,
        wanted: impl Into<crate::postgres::timeout::Wanted>,
        started: std::time::Instant,
        conn: Option<crate::postgres::conn::held::HeldConn>,
    ) -> crate::Error {
        let within = self.config().heartbeat_timeout;
        crate::postgres::timeout::timeout_error(
            self.pool(),
            within,
            (key, wanted.into()),
            started,
            conn,
        )
        .await
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
    /// (default one second). A session the server ends is learnt from its
    /// goodbye at once (see [`SessionLock::lost`](crate::SessionLock::lost));
    /// for a connection that dies silently, `lost()` completes at most about
    /// one interval plus the heartbeat deadline later.
    ///
    /// Range: at least [`MIN_HEARTBEAT`](crate::postgres::MIN_HEARTBEAT) (10 ms), and
    /// `heartbeat + heartbeat_timeout` at most
    /// [`MAX_DETECTION`](crate::postgres::MAX_DETECTION) (20 s), so at most 10 s while
    /// the deadline follows the interval; [`build`](Self::build) refuses
    /// others with [`Error::InvalidSetting`].
    #[must_use = "the setter returns the changed builder"]
    pub fn heartbeat(mut self, every: Duration) -> Self {
        self.config.heartbeat = every;
        if !self.heartbeat_timeout_set {
            self.config.heartbeat_timeout = self.config.heartbeat;
        }
        self
    }

    /// How long a heartbeat may wait for its answer before the lock counts as
    /// lost (default: the heartbeat interval). A holder that cannot reach the
    /// database must stop trusting its lock.
    ///
    /// It is also how long a try's statement (`try_lock` and its kin,
    /// `with_advisory_lock`) may wait for its answer before the call fails
    /// with [`Error::CommandTimedOut`](crate::Error::CommandTimedOut), and
    /// how long a waiting call goes on past its `timeout`. So a short
    /// heartbeat without a longer deadline makes tries fail on a busy
    /// machine too: a 100 ms heartbeat with a 1 s deadline keeps loss
    /// detection quick for a server that ends the session (its goodbye is
    /// read at once) and gives a try a second.
    ///
    /// Range: at least [`MIN_HEARTBEAT`](crate::postgres::MIN_HEARTBEAT) (10 ms), and
    /// `heartbeat + heartbeat_timeout` at most
    /// [`MAX_DETECTION`](crate::postgres::MAX_DETECTION) (20 s); [`build`](Self::build)
    /// refuses others with [`Error::InvalidSetting`].
    #[must_use = "the setter returns the changed builder"]
    pub fn heartbeat_timeout(mut self, deadline: Duration) -> Self {
        self.config.heartbeat_timeout = deadline;
        self.heartbeat_timeout_set = true;
        self
    }

    /// How long `SessionLock::release` (and a dropped guard's background
    /// release) may take before the connection is closed instead (default
    /// five seconds). Closing the session frees the lock on the server.
    ///
    /// Range: at least 1 ms; a deadline too long for the clock (such as
    /// `Duration::MAX`) means as long as possible. [`build`](Self::build)
    /// refuses zero with [`Error::InvalidSetting`].
    #[must_use = "the setter returns the changed builder"]
    pub fn release_timeout(mut self, deadline: Duration) -> Self {
        self.config.release_timeout = deadline;
        self
    }

    /// Issue a fencing token with every session lock (default `false`).
    /// Needs the crate's migrations (`distlock::migrate`).
    #[must_use = "the setter returns the changed builder"]
    pub fn fencing(mut self, enabled: bool) -> Self {
        self.config.fencing = enabled;
        self
    }

    /// Send the try of [`with_advisory_lock`](PgLocker::with_advisory_lock)
    /// and [`with_shared_advisory_lock`](PgLocker::with_shared_advisory_lock)
    /// with its `BEGIN`, in one round trip (default `false`): a call costs
    /// 2 round trips plus the closure's instead of 3, taken or busy; one
    /// round trip less wherever the network adds latency.
    ///
    /// The price: the try, sent where the driver reads no answer but
    /// success or failure, reports a busy key by failing. So each busy try
    /// leaves an `ERROR` line (and, by default, the statement) in the
    /// server's log, `invalid input syntax for type integer: "distlock:
    /// lock busy, not an error of the application, backend …"`. Leave it
    /// off where keys are often busy, or where server errors raise alarms.
    ///
    /// The try is a statement prepared once per server session (a
    /// session's first call costs 3 round trips more, and the statement
    /// stays in `pg_prepared_statements`). Behind a transaction pooler that
    /// deallocates statements between transactions (PgBouncer's
    /// `server_reset_query = DEALLOCATE ALL`) every call prepares it again:
    /// leave it off there. The waiting forms (`with_advisory_lock_wait`)
    /// are unchanged.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), distlock::Error> {
    /// let locker = distlock::PgLocker::builder(pool).try_with_begin(true).build()?;
    /// # Ok(()) }
    /// ```
    #[must_use = "the setter returns the changed builder"]
    pub fn try_with_begin(mut self, enabled: bool) -> Self {
        self.config.try_with_begin = enabled;
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
    /// let locker = distlock::PgLocker::builder(pool).multiplex(4).build()?;
    /// let mut held = Vec::new();
    /// for shard in 0..5_000 {
    ///     held.extend(locker.try_lock(format!("shard:{shard}")).await?);
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// Range: 0 to [`MAX_MULTIPLEX`](crate::postgres::MAX_MULTIPLEX) (1024)
    /// connections, each a server process; [`build`](Self::build) refuses
    /// more with [`Error::InvalidSetting`].
    #[must_use = "the setter returns the changed builder"]
    pub fn multiplex(mut self, connections: usize) -> Self {
        self.config.multiplex = connections;
        self
    }

    /// Multiplexed mode: at most `limit` session locks held at once through
    /// this locker (and its clones). An acquisition beyond it fails at once
    /// with [`Error::TooManyLocks`], without a round trip, instead of growing
    /// PostgreSQL's shared lock table (`max_locks_per_transaction` ×
    /// connections, shared by the whole cluster) until it is full for
    /// everyone. A released or dropped guard frees its place once its
    /// connection has run its unlock (or has been closed, which frees it
    /// too): a `release()` that timed out keeps its place until then.
    /// Default: no cap.
    ///
    /// Range: at least 1, and only together with
    /// [`multiplex`](Self::multiplex)`(n)`, n ≥ 1 (without it the cap would
    /// do nothing); [`build`](Self::build) refuses others with
    /// [`Error::InvalidSetting`].
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), distlock::Error> {
    /// let locker = distlock::PgLocker::builder(pool).multiplex(2).max_locks(1_000).build()?;
    /// match locker.try_lock("shard:1").await {
    ///     Err(distlock::Error::TooManyLocks { limit }) => eprintln!("holding {limit} already"),
    ///     other => drop(other?),
    /// }
    /// # Ok(()) }
    /// ```
    #[must_use = "the setter returns the changed builder"]
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
    /// A locker used on several runtimes keeps each connection for the
    /// runtime it was kept on: it is handed out, and returned to the pool
    /// after `idle_timeout`, only by that runtime (its socket usually
    /// belongs to that runtime's reactor). A runtime that sits idle (a
    /// current-thread runtime outside `block_on`) never holds up another
    /// runtime's; its own are closed (their sessions end; they hold no
    /// lock) by the next acquisition or release on another runtime once
    /// they are kept for twice `idle_timeout`, or when the pool is closed while
    /// another runtime keeps a connection; otherwise they stay until it
    /// runs again or is dropped. The `connections` limit counts all
    /// runtimes' together.
    ///
    /// Only connections that hold no lock are kept. Session state that your
    /// own code sets on pooled connections (distlock sets none beyond the
    /// settings its lock statements document) is as it would be after a
    /// return to the pool: sqlx does not reset connections either.
    ///
    /// Range: any; an idle time too long for the clock (such as
    /// `Duration::MAX`) means until the pool is closed.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), distlock::Error> {
    /// use std::time::Duration;
    /// let locker = distlock::PgLocker::builder(pool)
    ///     .keep_warm(4, Duration::from_millis(500))
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    #[must_use = "the setter returns the changed builder"]
    pub fn keep_warm(mut self, connections: usize, idle_timeout: Duration) -> Self {
        self.config.warm = connections;
        self.config.warm_idle = idle_timeout;
        self
    }

    /// Builds the locker, or refuses the first setting outside its range
    /// with [`Error::InvalidSetting`] naming it; nothing is changed to fit.
    /// Costs no round trip (connections are taken at the first lock).
    ///
    /// Why `heartbeat + heartbeat_timeout` is bounded: a holder cut off by a
    /// partition notices at most that long after its last answered
    /// heartbeat, while the server ends its session about 25 s after that
    /// (TCP keepalives, set by every lock statement); the holder must give
    /// up its lock first.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) {
    /// use std::time::Duration;
    /// let refused = distlock::PgLocker::builder(pool)
    ///     .heartbeat(Duration::from_secs(15))
    ///     .build();
    /// assert!(matches!(
    ///     refused,
    ///     Err(distlock::Error::InvalidSetting { setting: "heartbeat + heartbeat_timeout", .. })
    /// ));
    /// # }
    /// ```
    pub fn build(self) -> Result<PgLocker, Error> {
        self.config.validate()?;
        Ok(PgLocker::assemble(self.pool, self.config))
    }
}

/// Introspection: who holds advisory locks.
impl PgLocker {
    /// Every advisory lock held or awaited in this database right now, from
    /// `pg_locks` joined with `pg_stat_activity`. Granted locks come first.
    ///
    /// Each waiting row says whom it waits behind: the pids
    /// ([`Holder::blocked_by`], from `pg_blocking_pids`) and those sessions'
    /// locks on the key ([`Holder::waits_for`]: pid, application, since when,
    /// held or queued ahead). [`wait_chain`](super::wait_chain) follows them
    /// to the root holder, or marks a cycle.
    ///
    /// Costs 1 round trip; resolving the waiters costs none more. Answered
    /// within 5 s, or the heartbeat deadline when that is longer, once the
    /// pool has handed out a connection (within its `acquire_timeout`): a
    /// stalled network fails it with [`Error::NoReply`] and closes its
    /// connection instead of hanging the caller. Seeing
    /// other roles' `application_name` and client address needs the
    /// `pg_read_all_stats` role (or superuser); without it PostgreSQL shows
    /// `None` there.
    ///
    /// ```no_run
    /// # async fn demo(locker: distlock::PgLocker) -> Result<(), distlock::Error> {
    /// let holders = locker.holders().await?;
    /// for waiter in holders.iter().filter(|h| !h.granted) {
    ///     let chain = distlock::postgres::wait_chain(&holders, waiter.pid);
    ///     println!("pid {} waits: {chain}", waiter.pid);
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a read on a pooled connection; no lock is taken.
    pub async fn holders(&self) -> Result<Vec<Holder>, Error> {
        let within = self
            .heartbeat_timeout()
            .max(crate::postgres::holders::READ_WITHIN);
        Box::pin(crate::postgres::timeout::read_on_pool(
            self.pool(),
            ("PgLocker::holders", within),
            crate::postgres::holders::all,
        ))
        .await
    }

    /// The sessions holding or awaiting the lock `key`, waiters resolved as
    /// in [`holders`](Self::holders) (their blockers are on the same key, so
    /// they are among the rows). Costs 1 round trip, answered within
    /// 5 s, or the heartbeat deadline when that is longer, once the pool
    /// has handed out a connection (within its `acquire_timeout`): a
    /// stalled network fails it
    /// with [`Error::CommandTimedOut`] and closes its connection instead of
    /// hanging the caller (a timed-out lock's report, the CLI's hint of who
    /// holds a busy lock).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a read on a pooled connection; no lock is taken.
    pub async fn holders_of(&self, key: impl Into<LockKey>) -> Result<Vec<Holder>, Error> {
        let key = key.into();
        let within = self
            .heartbeat_timeout()
            .max(crate::postgres::holders::READ_WITHIN);
        // Boxed: the pool's acquisition and the read, held inline, would
        // make this future several kilobytes (`future_size.rs`).
        Box::pin(crate::postgres::timeout::answered_on_pool(
            self.pool(),
            (&key, within),
            async |conn| crate::postgres::holders::holders_of(conn, &key).await,
        ))
        .await
    }
}
