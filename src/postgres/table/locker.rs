//! `TableLocker`, its builder, and taking a lease (`try_lock`, `lock`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use sqlx::postgres::{PgConnectOptions, PgPool};
use sqlx::{AssertSqlSafe, Row};

use super::inner::Inner;
use super::lease::TableLease;
use super::notify::Listener;
use super::sql::{self, KeyExpr, Owner};
use crate::postgres::conn::HeldConn;
use crate::{Error, FencingToken, Lease, LockKey, Locker, span};

/// The default time to live of a lease: renewed every 10 s, a holder that
/// cannot renew reports loss within 20 s, and the key of a holder that
/// vanished is free again 30 s after its last renewal.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);
/// The shortest time to live a builder accepts.
pub const MIN_TTL: Duration = Duration::from_millis(100);
/// The longest time to live a builder accepts.
pub const MAX_TTL: Duration = Duration::from_secs(86_400);
/// Default deadline of a release.
const DEFAULT_RELEASE_TIMEOUT: Duration = Duration::from_secs(5);
/// A waiter's fallback poll while it listens for releases.
const POLL_LISTENING: Duration = Duration::from_secs(1);
/// A waiter's poll when it does not listen.
const POLL_NOT_LISTENING: Duration = Duration::from_millis(100);

/// Hands out leases kept as rows of `distlock.leases`, for transaction
/// poolers and failover.
///
/// A lease is a row with a random owner and an expiry on the database
/// server's clock, renewed from a background task every third of its time
/// to live (TTL). Every operation is **one statement in one short
/// transaction**, sent as a simple query (one protocol message), so it works
/// through PgBouncer in transaction mode, where [`PgLocker`](crate::PgLocker)'s
/// session locks cannot; and a grant committed on a primary with a
/// synchronous standby survives a failover to that standby.
///
/// | call | round trips | durable writes (commits) |
/// |---|---|---|
/// | [`try_lock`](Self::try_lock), granted | 1 | 1 (the row, its token, up to 8 expired rows purged) |
/// | [`try_lock`](Self::try_lock), busy | 1 | 0 |
/// | [`lock`](Self::lock) | 1 per attempt: one at once, one after each release announced or poll | 1 when granted |
/// | renewal (background, every TTL/3) | 1 | 1 |
/// | [`TableLease::release`] | 1 | 1 (and a `NOTIFY`) |
/// | [`purge_expired`](Self::purge_expired) | 1 | 1 if anything expired |
///
/// # Time and loss
///
/// The server alone decides when a lease has expired (`clock_timestamp()`);
/// the holder only measures durations on its own monotonic clock. It counts
/// from the moment it *sent* its last successful renewal (or the grant),
/// which is before the server set the new expiry, and reports the lease
/// lost ([`TableLease::lost`]) two thirds of a TTL after it, a third of a TTL
/// before the server can hand the key to anyone else. This assumes only that
/// the two clocks advance at rates within a third of each other, not that
/// they agree on the time. A holder that is *paused* (GC, SIGSTOP, a frozen
/// VM) cannot notice anything while it is paused: present the lease's
/// fencing token with every protected write ([`fence`](crate::fence)).
///
/// # Waiting
///
/// [`lock`](Self::lock) waits without a poll interval's latency: a release
/// announces the key on channel `distlock_lease` (`NOTIFY`), and waiters
/// listen on one connection per locker (sqlx's `PgListener`), opened at the
/// first wait. A busy answer also says how long the holder's lease has left,
/// so the expiry of a vanished holder's lease wakes a waiter too. A poll
/// (every second while listening, every 100 ms otherwise; see
/// [`TableLockerBuilder::poll_interval`]) covers the rest. `LISTEN` needs a
/// real session: through a transaction pooler, give the listener a direct
/// connection with [`TableLockerBuilder::listen_options`], or turn it off
/// with [`TableLockerBuilder::listen`]`(false)`.
///
/// Needs the crate's migrations ([`migrate`](crate::migrate)).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), distlock::Error> {
/// use std::time::Duration;
/// let locker = distlock::postgres::TableLocker::builder(pool)
///     .ttl(Duration::from_secs(15))
///     .build();
/// if let Some(lease) = locker.try_lock("reports:nightly").await? {
///     let token = lease.fencing_token().expect("always issued");
///     tokio::select! {
///         () = async { /* the work, writing with `token` */ } => lease.release().await?,
///         reason = lease.lost() => eprintln!("stopped: {reason}"),
///     }
///     # let _ = token;
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct TableLocker {
    pub(super) inner: Arc<Inner>,
}

