//! Builders of the Redis lockers, in the style of `PgLocker::builder`:
//! `builder(server).ttl(..).build().await`.
//!
//! They take anything `redis` accepts as connection info (a URL, a
//! `redis::ConnectionInfo` with TLS settings, a `(host, port)` pair). Their
//! `build()` refuses a setting out of range with [`Error::InvalidSetting`]
//! before it opens any connection.

use std::fmt;
use std::time::Duration;

use crate::setting::at_least;
use redis::{ConnectionInfo, IntoConnectionInfo, RedisResult};

use super::claim::check_ttl;
use super::{RedisLocker, Redlock, redlock, single};
use crate::Error;

/// The shortest deadline of one command (or one node's reply): a zero
/// deadline would fail every command before its reply could arrive.
const MIN_COMMAND_TIMEOUT: Duration = Duration::from_millis(1);

/// The shortest fallback poll: a shorter one would be the busy polling
/// that the release signals replace.
const MIN_POLL_INTERVAL: Duration = Duration::from_millis(1);

/// Configures a [`RedisLocker`]; from [`RedisLocker::builder`].
///
/// Its `Debug` output names the server's address, never its credentials.
#[must_use = "a builder does nothing until .build() is called"]
pub struct RedisLockerBuilder {
    server: RedisResult<ConnectionInfo>,
    /// The defaults, changed by the setters; checked by `build()`.
    config: single::Config,
}

impl RedisLockerBuilder {
    pub(super) fn new(server: impl IntoConnectionInfo) -> Self {
        Self {
            server: server.into_connection_info(),
            config: single::Config::default(),
        }
    }

    /// The leases' time to live (default 30 s). A holder that dies without
    /// releasing blocks others for at most this long; the watchdog extends
    /// every TTL/3.
    ///
    /// Range: 100 ms to 30 days; [`build`](Self::build) refuses others
    /// (such as `Duration::MAX`) with [`Error::InvalidSetting`].
    #[must_use = "the setter returns the changed builder"]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.config.ttl = ttl;
        self
    }

    /// Whether leases carry fencing tokens (default `true`). Each lock name
    /// then keeps a counter key (`distlock:fencing`, a NUL byte, the name;
    /// see the [module docs](super#keys)) that never expires (so tokens
    /// never repeat); turn this off to keep no state beyond held leases.
    #[must_use = "the setter returns the changed builder"]
    pub fn fencing(mut self, fencing: bool) -> Self {
        self.config.fencing = fencing;
        self
    }

    /// The deadline of one command to the server (default 2 s). An
    /// extension that gets no reply in time counts as loss.
    ///
    /// Range: at least 1 ms; a duration too long for the clock (such as
    /// `Duration::MAX`) means as long as possible, though an acquisition
    /// still waits for its reply at most the TTL less the drift margin.
    /// [`build`](Self::build) refuses zero with [`Error::InvalidSetting`].
    #[must_use = "the setter returns the changed builder"]
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.config.command_timeout = timeout;
        self
    }

    /// The longest pause between two tries of a waiting
    /// [`lock`](RedisLocker::lock) while it hears the key's releases
    /// (default 1 s, [`DEFAULT_POLL_INTERVAL`](super::DEFAULT_POLL_INTERVAL));
    /// each pause is random between half of it and all of it. A release
    /// wakes a waiter at once, so this poll is the fallback for a holder
    /// that vanishes without releasing (its key expires after at most the
    /// TTL) and for a signal lost with a broken connection. See
    /// [Waiting](super#waiting).
    ///
    /// Range: at least 1 ms; a duration too long for the clock (such as
    /// `Duration::MAX`) means no poll: a waiter then tries again only when
    /// woken, or at its deadline. [`build`](Self::build) refuses less than
    /// 1 ms with [`Error::InvalidSetting`].
    #[must_use = "the setter returns the changed builder"]
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.config.poll_interval = interval;
        self
    }

    /// Connects as [`RedisLocker::connect`] does (2 round trips: handshake
    /// and `INFO`). Fails with [`Error::InvalidSetting`] for a setting out of
    /// range (before connecting), and with [`Error::Redis`] for invalid
    /// connection info or a server that does not answer.
    ///
    /// # Cancel safety
    ///
    /// Takes no lease: dropping the future only drops the connection.
    pub async fn build(self) -> Result<RedisLocker, Error> {
        let config = self.config;
        check_ttl(config.ttl)?;
        at_least(
            "command_timeout",
            config.command_timeout,
            MIN_COMMAND_TIMEOUT,
        )?;
        at_least("poll_interval", config.poll_interval, MIN_POLL_INTERVAL)?;
        RedisLocker::open(redis::Client::open(self.server?)?, config).await
    }
}

/// Configures a [`Redlock`]; from [`Redlock::builder`].
///
/// Its `Debug` output names the nodes' addresses, never their credentials.
#[must_use = "a builder does nothing until .build() is called"]
pub struct RedlockBuilder {
    nodes: RedisResult<Vec<ConnectionInfo>>,
    /// The defaults, changed by the setters; checked by `build()`.
    config: redlock::Config,
}

