//! `PgLocker`, `SessionLock`, `MultiLock` and `UpgradeableLock` behind the
//! backend-neutral [`Locker`](crate::Locker) and [`Lease`](crate::Lease) traits.

crate::lease::locker_from_inherent!(
    crate::PgLocker,
    "postgres",
    election,
    fn native_semaphore(
        &self,
        name: &str,
        permits: u32,
    ) -> Option<Result<crate::Semaphore, crate::Error>> {
        Some(crate::PgLocker::semaphore(self, name, permits))
    }
);

crate::lease::lease_from_inherent!(crate::SessionLock);
crate::lease::lease_from_inherent!(crate::MultiLock, keys = first_key);
crate::lease::lease_from_inherent!(crate::UpgradeableLock);
