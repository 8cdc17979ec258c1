//! [`Redlock`]: leases over N independent Redis servers, granted by a
//! majority.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use redis::{Cmd, Value};
use tokio::time::Instant;

use super::claim::{self, Claim};
use super::lease::RedlockLease;
use super::node::{Failure, Node};
use super::retry::{self, Cause, Failed, Pacing, Tried, Waited};
use super::setup::{self, SetupReport};
use super::signals::Signals;
use super::watchdog::{Backend, Extension, Handle, InFlight};
use super::{DEFAULT_POLL_INTERVAL, scripts};
use crate::DEFAULT_TTL;
use crate::backoff::jittered;
use crate::span;
use crate::{Error, LockKey, LossReason};

/// Default deadline of one node's reply: well below any sensible TTL, so a
/// dead node costs little of the lease's validity.
pub const DEFAULT_NODE_TIMEOUT: Duration = Duration::from_millis(50);
/// Default fixed part of the delay between two attempts of [`Redlock::lock`].
pub const DEFAULT_RETRY_DELAY: Duration = Duration::from_millis(50);
/// Default random part added to [`DEFAULT_RETRY_DELAY`].
pub const DEFAULT_RETRY_JITTER: Duration = Duration::from_millis(50);

/// How long [`Redlock::connect`] waits for each node's `INFO`.
const SETUP_TIMEOUT: Duration = Duration::from_secs(1);

/// Hands out leases granted by a majority of N independent Redis servers,
/// following the published Redlock algorithm.
///
/// An attempt sets the key to the call's random token with the TTL (the
/// single instance's acquire script: free, or already holding this call's
/// token) on every node at once, each under a short deadline
/// ([`RedlockBuilder::node_timeout`](super::RedlockBuilder::node_timeout)). It succeeds if at least
/// N/2+1 nodes (the quorum) granted it and the validity left — TTL minus the
/// time the attempt took minus a clock-drift margin of TTL × 1% + 2 ms — is
/// positive. Otherwise it deletes the key on *all* nodes at once (also those
/// that seemed to fail: their `SET` may have landed after the deadline) and
/// reports failure. A watchdog extends on all nodes every TTL/3; the lease is
/// lost when extensions no longer reach a quorum within its validity.
/// Release always goes to every node.
///
/// Leases carry no fencing tokens: see the [module docs](super) for why, and
/// for pairing a Redlock lease with the PostgreSQL fence. Before relying on
/// it, make sure the nodes really are independent: see
/// [`check_setup`](Self::check_setup).
///
/// Cheap to clone. Costs per call: [`try_lock`](Self::try_lock) 1 round trip
/// to every node (2 when it fails: the cleanup), release 1 (which also
/// signals waiters), the watchdog 1 per TTL/3; the nodes are contacted
/// concurrently. Once a `lock` has had to wait, the locker and its clones
/// keep one subscriber connection per node for the release signals (see
/// [Waiting](super#waiting)).
///
/// ```no_run
/// # async fn demo() -> Result<(), distlock::Error> {
/// use std::time::Duration;
/// use distlock::redis::Redlock;
///
/// let redlock = Redlock::builder([
///     "redis://127.0.0.1:7001",
///     "redis://127.0.0.1:7002",
///     "redis://127.0.0.1:7003",
///     "redis://127.0.0.1:7004",
///     "redis://127.0.0.1:7005",
/// ])
/// .ttl(Duration::from_secs(10))
/// .build()
/// .await?;
/// let lease = redlock.lock("reports:nightly", Duration::from_secs(5)).await?;
/// println!("held for at least {:?} more", lease.validity());
/// lease.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Redlock {
    nodes: Arc<[Node]>,
    config: Config,
    signals: Signals,
}

/// The settings of a [`Redlock`], checked by its builder.
#[derive(Clone, Copy)]
pub(super) struct Config {
    pub(super) ttl: Duration,
    pub(super) node_timeout: Duration,
    pub(super) retry_count: u32,
    pub(super) retry_delay: Duration,
    pub(super) retry_jitter: Duration,
    pub(super) poll_interval: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            ttl: DEFAULT_TTL,
            node_timeout: DEFAULT_NODE_TIMEOUT,
            retry_count: u32::MAX,
            retry_delay: DEFAULT_RETRY_DELAY,
            retry_jitter: DEFAULT_RETRY_JITTER,
            poll_interval: DEFAULT_POLL_INTERVAL,
        }
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `u32::MAX` is how "no limit" is kept, not a count anyone set.
        let retry_count: &dyn fmt::Debug = match self.retry_count {
            u32::MAX => &format_args!("unlimited"),
            _ => &self.retry_count,
        };
        f.debug_struct("Config")
            .field("ttl", &self.ttl)
            .field("node_timeout", &self.node_timeout)
            .field("retry_count", retry_count)
            .field("retry_delay", &self.retry_delay)
            .field("retry_jitter", &self.retry_jitter)
            .field("poll_interval", &self.poll_interval)
            .finish()
    }
}

