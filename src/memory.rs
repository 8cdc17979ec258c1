//! An in-memory backend for your own tests: [`MemoryLocker`].
//!
//! It implements [`Locker`] with a lock table in the process, so code built
//! on `Arc<dyn Locker>` (a [`SingletonJob`](crate::SingletonJob), your own
//! services) can be unit-tested without a database, including what it does
//! when a lease is lost ([`MemoryLocker::lose`]). It is not a distributed
//! lock: clones share one table, other processes see nothing.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{Notify, watch};

use crate::{Error, FencingToken, Lease, LockKey, Locker, LossReason};

/// An in-memory [`Locker`] for tests. Cheap to clone; clones share one lock
/// table.
///
/// Leases carry fencing tokens (strictly increasing per key), waits are
/// woken the moment the key is freed (no polling), and [`lose`](Self::lose)
/// makes the current holder's `lost()` fire.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), distlock::Error> {
/// use distlock::memory::MemoryLocker;
/// use distlock::LockKey;
///
/// let locker = MemoryLocker::new();
/// let lease = locker.try_lock("job").await?.expect("free");
/// assert!(locker.try_lock("job").await?.is_none());
/// locker.lose(&LockKey::from("job"));
/// lease.lost().await; // fires at once
/// assert!(locker.try_lock("job").await?.is_some());
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
pub struct MemoryLocker {
    table: Arc<Table>,
}

#[derive(Default)]
struct Table {
    keys: Mutex<HashMap<LockKey, Entry>>,
    /// Woken whenever any key is freed; waiters re-check their key.
    freed: Notify,
}

#[derive(Default)]
struct Entry {
    /// The current holder's id and loss channel, if held.
    holder: Option<(u64, watch::Sender<Option<LossReason>>)>,
    /// The last token issued for this key.
    token: i64,
    next_id: u64,
}

impl fmt::Debug for MemoryLocker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let held = self
            .table
            .lock()
            .values()
            .filter(|e| e.holder.is_some())
            .count();
        f.debug_struct("MemoryLocker").field("held", &held).finish()
    }
}

impl Table {
    fn lock(&self) -> MutexGuard<'_, HashMap<LockKey, Entry>> {
        // A panic while holding the table cannot leave it inconsistent:
        // every change is a single assignment.
        self.keys
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn try_take(self: &Arc<Self>, key: &LockKey) -> Option<MemoryLease> {
        let mut keys = self.lock();
        let entry = keys.entry(key.clone()).or_default();
        if entry.holder.is_some() {
            return None;
        }
        entry.token += 1;
        entry.next_id += 1;
        let (loss, lost) = watch::channel(None);
        entry.holder = Some((entry.next_id, loss));
        Some(MemoryLease {
            key: key.clone(),
            id: entry.next_id,
            token: FencingToken::new(entry.token),
            lost,
            table: Arc::clone(self),
            released: false,
        })
    }

    /// Frees `key` if `id` still holds it; `false` if it did not.
    fn free(&self, key: &LockKey, id: u64) -> bool {
        let freed = {
            let mut keys = self.lock();
            match keys.get_mut(key) {
                Some(entry) if entry.holder.as_ref().is_some_and(|(h, _)| *h == id) => {
                    entry.holder = None;
                    true
                }
                _ => false,
            }
        };
        if freed {
            self.freed.notify_waiters();
        }
        freed
    }
}

impl MemoryLocker {
    /// An empty lock table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes the current holder of `key` lose it: its `lost()` completes
    /// with [`LossReason::Expired`] and the key is free for others at once.
    /// Returns whether anyone held it.
    pub fn lose(&self, key: &LockKey) -> bool {
        let lost = {
            let mut keys = self.table.lock();
            keys.get_mut(key).and_then(|entry| entry.holder.take())
        };
        let Some((_, loss)) = lost else {
            return false;
        };
        loss.send_replace(Some(LossReason::Expired));
        self.table.freed.notify_waiters();
        true
    }

    /// Whether someone holds `key` right now.
    pub fn is_held(&self, key: &LockKey) -> bool {
        self.table
            .lock()
            .get(key)
            .is_some_and(|entry| entry.holder.is_some())
    }

