//! `TableLocker`, its builder, and taking a lease (`try_lock`, `lock`).

use crate::DEFAULT_TTL;
use crate::setting::{at_least, within};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPool};
use sqlx::{AssertSqlSafe, Row};
use tokio::sync::oneshot;
use tracing::Instrument;

use super::inner::Inner;
use super::lease::TableLease;
use super::notify::Listener;
use super::sql::{self, KeyExpr, Owner};
use crate::postgres::conn::held::HeldConn;
use crate::postgres::conn::warm::{DEFAULT_WARM, DEFAULT_WARM_IDLE, Warm};
use crate::{Error, FencingToken, LockKey, span};

/// The shortest time to live a builder accepts.
pub const MIN_TTL: Duration = Duration::from_millis(100);
/// The longest time to live a builder accepts.
pub const MAX_TTL: Duration = Duration::from_secs(86_400);
/// Default deadline of a release.
const DEFAULT_RELEASE_TIMEOUT: Duration = Duration::from_secs(5);
/// The shortest release deadline a builder accepts.
const MIN_RELEASE_TIMEOUT: Duration = Duration::from_millis(1);
/// The range of a waiter's poll interval: a poll more often than every
/// millisecond is a busy loop against the server; one rarer than hourly
/// leaves a waiter without a listener asleep past any sensible deadline.
const MIN_POLL: Duration = Duration::from_millis(1);
const MAX_POLL: Duration = Duration::from_secs(3600);
/// A waiter's fallback poll while it listens for releases.
const POLL_LISTENING: Duration = Duration::from_secs(1);
/// A waiter's poll when it does not listen.
const POLL_NOT_LISTENING: Duration = Duration::from_millis(100);

/// Hands out leases kept as rows of `distlock.leases`, for transaction
/// poolers and failover.
///
/// A lease is a row with a random owner and an expiry on the database
/// server's clock, renewed from a background task every quarter of its time
/// to live (TTL). Every operation is **one statement in one short
/// transaction**, sent as a simple query (one protocol message), so it works
/// through PgBouncer in transaction mode, where [`PgLocker`](crate::PgLocker)'s
/// session locks cannot; and a grant committed on a primary with a
/// synchronous standby survives a failover to that standby.
///
/// | call | round trips | durable writes (commits) |
/// |---|---|---|
/// | [`try_lock`](Self::try_lock), granted | 1 | 1 (the row and its token; about one grant in 16 also purges up to 32 expired rows) |
/// | [`try_lock`](Self::try_lock), busy | 1 | 0 |
/// | [`lock`](Self::lock) | 1 per attempt: one at once, one after each release announced or poll | 1 when granted |
/// | renewal (background, every TTL/4) | 1 (more when retried) | 1 |
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
/// they agree on the time, and that the server's clock is not stepped:
/// `clock_timestamp()` is the wall clock, so a step forward of more than a
/// third of a TTL (an NTP correction, a VM restored from a snapshot) can
/// expire a lease whose holder still trusts it. A holder that is *paused*
/// (GC, SIGSTOP, a frozen VM) cannot notice anything while it is paused:
/// present the lease's fencing token with every protected write
/// ([`fence`](crate::fence)); it guards against a stepped clock too.
///
/// A renewal that fails or gets no answer is retried until that deadline,
/// each attempt on a fresh connection and given half of the time left, so
/// one connection stuck on a server that stopped answering cannot use up the
/// budget: an outage (a planned switchover behind a proxy, say) of up to a
/// third of a TTL, whenever it starts, is survived if the promoted server
/// has the lease (synchronous replication).
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
///     .build()?;
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
    warm: usize,
    warm_idle: Duration,
}

