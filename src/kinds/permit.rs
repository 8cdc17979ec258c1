//! A held permit of a [`Semaphore`](crate::Semaphore): one slot's lock,
//! with the guard vocabulary.

use std::time::{Duration, Instant};

use crate::postgres::permit_relay::Relay;
use crate::{Error, FencingToken, Lease, LockKey, LossReason, SessionLock};

/// One permit of a [`Semaphore`](crate::Semaphore), held until
/// [`release`](Self::release) or drop.
///
/// It is the lock of one slot (see [`slot`](Self::slot)): on PostgreSQL a
/// [`SessionLock`] on a pooled connection of its own, on other backends the
/// backend's lease. Dropping it never blocks: the slot is released in the
/// background, as the underlying guard's drop does.
///
/// On PostgreSQL ([`PgLocker::semaphore`](crate::PgLocker::semaphore), no
/// fencing), a permit given up (released or dropped) while a waiter of the
/// same `Semaphore` (or a clone) holds the semaphore's queue on the server
/// is handed to that waiter as it is, its slot still locked by the same
/// connection: no round trip, and the waiter, first in line across every
/// process, gets what it would have got. See "Waiting on PostgreSQL" at
/// [`Semaphore`](crate::Semaphore).
#[must_use = "the permit is released as soon as it is dropped"]
#[derive(Debug)]
pub struct SemaphorePermit {
    slot: u32,
    /// The slot's key, kept here too: it is asked for while `held` is
    /// given up only in `release` and `Drop`, where nothing reads it.
    key: LockKey,
    acquired_at: Instant,
    held: Held,
}

#[derive(Debug)]
enum Held {
    /// On PostgreSQL, with where the process's waiting head takes a permit
    /// given up.
    Postgres(SessionLock, Relay),
    Any(Box<dyn Lease>),
    /// Released or handed over (only inside `release` and `Drop`).
    Given,
}

impl SemaphorePermit {
    pub(crate) fn on_session(slot: u32, lock: SessionLock, relay: Relay) -> Self {
        Self {
            slot,
            key: lock.key().clone(),
            acquired_at: Instant::now(),
            held: Held::Postgres(lock, relay),
        }
    }

    pub(crate) fn any(slot: u32, lease: Box<dyn Lease>) -> Self {
        Self {
            slot,
            key: lease.key().clone(),
            acquired_at: Instant::now(),
            held: Held::Any(lease),
        }
    }

    /// The index of the slot this permit holds, `0..permits`.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The key of the slot's lock:
    /// `LockKey::namespaced(Semaphore::SLOT_NAMESPACE, "{name}#{slot}")`.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// The fencing token issued with this permit, where the backend issues
    /// them.
    ///
    /// On PostgreSQL (a locker built with `.fencing(true)`) tokens come from
    /// one sequence for every lock of the database, so the holders of a
    /// semaphore's permits carry distinct tokens, later permits larger ones.
    /// On the other backends a token counts the grants of *one slot*: two
    /// holders of different slots can carry equal tokens, so such a token
    /// fences a resource per slot, not one resource shared by all permits.
    pub fn fencing_token(&self) -> Option<FencingToken> {
        match &self.held {
            Held::Postgres(lock, _) => lock.fencing_token(),
            Held::Any(lease) => lease.fencing_token(),
            Held::Given => None,
        }
    }

    /// Completes when the permit can no longer be trusted (another process
    /// may hold its slot now), with the reason.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only watches the underlying guard's loss.
    pub async fn lost(&self) -> LossReason {
        match &self.held {
            Held::Postgres(lock, _) => lock.lost().await,
            Held::Any(lease) => lease.lost().await,
            Held::Given => LossReason::KeeperStopped,
        }
    }

    /// `true` once [`lost`](Self::lost) would complete.
    pub fn is_lost(&self) -> bool {
        match &self.held {
            Held::Postgres(lock, _) => lock.is_lost(),
            Held::Any(lease) => lease.is_lost(),
            Held::Given => true,
        }
    }

    /// Why the permit was lost, if it was. Never waits.
    pub fn loss(&self) -> Option<LossReason> {
        match &self.held {
            Held::Given => Some(LossReason::KeeperStopped),
            Held::Postgres(lock, _) => lock.loss(),
            Held::Any(lease) => lease.loss(),
        }
    }

    /// How long the permit has been held.
    pub fn held_for(&self) -> Duration {
        self.acquired_at.elapsed()
    }

    /// How long the slot's lease is still known to be held, where it has a
    /// time to live (the lease table, Redis): see
    /// [`Lease::validity`](crate::Lease::validity). `None` on PostgreSQL's
    /// advisory locks and in memory; `Some(ZERO)` once lost. No round trip.
    pub fn validity(&self) -> Option<Duration> {
        match &self.held {
            Held::Postgres(..) => None,
            Held::Any(lease) => lease.validity(),
            Held::Given => Some(Duration::ZERO),
        }
    }

    /// Releases the permit: what releasing the slot's lock costs (on
    /// PostgreSQL 1 round trip, whose unlock statement also announces the
    /// freed slot to waiting processes with a `NOTIFY`, no durable write;
    /// then the connection returns to the pool). On PostgreSQL, no round
    /// trip when the permit is handed to a waiter of this process instead
    /// (see the type's documentation).
    /// Fails as the underlying guard's release does, for example with
    /// [`Error::LockLost`] when the permit had been lost.
    ///
    /// # Cancel safety
    ///
    /// As the underlying guard's release: a dropped call leaves the slot
    /// released or its connection closed, never held.
    pub async fn release(mut self) -> Result<(), Error> {
        match std::mem::replace(&mut self.held, Held::Given) {
            Held::Postgres(lock, relay) => match relay.offer(self.slot, lock, false) {
                Some(lock) => lock.release().await,
                None => {
                    crate::metrics::released("postgres", &self.key, self.acquired_at.elapsed());
                    Ok(())
                }
            },
            Held::Any(lease) => lease.release().await,
            Held::Given => Ok(()),
        }
    }
}

impl Drop for SemaphorePermit {
    /// Never blocks: a permit not handed over is dropped as its guard, which
    /// releases it in the background.
    fn drop(&mut self) {
        if let Held::Postgres(lock, relay) = std::mem::replace(&mut self.held, Held::Given) {
            drop(relay.offer(self.slot, lock, false));
        }
    }
}
crate::lease::lease_from_inherent!(SemaphorePermit, validity = optional);