impl fmt::Debug for Redlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Redlock")
            .field("nodes", &self.nodes)
            .field("quorum", &self.quorum())
            .field("config", &self.config)
            .finish()
    }
}

impl Redlock {
    /// Sets up connections to the nodes at `urls`
    /// (`redis://[user:password@]host:port[/db]`) and checks the deployment
    /// (see [`check_setup`](Self::check_setup)), logging what is unsafe.
    ///
    /// Nodes that are down are tolerated: each connects on first use, and a
    /// node that comes up later takes part from then on. Fails only for a
    /// bad configuration: no URL, an invalid one, or one listed twice.
    /// Costs 1 round trip to every node (`INFO`), at most 1 s each.
    pub async fn connect(urls: &[&str]) -> Result<Self, Error> {
        let clients = urls
            .iter()
            .map(|url| redis::Client::open(*url))
            .collect::<Result<Vec<_>, _>>()?;
        Self::from_clients(clients).await
    }

    /// Starts a builder: `Redlock::builder(nodes).ttl(..).build().await`,
    /// where each node is anything `redis` takes as connection info (a URL,
    /// a `redis::ConnectionInfo` with TLS settings, a `(host, port)` pair).
    /// Its `build()` refuses a setting out of range before it connects.
    pub fn builder<I>(nodes: I) -> super::RedlockBuilder
    where
        I: IntoIterator,
        I::Item: redis::IntoConnectionInfo,
    {
        super::RedlockBuilder::new(nodes)
    }

    /// Like [`connect`](Self::connect), with `redis::Client`s you built
    /// (from `redis::ConnectionInfo`, with TLS settings, ...). Two clients for
    /// the same host, port and database are refused as a node listed twice.
    pub async fn from_clients(clients: Vec<redis::Client>) -> Result<Self, Error> {
        Self::open(clients, Config::default()).await
    }

    /// Sets up the nodes with settings its builder has checked.
    pub(super) async fn open(clients: Vec<redis::Client>, config: Config) -> Result<Self, Error> {
        if clients.is_empty() {
            return Err(Error::InvalidArgument {
                argument: "urls",
                reason: "Redlock needs at least one node".to_owned(),
            });
        }
        let nodes = clients
            .into_iter()
            .map(Node::lazy)
            .collect::<Result<Vec<_>, _>>()?;
        if nodes.iter().map(Node::label).collect::<HashSet<_>>().len() != nodes.len() {
            return Err(Error::InvalidArgument {
                argument: "urls",
                reason: "a Redlock node is listed twice (one host, port and database)".to_owned(),
            });
        }
        let needed = nodes.len() / 2 + 1;
        let redlock = Self {
            signals: Signals::new(&nodes, needed),
            nodes: nodes.into(),
            config,
        };
        let report = setup::inspect(&redlock.nodes, SETUP_TIMEOUT, false).await;
        if report.reachable() < redlock.quorum() {
            tracing::warn!(
                reachable = report.reachable(),
                quorum = redlock.quorum(),
                "distlock: fewer Redlock nodes answer than a quorum needs; locking fails until more come up"
            );
        }
        Ok(redlock)
    }

    /// Sets the leases' time to live: a shorthand for
    /// [`RedlockBuilder::ttl`](super::RedlockBuilder::ttl), which has the
    /// range (100 ms to 30 days) and the reasons.
    ///
    /// Deprecated because it cannot refuse a TTL out of range, being
    /// infallible: the locker it returns then fails every acquisition with
    /// [`Error::InvalidSetting`] (and this call logs that at `ERROR`). The
    /// builder is the checked path: its `build()` refuses such a TTL before
    /// anything connects, so no locker that fails later is ever made.
    #[deprecated(
        note = "use `Redlock::builder(urls).ttl(ttl).build()`, which refuses a TTL out of range before connecting"
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

