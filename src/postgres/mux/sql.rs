//! The statements a multiplexed connection runs: the lock statements come
//! from the one builder (`request::sql`); the unlock and the heartbeat,
//! which work on keys the server already resolved, are here.
//!
//! Unlike the dedicated-connection statements, the try statement also returns
//! the key *as the server resolved it* (`hashtext` computed), because two
//! different [`LockKey`]s can name the same server lock (`LockKey::from("x")`
//! and `LockKey::id(hashtext('x'))`, or two names whose `hashtext` collide),
//! and on one shared session PostgreSQL would grant both: session locks are
//! re-entrant. The driver keeps its held set by resolved key to catch that.

use sqlx::postgres::PgRow;

use crate::postgres::request::fragments::{PgQuery, millis_setting};
use crate::postgres::request::key::Bound;
use crate::postgres::request::key_args::KeyArgs;
use crate::postgres::request::row::SessionRow;
use crate::postgres::request::sql;
use crate::{Error, FencingToken, LockKey};

/// A lock as PostgreSQL's lock table knows it, after server-side hashing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum ServerKey {
    /// The single-`bigint` keyspace.
    BigInt(i64),
    /// The two-`int4` keyspace.
    Pair(i32, i32),
}

impl ServerKey {
    /// The server key of `key` when the client can know it without asking.
    pub(super) fn known(key: &LockKey) -> Option<Self> {
        key.pg_bigint().map(Self::BigInt)
    }

    /// The server key of a key the server resolved to `(space, a, b)`
    /// (`resolved` in `request::sql`): space 1 is one `bigint`, any other
    /// two `int4`s (`None` where `a` or `b` is out of their range).
    fn resolved(space: i32, a: i64, b: i64) -> Option<Self> {
        match space {
            1 => Some(Self::BigInt(a)),
            _ => Some(Self::Pair(i32::try_from(a).ok()?, i32::try_from(b).ok()?)),
        }
    }
}

/// What [`held_after`] read: the failed try's key as the server resolved
/// it, how many advisory locks the session holds, and its backend pid.
#[derive(Debug)]
pub(super) struct HeldAfter {
    pub(super) key: Option<ServerKey>,
    pub(super) held: i64,
    pub(super) pid: i32,
}

