//! What a [`TableLocker`](super::TableLocker) and its leases share: the
//! pool, the settings and the listening connection.

use std::time::Duration;

use sqlx::postgres::PgPool;

use super::notify::Listener;

#[derive(Debug)]
pub(super) struct Inner {
    pub(super) pool: PgPool,
    pub(super) ttl: Duration,
    pub(super) poll_interval: Duration,
    pub(super) release_timeout: Duration,
    /// `None` when built with `.listen(false)`.
    pub(super) listener: Option<Listener>,
    /// A setting the builder refused: every acquisition fails with it.
    pub(super) invalid: Option<&'static str>,
}