/// Configures a [`TableLocker`]; from [`TableLocker::builder`].
#[derive(Debug)]
#[must_use = "a builder does nothing until .build() is called"]
pub struct TableLockerBuilder {
    pool: PgPool,
    ttl: Duration,
    poll_interval: Option<Duration>,
    release_timeout: Duration,
    listen: bool,
    listen_options: Option<PgConnectOptions>,
}

impl TableLockerBuilder {
    /// The leases' time to live (default [`DEFAULT_TTL`], 30 s), between
    /// [`MIN_TTL`] (100 ms) and [`MAX_TTL`] (24 h); [`build`](Self::build)
    /// with others every acquisition fails with [`Error::InvalidConfig`].
    ///
    /// A lease is renewed every `ttl / 3`; a holder that cannot renew reports
    /// loss `2 * ttl / 3` after its last successful renewal was sent; a
    /// holder that vanished blocks its key for up to `ttl`.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How often a waiting [`TableLocker::lock`] looks again when nothing
    /// woke it (default: 1 s while listening, 100 ms with `.listen(false)`),
    /// between 1 ms and 1 h; with others every acquisition fails with
    /// [`Error::InvalidConfig`].
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.poll_interval = Some(every);
        self
    }

    /// Whether waiters listen for releases (default `true`): one extra
    /// connection per locker, opened at the first wait from the pool's
    /// connect options (or those of [`listen_options`](Self::listen_options)),
    /// outside the pool. With `false`, waiters poll.
    pub fn listen(mut self, enabled: bool) -> Self {
        self.listen = enabled;
        self
    }

    /// Listen on a connection made with `options` instead of the pool's:
    /// for a pool that goes through a transaction pooler, a direct connection
    /// to the same database, where `LISTEN` works.
    pub fn listen_options(mut self, options: PgConnectOptions) -> Self {
        self.listen_options = Some(options);
        self.listen = true;
        self
    }

    /// How long [`TableLease::release`] (and a dropped lease's background
    /// release) may take (default 5 s, at least 1 ms). A release that does
    /// not finish leaves the row to expire.
    pub fn release_timeout(mut self, deadline: Duration) -> Self {
        self.release_timeout = deadline.max(Duration::from_millis(1));
        self
    }

    /// Builds the locker. A TTL or poll interval out of range does not fail
    /// here but makes every acquisition fail with [`Error::InvalidConfig`],
    /// as the Redis lockers do, so that `build()` is infallible like
    /// [`PgLockerBuilder::build`](crate::postgres::PgLockerBuilder::build).
    pub fn build(self) -> TableLocker {
        let default_poll = if self.listen {
            POLL_LISTENING
        } else {
            POLL_NOT_LISTENING
        };
        let poll_interval = self.poll_interval.unwrap_or(default_poll);
        let invalid = if !(MIN_TTL..=MAX_TTL).contains(&self.ttl) {
            Some("TableLocker ttl must be between 100 ms and 24 h")
        } else if !(Duration::from_millis(1)..=Duration::from_secs(3600)).contains(&poll_interval) {
            Some("TableLocker poll interval must be between 1 ms and 1 h")
        } else {
            None
        };
        let listener = self.listen.then(|| {
            let options = self
                .listen_options
                .unwrap_or_else(|| self.pool.connect_options().as_ref().clone());
            Listener::new(options)
        });
        TableLocker {
            inner: Arc::new(Inner {
                pool: self.pool,
                ttl: self.ttl,
                poll_interval,
                release_timeout: self.release_timeout,
                listener,
                invalid,
            }),
        }
    }
}

/// What one attempt found.
enum Attempt {
    Granted(TableLease),
    /// The holder's lease has `left` to run; `lock_id` as the server
    /// computed it.
    Busy {
        left: Duration,
        lock_id: i64,
    },
}

