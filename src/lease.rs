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

/// The default time to live of a lease on the backends whose leases expire
/// unless renewed (the lease table, Redis). The lease table renews every
/// 7.5 s (a quarter of the TTL) and a holder that cannot renew reports its
/// loss 20 s after its last renewal was sent. Redis extends every 10 s (a
/// third): a single instance reports the loss when an extension fails (at
/// most 12 s after the last one succeeded, with the default 2 s command
/// deadline), while Redlock retries failing nodes until the lease's
/// validity (the TTL less the drift margin, about 29.7 s) runs out. The key
/// of a holder that vanished is free again 30 s after its last renewal.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);

/// Hands out exclusive leases on named keys.
///
/// Discarding the `Box<dyn Lease>` that [`lock`](Self::lock) returns warns,
/// since [`Lease`] is `#[must_use]`.
///
/// # Re-entrancy
///
/// No backend is re-entrant. A second `try_lock` of a key that this
/// process already holds, from the same locker or another, on the same task
/// or another, gets `Ok(None)`, as any other holder would, and a second
/// `lock` waits for the first lease to be released. (PostgreSQL's advisory
/// locks are re-entrant per server session; distlock never takes a second
/// lock on a session that holds one, so that one unlock never leaves a key
/// held.) Transaction-scoped locks nested on the same key in one task are
/// refused with [`Error::NestedLock`].
#[async_trait]
pub trait Locker: Debug + Send + Sync {
    /// Takes the lease `key` if it is free; `Ok(None)` if someone else holds it.
    async fn try_lock(&self, key: LockKey) -> Result<Option<Box<dyn Lease>>, Error>;

    /// Takes the lease `key`, waiting up to `timeout`; [`Error::Timeout`] when
    /// the deadline passes.
    async fn lock(&self, key: LockKey, timeout: Duration) -> Result<Box<dyn Lease>, Error>;

    /// A short name of the backend, for logs and metrics (`"postgres"`, `"redis"`, ...).
    fn backend(&self) -> &'static str;

    /// The backend's record of who leads an election, if it keeps one
    /// ([`ElectionLocker`](crate::ElectionLocker)): `None` by default, and
    /// on backends that keep none (Redis).
    fn election(&self) -> Option<&dyn crate::ElectionLocker> {
        None
    }

    /// The semaphore `name` of `permits` permits built the backend's own
    /// way, where it has one that costs less than permits taken as plain
    /// leases ([`PgLocker::semaphore`](crate::PgLocker::semaphore): 1 round
    /// trip a try, waiters served in arrival order and woken by the
    /// release); `None` by default. [`Semaphore::new`](crate::Semaphore::new)
    /// asks for it first, so a semaphore is the same whichever way it was
    /// made. Makes no round trip.
    fn native_semaphore(
        &self,
        name: &str,
        permits: u32,
    ) -> Option<Result<crate::Semaphore, Error>> {
        let _ = (name, permits);
        None
    }
}

/// A held lease. Dropping it releases it in the background.
///
/// Every guard of every backend implements it ([`SessionLock`](crate::SessionLock),
/// [`MultiLock`](crate::MultiLock), [`UpgradeableLock`](crate::UpgradeableLock),
/// [`TableLease`](crate::postgres::TableLease), the
/// Redis lease, [`MemoryLease`](crate::memory::MemoryLease)) with the same
/// vocabulary as its inherent methods, which document each backend's costs
/// and cancel safety. None of the methods but [`release`](Self::release)
/// costs a round trip: they read what the backend's keeper last learnt.
///
/// # Keys
///
/// [`keys`](Self::keys) is every key the lease holds; [`key`](Self::key) is
/// the one key of a single-key lease, and for a lease on several keys (a
/// [`MultiLock`](crate::MultiLock)) the first key given, the one its logs
/// and metrics name. Code that must see every key uses `keys()`.
///
/// # Discarding
///
/// The trait is `#[must_use]`, so a `Box<dyn Lease>` dropped where it is
/// returned warns (`unused_must_use`), as every guard type does:
///
/// ```compile_fail
/// #![deny(unused_must_use)]
/// # async fn demo(locker: &dyn distlock::Locker) -> Result<(), distlock::Error> {
/// locker.lock("job".into(), std::time::Duration::from_secs(1)).await?; // released at once
/// # Ok(()) }
/// # fn main() {}
/// ```
///
/// Held, as it should be, it compiles:
///
/// ```
/// #![deny(unused_must_use)]
/// # async fn demo(locker: &dyn distlock::Locker) -> Result<(), distlock::Error> {
/// let lease = locker.lock("job".into(), std::time::Duration::from_secs(1)).await?;
/// lease.release().await?;
/// # Ok(()) }
/// # fn main() {}
/// ```
#[async_trait]
#[must_use = "the lease is released as soon as it is dropped"]
pub trait Lease: Debug + Send + Sync {
    /// The key this lease holds; for a lease on several keys, the first
    /// given (see [Keys](#keys)).
    fn key(&self) -> &LockKey;

    /// Every key this lease holds, in the order given: one for a single-key
    /// lease (the default).
    fn keys(&self) -> &[LockKey] {
        std::slice::from_ref(self.key())
    }

