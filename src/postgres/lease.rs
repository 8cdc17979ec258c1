//! `PgLocker` and `SessionLock` behind the backend-neutral [`Locker`] and
//! [`Lease`] traits.

use std::time::Duration;

use async_trait::async_trait;

use crate::{Error, FencingToken, Lease, LockKey, Locker, LossReason};

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
