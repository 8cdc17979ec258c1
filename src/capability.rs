//! What a backend can do beyond exclusive leases, as traits: a backend that
//! lacks a capability does not implement its trait, so code that needs it
//! does not compile against that backend (rather than failing at run time).
//!
//! | trait | what | implemented by |
//! |---|---|---|
//! | [`SharedLocker`] | shared (reader) leases beside exclusive ones | [`PgLocker`] (every mode) |
//! | [`MultiKeyLocker`] | several keys at once, all or nothing | [`PgLocker`] (every mode) |
//! | [`XactLocker`] | a lock that lives exactly as long as a database transaction | [`PgLocker`] (every mode) |
//! | [`UpgradeableLocker`] | an upgradeable read lease beside shared ones, which can become exclusive and back | [`PgLocker`] (every mode) |
//! | [`ElectionLocker`] | a record of who leads an election, believed only while the backend sees that leader hold the election's lock | [`PgLocker`] (every mode), [`TableLocker`](crate::postgres::TableLocker), [`MemoryLocker`](crate::memory::MemoryLocker); not Redis |
//!
//! Each method calls the backend's own method of the same meaning; the
//! costs, durable writes and cancel safety are that method's, as each
//! method's documentation says.
//!
//! [`ElectionLocker`] is reached from any `Arc<dyn Locker>` through
//! [`Locker::election`], since [`LeaderElection`](crate::LeaderElection)
//! takes one: a backend without it still elects leaders, but cannot say
//! who leads ([`Error::Unsupported`]).

use std::future::Future;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::PgConnection;

use crate::{
    Error, FencingToken, LeaderInfo, Lease, LockKey, Locker, MultiLock, PgLocker, UpgradeableLock,
};

/// A [`Locker`] that also hands out *shared* leases: any number of shared
/// holders of a key at once, while an exclusive holder (from
/// [`Locker::try_lock`] / [`Locker::lock`]) excludes them all.
///
/// Object safe, like [`Locker`]: `Arc<dyn SharedLocker>` works, and upcasts
/// to `Arc<dyn Locker>`. A shared lease carries no fencing token.
#[async_trait]
pub trait SharedLocker: Locker {
    /// Takes the shared lease `key` if no one holds it exclusively;
    /// `Ok(None)` if someone does. A bad key is an [`Error::InvalidKey`].
    ///
    /// On [`PgLocker`]: [`PgLocker::try_lock_shared`], 1 round trip, writes
    /// nothing.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it returns leaves nothing held.
    async fn try_lock_shared(&self, key: LockKey) -> Result<Option<Box<dyn Lease>>, Error>;

    /// Takes the shared lease `key`, waiting up to `timeout` while someone
    /// holds it exclusively; [`Error::Timeout`] when the deadline passes.
    ///
    /// On [`PgLocker`]: [`PgLocker::lock_shared`], 1 round trip when free, 2
    /// when it waits (on the server, not by polling); writes nothing.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future while it waits abandons the wait; nothing is left
    /// held.
    async fn lock_shared(&self, key: LockKey, timeout: Duration) -> Result<Box<dyn Lease>, Error>;
}

/// A [`Locker`] that takes several keys at once, all or nothing, in an order
/// that never deadlocks against another caller's overlapping set.
///
/// No keys is an [`Error::NoKeys`], a key listed twice an
/// [`Error::DuplicateKey`], two spellings of one server lock an
/// [`Error::SameServerLock`], and a bad key an [`Error::InvalidKey`].
#[async_trait]
pub trait MultiKeyLocker: Locker {
    /// The guard holding all the keys: released and lost together.
    type Guard: Send + Sync + 'static;

    /// Takes every key of `keys` if all are free; `Ok(None)` (holding none)
    /// if any is held elsewhere.
    ///
    /// On [`PgLocker`]: [`PgLocker::try_lock_all`], 1 round trip, writes
    /// nothing.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it returns leaves none of the keys held.
    async fn try_lock_all(&self, keys: Vec<LockKey>) -> Result<Option<Self::Guard>, Error>;

    /// Takes every key of `keys`, waiting up to `timeout`;
    /// [`Error::Timeout`] (holding none) when the deadline passes.
    ///
    /// On [`PgLocker`]: [`PgLocker::lock_all`], 1 round trip when all are
    /// free, 2 when it waits; writes nothing.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future while it waits leaves none of the keys held.
    async fn lock_all(&self, keys: Vec<LockKey>, timeout: Duration) -> Result<Self::Guard, Error>;
}