impl TableLocker {
    /// A locker with default settings: TTL 30 s, listening for releases.
    pub fn new(pool: PgPool) -> Self {
        Self {
            inner: Arc::new(Inner {
                listener: Some(Listener::new(pool.connect_options().as_ref().clone())),
                pool,
                ttl: DEFAULT_TTL,
                poll_interval: POLL_LISTENING,
                release_timeout: DEFAULT_RELEASE_TIMEOUT,
                invalid: None,
            }),
        }
    }

    /// Starts a builder to set the TTL, polling and listening.
    pub fn builder(pool: PgPool) -> TableLockerBuilder {
        TableLockerBuilder {
            pool,
            ttl: DEFAULT_TTL,
            poll_interval: None,
            release_timeout: DEFAULT_RELEASE_TIMEOUT,
            listen: true,
            listen_options: None,
        }
    }

    /// Refuses a bad key, and every key when the builder was given a bad
    /// setting.
    fn check(&self, key: &LockKey) -> Result<(), Error> {
        if let Some(why) = self.inner.invalid {
            return Err(Error::InvalidConfig(why));
        }
        key.validate()
    }

    /// The pool this locker runs its statements on.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// The leases' time to live.
    pub fn ttl(&self) -> Duration {
        self.inner.ttl
    }

    /// Takes the lease `key` if nobody holds it (or its holder's lease has
    /// expired), without waiting; `Ok(None)` if someone holds it.
    ///
    /// Costs 1 round trip (plus what the pool spends handing out a
    /// connection); a grant is 1 durable write (the row and its fencing
    /// token), a refusal writes nothing. The returned [`TableLease`] renews
    /// itself in the background.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future leaves nothing held for long: once the statement
    /// may have been sent, a dropped future releases whatever it may have
    /// been granted in the background (1 round trip), and at worst (no
    /// runtime, no connection) the row expires after one TTL.
    pub async fn try_lock(&self, key: impl Into<LockKey>) -> Result<Option<TableLease>, Error> {
        let key = key.into();
        span::traced(&key, "table", "try", Option::is_some, async {
            self.check(&key)?;
            match self.attempt(&key, &KeyExpr::new(&key)).await? {
                Attempt::Granted(lease) => Ok(Some(lease)),
                Attempt::Busy { .. } => Ok(None),
            }
        })
        .await
    }

    /// Takes the lease `key`, waiting up to `timeout`; [`Error::Timeout`]
    /// when the deadline passes (a zero timeout is a single try; a huge one
    /// waits as long as it takes).
    ///
    /// Each attempt costs 1 round trip: one at once, then one each time a
    /// release of this key is announced (`NOTIFY`), the holder's lease
    /// expires, or the poll interval passes, and one at the deadline. The
    /// first wait of a locker opens its listening connection.
    ///
    /// # Cancel safety
    ///
    /// As for [`try_lock`](Self::try_lock): a dropped wait holds nothing
    /// (an attempt in flight is released in the background).
    pub async fn lock(
        &self,
        key: impl Into<LockKey>,
        timeout: Duration,
    ) -> Result<TableLease, Error> {
        let key = key.into();
        span::traced(&key, "table", "wait", |_| true, async {
            self.check(&key)?;
            self.wait(&key, Instant::now(), timeout).await
        })
        .await
    }

