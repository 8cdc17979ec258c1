//! The guard of several session locks held together, `MultiLock`: what
//! `PgLocker::try_lock_all` and `PgLocker::lock_all` hand out (`multi.rs`).

use std::fmt;
use std::time::Duration;

use crate::postgres::session::guard::SessionLock;
use crate::{Error, FencingToken, LockKey, LossReason};

/// Session locks on several keys, held together on one dedicated
/// connection until [`release`](Self::release) or drop.
///
/// Released together, and lost together: [`lost`](Self::lost) completes
/// when the connection can no longer vouch for them (all keys are then to
/// be treated as gone). Carries no fencing token.
///
/// It speaks the vocabulary of every guard ([`Lease`](crate::Lease) too),
/// with [`keys`](Self::keys) in place of a single key.
///
/// # Dropping
///
/// As for [`SessionLock`]: dropping never blocks; a background task unlocks
/// every key, or closes the connection.
#[must_use = "the locks are released as soon as the guard is dropped"]
pub struct MultiLock {
    /// Every key, in the order given.
    pub(crate) keys: Vec<LockKey>,
    /// The connection's lock, kept as one session lock on all keys (labelled
    /// with the first key, unlocked with `pg_advisory_unlock_all()`).
    pub(crate) inner: SessionLock,
}

impl fmt::Debug for MultiLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MultiLock")
            .field("keys", &self.keys)
            .field("backend_pid", &self.inner.backend_pid())
            .field("lost", &self.is_lost())
            .finish()
    }
}

impl MultiLock {
    /// The keys held, in the order they were given. No round trip.
    pub fn keys(&self) -> &[LockKey] {
        &self.keys
    }

    /// The first key given: what logs and metrics name, and what
    /// [`Lease::key`](crate::Lease::key) returns.
    pub(crate) fn first_key(&self) -> &LockKey {
        self.inner.key()
    }

    /// Always `None`: a multi-key lock carries no fencing token (there is
    /// one counter per key, and no single token could fence them all). No
    /// round trip.
    pub fn fencing_token(&self) -> Option<FencingToken> {
        self.inner.fencing_token()
    }

    /// Completes when the locks can no longer be trusted (see
    /// [`SessionLock::lost`]); all of them are lost at once.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only watches a channel.
    pub async fn lost(&self) -> LossReason {
        self.inner.lost().await
    }

    /// `true` once [`lost`](Self::lost) would complete; exactly when
    /// [`loss`](Self::loss) is `Some`. No round trip.
    pub fn is_lost(&self) -> bool {
        self.inner.is_lost()
    }

    /// Why the locks were lost, if they were: `None` while they are held.
    /// No round trip.
    pub fn loss(&self) -> Option<LossReason> {
        self.inner.loss()
    }

    /// How long the locks have been held, from the grant of the last key as
    /// this process saw it. No round trip.
    pub fn held_for(&self) -> Duration {
        self.inner.held_for()
    }

    /// Releases every key in 1 round trip (`pg_advisory_unlock_all()` on the
    /// dedicated connection, which holds nothing else) and, once the unlock
    /// is confirmed, keeps the connection [warm](crate::PgLockerBuilder::keep_warm)
    /// for the locker's next lock or returns it to the pool. Errors as for
    /// [`SessionLock::release`].
    ///
    /// # Cancel safety
    ///
    /// As for [`SessionLock::release`].
    pub async fn release(self) -> Result<(), Error> {
        self.inner.release().await
    }
}
