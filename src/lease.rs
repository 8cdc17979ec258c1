//! The backend-agnostic layer: something that hands out leases, and a lease.
//!
//! [`PgLocker`](crate::PgLocker) implements [`Locker`] with session locks;
//! the Redis lockers (feature `redis`) do too. Both traits are object safe, so
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

#[async_trait]
impl Locker for crate::PgLocker {
    async fn try_lock(&self, key: LockKey) -> Result<Option<Box<dyn Lease>>, Error> {
        let lock = crate::PgLocker::try_lock(self, key).await?;
        Ok(lock.map(|lock| Box::new(lock) as Box<dyn Lease>))
    }

    async fn lock(&self, key: LockKey, timeout: Duration) -> Result<Box<dyn Lease>, Error> {
        let lock = crate::PgLocker::lock(self, key, timeout).await?;
        Ok(Box::new(lock))
    }

    fn backend(&self) -> &'static str {
        "postgres"
    }
}

#[async_trait]
impl Lease for crate::SessionLock {
    fn key(&self) -> &LockKey {
        crate::SessionLock::key(self)
    }

    fn fencing_token(&self) -> Option<FencingToken> {
        crate::SessionLock::fencing_token(self)
    }

    async fn lost(&self) -> LossReason {
        crate::SessionLock::lost(self).await
    }

    fn is_lost(&self) -> bool {
        crate::SessionLock::is_lost(self)
    }

    async fn release(self: Box<Self>) -> Result<(), Error> {
        crate::SessionLock::release(*self).await
    }
}