    /// The fencing token issued with the lease, if the backend issues them.
    fn fencing_token(&self) -> Option<FencingToken>;

    /// Completes when the lease can no longer be trusted, with the reason.
    /// Cancel safe on every backend: it only watches a channel (and, for a
    /// lease with a time to live, the clock).
    async fn lost(&self) -> LossReason;

    /// `true` once [`lost`](Self::lost) would complete; exactly when
    /// [`loss`](Self::loss) is `Some`. A lease with a time to live (Redis,
    /// the lease table) also reads the clock: past its deadline it is lost
    /// even if its keeper has not run since. No round trip.
    fn is_lost(&self) -> bool;

    /// Why the lease was lost, if it was; `None` while it is held.
    fn loss(&self) -> Option<LossReason>;

    /// How long the lease has been held, from its grant as this process saw
    /// it.
    fn held_for(&self) -> Duration;

    /// How long a lease with a time to live is still known to be held, by
    /// this process's clock (zero once lost): `Some` for the lease table
    /// and Redis (and a semaphore permit over them), `None` (the default)
    /// for a lease that holds as long as its server session or its process
    /// does (PostgreSQL's advisory locks, memory). Work that must finish
    /// while the lease holds should fit into it. No round trip.
    fn validity(&self) -> Option<Duration> {
        None
    }

    /// Releases the lease (on PostgreSQL and Redis 1 round trip; see each
    /// guard's `release` for its errors and cancel safety).
    async fn release(self: Box<Self>) -> Result<(), Error>;
}

/// `impl Lease for $guard` by calling the guard's inherent methods of the
/// same names, so that the trait and the type cannot drift apart. A guard on
/// several keys names the inherent method that gives its first key
/// (`keys = first_key`); its `keys()` is then forwarded too. A guard with a
/// time to live names its inherent `validity` (`validity = validity` for
/// one that answers a `Duration`, `validity = optional` for one that
/// answers an `Option`).
macro_rules! lease_from_inherent {
    ($guard:ty) => {
        $crate::lease::lease_from_inherent!(@impl $guard, key);
    };
    ($guard:ty, keys = $first:ident) => {
        $crate::lease::lease_from_inherent!(@impl $guard, $first,
            fn keys(&self) -> &[$crate::LockKey] { <$guard>::keys(self) });
    };
    ($guard:ty, validity = validity) => {
        $crate::lease::lease_from_inherent!(@impl $guard, key,
            fn validity(&self) -> Option<::std::time::Duration> { Some(<$guard>::validity(self)) });
    };
    ($guard:ty, validity = optional) => {
        $crate::lease::lease_from_inherent!(@impl $guard, key,
            fn validity(&self) -> Option<::std::time::Duration> { <$guard>::validity(self) });
    };
    (@impl $guard:ty, $key:ident $(, $extra:item)?) => {
        #[::async_trait::async_trait]
        impl $crate::Lease for $guard {
            fn key(&self) -> &$crate::LockKey { <$guard>::$key(self) }
            $($extra)?
            fn fencing_token(&self) -> Option<$crate::FencingToken> { <$guard>::fencing_token(self) }
            async fn lost(&self) -> $crate::LossReason { <$guard>::lost(self).await }
            fn is_lost(&self) -> bool { <$guard>::is_lost(self) }
            fn loss(&self) -> Option<$crate::LossReason> { <$guard>::loss(self) }
            fn held_for(&self) -> ::std::time::Duration { <$guard>::held_for(self) }
            async fn release(self: Box<Self>) -> Result<(), $crate::Error> { <$guard>::release(*self).await }
        }
    };
}
pub(crate) use lease_from_inherent;

/// `impl Locker for $locker` by calling the locker's inherent `try_lock` and
/// `lock` and boxing their guards; `$backend` is its
/// [`backend`](Locker::backend) name. `election` adds
/// `election() -> Some(self)` (the locker implements
/// [`ElectionLocker`](crate::ElectionLocker)); further items follow it.
macro_rules! locker_from_inherent {
    ($locker:ty, $backend:expr, election $(, $extra:item)*) => {
        $crate::lease::locker_from_inherent!($locker, $backend,
            fn election(&self) -> Option<&dyn $crate::ElectionLocker> { Some(self) }
            $(, $extra)*);
    };
    ($locker:ty, $backend:expr $(, $extra:item)*) => {
        #[::async_trait::async_trait]
        impl $crate::Locker for $locker {
            async fn try_lock(&self, key: $crate::LockKey)
                -> Result<Option<Box<dyn $crate::Lease>>, $crate::Error> {
                let lease = <$locker>::try_lock(self, key).await?;
                Ok(lease.map(|lease| Box::new(lease) as Box<dyn $crate::Lease>))
            }
            async fn lock(&self, key: $crate::LockKey, timeout: ::std::time::Duration)
                -> Result<Box<dyn $crate::Lease>, $crate::Error> {
                Ok(Box::new(<$locker>::lock(self, key, timeout).await?))
            }
            fn backend(&self) -> &'static str { $backend }
            $($extra)*
        }
    };
}
pub(crate) use locker_from_inherent;