/// A [`SharedLocker`] that also hands out *upgradeable* read leases: at most
/// one holder of a key at a time in this form, beside any number of shared
/// holders, which can become the exclusive holder without letting go of the
/// read, and back. Two upgraders of one key never deadlock.
///
/// A bad key is an [`Error::InvalidKey`].
#[async_trait]
pub trait UpgradeableLocker: SharedLocker {
    /// The upgradeable guard (on [`PgLocker`]: [`UpgradeableLock`], with
    /// `upgrade`, `try_upgrade` and `downgrade`).
    type Guard: Lease + 'static;

    /// Takes the upgradeable read lease `key` if no one holds it exclusively
    /// or upgradeable; `Ok(None)` if someone does.
    ///
    /// On [`PgLocker`]: [`PgLocker::try_lock_upgradeable`], 1 round trip,
    /// writes nothing.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it returns leaves nothing held.
    async fn try_lock_upgradeable(&self, key: LockKey) -> Result<Option<Self::Guard>, Error>;

    /// Takes the upgradeable read lease `key`, waiting up to `timeout`;
    /// [`Error::Timeout`] when the deadline passes.
    ///
    /// On [`PgLocker`]: [`PgLocker::lock_upgradeable`], 1 round trip when
    /// free, 2 when it waits (on the server); writes nothing.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future while it waits abandons the wait; nothing is left
    /// held.
    async fn lock_upgradeable(&self, key: LockKey, timeout: Duration)
    -> Result<Self::Guard, Error>;
}

/// A locker whose lock lives exactly as long as a database transaction: it
/// begins one, takes the lock in it, runs `f` on its connection, commits on
/// `Ok` and rolls back on `Err` (the closure's error comes back unchanged);
/// the server frees the lock at commit or rollback, also when the process
/// dies.
///
/// Generic over the closure, so not object safe: write code generic over
/// `L: XactLocker`.
pub trait XactLocker: Send + Sync {
    /// Runs `f` holding the exclusive lock `key`, or returns `Ok(None)` at
    /// once if another session holds it.
    ///
    /// On [`PgLocker`]: [`PgLocker::with_advisory_lock`], 3 round trips plus
    /// the closure's own (2 with
    /// [`try_with_begin`](crate::PgLockerBuilder::try_with_begin)); writes
    /// only what `f` writes.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future at any `.await` rolls the transaction back and
    /// frees the lock (the connection is closed, not pooled).
    fn try_with_xact_lock<F, T, E>(
        &self,
        key: LockKey,
        f: F,
    ) -> impl Future<Output = Result<Option<T>, E>>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
        E: From<Error>;

    /// Runs `f` holding the exclusive lock `key`, waiting up to `timeout`
    /// for it; [`Error::Timeout`] when the deadline passes.
    ///
    /// On [`PgLocker`]: [`PgLocker::with_advisory_lock_wait`], 3 round trips
    /// plus the closure's own when free, 4 when it waits (on the server).
    ///
    /// # Cancel safety
    ///
    /// As for [`try_with_xact_lock`](Self::try_with_xact_lock).
    fn with_xact_lock<F, T, E>(
        &self,
        key: LockKey,
        timeout: Duration,
        f: F,
    ) -> impl Future<Output = Result<T, E>>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
        E: From<Error>;
}

/// A [`Locker`] that keeps, beside an election's lock, a record of who
/// leads it, and reads that record back only while the backend itself sees
/// the recorded holder hold the lock: a leader whose lock the backend freed
/// (its session ended, its lease expired) is never named, whatever the
/// record still says. What [`LeaderElection`](crate::LeaderElection)'s
/// `leader()` and `observe()` are built on.
///
/// Reached from an `Arc<dyn Locker>` through [`Locker::election`]. The
/// election calls [`lock_seat`](Self::lock_seat), then
/// [`proclaim`](Self::proclaim) before it leads, and
/// [`withdraw`](Self::withdraw) after it stopped leading, before its lease
/// is released.
///
/// | backend | record | believed while |
/// |---|---|---|
/// | [`PgLocker`] | a row of `distlock.leaders` (needs [`migrate`](crate::migrate)) naming the backend pid and its start time | `pg_locks` shows that backend holding the election's advisory lock |
/// | [`TableLocker`](crate::postgres::TableLocker) | a row of `distlock.leaders` naming the lease's owner | the lease's row is that owner's and unexpired, by the server's clock |
/// | [`MemoryLocker`](crate::memory::MemoryLocker) | beside the key in its table | the same lease holds the key |
#[async_trait]
pub trait ElectionLocker: Locker {
    /// Takes the election's lock `key`, waiting up to `timeout` as
    /// [`Locker::lock`] does, and says which seat holds it: how the backend
    /// names this holder in its records.
    ///
    /// On [`PgLocker`]: [`PgLocker::lock`]; the seat is the backend pid.
    ///
    /// # Cancel safety
    ///
    /// As [`Locker::lock`]: dropped while it waits, nothing is left held.
    async fn lock_seat(
        &self,
        key: LockKey,
        timeout: Duration,
    ) -> Result<(Box<dyn Lease>, Seat), Error>;