    /// How many nodes must grant a lease: N/2 + 1.
    pub fn quorum(&self) -> usize {
        self.nodes.len() / 2 + 1
    }

    /// The nodes, as `host:port/db` (no credentials), in the order given.
    pub fn nodes(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.label().to_owned()).collect()
    }

    /// Asks every node with `INFO` whether it is reachable, a replica, has
    /// replicas, or is the same server as another node (same `run_id`), and
    /// logs each finding at `WARN`. Redlock's guarantee assumes N
    /// independent primaries; see the [module docs](super). Costs 1 round
    /// trip to every node, concurrently, each within the node timeout (as
    /// every lock command: at most the TTL less the drift margin).
    pub async fn check_setup(&self) -> SetupReport {
        let within = self.config.node_timeout.min(claim::window(self.config.ttl));
        setup::inspect(&self.nodes, within, false).await
    }

    /// Makes one attempt to take the lease `key`; `Ok(None)` if it was not
    /// granted by a quorum because others hold the key on some nodes (or the
    /// attempt took longer than the TTL allows).
    ///
    /// Fails with [`Error::QuorumUnreachable`] when failing nodes alone leave no quorum
    /// (more than N − quorum nodes down or too slow), and with
    /// [`Error::InvalidKey`] for an empty name, one containing NUL, or a
    /// [`LockKey::namespaced`] key outside the semaphore's reserved namespace
    /// ([`Semaphore::SLOT_NAMESPACE`](crate::Semaphore::SLOT_NAMESPACE)).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it returns leaves no lease held: a
    /// background task deletes the key on all nodes (compare-then-`DEL`).
    pub async fn try_lock(&self, key: impl Into<LockKey>) -> Result<Option<RedlockLease>, Error> {
        let key = key.into();
        span::traced(&key, Quorum::NAME, "try", Option::is_some, async {
            let claim = Arc::new(Claim::new(key.clone(), self.config.ttl)?);
            match self.attempt(&claim).await {
                Ok(Round::Granted(lease)) => Ok(Some(lease)),
                Ok(Round::Held | Round::Missed) => Ok(None),
                Err(unreachable) => Err(unreachable.error),
            }
        })
        .await
    }

    /// Takes the lease `key`, trying again after each failed attempt until
    /// `timeout` has passed or the retry count is used up; then fails with
    /// [`Error::Timeout`]. A `timeout` too long for the clock (such as
    /// `Duration::MAX`) means as long as possible.
    ///
    /// An attempt that finds the key held by others on a quorum of nodes is
    /// followed by a subscription to the key's release signal on every node
    /// and one more attempt; then the call sleeps until a release wakes it
    /// or the fallback poll is due (at most
    /// [`poll_interval`](super::RedlockBuilder::poll_interval), default
    /// 1 s). A split vote (no quorum holds the key), failing nodes, or
    /// releases that a quorum of subscribers cannot hear wait the retry
    /// delay plus a random jitter instead. Each attempt after the first
    /// counts against the retry count. See [Waiting](super#waiting).
    ///
    /// Nodes that fail for a passing reason (down, refusing or resetting
    /// connections, no reply within the node timeout, still loading their
    /// data) do not end the wait: an attempt they leave without a quorum is
    /// retried like a busy one, so the wait survives nodes restarting before
    /// the deadline. It fails at once with [`Error::QuorumUnreachable`] only when nodes
    /// failing with a permanent error (failed authentication, a missing ACL
    /// permission, …) alone leave no quorum. Every attempt uses the same
    /// token, so a `SET` that landed late still belongs to this call.
    ///
    /// # Cancel safety
    ///
    /// As for [`try_lock`](Self::try_lock): no lease outlives a dropped call.
    pub async fn lock(
        &self,
        key: impl Into<LockKey>,
        timeout: Duration,
    ) -> Result<RedlockLease, Error> {
        let key = key.into();
        span::traced(
            &key,
            Quorum::NAME,
            "wait",
            |_| true,
            self.wait(&key, timeout),
        )
        .await
    }

    async fn wait(&self, key: &LockKey, timeout: Duration) -> Result<RedlockLease, Error> {
        let started = Instant::now();
        let claim = Arc::new(Claim::new(key.clone(), self.config.ttl)?);
        let config = self.config;
        let mut retries = 0_u32;
        let pacing = Pacing {
            signals: self.signals.clone(),
            listen_within: self.backend(&claim).within,
            // A held key is released with a signal, when heard; a split
            // vote or failing nodes are not: they wait the retry delay.
            pause: |cause, heard| {
                (retries < config.retry_count).then(|| {
                    retries += 1;
                    match cause {
                        Cause::Held if heard => {
                            jittered(config.poll_interval / 2, config.poll_interval / 2)
                        }
                        _ => jittered(config.retry_delay, config.retry_jitter),
                    }
                })
            },
        };
        let attempt = || async {
            match self.attempt(&claim).await {
                Ok(Round::Granted(lease)) => Tried::Granted(lease),
                Ok(Round::Held) => Tried::Held,
                Ok(Round::Missed) => Tried::Missed,
                Err(unreachable) => Tried::Failed(Failed {
                    error: unreachable.error,
                    transient: unreachable.transient,
                }),
            }
        };
        match retry::until_granted(&claim, started, timeout, pacing, attempt).await {
            Waited::Granted(lease) => Ok(lease),
            Waited::TimedOut { .. } => Err(claim.timed_out(started)),
            Waited::Failed(error) => Err(error),
        }
    }

    /// One round of the algorithm: take the key everywhere (where it is
    /// free or already this call's: an earlier attempt's key whose reply
    /// and cleanup were lost must not count against the call until its
    /// TTL), count, and on failure delete everywhere before reporting it.
    async fn attempt(&self, claim: &Arc<Claim>) -> Result<Round, Unreachable> {
        let quorum = self.backend(claim);
        let in_flight = InFlight::new(&quorum, claim);
        let started = Instant::now();
        let tally = quorum
            .ask(&scripts::acquire_naming_holder(claim), |v| {
                *v == Value::Int(0)
            })
            .await;
        let in_time = Instant::now() < started + claim.window();
        if tally.granted >= quorum.needed() && in_time {
            in_flight.disarm();
            let handle = Handle::spawn(quorum, Arc::clone(claim), started);
            return Ok(Round::Granted(RedlockLease::new(
                handle,
                None,
                Quorum::NAME,
            )));
        }
        let cleanup = quorum.ask(&scripts::release_quietly(claim), is_one).await;
        if let Some(failure) = cleanup.first_failure() {
            tracing::trace!(error = %failure, "cleanup after a failed Redlock attempt");
        }
        in_flight.disarm();
        let spare = self.nodes.len() - quorum.needed();
        if tally.failed.len() > spare {
            let transient = tally.lasting() <= spare;
            return Err(Unreachable {
                error: tally.unreachable(&claim.key, quorum.needed(), transient),
                transient,
            });
        }
        if tally.granted >= quorum.needed() {
            tracing::warn!(
                took_ms = started.elapsed().as_secs_f64() * 1e3,
                "distlock: Redlock quorum reached too late, its validity had run out"
            );
            return Ok(Round::Missed);
        }
        // Held by one other call on a quorum of the nodes that answered
        // (whose release signals). Otherwise the vote split among several
        // calls, whose failed attempts clean up without a signal, or the
        // holder's quorum is partly on nodes that did not answer: either
        // way the retry delay, not the release signal, paces the next try.
        if tally.most_held_by_one() >= quorum.needed() {
            Ok(Round::Held)
        } else {
            Ok(Round::Missed)
        }
    }

    fn backend(&self, claim: &Claim) -> Quorum {
        Quorum {
            nodes: Arc::clone(&self.nodes),
            within: self.config.node_timeout.min(claim.window()),
        }
    }
}

