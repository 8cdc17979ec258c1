//! The statements a multiplexed connection runs, one static string per key
//! shape; keys are always bound, never formatted into SQL.
//!
//! Unlike the dedicated-connection statements, the try statement also returns
//! the key *as the server resolved it* (`hashtext` computed), because two
//! different [`LockKey`]s can name the same server lock (`LockKey::from("x")`
//! and `LockKey::id(hashtext('x'))`, or two names whose `hashtext` collide),
//! and on one shared session PostgreSQL would grant both: session locks are
//! re-entrant. The driver keeps its held set by resolved key to catch that.

use sqlx::Row;
use sqlx::postgres::PgRow;

use crate::postgres::key_args::KeyArgs;
use crate::postgres::sql::{PgQuery, bind_key, millis_setting};
use crate::{FencingToken, LockKey};

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

/// The session-marker test (see `session_marker` in the parent's `sql`):
/// the lock is attempted only if the session holds exactly the locks this
/// connection's driver counts (`$n`, as text).
macro_rules! counted {
    ($n:literal) => {
        concat!(
            "CASE WHEN coalesce(nullif(current_setting('distlock.locks', true), ''), '0') = ",
            $n,
            " THEN "
        )
    };
}

/// The try statement for one key shape: `$lock` is the lock call on `k`
/// (and `$1` for the pair), `$from` computes `k`, `$token` the token column,
/// `$n`/`$next` the placeholders of the marker's counts.
macro_rules! try_sql {
    ($lock:literal, $from:literal, $token:literal, $n:literal, $next:literal) => {
        concat!(
            "WITH l AS (SELECT ",
            counted!($n),
            $lock,
            " END AS ok, pg_backend_pid() AS pid, k ",
            $from,
            ") SELECT l.ok, l.pid, l.k, ",
            $token,
            ", CASE WHEN l.ok THEN set_config('distlock.locks', ",
            $next,
            ", false) END FROM l"
        )
    };
}