    /// Records `proclamation` as the leader of `key` if `seat` holds the key's
    /// lock as the backend sees it now, as a new term; `Ok(None)`, recording
    /// nothing, if it does not. If the record it replaces still named a leader,
    /// or named one withdrawn before its term started, the new term starts
    /// after the proclamation's `grace` ([`LeaderInfo::since`] is that much
    /// later, and [`leader`](Self::leader) names it only from then on). A grace
    /// longer than [`Proclamation::MAX_GRACE`] is refused with
    /// [`Error::InvalidArgument`], recording nothing.
    ///
    /// On [`PgLocker`]: 1 round trip, one durable row write; no answer
    /// within the heartbeat deadline (a stalled network, or the record's
    /// row locked by another transaction, which the server then stops
    /// waiting for too) is [`Error::CommandTimedOut`], its pooled
    /// connection closed (unless the server's own timeout answered
    /// first).
    ///
    /// # Cancel safety
    ///
    /// Dropped before it returns, the record may or may not have been
    /// written; [`withdraw`](Self::withdraw) clears it either way.
    async fn proclaim(
        &self,
        key: &LockKey,
        seat: Seat,
        proclamation: &Proclamation,
    ) -> Result<Option<Proclaimed>, Error>;

    /// Clears the record of `key` if it names `seat` (and, when given,
    /// `term`), so that nobody is named until the next proclamation.
    /// Called after leading stopped and before the lease is released. A
    /// `term` no backend can record (above `i64::MAX`) names no record:
    /// nothing is cleared.
    ///
    /// On [`PgLocker`]: 1 round trip, a durable row write when it clears;
    /// within the heartbeat deadline (5 s at most, what a campaign waits
    /// for it), as [`proclaim`](Self::proclaim).
    ///
    /// # Cancel safety
    ///
    /// Dropped before it returns, the record may or may not be cleared;
    /// it is never named once the lease is released, either way.
    async fn withdraw(&self, key: &LockKey, seat: Seat, term: Option<u64>) -> Result<(), Error>;

    /// Who leads `key` now: the record, if the backend sees its holder hold
    /// the key's lock at the moment it is read and the term has started
    /// (its grace is over); `Ok(None)` otherwise.
    ///
    /// On [`PgLocker`]: 1 round trip, writes nothing; within the heartbeat
    /// deadline, as [`proclaim`](Self::proclaim).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    async fn leader(&self, key: &LockKey) -> Result<Option<LeaderInfo>, Error>;

    /// How long a holder may go on believing it holds a lease after the
    /// backend freed it: on [`PgLocker`] `heartbeat + heartbeat_timeout`;
    /// zero on [`TableLocker`](crate::postgres::TableLocker) (a holder that cannot
    /// renew reports its loss before its lease expires) and in memory (the
    /// holder is told before the key is freed). A new
    /// leader whose predecessor did not withdraw waits this long before it
    /// leads (see [`LeaderElectionBuilder::grace`](crate::LeaderElectionBuilder::grace)).
    fn loss_notice_bound(&self) -> Duration;
}

/// How an [`ElectionLocker`] names one holder of an election's lock in its
/// records: on PostgreSQL the backend pid, in memory the lease's number.
/// Opaque to the election, which only hands it back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Seat(u128);

impl Seat {
    /// The seat numbered `id` (what the number means is the backend's).
    pub fn new(id: u128) -> Self {
        Self(id)
    }

    /// The seat's number.
    pub fn id(self) -> u128 {
        self.0
    }
}

/// What a leader proclaims: from its election's builder, and the fencing
/// token of its lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proclamation {
    /// Names the candidate ([`LeaderElectionBuilder::identity`](crate::LeaderElectionBuilder::identity)).
    pub identity: String,
    /// What the leader tells everyone ([`LeaderElectionBuilder::value`](crate::LeaderElectionBuilder::value)).
    pub value: String,
    /// The lease's fencing token, where the backend issues them.
    pub fencing_token: Option<FencingToken>,
    /// How long the proclaimer waits before it leads when the record it
    /// replaces still names a leader ([`Proclaimed::after_loss`]): the term
    /// is recorded as starting that much later, and is not named before.
    pub grace: Duration,
}