    async fn wait(
        &self,
        key: &LockKey,
        started: Instant,
        timeout: Duration,
    ) -> Result<TableLease, Error> {
        let deadline = crate::deadline::after_std(started, timeout);
        let expr = KeyExpr::new(key);
        // Subscribed before each attempt, so a release between the attempt
        // and the wait is not missed.
        let mut wakes = match &self.inner.listener {
            Some(listener) => Some(listener.subscribe(deadline).await),
            None => None,
        };
        loop {
            if let Some(wakes) = &mut wakes {
                wakes.clear();
            }
            let (busy_for, lock_id) = match self.attempt(key, &expr).await? {
                Attempt::Granted(lease) => return Ok(lease),
                Attempt::Busy { left, lock_id } => (left, lock_id),
            };
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    key: key.to_string(),
                    waited: started.elapsed(),
                    holder_pid: None,
                    holder_application: None,
                });
            }
            // A listening waiter polls only as a safety net; one whose
            // listener is not (yet) listening polls as if it did not listen.
            // Either looks again as soon as the holder's lease runs out.
            let poll = match &wakes {
                Some(wakes) if !wakes.listening() => {
                    self.inner.poll_interval.min(POLL_NOT_LISTENING)
                }
                _ => self.inner.poll_interval,
            };
            let pause = poll.min(busy_for.saturating_add(Duration::from_millis(1)));
            let next = crate::deadline::after(now, pause).min(deadline);
            match &mut wakes {
                Some(wakes) => wakes.until(next, (expr.space(), lock_id)).await,
                None => tokio::time::sleep_until(next).await,
            }
        }
    }

    /// One attempt: 1 round trip.
    async fn attempt(&self, key: &LockKey, expr: &KeyExpr) -> Result<Attempt, Error> {
        let owner = Owner::random();
        let mut conn = HeldConn::new(self.pool().acquire().await?, true);
        // From here the statement may reach the server: if this future is
        // dropped (or fails) before the answer is read, whatever it was
        // granted is released in the background.
        let pending = Pending {
            inner: Some(Arc::clone(&self.inner)),
            expr: expr.clone(),
            owner,
        };
        let sent = tokio::time::Instant::now();
        let row = sqlx::raw_sql(AssertSqlSafe(sql::acquire(expr, owner, self.inner.ttl)))
            .fetch_one(conn.conn())
            .await?;
        conn.into_pool();
        let granted: bool = row.try_get("granted")?;
        let lock_id: i64 = row.try_get("lock_id")?;
        if !granted {
            pending.disarm();
            let wait_ms: Option<i64> = row.try_get("wait_ms")?;
            let wait_ms = u64::try_from(wait_ms.unwrap_or(1)).unwrap_or(1);
            return Ok(Attempt::Busy {
                left: Duration::from_millis(wait_ms),
                lock_id,
            });
        }
        let token: Option<i64> = row.try_get("fencing_token")?;
        let Some(token) = token else {
            // Leave `pending` armed: the row is released in the background.
            return Err(Error::Database(sqlx::Error::Protocol(
                "lease_acquire granted a lease without a fencing token".into(),
            )));
        };
        pending.disarm();
        Ok(Attempt::Granted(TableLease::start(
            Arc::clone(&self.inner),
            key.clone(),
            expr.with_id(lock_id),
            owner,
            FencingToken::new(token),
            sent,
        )))
    }

    /// Deletes up to `limit` expired rows of `distlock.leases` (every grant
    /// already deletes up to 8); returns how many were deleted.
    ///
    /// Costs 1 round trip, and a durable write if anything had expired.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it deletes only rows whose leases have expired, all or
    /// none of them.
    pub async fn purge_expired(&self, limit: u32) -> Result<u64, Error> {
        let mut conn = HeldConn::new(self.pool().acquire().await?, true);
        let row = sqlx::raw_sql(AssertSqlSafe(sql::purge(limit)))
            .fetch_one(conn.conn())
            .await?;
        conn.into_pool();
        let deleted: i64 = row.try_get(0)?;
        Ok(u64::try_from(deleted).unwrap_or(0))
    }
}

/// An attempt whose answer has not been read yet: dropped armed, it releases
/// the key for its owner in the background (harmless if nothing was granted).
struct Pending {
    inner: Option<Arc<Inner>>,
    expr: KeyExpr,
    owner: Owner,
}

impl Pending {
    fn disarm(mut self) {
        self.inner = None;
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            super::release::release_in_background(inner, self.expr.clone(), self.owner);
        }
    }
}

#[async_trait]
impl Locker for TableLocker {
    async fn try_lock(&self, key: LockKey) -> Result<Option<Box<dyn Lease>>, Error> {
        let lease = TableLocker::try_lock(self, key).await?;
        Ok(lease.map(|lease| Box::new(lease) as Box<dyn Lease>))
    }

    async fn lock(&self, key: LockKey, timeout: Duration) -> Result<Box<dyn Lease>, Error> {
        Ok(Box::new(TableLocker::lock(self, key, timeout).await?))
    }

    fn backend(&self) -> &'static str {
        "table"
    }
}
