//! A held permit of a [`Semaphore`](crate::Semaphore): one slot's lock,
//! with the guard vocabulary.

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::{Error, FencingToken, Lease, LockKey, LossReason, SessionLock};

/// One permit of a [`Semaphore`](crate::Semaphore), held until
/// [`release`](Self::release) or drop.
///
/// It is the lock of one slot (see [`slot`](Self::slot)): on PostgreSQL a
/// [`SessionLock`] on a pooled connection of its own, on other backends the
/// backend's lease. Dropping it never blocks: the slot is released in the
/// background, as the underlying guard's drop does.
#[must_use = "the permit is released as soon as it is dropped"]
#[derive(Debug)]
pub struct SemaphorePermit {
    slot: u32,
    acquired_at: Instant,
    held: Held,
}

#[derive(Debug)]
enum Held {
    Postgres(SessionLock),
    Any(Box<dyn Lease>),
}

impl SemaphorePermit {
    pub(crate) fn on_session(slot: u32, lock: SessionLock) -> Self {
        Self {
            slot,
            acquired_at: Instant::now(),
            held: Held::Postgres(lock),
        }
    }

    pub(crate) fn any(slot: u32, lease: Box<dyn Lease>) -> Self {
        Self {
            slot,
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
        match &self.held {
            Held::Postgres(lock) => lock.key(),
            Held::Any(lease) => lease.key(),
        }
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
            Held::Postgres(lock) => lock.fencing_token(),
            Held::Any(lease) => lease.fencing_token(),
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
            Held::Postgres(lock) => lock.lost().await,
            Held::Any(lease) => lease.lost().await,
        }
    }

    /// `true` once [`lost`](Self::lost) would complete.
    pub fn is_lost(&self) -> bool {
        match &self.held {
            Held::Postgres(lock) => lock.is_lost(),
            Held::Any(lease) => lease.is_lost(),
        }
    }

    /// Why the permit was lost, if it was. Never waits.
    pub fn loss(&self) -> Option<LossReason> {
        match &self.held {
            Held::Postgres(lock) => lock.loss(),
            Held::Any(lease) => {
                if !lease.is_lost() {
                    return None;
                }
                // A lost lease's `lost()` is ready at once: read it with one
                // poll rather than waiting.
                let mut lost = pin!(lease.lost());
                match lost.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
                    Poll::Ready(reason) => Some(reason),
                    Poll::Pending => None,
                }
            }
        }
    }

    /// How long the permit has been held.
    pub fn held_for(&self) -> Duration {
        self.acquired_at.elapsed()
    }

    /// Releases the permit: what releasing the slot's lock costs (on
    /// PostgreSQL 1 round trip, whose unlock statement also announces the
    /// freed slot to waiting processes with a `NOTIFY`, no durable write;
    /// then the connection returns to the pool).
    /// Fails as the underlying guard's release does, for example with
    /// [`Error::LockLost`] when the permit had been lost.
    ///
    /// # Cancel safety
    ///
    /// As the underlying guard's release: a dropped call leaves the slot
    /// released or its connection closed, never held.
    pub async fn release(self) -> Result<(), Error> {
        match self.held {
            Held::Postgres(lock) => lock.release().await,
            Held::Any(lease) => lease.release().await,
        }
    }
}
crate::lease::lease_from_inherent!(SemaphorePermit);