    /// Takes `key` if it is free; `Ok(None)` if held. Validates the key like
    /// every backend. No round trip; cancel safe.
    pub async fn try_lock(&self, key: impl Into<LockKey>) -> Result<Option<MemoryLease>, Error> {
        let key = key.into();
        key.validate()?;
        Ok(self.table.try_take(&key))
    }

    /// Takes `key`, waiting up to `timeout` (woken when the key is freed,
    /// not polled); [`Error::Timeout`] when the deadline passes.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped wait holds nothing.
    pub async fn lock(
        &self,
        key: impl Into<LockKey>,
        timeout: Duration,
    ) -> Result<MemoryLease, Error> {
        let key = key.into();
        key.validate()?;
        let started = std::time::Instant::now();
        let deadline = crate::deadline::from_now(timeout);
        loop {
            // Register for the wake-up before checking, so a release between
            // the check and the wait is not missed.
            let freed = self.table.freed.notified();
            if let Some(lease) = self.table.try_take(&key) {
                return Ok(lease);
            }
            if tokio::time::timeout_at(deadline, freed).await.is_err() {
                return Err(Error::Timeout {
                    key: key.to_string(),
                    waited: started.elapsed(),
                    holder_pid: None,
                    holder_application: None,
                });
            }
        }
    }
}

/// A lease of a [`MemoryLocker`].
#[must_use = "the lease is released as soon as it is dropped"]
pub struct MemoryLease {
    key: LockKey,
    id: u64,
    token: FencingToken,
    lost: watch::Receiver<Option<LossReason>>,
    table: Arc<Table>,
    released: bool,
}

impl fmt::Debug for MemoryLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryLease")
            .field("key", &self.key)
            .field("fencing_token", &self.token)
            .field("lost", &self.is_lost())
            .finish()
    }
}

impl MemoryLease {
    /// The key held.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// The lease's fencing token: strictly increasing per key.
    pub fn fencing_token(&self) -> FencingToken {
        self.token
    }

    /// Completes when [`MemoryLocker::lose`] took the key away.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only watches a channel.
    pub async fn lost(&self) -> LossReason {
        let mut lost = self.lost.clone();
        match lost.wait_for(Option::is_some).await {
            Ok(reason) => reason.clone().unwrap_or(LossReason::Expired),
            Err(_) => LossReason::Expired,
        }
    }

    /// `true` once [`lost`](Self::lost) would complete.
    pub fn is_lost(&self) -> bool {
        self.lost.borrow().is_some()
    }

    /// Frees the key; [`Error::LockLost`] if it had been lost.
    pub async fn release(mut self) -> Result<(), Error> {
        self.released = true;
        if self.table.free(&self.key, self.id) {
            return Ok(());
        }
        Err(Error::LockLost {
            key: self.key.to_string(),
            reason: self.lost.borrow().clone().unwrap_or(LossReason::Expired),
        })
    }
}

impl Drop for MemoryLease {
    fn drop(&mut self) {
        if !self.released {
            self.table.free(&self.key, self.id);
        }
    }
}

#[async_trait]
impl Locker for MemoryLocker {
    async fn try_lock(&self, key: LockKey) -> Result<Option<Box<dyn Lease>>, Error> {
        let lease = MemoryLocker::try_lock(self, key).await?;
        Ok(lease.map(|lease| Box::new(lease) as Box<dyn Lease>))
    }

    async fn lock(&self, key: LockKey, timeout: Duration) -> Result<Box<dyn Lease>, Error> {
        Ok(Box::new(MemoryLocker::lock(self, key, timeout).await?))
    }

    fn backend(&self) -> &'static str {
        "memory"
    }
}

#[async_trait]
impl Lease for MemoryLease {
    fn key(&self) -> &LockKey {
        MemoryLease::key(self)
    }

    fn fencing_token(&self) -> Option<FencingToken> {
        Some(self.token)
    }

    async fn lost(&self) -> LossReason {
        MemoryLease::lost(self).await
    }

    fn is_lost(&self) -> bool {
        MemoryLease::is_lost(self)
    }

    async fn release(self: Box<Self>) -> Result<(), Error> {
        MemoryLease::release(*self).await
    }
}
