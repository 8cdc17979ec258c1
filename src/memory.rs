//! An in-memory backend for your own tests: [`MemoryLocker`].
//!
//! It implements [`Locker`](crate::Locker) with a lock table in the process, so code built
//! on `Arc<dyn Locker>` (a [`SingletonJob`](crate::SingletonJob), your own
//! services) can be unit-tested without a database, including what it does
//! when a lease is lost ([`MemoryLocker::lose`]). It is not a distributed
//! lock: clones share one table, other processes see nothing.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use tokio::sync::Notify;

use crate::loss_state::{self, LossSender, LossState};
use crate::{
    ElectionLocker, Error, FencingToken, LeaderInfo, Lease, LockKey, LossReason, Proclaimed,
    Proclamation, Seat,
};

/// An in-memory [`Locker`](crate::Locker) for tests. Cheap to clone; clones share one lock
/// table.
///
/// Leases carry fencing tokens (strictly increasing per key), waits are
/// woken the moment the key is freed (no polling), and [`lose`](Self::lose)
/// makes the current holder's `lost()` fire.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), distlock::Error> {
/// use distlock::memory::MemoryLocker;
///
/// let locker = MemoryLocker::new();
/// let lease = locker.try_lock("job").await?.expect("free");
/// assert!(locker.try_lock("job").await?.is_none());
/// assert!(locker.is_held("job"));
/// locker.lose("job");
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
    holder: Option<(u64, LossSender)>,
    /// The last token issued for this key.
    token: i64,
    next_id: u64,
    /// The leader record of an election on this key, if one was proclaimed.
    record: Option<Record>,
    /// Terms proclaimed on this key so far.
    terms: u64,
}

