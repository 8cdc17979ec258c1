//! [`RedisLocker`]: leases on one Redis server, kept alive by a watchdog.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::claim::{self, Claim};
use super::lease::RedisLease;
use super::node::{Failure, Node};
use super::retry::{self, Cause, Failed, Pacing, Tried, Waited};
use super::setup::{self, SetupReport};
use super::signals::Signals;
use super::watchdog::{Backend, Extension, Handle, InFlight};
use super::{DEFAULT_POLL_INTERVAL, scripts};
use crate::DEFAULT_TTL;
use crate::backoff;
use crate::span;
use crate::{Error, FencingToken, LockKey, LossReason};

/// Default deadline of one command (acquire, extend, release) to the server.
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(2);

/// First and largest delay between two tries of [`RedisLocker::lock`] while
/// it cannot hear releases, or its tries fail.
const FIRST_BACKOFF: Duration = Duration::from_millis(5);
const MAX_BACKOFF: Duration = Duration::from_millis(100);

/// Hands out leases on a single Redis server.
///
/// A lease is the key named after the lock holding a random 128-bit token
/// with a time to live (a script that sets the key to the token with
/// `PX ttl` where it is free). A watchdog task resets
/// the TTL every TTL/3 while the lease lives; only the token's owner can
/// extend or delete the key (Lua compare-then-`PEXPIRE` / compare-then-`DEL`).
/// Each lease comes with a [`FencingToken`] issued by `INCR` on a companion
/// key in the same atomic step (turn off with
/// [`RedisLockerBuilder::fencing`](super::RedisLockerBuilder::fencing)).
///
/// Cheap to clone: all clones share one multiplexed connection, which
/// reconnects by itself, and, once a `lock` has had to wait, one subscriber
/// connection for the release signals (see [Waiting](super#waiting)).
///
/// | method | waits | round trips |
/// |---|---|---|
/// | [`try_lock`](Self::try_lock) | no | 1 (release: 1, which also signals waiters; watchdog: 1 per TTL/3) |
/// | [`lock`](Self::lock) | until a release wakes it, polling at most every `poll_interval` (1 s) as a fallback | 1, then 2 if busy, then 1 per wake-up or poll |
/// | [`check_setup`](Self::check_setup) | no | 1 |
///
/// ```no_run
/// # async fn demo() -> Result<(), distlock::Error> {
/// use std::time::Duration;
/// use distlock::redis::RedisLocker;
///
/// let locker = RedisLocker::builder("redis://127.0.0.1:6379")
///     .ttl(Duration::from_secs(10))
///     .build()
///     .await?;
/// if let Some(lease) = locker.try_lock("reports:nightly").await? {
///     // ... the work; race it against `lease.lost()` if it runs long ...
///     lease.release().await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisLocker {
    node: Node,
    config: Config,
    signals: Signals,
}

/// The settings of a [`RedisLocker`], checked by its builder.
#[derive(Debug, Clone, Copy)]
pub(super) struct Config {
    pub(super) ttl: Duration,
    pub(super) fencing: bool,
    pub(super) command_timeout: Duration,
    pub(super) poll_interval: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            ttl: DEFAULT_TTL,
            fencing: true,
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
            poll_interval: DEFAULT_POLL_INTERVAL,
        }
    }
}

impl fmt::Debug for RedisLocker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLocker")
            .field("node", &self.node)
            .field("ttl", &self.config.ttl)
            .field("fencing", &self.config.fencing)
            .field("command_timeout", &self.config.command_timeout)
            .field("poll_interval", &self.config.poll_interval)
            .finish()
    }
}

impl RedisLocker {
    /// Connects to the server at `url` (`redis://[user:password@]host:port[/db]`)
    /// and checks with `INFO` that it is a primary without replicas, logging
    /// a warning if not (see [`check_setup`](Self::check_setup)).
    ///
    /// Defaults: TTL 30 s ([`DEFAULT_TTL`]), fencing tokens on, command
    /// deadline 2 s ([`DEFAULT_COMMAND_TIMEOUT`]). Fails if the URL is invalid
    /// or the server does not answer. Costs 2 round trips (handshake, `INFO`).
    pub async fn connect(url: &str) -> Result<Self, Error> {
        Self::from_client(redis::Client::open(url)?).await
    }

    /// Starts a builder: `RedisLocker::builder(server).ttl(..).build().await`,
    /// where `server` is anything `redis` takes as connection info (a URL, a
    /// `redis::ConnectionInfo` with TLS settings, a `(host, port)` pair).
    /// Its `build()` refuses a setting out of range before it connects.
    pub fn builder(server: impl redis::IntoConnectionInfo) -> super::RedisLockerBuilder {
        super::RedisLockerBuilder::new(server)
    }

    /// Like [`connect`](Self::connect), with a `redis::Client` you built
    /// (from `redis::ConnectionInfo`, with TLS settings, ...).
    pub async fn from_client(client: redis::Client) -> Result<Self, Error> {
        Self::open(client, Config::default()).await
    }

