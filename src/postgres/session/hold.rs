//! What a session lock's connection holds, and so how it is unlocked.

/// What a session lock's connection holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hold {
    /// `pg_advisory_lock(key)`.
    Exclusive,
    /// `pg_advisory_lock_shared(key)`.
    Shared,
    /// Several keys (a `MultiLock`): unlocked with `pg_advisory_unlock_all()`,
    /// which is sound because the connection holds nothing else.
    All,
    /// An upgradeable read lock (an `UpgradeableLock`): the key's upgrade
    /// intent exclusively, the key shared, and, while upgraded, the key
    /// exclusively too. Unlocked with `pg_advisory_unlock_all()` like
    /// [`All`](Self::All), which frees whatever of these the session holds
    /// at that moment, upgraded or not.
    Upgradeable,
    /// A semaphore's slot (a permit of `PgLocker::semaphore`), exclusively
    /// like [`Exclusive`](Self::Exclusive); its unlock also tells the
    /// semaphore's waiting processes (`NOTIFY`), so that a freed permit
    /// reaches a waiter without a poll.
    Permit,
}

impl Hold {
    /// How its wait wants the key, for naming whom a missed deadline waited
    /// for: a shared hold shares the key with readers, an upgradeable one
    /// with readers but not with another upgradeable holder (its intent).
    pub(crate) fn wanted(self) -> crate::postgres::timeout::Wanted {
        use crate::postgres::holder::LockMode;
        use crate::postgres::timeout::Wanted;
        match self {
            Hold::Shared => Wanted::Mode(LockMode::Shared),
            Hold::Upgradeable => Wanted::Upgradeable,
            Hold::Exclusive | Hold::All | Hold::Permit => Wanted::Mode(LockMode::Exclusive),
        }
    }

    /// How spans and metrics name an acquisition of this hold: a try
    /// (`waits == false`) or a wait.
    pub(crate) fn mode(self, waits: bool) -> &'static str {
        match (self, waits) {
            (Hold::Exclusive, false) => "try",
            (Hold::Exclusive, true) => "wait",
            (Hold::Shared, false) => "try_shared",
            (Hold::Shared, true) => "wait_shared",
            (Hold::Upgradeable, false) => "try_upgradeable",
            (Hold::Upgradeable, true) => "wait_upgradeable",
            (Hold::All, false) => "try_all",
            (Hold::All, true) => "wait_all",
            (Hold::Permit, false) => "semaphore_try",
            (Hold::Permit, true) => "semaphore_wait",
        }
    }
}