/// The Redlock side of a lease: every node, and the per-node deadline.
#[derive(Debug, Clone)]
struct Quorum {
    nodes: Arc<[Node]>,
    within: Duration,
}

/// What the nodes answered to one command.
#[derive(Debug)]
struct Tally {
    /// How many nodes were asked.
    asked: usize,
    /// Nodes that did what was asked.
    granted: usize,
    /// Nodes that could not be asked (error or no reply in time), by label.
    failed: Vec<(String, Failure)>,
    /// The replies of the nodes that answered, but not as asked (for the
    /// acquire script: the token that holds the key there).
    refusals: Vec<Value>,
}

/// What one attempt that no node failure ruled out came to.
enum Round {
    Granted(RedlockLease),
    /// Others hold the key on a quorum of nodes.
    Held,
    /// Not granted, and no quorum of others holds the key: a split vote
    /// (or a quorum reached too late).
    Missed,
}

/// An attempt that too many failing nodes left without a quorum.
#[derive(Debug)]
struct Unreachable {
    /// [`Error::QuorumUnreachable`], naming every failing node and its
    /// error.
    error: Error,
    /// Whether the nodes that failed for good (see [`Failure::is_transient`])
    /// still leave room for a quorum once the others recover.
    transient: bool,
}

impl Tally {
    /// The most nodes that refused with one and the same reply (for the
    /// acquire script: held by one call).
    fn most_held_by_one(&self) -> usize {
        let mut most = 0;
        for (i, refusal) in self.refusals.iter().enumerate() {
            let same = self.refusals[i..].iter().filter(|r| *r == refusal).count();
            most = most.max(same);
        }
        most
    }

