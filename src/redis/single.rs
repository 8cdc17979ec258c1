//! [`RedisLocker`]: leases on one Redis server, kept alive by a watchdog.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use redis::RedisError;
use tokio::time::Instant;

use super::backoff::Backoff;
use super::claim::Claim;
use super::lease::RedisLease;
use super::node::{self, Node};
use super::retry::{self, Failed, Waited};
use super::setup::{self, SetupReport};
use super::watchdog::{Backend, Extension, Handle, InFlight};
use super::{DEFAULT_TTL, scripts};
use crate::span;
use crate::{Error, FencingToken, Lease, LockKey, Locker, LossReason};

/// Default deadline of one command (acquire, extend, release) to the server.
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(2);

/// First and largest delay between two tries of [`RedisLocker::lock`].
const FIRST_BACKOFF: Duration = Duration::from_millis(5);
const MAX_BACKOFF: Duration = Duration::from_millis(100);

/// Hands out leases on a single Redis server.
///
/// A lease is the key named after the lock holding a random 128-bit token
/// with a time to live (`SET key token NX PX ttl`). A watchdog task resets
/// the TTL every TTL/3 while the lease lives; only the token's owner can
/// extend or delete the key (Lua compare-then-`PEXPIRE` / compare-then-`DEL`).
/// Each lease comes with a [`FencingToken`] issued by `INCR` on a companion
/// key in the same atomic step (turn off with
/// [`with_fencing(false)`](Self::with_fencing)).
///
/// Cheap to clone: all clones share one multiplexed connection, which
/// reconnects by itself.
///
/// | method | waits | round trips |
/// |---|---|---|
/// | [`try_lock`](Self::try_lock) | no | 1 (release: 1; watchdog: 1 per TTL/3) |
/// | [`lock`](Self::lock) | polls with jittered backoff (5 ms doubling to 100 ms) | 1 per try |
/// | [`check_setup`](Self::check_setup) | no | 1 |
///
/// ```no_run
/// # async fn demo() -> Result<(), distlock::Error> {
/// use std::time::Duration;
/// use distlock::redis::RedisLocker;
///
/// let locker = RedisLocker::connect("redis://127.0.0.1:6379")
///     .await?
///     .with_ttl(Duration::from_secs(10));
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
}

#[derive(Debug, Clone, Copy)]
struct Config {
    ttl: Duration,
    fencing: bool,
    command_timeout: Duration,
}

