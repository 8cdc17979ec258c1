//! A lock request on one key, turned into its bound statement: the key in
//! its one shape, exclusive or shared, fenced or not; the scope (a
//! dedicated session, or a transaction) and the step (try, wait) are the
//! method called. A new kind of lock costs a request shape here and its
//! fragments in [`sql`](super::sql), not new statements in every path.

use std::time::Duration;

use super::key::Bound;
use super::{Lock, Step, sql};
use crate::postgres::request::fragments::{PgQuery, millis_setting};

/// What one single-key lock statement asks for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Request<'k> {
    /// The key, bound as `$1`–`$3`.
    pub(crate) key: Bound<'k>,
    /// Exclusive or shared.
    pub(crate) lock: Lock,
    /// Whether a granted exclusive session lock carries a fencing token.
    pub(crate) fencing: bool,
}

impl<'k> Request<'k> {
    /// The session lock statement of `step` on a dedicated connection, with
    /// `timeout` (what is left of the caller's) as the `lock_timeout` of a
    /// step that may wait. Columns: see [`SessionRow`](super::row::SessionRow).
    pub(crate) fn session(self, step: Step, timeout: Duration) -> PgQuery<'k> {
        let query = self
            .key
            .bind(sqlx::query(sql::session(step, self.lock, self.fencing)));
        match step {
            Step::Try => query,
            Step::TryOrWait | Step::Wait => query.bind(millis_setting(timeout)),
        }
    }

    /// An upgradeable read lock's statement of `step` (the key's intent
    /// exclusively, then the key shared), as [`session`](Self::session)
    /// builds a plain one; `lock` and `fencing` are not read (the read lock
    /// carries no token).
    pub(crate) fn upgradeable(self, step: Step, timeout: Duration) -> PgQuery<'k> {
        let query = self.key.bind(sqlx::query(sql::session_upgradeable(step)));
        match step {
            Step::Try => query,
            Step::TryOrWait | Step::Wait => query.bind(millis_setting(timeout)),
        }
    }

    /// The upgrade of an upgradeable read lock held by backend `pid` to an
    /// exclusive lock, with a fresh token if `fencing`; `timeout` as for
    /// [`session`](Self::session). Columns: see
    /// [`SessionRow`](super::row::SessionRow).
    pub(crate) fn upgrade(self, step: Step, timeout: Duration, pid: i32) -> PgQuery<'k> {
        self.key
            .bind(sqlx::query(sql::upgrade(step, self.fencing)))
            .bind(millis_setting(timeout))
            .bind(pid)
    }

    /// Gives back the exclusive mode of an upgraded lock held by backend
    /// `pid`. Columns: unlocked (NULL: not that backend), pid.
    pub(crate) fn downgrade(self, pid: i32) -> PgQuery<'k> {
        self.key.bind(sqlx::query(sql::DOWNGRADE)).bind(pid)
    }

    /// After a failed upgrade wait of backend `pid`: gives the exclusive
    /// mode back if the server granted it anyway. Columns: given back
    /// (NULL: not that backend), pid.
    pub(crate) fn undo_upgrade(self, pid: i32) -> PgQuery<'k> {
        self.key.bind(sqlx::query(sql::UNDO_UPGRADE)).bind(pid)
    }

    /// The try inside a transaction that `with_advisory_lock*` opened;
    /// `waits`: a wait follows a busy key (so the try lifts a session
    /// `statement_timeout` for it). Columns: taken, then (`waits` only) the
    /// `statement_timeout`.
    pub(crate) fn xact_try(self, waits: bool) -> PgQuery<'k> {
        let query = self.key.bind(sqlx::query(sql::xact_try(self.lock, waits)));
        if waits { query.bind(true) } else { query }
    }

    /// The wait inside an open transaction, under `timeout`, putting the
    /// caller's `lock_timeout` back and the `statement_timeout` a try
    /// lifted (`restore`; `None` where none was).
    pub(crate) fn xact_wait(self, timeout: Duration, restore: Option<String>) -> PgQuery<'k> {
        self.key
            .bind(sqlx::query(sql::xact_wait(self.lock)))
            .bind(millis_setting(timeout))
            .bind(restore)
    }
}