impl RedlockBuilder {
    pub(super) fn new<I>(nodes: I) -> Self
    where
        I: IntoIterator,
        I::Item: IntoConnectionInfo,
    {
        Self {
            nodes: nodes
                .into_iter()
                .map(IntoConnectionInfo::into_connection_info)
                .collect(),
            config: redlock::Config::default(),
        }
    }

    /// The leases' time to live (default 30 s).
    ///
    /// Range: 100 ms to 30 days; [`build`](Self::build) refuses others
    /// (such as `Duration::MAX`) with [`Error::InvalidSetting`].
    #[must_use = "the setter returns the changed builder"]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.config.ttl = ttl;
        self
    }

    /// The deadline of one node's reply (default 50 ms). It bounds how much
    /// of the validity a dead or slow node can eat.
    ///
    /// Range: at least 1 ms; it never exceeds the TTL less the drift
    /// margin, so `Duration::MAX` means exactly that. [`build`](Self::build)
    /// refuses zero with [`Error::InvalidSetting`].
    #[must_use = "the setter returns the changed builder"]
    pub fn node_timeout(mut self, timeout: Duration) -> Self {
        self.config.node_timeout = timeout;
        self
    }

    /// How many times [`Redlock::lock`] tries again after a failed attempt
    /// (default: no limit; the timeout bounds the wait). Range: any.
    #[must_use = "the setter returns the changed builder"]
    pub fn retry_count(mut self, retries: u32) -> Self {
        self.config.retry_count = retries;
        self
    }

    /// The fixed part of the delay between two attempts (default 50 ms).
    /// The delay never outlasts the wait's deadline. Range: any; a duration
    /// too long for the clock (such as `Duration::MAX`) saturates.
    #[must_use = "the setter returns the changed builder"]
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.config.retry_delay = delay;
        self
    }

    /// The upper bound of the random part added to each delay (default
    /// 50 ms). Random delays keep clients that split the vote from
    /// splitting it again. Range: any.
    #[must_use = "the setter returns the changed builder"]
    pub fn retry_jitter(mut self, jitter: Duration) -> Self {
        self.config.retry_jitter = jitter;
        self
    }

    /// The longest pause between two attempts of a waiting
    /// [`lock`](Redlock::lock) that found the key held by others on a
    /// quorum of nodes while it hears the key's releases on a quorum
    /// (default 1 s, [`DEFAULT_POLL_INTERVAL`](super::DEFAULT_POLL_INTERVAL));
    /// each pause is random between half of it and all of it. A release
    /// wakes a waiter at once, so this poll is the fallback for a holder
    /// that vanishes without releasing and for a signal lost with a broken
    /// connection. A split vote, failing nodes, or releases not heard wait
    /// the retry delay instead. See [Waiting](super#waiting).
    ///
    /// Range: at least 1 ms; a duration too long for the clock (such as
    /// `Duration::MAX`) means no poll. [`build`](Self::build) refuses less
    /// than 1 ms with [`Error::InvalidSetting`].
    #[must_use = "the setter returns the changed builder"]
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.config.poll_interval = interval;
        self
    }

    /// Sets up the nodes as [`Redlock::connect`] does (1 `INFO` per node,
    /// at most 1 s each). Fails with [`Error::InvalidSetting`] for a setting
    /// out of range (before connecting), [`Error::Redis`] for connection
    /// info that does not parse, and [`Error::InvalidArgument`] (argument
    /// `urls`) for no node or a node listed twice.
    ///
    /// # Cancel safety
    ///
    /// Takes no lease: dropping the future only drops the connections.
    pub async fn build(self) -> Result<Redlock, Error> {
        let config = self.config;
        check_ttl(config.ttl)?;
        at_least("node_timeout", config.node_timeout, MIN_COMMAND_TIMEOUT)?;
        at_least("poll_interval", config.poll_interval, MIN_POLL_INTERVAL)?;
        let clients = self
            .nodes?
            .into_iter()
            .map(redis::Client::open)
            .collect::<Result<Vec<_>, _>>()?;
        Redlock::open(clients, config).await
    }
}

/// A server's address for `Debug` output: host and port, no credentials.
fn address(info: &RedisResult<ConnectionInfo>) -> String {
    match info {
        Ok(info) => info.addr().to_string(),
        Err(_) => "<invalid>".to_owned(),
    }
}

impl fmt::Debug for RedisLockerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLockerBuilder")
            .field("server", &address(&self.server))
            .field("config", &self.config)
            .finish()
    }
}

impl fmt::Debug for RedlockBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nodes: Vec<String> = match &self.nodes {
            Ok(nodes) => nodes.iter().map(|n| n.addr().to_string()).collect(),
            Err(_) => vec!["<invalid>".to_owned()],
        };
        f.debug_struct("RedlockBuilder")
            .field("nodes", &nodes)
            .field("config", &self.config)
            .finish()
    }
}
