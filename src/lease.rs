//! The backend-agnostic layer: something that hands out leases, and a lease.
//!
//! Each backend implements them in its own folder:
//! [`PgLocker`](crate::PgLocker) with session locks (`postgres/lease.rs`),
//! the Redis lockers (feature `redis`) with TTL leases. Both traits are object safe, so
//! code such as the singleton-job runner can take an `Arc<dyn Locker>` and
//! work with any backend.

use std::fmt::Debug;
use std::time::Duration;

use async_trait::async_trait;

use crate::{Error, FencingToken, LockKey, LossReason};

/// Hands out exclusive leases on named keys.
#[async_trait]
pub trait Locker: Debug + Send + Sync {
    /// Takes the lease `key` if it is free; `Ok(None)` if someone else holds it.
    async fn try_lock(&self, key: LockKey) -> Result<Option<Box<dyn Lease>>, Error>;

    /// Takes the lease `key`, waiting up to `timeout`; [`Error::Timeout`] when
    /// the deadline passes.
    async fn lock(&self, key: LockKey, timeout: Duration) -> Result<Box<dyn Lease>, Error>;

    /// A short name of the backend, for logs and metrics (`"postgres"`, `"redis"`, ...).
    fn backend(&self) -> &'static str;
}

/// A held lease. Dropping it releases it in the background.
#[async_trait]
pub trait Lease: Debug + Send + Sync {
    /// The key this lease holds.
    fn key(&self) -> &LockKey;

    /// The fencing token issued with the lease, if the backend issues them.
    fn fencing_token(&self) -> Option<FencingToken>;

    /// Completes when the lease can no longer be trusted, with the reason.
    async fn lost(&self) -> LossReason;

    /// `true` once [`lost`](Self::lost) would complete.
    fn is_lost(&self) -> bool;

    /// Releases the lease.
    async fn release(self: Box<Self>) -> Result<(), Error>;
}