impl TableLockerBuilder {
    /// The leases' time to live (default [`DEFAULT_TTL`], 30 s).
    ///
    /// Range: [`MIN_TTL`] (100 ms) to [`MAX_TTL`] (24 h);
    /// [`build`](Self::build) refuses others with [`Error::InvalidSetting`].
    ///
    /// A lease is renewed every `ttl / 4`; a holder that cannot renew reports
    /// loss `2 * ttl / 3` after its last successful renewal was sent; a
    /// holder that vanished blocks its key for up to `ttl`. The same
    /// `2 * ttl / 3` bounds how long an attempt of [`TableLocker::try_lock`]
    /// or [`TableLocker::lock`] waits for the server's answer on a stalled
    /// network.
    #[must_use = "the setter returns the changed builder"]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How often a waiting [`TableLocker::lock`] looks again when nothing
    /// woke it (default: 1 s while listening, 100 ms with `.listen(false)`).
    ///
    /// Range: 1 ms to 1 h; [`build`](Self::build) refuses others with
    /// [`Error::InvalidSetting`].
    #[must_use = "the setter returns the changed builder"]
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.poll_interval = Some(every);
        self
    }

    /// Whether waiters listen for releases (default `true`): one extra
    /// connection per locker, opened at the first wait from the pool's
    /// connect options (or those of [`listen_options`](Self::listen_options)),
    /// outside the pool. With `false`, waiters poll.
    #[must_use = "the setter returns the changed builder"]
    pub fn listen(mut self, enabled: bool) -> Self {
        self.listen = enabled;
        self
    }

    /// Listen on a connection made with `options` instead of the pool's:
    /// for a pool that goes through a transaction pooler, a direct connection
    /// to the same database, where `LISTEN` works.
    #[must_use = "the setter returns the changed builder"]
    pub fn listen_options(mut self, options: PgConnectOptions) -> Self {
        self.listen_options = Some(options);
        self.listen = true;
        self
    }

    /// Keep up to `connections` connections between statements, each for
    /// at most `idle_timeout`, and run the next grant or release on them
    /// instead of borrowing from the pool (default: 2 connections, 20 ms;
    /// `0` connections turns it off), as
    /// [`PgLockerBuilder::keep_warm`](crate::PgLockerBuilder::keep_warm)
    /// does for session locks.
    ///
    /// sqlx's pool pings a connection when it takes it back and again when
    /// it hands it out, so a grant and a release on borrowed connections
    /// cost 4 round trips on top of their 2 statements. A lease holds
    /// nothing on a connection (each statement is a transaction of its own,
    /// committed before the answer), so the connection of every answered
    /// statement can be kept, but only while the pool has an idle
    /// connection or room to open one; it goes back to the pool after
    /// `idle_timeout` without use, or at once when the pool is closed.
    /// Renewals borrow from the pool, a fresh connection per attempt.
    ///
    /// A kept connection is not pinged: if the server (or a transaction
    /// pooler) ended its session meanwhile, the statement fails on it with
    /// a connection error and runs once more on a connection from the pool
    /// (a grant under a new owner; the first owner's row, if the failed
    /// statement was granted after all, is released in the background).
    ///
    /// Range: any; an idle time too long for the clock (such as
    /// `Duration::MAX`) means until the pool is closed.
    #[must_use = "the setter returns the changed builder"]
    pub fn keep_warm(mut self, connections: usize, idle_timeout: Duration) -> Self {
        self.warm = connections;
        self.warm_idle = idle_timeout;
        self
    }

    /// How long [`TableLease::release`] (and a dropped lease's background
    /// release) may take (default 5 s). A release that does not finish
    /// leaves the row to expire.
    ///
    /// Range: at least 1 ms; a deadline too long for the clock (such as
    /// `Duration::MAX`) means as long as possible. [`build`](Self::build)
    /// refuses zero with [`Error::InvalidSetting`].
    #[must_use = "the setter returns the changed builder"]
    pub fn release_timeout(mut self, deadline: Duration) -> Self {
        self.release_timeout = deadline;
        self
    }

    /// Builds the locker, or refuses the first setting outside its range
    /// with [`Error::InvalidSetting`] naming it. Costs no round trip (the
    /// listener connects at the first wait).
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) {
    /// use std::time::Duration;
    /// let refused = distlock::postgres::TableLocker::builder(pool)
    ///     .ttl(Duration::from_millis(10))
    ///     .build();
    /// assert!(matches!(
    ///     refused,
    ///     Err(distlock::Error::InvalidSetting { setting: "ttl", .. })
    /// ));
    /// # }
    /// ```
    pub fn build(self) -> Result<TableLocker, Error> {
        let default_poll = if self.listen {
            POLL_LISTENING
        } else {
            POLL_NOT_LISTENING
        };
        let poll_interval = self.poll_interval.unwrap_or(default_poll);
        within("ttl", self.ttl, MIN_TTL, MAX_TTL)?;
        within("poll_interval", poll_interval, MIN_POLL, MAX_POLL)?;
        at_least("release_timeout", self.release_timeout, MIN_RELEASE_TIMEOUT)?;
        let listener = self.listen.then(|| {
            let options = self
                .listen_options
                .unwrap_or_else(|| self.pool.connect_options().as_ref().clone());
            Listener::new(options)
        });
        Ok(TableLocker {
            inner: Arc::new(Inner {
                ttl: self.ttl,
                poll_interval,
                release_timeout: self.release_timeout,
                listener,
                warm: Warm::new(self.pool.clone(), self.warm, self.warm_idle),
                pool: self.pool,
            }),
        })
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
                warm: Warm::new(pool.clone(), DEFAULT_WARM, DEFAULT_WARM_IDLE),
                pool,
                ttl: DEFAULT_TTL,
                poll_interval: POLL_LISTENING,
                release_timeout: DEFAULT_RELEASE_TIMEOUT,
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
            warm: DEFAULT_WARM,
            warm_idle: DEFAULT_WARM_IDLE,
        }
    }

    /// Refuses a bad key.
    fn check(&self, key: &LockKey) -> Result<(), Error> {
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
    /// connection when no [warm one](TableLockerBuilder::keep_warm) is
    /// kept); a grant is 1 durable write (the row and its fencing
    /// token), a refusal writes nothing. The returned [`TableLease`] renews
    /// itself in the background.
    ///
    /// The answer is awaited for the renewal deadline, two thirds of the
    /// [TTL](TableLockerBuilder::ttl) from the statement's send: on a
    /// stalled network or server (bytes stop flowing, nothing is closed),
    /// the call fails then with [`Error::CommandTimedOut`] instead of
    /// hanging until TCP gives up. So does a grant answered in time but read
    /// only past that deadline (a runtime that ran the call too late): such
    /// a lease would be lost by the clock already, so it is released in the
    /// background instead of handed out. Nothing is held for the caller: the
    /// statement's task keeps its connection for a third of a TTL more and
    /// releases a grant that comes in by then; after that it closes the
    /// connection (so stalled calls do not drain the pool). A statement
    /// held up by a row that another transaction locked waits for it about
    /// that long at most (a statement-local `lock_timeout`, for each wait),
    /// so such a wait does not make a grant later; a grant that a stalled
    /// server makes later expires one TTL after it was made.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future leaves no lease behind once the statement it
    /// started has ended. The statement runs in a task of its own that owns
    /// its connection, so a dropped caller never cuts it short (PostgreSQL
    /// would not notice a closed socket while the statement waits for a
    /// concurrent taker of the key, and could still commit a grant). If the
    /// statement grants the key after the caller is gone, the task deletes
    /// the row (1 more round trip and durable write). At worst (the runtime
    /// shuts down first, the connection breaks mid-statement, the release
    /// fails) the row expires after one TTL.
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
    /// first wait of a locker opens its listening connection; every wait
    /// that starts while that connection is not listening yet gives it up
    /// to 2 s (never past its deadline) before its first attempt, so that a
    /// release right after that attempt is heard.
    ///
    /// An attempt's answer is awaited for the renewal deadline (two thirds
    /// of the [TTL](TableLockerBuilder::ttl)) from its send, as for
    /// [`try_lock`](Self::try_lock); one that gets none is made again while
    /// the deadline has not passed. On a stalled network or server the call
    /// so fails with [`Error::Timeout`] at most `timeout` plus that long
    /// after it began (plus what the pool spends handing out connections),
    /// instead of hanging until TCP gives up. A grant that comes in later is
    /// released by its attempt's task, or expires after a TTL if it comes
    /// after the task closed the connection (see
    /// [`try_lock`](Self::try_lock)).
    ///
    /// # Cancel safety
    ///
    /// As for [`try_lock`](Self::try_lock): a dropped wait leaves no lease
    /// behind once the attempt in flight (if any) has ended; that attempt
    /// runs to its end in a task of its own, which releases a grant nobody
    /// took. Waiting between attempts holds nothing.
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
            let attempt = self.attempt(key, &expr).await;
            let now = tokio::time::Instant::now();
            let (busy_for, lock_id) = match attempt {
                Ok(Attempt::Granted(lease)) => return Ok(lease),
                Ok(Attempt::Busy { left, lock_id }) => (left, lock_id),
                // No answer within the renewal deadline (a grant answered
                // later would be lost at once): stalled. Again, while
                // there is time.
                Err(Error::CommandTimedOut { .. }) if now < deadline => continue,
                Err(Error::CommandTimedOut { .. }) => return Err(timed_out(key, started)),
                Err(err) => return Err(err),
            };
            if now >= deadline {
                return Err(timed_out(key, started));
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

    /// One attempt: 1 round trip, its answer awaited for the renewal
    /// deadline from the send, else [`Error::CommandTimedOut`]. Both `try_lock` and `lock` go through
    /// here, so this is the one place that bounds a stalled statement.
    ///
    /// The statement runs in a task of its own that owns the connection, so
    /// that dropping this future never cuts a statement short: PostgreSQL
    /// does not notice a closed socket while a statement waits (for a row
    /// lock, say), and such a statement would go on to commit a grant after
    /// any release sent meanwhile on another connection had found nothing to
    /// delete. The task releases a grant nobody took, once the statement has
    /// ended.
    ///
    /// The statement runs on one of the locker's warm connections when there
    /// is one (see `Warm`), else on one from the pool. A kept connection
    /// found broken is closed, its attempt's owner released in the
    /// background (harmless if nothing was granted), and the statement runs
    /// once more on a pooled connection *under a new owner*, so that release
    /// can never delete the new attempt's row.
    ///
    /// Giving up on the answer is safe for the same reason as dropping this
    /// future: the task goes on owning the connection, and the answer it
    /// sends to nobody releases a grant. The task itself gives up one TTL
    /// after the send (see `spawn_statement`): the statement is dropped,
    /// its connection closed, and a best-effort release sent, which may
    /// reach the server before a late grant does; such a grant expires
    /// after a TTL.
    async fn attempt(&self, key: &LockKey, expr: &KeyExpr) -> Result<Attempt, Error> {
        // Dropped while waiting for a connection: nothing was sent.
        let taken = self.inner.warm.connection(self.inner.pooled(key)).await?;
        let sent = tokio::time::Instant::now();
        let answer_rx = self.spawn_statement(taken, key, expr, sent);
        // A statement that waits at all waits briefly (for a concurrent
        // taker's row); a server silent for the renewal deadline is
        // stalled, and a grant answered later would be lost at once (its
        // renewal deadline counts from the send).
        let give_up = self.inner.valid_until(sent);
        let Ok(answer) = tokio::time::timeout_at(give_up, answer_rx).await else {
            return Err(Error::CommandTimedOut {
                key: key.clone(),
                after: give_up - sent,
            });
        };
        // Only a runtime shutting down drops the task before it answers; the
        // statement's connection is then closed and a grant expires after a
        // TTL.
        let answer = answer.map_err(|_| Error::TaskStopped {
            key: key.clone(),
            task: "lease_acquire",
        })??;
        // A grant read only past the renewal deadline (answered in time,
        // but this call ran too late: the channel is polled before the
        // timer) is lost by the clock already, and its row may be another
        // holder's from a TTL on: dropped armed, it is released in the
        // background, and the call hears what it would have heard had the
        // timer come first.
        if matches!(answer, Answer::Granted { .. }) && tokio::time::Instant::now() >= give_up {
            drop(answer);
            return Err(Error::CommandTimedOut {
                key: key.clone(),
                after: give_up - sent,
            });
        }
        Ok(self.taken(answer, key, expr, sent))
    }

    /// Runs the acquiring statement on `taken` in a task of its own, which
    /// owns the connection; its answer comes on the returned channel.
    ///
    /// The task waits for the answer one TTL from `sent` at most, a third
    /// of a TTL longer than the caller: a grant answered by then is still
    /// released cleanly. After that the statement is dropped, which closes
    /// its armed connection, so that a stalled link (a NAT that dropped
    /// the connection's state, a server that stopped answering) does not
    /// keep a pooled connection until TCP gives up, one more for every
    /// stalled call; its grant, if the server makes one later, expires one
    /// TTL after it was made (nobody renews it).
    fn spawn_statement(
        &self,
        taken: (HeldConn, bool),
        key: &LockKey,
        expr: &KeyExpr,
        sent: tokio::time::Instant,
    ) -> oneshot::Receiver<Result<Answer, Error>> {
        let (answer_tx, answer_rx) = oneshot::channel();
        let (inner, task_key, task_expr) = (Arc::clone(&self.inner), key.clone(), expr.clone());
        let closed_at = crate::deadline::after(sent, self.inner.ttl);
        tokio::spawn(
            async move {
                let (inner, key, expr) = (&inner, &task_key, &task_expr);
                let statement = move |mut conn: HeldConn| async move {
                    let owner = Owner::random();
                    let answer = acquire_statement(inner, (key, expr), owner, closed_at, &mut conn);
                    let answer = answer.await;
                    (conn, answer)
                };
                let ran = inner
                    .warm
                    .first_statement(taken, || inner.pooled(key), statement);
                let ran = tokio::time::timeout_at(closed_at, ran)
                    .await
                    .unwrap_or_else(|_| {
                        Err(Error::CommandTimedOut {
                            key: key.clone(),
                            after: closed_at - sent,
                        })
                    });
                // The connection answered: it goes back (kept warm, or to
                // the pool) before the caller hears of it, so the caller's
                // next statement (a release, at once) finds it.
                let answer = ran.map(|(conn, answer)| {
                    drop(conn);
                    answer
                });
                // If this caller is gone (or gave up waiting), the answer
                // comes back here, or is dropped with the channel, which
                // releases a grant (see `Answer`).
                let _ = answer_tx.send(answer);
            }
            .in_current_span(),
        );
        answer_rx
    }

    /// The caller takes `answer`: a grant becomes a lease, renewed counting
    /// from `sent`.
    fn taken(
        &self,
        answer: Answer,
        key: &LockKey,
        expr: &KeyExpr,
        sent: tokio::time::Instant,
    ) -> Attempt {
        match answer {
            Answer::Busy { left, lock_id } => Attempt::Busy { left, lock_id },
            Answer::Granted {
                mut grant,
                token,
                lock_id,
            } => {
                grant.disarm();
                Attempt::Granted(TableLease::start(
                    Arc::clone(&self.inner),
                    key.clone(),
                    expr.with_id(lock_id),
                    grant.owner,
                    FencingToken::new(token),
                    sent,
                ))
            }
        }
    }

    /// Deletes up to `limit` expired rows of `distlock.leases` (about one
    /// grant in 16 already deletes up to 32); returns how many were
    /// deleted. A `limit` above `i32::MAX` counts as `i32::MAX`, so
    /// `u32::MAX` means "every expired row".
    ///
    /// Costs 1 round trip, and a durable write if anything had expired.
    /// It has no deadline of its own, since a large purge takes as long as
    /// its rows do (10,000 rows in 38-64 ms in BENCHMARKS.md): on a network
    /// that stalls it waits until TCP gives up. Wrap it in
    /// `tokio::time::timeout` to bound it; dropped mid-flight, its
    /// connection is closed, not given back to the pool.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it deletes only rows whose leases have expired, all or
    /// none of them.
    pub async fn purge_expired(&self, limit: u32) -> Result<u64, Error> {
        let mut conn = HeldConn::new(
            crate::postgres::conn::pooled::acquire(self.pool()).await?,
            true,
        );
        let row = sqlx::raw_sql(AssertSqlSafe(sql::purge(limit)))
            .fetch_one(conn.conn())
            .await?;
        conn.into_pool();
        let deleted: i64 = row.try_get(0)?;
        Ok(u64::try_from(deleted).unwrap_or(0))
    }
}

/// The error of a wait for `key` that began at `started` and ran out of
/// time.
fn timed_out(key: &LockKey, started: Instant) -> Error {
    Error::Timeout {
        key: key.clone(),
        waited: started.elapsed(),
        holder_pid: None,
        holder_application: None,
        chain: Default::default(),
    }
}

/// What `lease_acquire` answered, as the statement's task hands it over.
enum Answer {
    Busy {
        left: Duration,
        lock_id: i64,
    },
    /// Dropped with `grant` armed (the caller went away or gave up waiting
    /// before it took the answer, or the answer was never received), the
    /// grant is released.
    Granted {
        grant: Grant,
        token: i64,
        lock_id: i64,
    },
}

/// `lease_acquire` for `owner` on `conn`, from start to end; a statement
/// that failed or granted a lease without a token is released in the
/// background (harmless if nothing was granted). `conn` is disarmed once
/// the answer is read.
///
/// Each of the statement's waits for a row that another transaction
/// locked lasts at most until `closed_at`, when its task gives up on the
/// answer (counted from now, so the server's wait, which starts later,
/// ends a moment after): a grant given up on is not made later because
/// of such a wait. `closed_at` is a TTL from the send, after the caller
/// gives up, so the caller never gets the server's timeout.
async fn acquire_statement(
    inner: &Arc<Inner>,
    (key, expr): (&LockKey, &KeyExpr),
    owner: Owner,
    closed_at: tokio::time::Instant,
    conn: &mut HeldConn,
) -> Result<Answer, Error> {
    let mut grant = Grant {
        inner: Some(Arc::clone(inner)),
        key: key.clone(),
        expr: expr.clone(),
        owner,
    };
    // Armed until the answer is read: an error here (a broken connection
    // among them) may come after the server committed a grant.
    let acquire = |wait| sql::acquire(expr, owner, inner.ttl, wait);
    let Some(row) = super::row_wait::answered_by(conn, closed_at, acquire).await? else {
        // Held up by a locked row until the task gives up (which it does
        // first, on its own clock): nothing was granted.
        grant.disarm();
        return Err(Error::CommandTimedOut {
            key: key.clone(),
            after: inner.ttl,
        });
    };
    let granted: bool = row.try_get("granted")?;
    let lock_id: i64 = row.try_get("lock_id")?;
    if !granted {
        grant.disarm();
        let wait_ms: Option<i64> = row.try_get("wait_ms")?;
        let wait_ms = u64::try_from(wait_ms.unwrap_or(1)).unwrap_or(1);
        return Ok(Answer::Busy {
            left: Duration::from_millis(wait_ms),
            lock_id,
        });
    }
    let token: Option<i64> = row.try_get("fencing_token")?;
    let Some(token) = token else {
        // `grant` stays armed: the row is released in the background.
        return Err(Error::MissingFencingToken { key: key.clone() });
    };
    Ok(Answer::Granted {
        grant,
        token,
        lock_id,
    })
}

/// A grant nobody has taken yet: dropped armed, it releases the key for its
/// owner in the background (harmless if nothing was granted). It is
/// dropped armed after the acquiring statement has ended (answered, failed,
/// or its task was stopped with the runtime), so the release cannot run
/// before the grant it deletes; or, one TTL after the send, with the
/// statement still unanswered (`spawn_statement` gives up on a stalled
/// link): then the release is best effort, it may reach the server before
/// a late grant, which then expires after a TTL (nobody renews it).
struct Grant {
    inner: Option<Arc<Inner>>,
    key: LockKey,
    expr: KeyExpr,
    owner: Owner,
}

impl Grant {
    fn disarm(&mut self) {
        self.inner = None;
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            let (key, expr) = (self.key.clone(), self.expr.clone());
            super::release::release_in_background(inner, key, expr, self.owner);
        }
    }
}

crate::lease::locker_from_inherent!(TableLocker, "table", election);