impl fmt::Debug for RedisLocker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLocker")
            .field("node", &self.node)
            .field("ttl", &self.config.ttl)
            .field("fencing", &self.config.fencing)
            .field("command_timeout", &self.config.command_timeout)
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
    /// The same as [`connect`](Self::connect) followed by the `with_*`
    /// methods.
    pub fn builder(server: impl redis::IntoConnectionInfo) -> super::RedisLockerBuilder {
        super::RedisLockerBuilder::new(server)
    }

    /// Like [`connect`](Self::connect), with a `redis::Client` you built
    /// (from `redis::ConnectionInfo`, with TLS settings, ...).
    pub async fn from_client(client: redis::Client) -> Result<Self, Error> {
        let locker = Self {
            node: Node::connect(client).await?,
            config: Config {
                ttl: DEFAULT_TTL,
                fencing: true,
                command_timeout: DEFAULT_COMMAND_TIMEOUT,
            },
        };
        locker.check_setup().await;
        Ok(locker)
    }

    /// Sets the leases' time to live (default 30 s, from 100 ms to 30 days;
    /// outside that range, such as `Duration::MAX`, every acquisition fails
    /// with [`Error::InvalidConfig`]). A holder that dies without releasing
    /// blocks others for at most this long; the watchdog extends every
    /// TTL/3.
    #[must_use]
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.config.ttl = ttl;
        self
    }

    /// Issues fencing tokens (default `true`). Each lock name then keeps a
    /// counter key (`distlock:fencing`, a NUL byte, the name; see the
    /// [module docs](super#keys)) that never expires (so tokens never
    /// repeat); turn this off to keep no state beyond held leases.
    #[must_use]
    pub fn with_fencing(mut self, fencing: bool) -> Self {
        self.config.fencing = fencing;
        self
    }

    /// Sets the deadline of one command to the server (default 2 s). An
    /// extension that gets no reply in time counts as loss. A duration too
    /// long for the clock (such as `Duration::MAX`) means as long as
    /// possible; an acquisition still waits for its reply at most the TTL
    /// less the drift margin.
    #[must_use]
    pub fn with_command_timeout(mut self, timeout: Duration) -> Self {
        self.config.command_timeout = timeout;
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
    /// name, a name containing NUL, or a [`LockKey::namespaced`] key.
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
            let lease = self.attempt(&claim).await?;
            in_flight.disarm();
            Ok(lease)
        })
        .await
    }

    /// Takes the lease `key`, trying again with jittered exponential backoff
    /// until `timeout` has passed; then fails with [`Error::Timeout`] (which
    /// cannot name the holder: Redis does not know it). A `timeout` of zero
    /// is a single try; one too long for the clock (such as `Duration::MAX`)
    /// means as long as possible.
    ///
    /// A try that fails for a passing reason (connection refused or reset,
    /// no reply within the command deadline, a server still loading its data
    /// or in a failover: `LOADING`, `BUSY`, `READONLY`, `MASTERDOWN`, …) is
    /// retried like a busy one, so a wait survives a server restart that ends
    /// before the deadline. A permanent error (a wrong type, a script error,
    /// failed authentication, a missing ACL permission, `OOM`) ends the wait
    /// at once with [`Error::Redis`]. A try that starts just before the
    /// deadline may end up to one command deadline after it.
    ///
    /// Costs 1 round trip per try. Every try uses the same token, so a `SET`
    /// whose reply was lost still belongs to this call: the next try finds
    /// the key holding its token and takes it over.
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
        let mut backoff = Backoff::new(FIRST_BACKOFF, MAX_BACKOFF);
        // One guard for the whole wait, not one per try: a try that failed may
        // still set the key, and the next try (same token) takes that over. A
        // cleanup per failed try could instead delete the key after a later
        // try had taken it. Whatever is still ours when the wait ends without
        // a lease (error, timeout, cancellation) is deleted in the background.
        let in_flight = InFlight::new(&self.backend(), &claim);
        let waited = retry::until_granted(
            &claim,
            started,
            timeout,
            || Some(backoff.next_delay()),
            || async {
                self.attempt(&claim).await.map_err(|error| Failed {
                    transient: node::is_transient(&error),
                    error,
                })
            },
        )
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
            Waited::Failed(error) => Err(Error::Redis(error)),
        }
    }

    /// One `SET PX` if free (with `INCR` of the fence counter) under the
    /// command deadline, capped so that a reply always arrives while the TTL
    /// lasts. On error the `SET` may still have landed: the caller cleans up.
    async fn attempt(&self, claim: &Arc<Claim>) -> Result<Option<RedisLease>, RedisError> {
        let started = Instant::now();
        let within = self.config.command_timeout.min(claim.window());
        let cmd = scripts::acquire(claim, self.config.fencing);
        let reply: i64 = self.node.query(&cmd, within).await?;
        if reply < 0 {
            return Ok(None);
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
            Err(err) if err.is_timeout() => {
                Extension::Lost(LossReason::HeartbeatTimedOut(self.timeout))
            }
            Err(err) => Extension::Lost(LossReason::ConnectionFailed(err.to_string())),
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
            Err(err) => Err(claim.release_failed(err, self.timeout)),
        }
    }
}

#[async_trait]
impl Locker for RedisLocker {
    async fn try_lock(&self, key: LockKey) -> Result<Option<Box<dyn Lease>>, Error> {
        let lease = RedisLocker::try_lock(self, key).await?;
        Ok(lease.map(|lease| Box::new(lease) as Box<dyn Lease>))
    }

    async fn lock(&self, key: LockKey, timeout: Duration) -> Result<Box<dyn Lease>, Error> {
        Ok(Box::new(RedisLocker::lock(self, key, timeout).await?))
    }

    fn backend(&self) -> &'static str {
        Single::NAME
    }
}
