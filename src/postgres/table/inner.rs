//! What a [`TableLocker`](super::TableLocker) and its leases share: the
//! pool, the settings, the warm connections and the listening connection.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgPool;

use super::notify::Listener;
use crate::postgres::conn::warm::Warm;
use crate::postgres::conn::watched::WatchedConn;
use crate::{Error, LockKey};

#[derive(Debug)]
pub(super) struct Inner {
    pub(super) pool: PgPool,
    pub(super) ttl: Duration,
    pub(super) poll_interval: Duration,
    pub(super) release_timeout: Duration,
    /// `None` when built with `.listen(false)`.
    pub(super) listener: Option<Listener>,
    /// Connections kept between grants and releases, so the next skips the
    /// pool's pings (a lease's statements leave nothing held on them).
    pub(super) warm: Arc<Warm>,
}

impl Inner {
    /// How long after a statement was sent its answer is still worth
    /// waiting for: two thirds of the TTL, the deadline by which a lease's
    /// holder reports it lost when no renewal was answered (counted from
    /// the send, as a grant's is). A grant answered later would be handed
    /// over already lost, so a silent server is given up at this point.
    pub(super) fn renewal_deadline(&self) -> Duration {
        self.ttl * 2 / 3
    }

    /// Until when a lease granted or renewed by a statement sent at `sent`
    /// is known held: [`renewal_deadline`](Self::renewal_deadline) later.
    pub(super) fn valid_until(&self, sent: tokio::time::Instant) -> tokio::time::Instant {
        crate::deadline::after(sent, self.renewal_deadline())
    }

    /// A connection from the pool for `key`'s statement, or
    /// [`Error::PoolExhausted`] when every connection is in use. Of the
    /// kind the locker's warm connections keep (shared with no session
    /// lock: a lease's statements need no watching, but one stash serves
    /// every kind).
    pub(super) async fn pooled(&self, key: &LockKey) -> Result<WatchedConn, Error> {
        crate::postgres::conn::pooled::watched(&self.pool, key).await
    }
}