    /// How many nodes failed with an error that trying again cannot fix.
    fn lasting(&self) -> usize {
        self.failed
            .iter()
            .filter(|(_, failure)| !failure.is_transient())
            .count()
    }

    /// Why a quorum could not be reached with this many failing nodes.
    fn unreachable(self, key: &LockKey, quorum: usize, passing: bool) -> Error {
        Error::QuorumUnreachable {
            key: key.clone(),
            nodes: self.asked,
            quorum,
            failures: self
                .failed
                .iter()
                .map(|(node, failure)| format!("{node}: {failure}"))
                .collect(),
            passing,
        }
    }

    /// Why the nodes that failed kept a quorum out: a node that failed
    /// outright says more than a silent one, and when every one was silent
    /// the extension got no answer in time, as a single server's would.
    fn loss(&self) -> LossReason {
        let failed = self
            .failed
            .iter()
            .find(|(_, failure)| !matches!(failure, Failure::TimedOut(_)))
            .or_else(|| self.failed.first());
        match failed {
            Some((_, Failure::TimedOut(after))) => LossReason::HeartbeatTimedOut(*after),
            Some((node, failure)) => LossReason::ConnectionFailed(format!("{node}: {failure}")),
            None => LossReason::Expired,
        }
    }

    fn first_failure(self) -> Option<Failure> {
        self.failed.into_iter().next().map(|(_, failure)| failure)
    }
}

impl Quorum {
    fn needed(&self) -> usize {
        self.nodes.len() / 2 + 1
    }

    /// Sends `cmd` to every node at once; `yes` tells a granting reply.
    async fn ask(&self, cmd: &Cmd, yes: fn(&Value) -> bool) -> Tally {
        let replies = join_all(
            self.nodes
                .iter()
                .map(|n| n.query::<Value>(cmd, self.within)),
        )
        .await;
        let mut tally = Tally {
            asked: self.nodes.len(),
            granted: 0,
            failed: Vec::new(),
            refusals: Vec::new(),
        };
        for (node, reply) in self.nodes.iter().zip(replies) {
            match reply {
                Ok(value) if yes(&value) => tally.granted += 1,
                Ok(value) => tally.refusals.push(value),
                Err(failure) => tally.failed.push((node.label().to_owned(), failure)),
            }
        }
        tally
    }
}

fn is_one(value: &Value) -> bool {
    *value == Value::Int(1)
}

impl Backend for Quorum {
    const NAME: &'static str = "redlock";

    /// Nodes that answered "not ours" never become ours again; when they
    /// alone rule out a quorum the lease is lost at once. Failing nodes may
    /// recover, so then the watchdog retries while the validity lasts.
    async fn extend(&self, claim: &Claim) -> Extension {
        let tally = self.ask(&scripts::extend(claim), is_one).await;
        if tally.granted >= self.needed() {
            Extension::Extended
        } else if tally.granted + tally.failed.len() < self.needed() {
            Extension::Lost(LossReason::Expired)
        } else {
            Extension::Retry(tally.loss())
        }
    }

    /// Deletes on every node, also those that never granted the lease. As
    /// for [`extend`](Self::extend): when the nodes that answered "not
    /// ours" alone rule out a quorum, the lease was lost whatever the
    /// failing nodes would have said.
    async fn release(&self, claim: &Claim) -> Result<(), Error> {
        let tally = self.ask(&scripts::release(claim), is_one).await;
        if tally.granted >= self.needed() {
            return Ok(());
        }
        let could_hold = tally.granted + tally.failed.len() >= self.needed();
        match tally.first_failure() {
            Some(failure) if could_hold => Err(claim.release_failed(failure)),
            _ => Err(claim.not_held()),
        }
    }
}

crate::lease::locker_from_inherent!(Redlock, Quorum::NAME);