    /// Connects with settings its builder has checked, and inspects the
    /// server with them (so a builder's `fencing(false)` is not warned about
    /// a missing append-only file).
    pub(super) async fn open(client: redis::Client, config: Config) -> Result<Self, Error> {
        let node = Node::connect(client).await?;
        let locker = Self {
            signals: Signals::new(std::slice::from_ref(&node), 1),
            node,
            config,
        };
        locker.check_setup().await;
        Ok(locker)
    }

    /// Sets the leases' time to live: a shorthand for
    /// [`RedisLockerBuilder::ttl`](super::RedisLockerBuilder::ttl), which
    /// has the range (100 ms to 30 days) and the reasons.
    ///
    /// Deprecated because it cannot refuse a TTL out of range, being
    /// infallible: the locker it returns then fails every acquisition with
    /// [`Error::InvalidSetting`] (and this call logs that at `ERROR`). The
    /// builder is the checked path: its `build()` refuses such a TTL before
    /// anything connects, so no locker that fails later is ever made.
    #[deprecated(
        note = "use `RedisLocker::builder(url).ttl(ttl).build()`, which refuses a TTL out of range before connecting"
    )]
    #[must_use]
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        if let Err(error) = claim::check_ttl(ttl) {
            tracing::error!(%error, "distlock: with_ttl got a TTL out of range; every acquisition will fail");
        }
        self.config.ttl = ttl;
        self
    }

    /// The leases' time to live.
    pub fn ttl(&self) -> Duration {
        self.config.ttl
    }

    /// Asks the server with `INFO` whether it is a replica or has replicas
    /// (both unsafe for locks, see the [module docs](super)) and, with
    /// fencing on, whether it keeps an append-only file (without one a
    /// restart grants held locks again and repeats tokens), and logs each
    /// finding at `WARN`. Costs 1 round trip.
    pub async fn check_setup(&self) -> SetupReport {
        setup::inspect(
            std::slice::from_ref(&self.node),
            self.config.command_timeout,
            self.config.fencing,
        )
        .await
    }

    /// Takes the lease `key` if it is free, without waiting; `Ok(None)` if
    /// another holder has it.
    ///
    /// Costs 1 round trip. Fails with [`Error::InvalidKey`] for an empty
    /// name, a name containing NUL, or a [`LockKey::namespaced`] key outside
    /// the semaphore's reserved namespace
    /// ([`Semaphore::SLOT_NAMESPACE`](crate::Semaphore::SLOT_NAMESPACE)),
    /// with [`Error::CommandTimedOut`] when the server does not answer
    /// within the command deadline, or its grant is read only after the
    /// lease's validity (TTL less 1% and 2 ms; a runtime that ran the call
    /// too late: by this process's clock the key may already have expired,
    /// so the grant is not handed out and the key is deleted again), and
    /// with [`Error::Redis`] for an error of the client or the server.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it returns leaves no lease held: if the
    /// `SET` may have been sent, a background task deletes the key again
    /// (compare-then-`DEL`, so never another holder's).
    pub async fn try_lock(&self, key: impl Into<LockKey>) -> Result<Option<RedisLease>, Error> {
        let key = key.into();
        span::traced(&key, Single::NAME, "try", Option::is_some, async {
            let claim = Arc::new(Claim::new(key.clone(), self.config.ttl)?);
            // On error the SET may still have landed: `in_flight` cleans up.
            let in_flight = InFlight::new(&self.backend(), &claim);
            let lease = self
                .attempt(&claim)
                .await
                .map_err(|failure| claim.failed(failure))?;
            in_flight.disarm();
            Ok(lease)
        })
        .await
    }

    /// Takes the lease `key`, waiting for its release until `timeout` has
    /// passed; then fails with [`Error::Timeout`] (which cannot name the
    /// holder: Redis does not know it). A `timeout` of zero is a single try;
    /// one too long for the clock (such as `Duration::MAX`) means as long as
    /// possible.
    ///
    /// A busy try is followed by a subscription to the key's release
    /// signal and one more try; then the call sleeps until a release wakes
    /// it (one waiter of this locker per release, the longest waiting) or
    /// the fallback poll is due (at most
    /// [`poll_interval`](super::RedisLockerBuilder::poll_interval), default
    /// 1 s), and tries again. While the signals cannot be heard (the
    /// subscriber connection is down or refused), it polls with jittered
    /// backoff, 5 ms doubling to 100 ms. See [Waiting](super#waiting).
    ///
    /// A try that fails for a passing reason (connection refused or reset,
    /// no reply within the command deadline, a server still loading its data
    /// or in a failover: `LOADING`, `BUSY`, `READONLY`, `MASTERDOWN`, …) is
    /// retried with the backoff, so a wait survives a server restart that
    /// ends before the deadline. A permanent error (a wrong type, a script
    /// error, failed authentication, a missing ACL permission, `OOM`) ends
    /// the wait at once with [`Error::Redis`]. A try that starts just before
    /// the deadline may end up to one command deadline after it.
    ///
    /// Costs 1 round trip per try: 1 for a free key, 2 for a busy one, then
    /// 1 per wake-up or poll. The first waiting call of a locker opens its
    /// subscriber connection, and the first waiter of a key sends a
    /// `SUBSCRIBE` on it. Every try uses the same token, so a `SET` whose
    /// reply was lost still belongs to this call: the next try finds the key
    /// holding its token and takes it over.
    ///
    /// # Cancel safety
    ///
    /// As for [`try_lock`](Self::try_lock): no lease outlives a dropped call.
    pub async fn lock(
        &self,
        key: impl Into<LockKey>,
        timeout: Duration,
    ) -> Result<RedisLease, Error> {
        let key = key.into();
        span::traced(
            &key,
            Single::NAME,
            "wait",
            |_| true,
            self.wait(&key, timeout),
        )
        .await
    }

    async fn wait(&self, key: &LockKey, timeout: Duration) -> Result<RedisLease, Error> {
        let started = Instant::now();
        let claim = Arc::new(Claim::new(key.clone(), self.config.ttl)?);
        let mut backoff = backoff::exponential(FIRST_BACKOFF, MAX_BACKOFF);
        let poll = self.config.poll_interval;
        let pacing = Pacing {
            signals: self.signals.clone(),
            listen_within: self.config.command_timeout,
            // Heard releases need no polling but the fallback's; unheard
            // ones (no subscriber connection) and failures need the backoff.
            pause: |cause, heard| match cause {
                Cause::Held if heard => Some(backoff::jittered(poll / 2, poll / 2)),
                _ => backoff.next(),
            },
        };
        // One guard for the whole wait, not one per try: a try that failed may
        // still set the key, and the next try (same token) takes that over. A
        // cleanup per failed try could instead delete the key after a later
        // try had taken it. Whatever is still ours when the wait ends without
        // a lease (error, timeout, cancellation) is deleted in the background.
        let in_flight = InFlight::new(&self.backend(), &claim);
        let waited = retry::until_granted(&claim, started, timeout, pacing, || async {
            match self.attempt(&claim).await {
                Ok(Some(lease)) => Tried::Granted(lease),
                Ok(None) => Tried::Held,
                Err(failure) => Tried::Failed(Failed {
                    transient: failure.is_transient(),
                    error: claim.failed(failure),
                }),
            }
        })
        .await;
        match waited {
            Waited::Granted(lease) => {
                in_flight.disarm();
                Ok(lease)
            }
            Waited::TimedOut { failing } => {
                // Every reply was a definite "held": nothing of ours is set.
                if !failing {
                    in_flight.disarm();
                }
                Err(claim.timed_out(started))
            }
            Waited::Failed(error) => Err(error),
        }
    }

    /// One `SET PX` if free (with `INCR` of the fence counter) under the
    /// command deadline, capped so that a reply always arrives while the TTL
    /// lasts. On error the `SET` may still have landed: the caller cleans up.
    ///
    /// A grant read only after the validity (the reply arrived in time, but
    /// the runtime ran this task too late) counts as no reply in time: by
    /// this process's clock the key may have expired and been taken by
    /// another holder, so it is no lease. As Redlock's `in_time`.
    async fn attempt(&self, claim: &Arc<Claim>) -> Result<Option<RedisLease>, Failure> {
        let started = Instant::now();
        let within = self.config.command_timeout.min(claim.window());
        let cmd = scripts::acquire(claim, self.config.fencing);
        let reply: i64 = self.node.query(&cmd, within).await?;
        if reply < 0 {
            return Ok(None);
        }
        if started.elapsed() >= claim.window() {
            tracing::warn!(
                took_ms = started.elapsed().as_secs_f64() * 1e3,
                "distlock: a Redis grant was read after its validity had run out"
            );
            return Err(Failure::TimedOut(within));
        }
        Ok(Some(RedisLease::new(
            Handle::spawn(self.backend(), Arc::clone(claim), started),
            (reply > 0).then(|| FencingToken::new(reply)),
            Single::NAME,
        )))
    }

    fn backend(&self) -> Single {
        Single {
            node: self.node.clone(),
            timeout: self.config.command_timeout,
        }
    }
}

/// The single-instance side of a lease.
#[derive(Debug, Clone)]
struct Single {
    node: Node,
    timeout: Duration,
}

impl Backend for Single {
    const NAME: &'static str = "redis";

    /// Any failure is loss at once: one server is the only witness.
    async fn extend(&self, claim: &Claim) -> Extension {
        match self
            .node
            .query::<i64>(&scripts::extend(claim), self.timeout)
            .await
        {
            Ok(1) => Extension::Extended,
            Ok(_) => Extension::Lost(LossReason::Expired),
            Err(Failure::TimedOut(after)) => Extension::Lost(LossReason::HeartbeatTimedOut(after)),
            Err(failure) => Extension::Lost(LossReason::ConnectionFailed(failure.to_string())),
        }
    }

    async fn release(&self, claim: &Claim) -> Result<(), Error> {
        match self
            .node
            .query::<i64>(&scripts::release(claim), self.timeout)
            .await
        {
            Ok(1) => Ok(()),
            Ok(_) => Err(claim.not_held()),
            Err(failure) => Err(claim.release_failed(failure)),
        }
    }
}

crate::lease::locker_from_inherent!(RedisLocker, Single::NAME);