/// Who leads an election on a key: believed only while `holder` holds it.
struct Record {
    holder: u64,
    leader: LeaderInfo,
    withdrawn: bool,
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
        // The table keeps the sender while the lease holds the key; it goes
        // only with the holder, after `lose` reported why.
        let (loss, lost) = loss_state::channel(LossReason::Expired);
        entry.holder = Some((entry.next_id, loss));
        Some(MemoryLease {
            key: key.clone(),
            id: entry.next_id,
            token: FencingToken::new(entry.token),
            acquired_at: Instant::now(),
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
    /// Returns whether anyone held it. Takes any key form (`lose("job")`,
    /// `lose(&key)`), like the locking calls. No round trip.
    pub fn lose(&self, key: impl Into<LockKey>) -> bool {
        let key = key.into();
        let lost = {
            let mut keys = self.table.lock();
            let lost = keys.get_mut(&key).and_then(|entry| entry.holder.take());
            // Told before the table is let go: nobody can take the key
            // before its holder's `is_lost()` says so.
            if let Some((_, loss)) = &lost {
                loss.send_replace(Some(LossReason::Expired));
            }
            lost
        };
        if lost.is_none() {
            return false;
        }
        self.table.freed.notify_waiters();
        true
    }

    /// Whether someone holds `key` right now. Takes any key form, like
    /// [`lose`](Self::lose). No round trip.
    pub fn is_held(&self, key: impl Into<LockKey>) -> bool {
        let key = key.into();
        self.table
            .lock()
            .get(&key)
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
        let started = Instant::now();
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
                    key: key.clone(),
                    waited: started.elapsed(),
                    holder_pid: None,
                    holder_application: None,
                    chain: Default::default(),
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
    acquired_at: Instant,
    lost: LossState,
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

    /// The lease's fencing token: always `Some`, strictly increasing per
    /// key. No round trip.
    pub fn fencing_token(&self) -> Option<FencingToken> {
        Some(self.token)
    }

    /// Completes when [`MemoryLocker::lose`] took the key away, with
    /// [`LossReason::Expired`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only watches a channel.
    pub async fn lost(&self) -> LossReason {
        self.lost.lost().await
    }

    /// `true` once [`lost`](Self::lost) would complete; exactly when
    /// [`loss`](Self::loss) is `Some`.
    pub fn is_lost(&self) -> bool {
        self.lost.is_lost()
    }

    /// Why the lease was lost, if it was: `None` while it is held.
    pub fn loss(&self) -> Option<LossReason> {
        self.lost.loss()
    }

    /// How long the lease has been held.
    pub fn held_for(&self) -> Duration {
        self.acquired_at.elapsed()
    }

    /// Frees the key; [`Error::LockLost`] if it had been lost. No round
    /// trip; cancel safe (it never waits).
    pub async fn release(mut self) -> Result<(), Error> {
        self.released = true;
        if self.table.free(&self.key, self.id) {
            return Ok(());
        }
        Err(Error::LockLost {
            key: self.key.clone(),
            reason: self.lost.loss().unwrap_or(LossReason::Expired),
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

crate::lease::locker_from_inherent!(MemoryLocker, "memory", election);

/// The leader record lives beside the key in the table; a seat is a
/// lease's number. No round trips; every method is cancel safe (none
/// waits but `lock_seat`, which is `lock`).
#[async_trait]
impl ElectionLocker for MemoryLocker {
    async fn lock_seat(
        &self,
        key: LockKey,
        timeout: Duration,
    ) -> Result<(Box<dyn Lease>, Seat), Error> {
        let lease = MemoryLocker::lock(self, key, timeout).await?;
        let seat = Seat::new(u128::from(lease.id));
        Ok((Box::new(lease), seat))
    }

    async fn proclaim(
        &self,
        key: &LockKey,
        seat: Seat,
        proclamation: &Proclamation,
    ) -> Result<Option<Proclaimed>, Error> {
        key.validate()?;
        proclamation.check()?;
        let mut keys = self.table.lock();
        let Some(entry) = keys.get_mut(key) else {
            return Ok(None);
        };
        let Some(holder) = holding(entry, seat) else {
            return Ok(None);
        };
        entry.terms += 1;
        // A record that still names its leader, or whose term never
        // started (withdrawn in its grace: the one before it may still
        // believe it leads), as `distlock.leader_proclaim` decides.
        let after_loss = entry
            .record
            .as_ref()
            .is_some_and(|r| !r.withdrawn || r.leader.since > SystemTime::now());
        let grace = if after_loss {
            proclamation.grace
        } else {
            Duration::ZERO
        };
        let leader = LeaderInfo::new(
            proclamation.identity.clone(),
            proclamation.value.clone(),
            entry.terms,
            SystemTime::now() + grace,
            proclamation.fencing_token,
        );
        entry.record = Some(Record {
            holder,
            leader: leader.clone(),
            withdrawn: false,
        });
        Ok(Some(Proclaimed { leader, after_loss }))
    }

    async fn withdraw(&self, key: &LockKey, seat: Seat, term: Option<u64>) -> Result<(), Error> {
        let mut keys = self.table.lock();
        if let Some(record) = keys.get_mut(key).and_then(|e| e.record.as_mut())
            && u128::from(record.holder) == seat.id()
            && term.is_none_or(|term| term == record.leader.term)
        {
            record.withdrawn = true;
        }
        Ok(())
    }

    async fn leader(&self, key: &LockKey) -> Result<Option<LeaderInfo>, Error> {
        key.validate()?;
        let keys = self.table.lock();
        let Some(entry) = keys.get(key) else {
            return Ok(None);
        };
        Ok(entry
            .record
            .as_ref()
            .filter(|r| !r.withdrawn && r.leader.since <= SystemTime::now())
            .filter(|r| entry.holder.as_ref().is_some_and(|(h, _)| *h == r.holder))
            .map(|r| r.leader.clone()))
    }

    fn loss_notice_bound(&self) -> Duration {
        // `lose` tells the holder before it frees the key.
        Duration::ZERO
    }
}

/// The id of the holder of `entry` if it is `seat`.
fn holding(entry: &Entry, seat: Seat) -> Option<u64> {
    entry
        .holder
        .as_ref()
        .map(|(id, _)| *id)
        .filter(|id| u128::from(*id) == seat.id())
}

crate::lease::lease_from_inherent!(MemoryLease);

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    /// `lose` tells the holder before anyone can take the key: whoever
    /// takes it next finds the old holder lost (an election's successor
    /// must never see its predecessor still holding).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lost_holder_is_told_before_its_key_is_free() {
        let memory = MemoryLocker::new();
        for round in 0..50_000 {
            let held = Arc::new(
                memory
                    .try_lock("memory:lose")
                    .await
                    .expect("try_lock")
                    .expect("free"),
            );
            let started = Arc::new(AtomicBool::new(false));
            let taker = {
                let (memory, held, started) = (memory.clone(), held.clone(), started.clone());
                tokio::spawn(async move {
                    loop {
                        started.store(true, Ordering::SeqCst);
                        if let Some(next) = memory.try_lock("memory:lose").await.expect("try") {
                            return (held.is_lost(), next);
                        }
                    }
                })
            };
            while !started.load(Ordering::SeqCst) {
                std::hint::spin_loop();
            }
            assert!(memory.lose("memory:lose"));
            let (told, next) = taker.await.expect("taker");
            assert!(
                told,
                "round {round}: the key was taken before its holder was told"
            );
            drop(next);
        }
    }
}