/// The lookup after a failed try (see [`sql::MUX_HELD_AFTER`]).
pub(super) fn held_after(args: KeyArgs<'_>) -> PgQuery<'_> {
    Bound::from(args).bind(sqlx::query(sql::MUX_HELD_AFTER))
}

/// Decodes [`held_after`]'s row.
pub(super) fn decode_held_after(row: &PgRow) -> Result<HeldAfter, sqlx::Error> {
    use sqlx::Row;
    Ok(HeldAfter {
        key: ServerKey::resolved(row.try_get(0)?, row.try_get(1)?, row.try_get(2)?),
        held: row.try_get(3)?,
        pid: row.try_get(4)?,
    })
}

/// What one try statement answered.
#[derive(Debug)]
pub(super) struct TryRow {
    /// `None`: not attempted, the session holds locks this connection does
    /// not know of (shared with another client).
    pub(super) locked: Option<bool>,
    pub(super) pid: i32,
    pub(super) key: ServerKey,
    pub(super) token: Option<FencingToken>,
}

/// The try statement (see [`sql::mux_try`]): lock attempt, backend pid and
/// resolved key in one round trip; with fencing, the token is issued by
/// the same statement when the lock was taken. The driver's count of held
/// locks and the count after a grant bind after the key: the lock is
/// attempted only if the session's marker matches the count, so a server
/// session shared with another client takes nothing (NULL "taken").
pub(super) fn try_lock(args: KeyArgs<'_>, fencing: bool, held: usize) -> PgQuery<'_> {
    Bound::from(args)
        .bind(sqlx::query(sql::mux_try(fencing)))
        .bind(held.to_string())
        .bind((held + 1).to_string())
}

/// Decodes a try statement's row.
pub(super) fn decode_try(
    row: &PgRow,
    (asked, _args): (&LockKey, KeyArgs<'_>),
    fencing: bool,
) -> Result<TryRow, Error> {
    let row = SessionRow::decode(row, asked, fencing)?;
    let key = match row.resolved {
        Some((space, a, b)) => match ServerKey::resolved(space, a, b) {
            Some(key) => key,
            None => {
                return Err(Error::InvalidKey {
                    key: asked.clone(),
                    reason: "the server resolved it outside the two-int4 keyspace",
                });
            }
        },
        // The multiplexed try always returns the resolved key.
        None => {
            return Err(Error::InvalidKey {
                key: asked.clone(),
                reason: "the server did not say how it resolved it",
            });
        }
    };
    Ok(TryRow {
        locked: row.taken,
        pid: row.pid,
        key,
        token: row.token,
    })
}

/// The multiplexed unlock around the unlock call `$call`: only on the
/// connection's own backend (`$1`) while the marker counts the driver's
/// locks (`$2`, the count before this unlock), it unlocks and sets the
/// marker to `$3`, the count after, also when the unlock answers `false`
/// (so the heartbeat cannot tell afterwards that the session lost locks:
/// the driver gives the connection up on that answer instead). Elsewhere
/// (a pooler moved the connection, or shares its session) it gives back
/// nothing and leaves that session's marker alone: column 0 NULL.
macro_rules! mux_unlock {
    ($call:literal) => {
        concat!(
            "SELECT CASE WHEN pg_catalog.pg_backend_pid() OPERATOR(pg_catalog.=) $1::pg_catalog.int4 \
             AND coalesce(pg_catalog.current_setting('distlock.locks', true), '') OPERATOR(pg_catalog.=) $2 \
             THEN CASE WHEN ",
            $call,
            " THEN pg_catalog.set_config('distlock.locks', $3, false) IS NOT NULL \
             ELSE pg_catalog.set_config('distlock.locks', $3, false) IS NULL END END, \
             pg_catalog.pg_backend_pid()"
        )
    };
}

/// Unlocks one level of a resolved key on the driver's backend `pid`,
/// whose marker counts `held + 1` locks, and sets the marker to `held`
/// (see [`mux_unlock`]); returns whether it was held (NULL: not the
/// driver's session, nothing done), and the backend pid (checked like
/// every answer on a shared connection).
pub(super) fn unlock(key: ServerKey, pid: i32, held: usize) -> PgQuery<'static> {
    let query = match key {
        ServerKey::BigInt(_) => sqlx::query(mux_unlock!(
            "pg_catalog.pg_advisory_unlock($4::pg_catalog.int8)"
        )),
        ServerKey::Pair(..) => sqlx::query(mux_unlock!(
            "pg_catalog.pg_advisory_unlock($4::pg_catalog.int4, $5::pg_catalog.int4)"
        )),
    };
    let query = query
        .bind(pid)
        .bind((held + 1).to_string())
        .bind(held.to_string());
    match key {
        ServerKey::BigInt(k) => query.bind(k),
        ServerKey::Pair(a, b) => query.bind(a).bind(b),
    }
}

/// The wake-up wait run on a temporary pooled connection (see
/// [`sql::MUX_WAIT_UNTIL_FREE`]), under a statement-local `lock_timeout`.
pub(super) fn wait_until_free<'q>(args: KeyArgs<'q>, timeout: std::time::Duration) -> PgQuery<'q> {
    Bound::from(args)
        .bind(sqlx::query(sql::MUX_WAIT_UNTIL_FREE))
        .bind(millis_setting(timeout))
}

/// The heartbeat: which backend answers, and the session's lock count.
pub(super) const HEARTBEAT: &str =
    "SELECT pg_catalog.pg_backend_pid(), pg_catalog.current_setting('distlock.locks', true)";