/// The try statement: lock attempt, backend pid and resolved key in one round
/// trip; with fencing, the token is issued by the same statement when the
/// lock was taken (`distlock.next_token()`: a sequence draw, no durable write). The
/// driver's count of held locks and the count after a grant bind after the
/// key: the lock is attempted only if the session's marker matches the
/// count, so a server session shared with another client takes nothing
/// (NULL "taken").
pub(super) fn try_lock(args: KeyArgs<'_>, fencing: bool, held: usize) -> PgQuery<'_> {
    // Columns: taken (NULL: refused), pid, resolved key (int8, or int4 for
    // the pair's second half), token, marker. The subquery computes
    // `hashtext` once for every use.
    let sql = match (args, fencing) {
        (KeyArgs::Text(_), false) => try_sql!(
            "pg_try_advisory_lock(k)",
            "FROM (SELECT hashtext($1)::int8 AS k) s",
            "NULL::int8",
            "$2",
            "$3"
        ),
        (KeyArgs::Text(_), true) => try_sql!(
            "pg_try_advisory_lock(k)",
            "FROM (SELECT hashtext($1)::int8 AS k) s",
            "CASE WHEN l.ok THEN distlock.next_token() END",
            "$2",
            "$3"
        ),
        (KeyArgs::BigInt(_), false) => try_sql!(
            "pg_try_advisory_lock(k)",
            "FROM (SELECT $1::int8 AS k) s",
            "NULL::int8",
            "$2",
            "$3"
        ),
        (KeyArgs::BigInt(_), true) => try_sql!(
            "pg_try_advisory_lock(k)",
            "FROM (SELECT $1::int8 AS k) s",
            "CASE WHEN l.ok THEN distlock.next_token() END",
            "$2",
            "$3"
        ),
        (KeyArgs::Pair(..), false) => try_sql!(
            "pg_try_advisory_lock($1::int4, k)",
            "FROM (SELECT hashtext($2) AS k) s",
            "NULL::int8",
            "$3",
            "$4"
        ),
        (KeyArgs::Pair(..), true) => try_sql!(
            "pg_try_advisory_lock($1::int4, k)",
            "FROM (SELECT hashtext($2) AS k) s",
            "CASE WHEN l.ok THEN distlock.next_token() END",
            "$3",
            "$4"
        ),
    };
    bind_counts(bind_key(sqlx::query(sql), args), held)
}

/// Binds the driver's count of held locks, and that count plus the lock
/// being tried, as the session marker's text.
fn bind_counts(query: PgQuery<'_>, held: usize) -> PgQuery<'_> {
    query.bind(held.to_string()).bind((held + 1).to_string())
}

/// Decodes a try statement's row for a key of shape `args`.
pub(super) fn decode_try(
    row: &PgRow,
    args: KeyArgs<'_>,
    fencing: bool,
) -> Result<TryRow, sqlx::Error> {
    let key = match args {
        KeyArgs::Text(_) | KeyArgs::BigInt(_) => ServerKey::BigInt(row.try_get(2)?),
        KeyArgs::Pair(ns, _) => ServerKey::Pair(ns, row.try_get(2)?),
    };
    let locked: Option<bool> = row.try_get(0)?;
    let token = if fencing && locked == Some(true) {
        match row.try_get::<Option<i64>, _>(3)? {
            Some(token) => Some(FencingToken::new(token)),
            None => {
                return Err(sqlx::Error::Protocol(
                    "the lock statement issued no fencing token".into(),
                ));
            }
        }
    } else {
        None
    };
    Ok(TryRow {
        locked,
        pid: row.try_get(1)?,
        key,
        token,
    })
}

/// Unlocks one level of a resolved key and sets the session marker to
/// `held`, the driver's count of locks still held; returns whether it was
/// held, and the backend pid (checked like every answer on a shared
/// connection).
pub(super) fn unlock(key: ServerKey, held: usize) -> PgQuery<'static> {
    let query = match key {
        ServerKey::BigInt(k) => sqlx::query(
            "SELECT pg_advisory_unlock($1::int8), pg_backend_pid(), \
             set_config('distlock.locks', $2, false)",
        )
        .bind(k),
        ServerKey::Pair(a, b) => sqlx::query(
            "SELECT pg_advisory_unlock($1::int4, $2::int4), pg_backend_pid(), \
             set_config('distlock.locks', $3, false)",
        )
        .bind(a)
        .bind(b),
    };
    query.bind(held.to_string())
}

/// The wake-up wait run on a temporary pooled connection: waits (under a
/// statement-local `lock_timeout`, which the server reads when the wait
/// begins) until no one holds `key` exclusively by taking it *shared*, and
/// gives the shared lock back in the same statement, so a finished statement
/// leaves nothing held. A shared request queues behind exclusive waiters, so
/// it does not jump ahead of them.
pub(super) fn wait_until_free<'q>(args: KeyArgs<'q>, timeout: std::time::Duration) -> PgQuery<'q> {
    let sql = match args {
        KeyArgs::Text(_) => {
            "SELECT set_config('lock_timeout', $1, true), \
             pg_advisory_lock_shared(hashtext($2)), pg_advisory_unlock_shared(hashtext($2))"
        }
        KeyArgs::BigInt(_) => {
            "SELECT set_config('lock_timeout', $1, true), \
             pg_advisory_lock_shared($2::int8), pg_advisory_unlock_shared($2::int8)"
        }
        KeyArgs::Pair(..) => {
            "SELECT set_config('lock_timeout', $1, true), \
             pg_advisory_lock_shared($2::int4, hashtext($3)), \
             pg_advisory_unlock_shared($2::int4, hashtext($3))"
        }
    };
    bind_key(sqlx::query(sql).bind(millis_setting(timeout)), args)
}

/// The heartbeat: which backend answers, and the session's lock count.
pub(super) const HEARTBEAT: &str =
    "SELECT pg_backend_pid(), current_setting('distlock.locks', true)";
