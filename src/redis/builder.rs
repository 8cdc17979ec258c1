//! Builders of the Redis lockers, in the style of `PgLocker::builder`:
//! `builder(server).ttl(..).build().await`.
//!
//! They take anything `redis` accepts as connection info (a URL, a
//! `redis::ConnectionInfo` with TLS settings, a `(host, port)` pair) and set
//! the same options as the `with_*` methods of the lockers.

use std::fmt;
use std::time::Duration;

use redis::{ConnectionInfo, IntoConnectionInfo, RedisResult};

use super::{RedisLocker, Redlock};
use crate::Error;

/// Configures a [`RedisLocker`]; from [`RedisLocker::builder`].
///
/// Its `Debug` output names the server's address, never its credentials.
#[must_use = "a builder does nothing until .build() is called"]
pub struct RedisLockerBuilder {
    server: RedisResult<ConnectionInfo>,
    ttl: Option<Duration>,
    fencing: Option<bool>,
    command_timeout: Option<Duration>,
}

impl RedisLockerBuilder {
    pub(super) fn new(server: impl IntoConnectionInfo) -> Self {
        Self {
            server: server.into_connection_info(),
            ttl: None,
            fencing: None,
            command_timeout: None,
        }
    }

    /// The leases' time to live; see [`RedisLocker::with_ttl`].
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// Whether leases carry fencing tokens; see [`RedisLocker::with_fencing`].
    pub fn fencing(mut self, fencing: bool) -> Self {
        self.fencing = Some(fencing);
        self
    }

    /// The deadline of one command; see [`RedisLocker::with_command_timeout`].
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = Some(timeout);
        self
    }

    /// Connects as [`RedisLocker::connect`] does (2 round trips: handshake
    /// and `INFO`). Fails with [`Error::Redis`] for invalid connection info
    /// or a server that does not answer.
    ///
    /// # Cancel safety
    ///
    /// Takes no lease: dropping the future only drops the connection.
    pub async fn build(self) -> Result<RedisLocker, Error> {
        let mut locker = RedisLocker::from_client(redis::Client::open(self.server?)?).await?;
        if let Some(ttl) = self.ttl {
            locker = locker.with_ttl(ttl);
        }
        if let Some(fencing) = self.fencing {
            locker = locker.with_fencing(fencing);
        }
        if let Some(timeout) = self.command_timeout {
            locker = locker.with_command_timeout(timeout);
        }
        Ok(locker)
    }
}

/// Configures a [`Redlock`]; from [`Redlock::builder`].
///
/// Its `Debug` output names the nodes' addresses, never their credentials.
#[must_use = "a builder does nothing until .build() is called"]
pub struct RedlockBuilder {
    nodes: RedisResult<Vec<ConnectionInfo>>,
    ttl: Option<Duration>,
    node_timeout: Option<Duration>,
    retry_count: Option<u32>,
    retry_delay: Option<Duration>,
    retry_jitter: Option<Duration>,
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
            ttl: None,
            node_timeout: None,
            retry_count: None,
            retry_delay: None,
            retry_jitter: None,
        }
    }

    /// The leases' time to live; see [`Redlock::with_ttl`].
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// One node's reply deadline; see [`Redlock::with_node_timeout`].
    pub fn node_timeout(mut self, timeout: Duration) -> Self {
        self.node_timeout = Some(timeout);
        self
    }

    /// Retries after a failed attempt; see [`Redlock::with_retry_count`].
    pub fn retry_count(mut self, retries: u32) -> Self {
        self.retry_count = Some(retries);
        self
    }

    /// The fixed part of the delay between attempts; see
    /// [`Redlock::with_retry_delay`].
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = Some(delay);
        self
    }

    /// The random part of the delay; see [`Redlock::with_retry_jitter`].
    pub fn retry_jitter(mut self, jitter: Duration) -> Self {
        self.retry_jitter = Some(jitter);
        self
    }

    /// Sets up the nodes as [`Redlock::connect`] does (1 `INFO` per node,
    /// at most 1 s each). Fails for invalid connection info, no node, or a
    /// node listed twice.
    ///
    /// # Cancel safety
    ///
    /// Takes no lease: dropping the future only drops the connections.
    pub async fn build(self) -> Result<Redlock, Error> {
        let clients = self
            .nodes?
            .into_iter()
            .map(redis::Client::open)
            .collect::<Result<Vec<_>, _>>()?;
        let mut redlock = Redlock::from_clients(clients).await?;
        if let Some(ttl) = self.ttl {
            redlock = redlock.with_ttl(ttl);
        }
        if let Some(timeout) = self.node_timeout {
            redlock = redlock.with_node_timeout(timeout);
        }
        if let Some(retries) = self.retry_count {
            redlock = redlock.with_retry_count(retries);
        }
        if let Some(delay) = self.retry_delay {
            redlock = redlock.with_retry_delay(delay);
        }
        if let Some(jitter) = self.retry_jitter {
            redlock = redlock.with_retry_jitter(jitter);
        }
        Ok(redlock)
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
            .field("ttl", &self.ttl)
            .field("fencing", &self.fencing)
            .field("command_timeout", &self.command_timeout)
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
            .field("ttl", &self.ttl)
            .field("node_timeout", &self.node_timeout)
            .field("retry_count", &self.retry_count)
            .finish_non_exhaustive()
    }
}
