//! `PgLocker`, `SessionLock`, `MultiLock` and `UpgradeableLock` behind the backend-neutral [`Locker`] and
//! [`Lease`] traits.

use std::time::Duration;

use async_trait::async_trait;

use crate::{Error, Lease, LockKey, Locker};

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

    fn election(&self) -> Option<&dyn crate::ElectionLocker> {
        Some(self)
    }

    fn native_semaphore(
        &self,
        name: &str,
        permits: u32,
    ) -> Option<Result<crate::Semaphore, Error>> {
        Some(crate::PgLocker::semaphore(self, name, permits))
    }
}

crate::lease::lease_from_inherent!(crate::SessionLock);
crate::lease::lease_from_inherent!(crate::MultiLock, keys = first_key);
crate::lease::lease_from_inherent!(crate::UpgradeableLock);
