//! The lock request and its one statement builder: every advisory-lock
//! statement of the PostgreSQL backend (session, shared, multi-key,
//! multiplexed, transaction-scoped and caller's-transaction locks) is
//! composed here, from one normalised key shape and one set of fragments.
//!
//! A request says what it wants: which keys ([`key`]: bound as parameters,
//! each resolved once, in SQL, to `(space, a, b)`, in a CTE or in place in
//! the short tries), exclusive or shared
//! ([`Lock`]), try or wait ([`Step`]), fenced or not, on which kind of
//! connection ([`lock_request`]). [`sql`] turns it into a `&'static str` (so the driver's
//! prepared-statement cache keeps working), composing the guarantees once:
//! the standby check, the pooler's session marker, the statement-local
//! `lock_timeout`, the client check and keepalives, the fencing token, and
//! (in [`unlimited`]) the waits' escape from a session `statement_timeout`
//! and `transaction_timeout`.
//! An upgradeable read lock is one more shape of the same statements: the
//! key shared behind an exclusive "upgrade intent" derived from it, and its
//! upgrade the exclusive lock on a session that already holds the key.
//! `with_advisory_lock`'s try can also travel with its `BEGIN`
//! ([`prepared_try`]): the same parts, composed into a statement that fails
//! instead of answering "not taken".
//! The grant-after-timeout race is the caller's to close: a wait that fails
//! may have been granted, so its connection is closed, never pooled.

pub(crate) mod fragments;
pub(crate) mod key;
pub(crate) mod key_args;
pub(crate) mod literal;
pub(crate) mod lock_request;
pub(crate) mod prepared_try;
pub(crate) mod sql;
pub(crate) mod unlimited;

/// How the lock is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lock {
    /// One holder at a time (`pg_advisory_lock`).
    Exclusive,
    /// Any number of holders beside each other, none beside an exclusive
    /// one (`pg_advisory_lock_shared`).
    Shared,
}

impl Lock {
    /// The mode of a `pg_locks` row that this lock's wait wants (a missed
    /// deadline names whom it waited for by it).
    pub(crate) fn wanted(self) -> crate::postgres::holder::LockMode {
        match self {
            Lock::Exclusive => crate::postgres::holder::LockMode::Exclusive,
            Lock::Shared => crate::postgres::holder::LockMode::Shared,
        }
    }
}

/// Why a lock statement did not take its lock.
#[derive(Debug)]
pub(crate) enum NotTaken {
    /// Another session holds the key (a wait: until its deadline).
    Busy,
    /// The session carries another client's lock marker: a pooler shares
    /// it, and nothing was attempted. The backend's pid.
    MarkerSeen(i32),
    /// The lock statement failed.
    Failed(sqlx::Error),
}

/// What a statement does about a busy key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Attempts the lock and returns at once.
    Try,
    /// Waits at once where that is safe (the connection checks for a vanished
    /// client, and no `statement_timeout` or `transaction_timeout` would cut
    /// the wait short), tries elsewhere. The first statement of a waiting call.
    TryOrWait,
    /// Waits on the server, under a statement-local `lock_timeout`.
    Wait,
}

pub(crate) mod row;

impl From<crate::postgres::session::hold::Hold> for Lock {
    fn from(hold: crate::postgres::session::hold::Hold) -> Self {
        match hold {
            // The key itself is held shared; its intent is the request's
            // shape (`Request::upgradeable`), not its mode.
            crate::postgres::session::hold::Hold::Shared
            | crate::postgres::session::hold::Hold::Upgradeable => Lock::Shared,
            crate::postgres::session::hold::Hold::Exclusive
            | crate::postgres::session::hold::Hold::All
            | crate::postgres::session::hold::Hold::Permit => Lock::Exclusive,
        }
    }
}
