//! The guard of an upgradeable read lock, `UpgradeableLock`: what
//! `PgLocker::try_lock_upgradeable` and `PgLocker::lock_upgradeable` hand
//! out. Its upgrade and downgrade are in `upgrade.rs`.

use std::fmt;
use std::time::Duration;

use crate::postgres::session::guard::SessionLock;
use crate::{Error, FencingToken, LockKey, LossReason};

/// An upgradeable read lock: a shared lock on a key that at most one
/// session holds in this form at a time, beside any number of plain readers
/// ([`PgLocker::try_lock_shared`](crate::PgLocker::try_lock_shared),
/// [`lock_shared`](crate::PgLocker::lock_shared)), and that can become the
/// exclusive lock ([`upgrade`](Self::upgrade)) without letting go of the
/// read, and back ([`downgrade`](Self::downgrade)). A plain writer
/// ([`PgLocker::lock`](crate::PgLocker::lock)) excludes it, and it excludes
/// plain writers, as any reader does.
///
/// Held on a dedicated pooled connection (in every mode, the multiplexed
/// one included) until [`release`](Self::release) or drop, kept by the same
/// heartbeat as a [`SessionLock`], and speaking the same vocabulary
/// ([`Lease`](crate::Lease) too).
///
/// # How it works
///
/// Besides the key, shared, the session holds the key's *upgrade intent*
/// exclusively: a lock in the reserved namespace
/// [`INTENT_NAMESPACE`](Self::INTENT_NAMESPACE), which plain readers and
/// writers never touch. Only one session can hold the intent, so only one
/// upgrader exists per key, and two upgraders cannot deadlock (two readers
/// that both upgrade would: each would wait for the other to stop reading).
/// The intent is taken first, before the key. An upgrade takes the key
/// exclusively on the same session: PostgreSQL grants it once every other
/// reader has gone, ahead of any writer queued behind this lock's read, and
/// readers that come after it queue behind it, so it cannot be starved. A
/// downgrade gives the exclusive mode back (PostgreSQL counts a session's
/// advisory locks per mode), keeping the read and the intent.
///
/// # Fencing tokens
///
/// The read carries none ([`fencing_token`](Self::fencing_token) is `None`).
/// With fencing on, each upgrade draws a fresh token, greater than every
/// token issued before it, which [`fencing_token`](Self::fencing_token)
/// returns until the downgrade: a writer that lost the lock between two
/// upgrades cannot reuse an older one.
///
/// # Dropping
///
/// As for [`SessionLock`]: dropping never blocks; a background task frees
/// everything the session holds for this lock (read, intent, and the
/// exclusive mode if upgraded), or closes the connection.
///
/// ```no_run
/// # async fn demo(locker: distlock::PgLocker) -> Result<(), distlock::Error> {
/// use std::time::Duration;
/// let mut config = locker.lock_upgradeable("config", Duration::from_secs(5)).await?;
/// // ... read the configuration, beside any number of readers ...
/// # let stale = true;
/// if stale {
///     config.upgrade(Duration::from_secs(5)).await?;
///     // ... rewrite it, alone ...
///     config.downgrade().await?;
/// }
/// config.release().await?;
/// # Ok(()) }
/// ```
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct UpgradeableLock {
    /// The session lock on the key (read and intent), unlocked with
    /// `pg_advisory_unlock_all()`, which frees the exclusive mode as well.
    pub(crate) inner: SessionLock,
    /// Whether an upgrade draws a fencing token.
    pub(crate) fencing: bool,
    /// How long a statement on the lock's connection may go unanswered
    /// beyond its own deadline (the locker's heartbeat deadline).
    pub(crate) answer_within: Duration,
    /// What the lock holds now.
    pub(crate) mode: Mode,
}

/// What an [`UpgradeableLock`] holds now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// The key shared, and its intent.
    Read,
    /// The key exclusively as well, with the token its upgrade drew.
    Upgraded(Option<FencingToken>),
}

impl fmt::Debug for UpgradeableLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpgradeableLock")
            .field("key", self.key())
            .field("upgraded", &self.is_upgraded())
            .field("fencing_token", &self.fencing_token())
            .field("backend_pid", &self.backend_pid())
            .field("lost", &self.is_lost())
            .finish()
    }
}

impl UpgradeableLock {
    /// The [`LockKey::namespaced`] namespace of upgrade intents: the intent
    /// of a key is a lock in this namespace of the two-`int4` keyspace,
    /// whose second half is the key's own value where it fits an `int4`
    /// (every `LockKey::from` name, as `hashtext` gives it, and ids within
    /// `i32`), else a 32-bit hash of the key. So the intent of
    /// `LockKey::from("config")` is the server lock of
    /// `LockKey::namespaced(INTENT_NAMESPACE, "config")`, which is how it
    /// shows in [`PgLocker::holders`](crate::PgLocker::holders).
    ///
    /// The namespace is reserved: a key in it is refused with
    /// [`Error::InvalidKey`], on every backend, so no user key can take or
    /// block an intent. Two keys whose intents hash alike (a chance of one in
    /// 2^32 for a pair of 64-bit or namespaced keys) share one upgrade slot:
    /// at most one of them has an upgradeable holder at a time, never two
    /// writers of one key.
    pub const INTENT_NAMESPACE: i32 = crate::key::INTENT_NAMESPACE;

    pub(crate) fn new(inner: SessionLock, fencing: bool, answer_within: Duration) -> Self {
        Self {
            inner,
            fencing,
            answer_within,
            mode: Mode::Read,
        }
    }

    /// The key this lock holds.
    pub fn key(&self) -> &LockKey {
        self.inner.key()
    }

    /// Whether the lock is upgraded (exclusive) now. No round trip.
    pub fn is_upgraded(&self) -> bool {
        matches!(self.mode, Mode::Upgraded(_))
    }

    /// The fencing token the current upgrade drew, when the locker was
    /// built with `.fencing(true)` and the lock is upgraded; `None` while
    /// it is a read lock (readers do not write) and without fencing. No
    /// round trip.
    pub fn fencing_token(&self) -> Option<FencingToken> {
        match self.mode {
            Mode::Upgraded(token) => token,
            Mode::Read => None,
        }
    }

    /// The backend process id of the session holding the lock.
    pub fn backend_pid(&self) -> i32 {
        self.inner.backend_pid()
    }

    /// Completes when the lock can no longer be trusted, with the reason
    /// (see [`SessionLock::lost`]); read, intent and exclusive mode are lost
    /// together. Also after an [`upgrade`](Self::upgrade) or
    /// [`downgrade`](Self::downgrade) that was dropped midway
    /// ([`LossReason::Interrupted`]) or found the connection broken.
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

    /// Why the lock was lost, if it was: `None` while it is held. No round
    /// trip.
    pub fn loss(&self) -> Option<LossReason> {
        self.inner.loss()
    }

    /// How long the lock has been held, from the grant of the read as this
    /// process saw it (upgrades and downgrades do not reset it). No round
    /// trip.
    pub fn held_for(&self) -> Duration {
        self.inner.held_for()
    }

    /// Releases the lock, upgraded or not (`pg_advisory_unlock_all()` on its
    /// dedicated connection, which holds nothing else), and returns the
    /// connection to the pool. 1 round trip. Errors as for
    /// [`SessionLock::release`].
    ///
    /// # Cancel safety
    ///
    /// As for [`SessionLock::release`]: dropped midway, the connection is
    /// closed (the server frees the lock) or the background task releases
    /// it.
    pub async fn release(self) -> Result<(), Error> {
        self.inner.release().await
    }
}
