//! What a lock statement answered (the columns of every statement
//! [`sql::session`](super::sql::session) and [`sql::mux_try`](super::sql::mux_try)
//! build, and the first column of the transaction-scoped ones), read in one
//! place.

use sqlx::Row;
use sqlx::postgres::PgRow;

use super::unlimited;
use crate::{Error, FencingToken, LockKey};

/// One session lock statement's answer.
#[derive(Debug)]
pub(crate) struct SessionRow {
    /// `None`: not attempted, the session holds a distlock lock this
    /// connection does not know of (it is shared through a pooler).
    pub(crate) taken: Option<bool>,
    /// The backend that answered.
    pub(crate) pid: i32,
    /// The fencing token, when the lock was taken with fencing on.
    pub(crate) token: Option<FencingToken>,
    /// Whether the session's `statement_timeout` or `transaction_timeout` would
    /// cut a wait short (`false` from a plain try, which does not read it: only
    /// the first statement of a wait, `Step::TryOrWait`, answers for a wait).
    pub(crate) limited: bool,
    /// The key as the server resolved it: space, a, b (`None` from a
    /// statement that resolves it in place, a fresh session's: only the
    /// multiplexed try's caller reads it).
    pub(crate) resolved: Option<(i32, i64, i64)>,
}

impl SessionRow {
    /// Reads `row`; a lock taken with `fencing` on must carry its token.
    pub(crate) fn decode(row: &PgRow, key: &LockKey, fencing: bool) -> Result<Self, Error> {
        let taken: Option<bool> = row.try_get(0)?;
        let token = match (
            fencing && taken == Some(true),
            row.try_get::<Option<i64>, _>(2)?,
        ) {
            (false, _) => None,
            (true, Some(token)) => Some(FencingToken::new(token)),
            (true, None) => {
                return Err(Error::MissingFencingToken { key: key.clone() });
            }
        };
        let limit: Option<String> = row.try_get(4)?;
        Ok(Self {
            taken,
            pid: row.try_get(1)?,
            token,
            limited: unlimited::limited(limit.as_deref()),
            resolved: resolved(row)?,
        })
    }

    /// Whether the lock was taken; a refused attempt (the session already
    /// holds another client's lock: it is shared) is
    /// [`Error::PoolerDetected`].
    pub(crate) fn taken(&self) -> Result<bool, Error> {
        self.taken
            .ok_or_else(|| crate::postgres::pooler::marker_seen(self.pid))
    }
}

/// Columns 5–7, the resolved key, or `None` where the statement left them
/// NULL.
fn resolved(row: &PgRow) -> Result<Option<(i32, i64, i64)>, Error> {
    let space: Option<i32> = row.try_get(5)?;
    let (a, b): (Option<i64>, Option<i64>) = (row.try_get(6)?, row.try_get(7)?);
    Ok(match (space, a, b) {
        (Some(space), Some(a), Some(b)) => Some((space, a, b)),
        _ => None,
    })
}

/// The first column of a transaction-scoped lock statement: whether the
/// lock was taken, or `Err(pid)` when the statement did not attempt it
/// because the session carries distlock's session marker (another client's
/// session lock on a session a pooler shares, which the backend would grant
/// the key again: see `session_marker`). The pid is the statement's last
/// column.
pub(crate) fn xact_taken(row: &PgRow) -> Result<Result<bool, i32>, sqlx::Error> {
    match row.try_get::<Option<bool>, _>(0)? {
        Some(taken) => Ok(Ok(taken)),
        None => Ok(Err(row.try_get(row.len().saturating_sub(1))?)),
    }
}