impl Proclamation {
    /// The longest [`grace`](Self::grace) a backend records: an hour, the
    /// most [`LeaderElectionBuilder::grace`](crate::LeaderElectionBuilder::grace)
    /// allows.
    pub const MAX_GRACE: Duration = Duration::from_secs(3600);

    /// `Err` for a grace no backend records (see [`MAX_GRACE`](Self::MAX_GRACE)).
    pub(crate) fn check(&self) -> Result<(), Error> {
        if self.grace > Self::MAX_GRACE {
            return Err(Error::InvalidArgument {
                argument: "grace",
                reason: format!("{:?}, more than the limit of one hour", self.grace),
            });
        }
        Ok(())
    }
}

/// How long a campaign waits for [`ElectionLocker::withdraw`] before it
/// goes on without it (the record is not believed once the lock is gone);
/// a backend's withdrawal that waits on the server waits no longer.
pub(crate) const WITHDRAW_WITHIN: Duration = Duration::from_secs(5);

/// The term filter of a withdrawal as a backend records terms (`bigint`):
/// `Some(None)` for any term, `Some(Some(n))` for term `n`, and `None` for
/// a term above `i64::MAX`, which no record carries (so nothing is to be
/// cleared; widening it to "any term" would clear another term's record).
pub(crate) fn recorded_term(term: Option<u64>) -> Option<Option<i64>> {
    match term {
        None => Some(None),
        Some(term) => i64::try_from(term).ok().map(Some),
    }
}

/// What [`ElectionLocker::proclaim`] recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proclaimed {
    /// The record as [`ElectionLocker::leader`] will return it, with the
    /// term number the backend gave it.
    pub leader: LeaderInfo,
    /// Whether the record this one replaced still named a leader (it had
    /// not withdrawn), or named one whose term had not started (withdrawn
    /// in its grace: the leader before it may still believe it leads):
    /// that leader may not know yet that it lost, so the new one waits
    /// [`ElectionLocker::loss_notice_bound`] before it leads.
    pub after_loss: bool,
}

// Each impl only forwards to the inherent method of the same meaning; the
// path form names the inherent method, which takes precedence anyway.

#[async_trait]
impl SharedLocker for PgLocker {
    async fn try_lock_shared(&self, key: LockKey) -> Result<Option<Box<dyn Lease>>, Error> {
        let lock = PgLocker::try_lock_shared(self, key).await?;
        Ok(lock.map(|lock| Box::new(lock) as Box<dyn Lease>))
    }

    async fn lock_shared(&self, key: LockKey, timeout: Duration) -> Result<Box<dyn Lease>, Error> {
        Ok(Box::new(PgLocker::lock_shared(self, key, timeout).await?))
    }
}

#[async_trait]
impl MultiKeyLocker for PgLocker {
    type Guard = MultiLock;

    async fn try_lock_all(&self, keys: Vec<LockKey>) -> Result<Option<MultiLock>, Error> {
        PgLocker::try_lock_all(self, keys).await
    }

    async fn lock_all(&self, keys: Vec<LockKey>, timeout: Duration) -> Result<MultiLock, Error> {
        PgLocker::lock_all(self, keys, timeout).await
    }
}

#[async_trait]
impl UpgradeableLocker for PgLocker {
    type Guard = UpgradeableLock;

    async fn try_lock_upgradeable(&self, key: LockKey) -> Result<Option<UpgradeableLock>, Error> {
        PgLocker::try_lock_upgradeable(self, key).await
    }

    async fn lock_upgradeable(
        &self,
        key: LockKey,
        timeout: Duration,
    ) -> Result<UpgradeableLock, Error> {
        PgLocker::lock_upgradeable(self, key, timeout).await
    }
}

impl XactLocker for PgLocker {
    fn try_with_xact_lock<F, T, E>(
        &self,
        key: LockKey,
        f: F,
    ) -> impl Future<Output = Result<Option<T>, E>>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
        E: From<Error>,
    {
        self.with_advisory_lock(key, f)
    }

    fn with_xact_lock<F, T, E>(
        &self,
        key: LockKey,
        timeout: Duration,
        f: F,
    ) -> impl Future<Output = Result<T, E>>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
        E: From<Error>,
    {
        self.with_advisory_lock_wait(key, timeout, f)
    }
}
