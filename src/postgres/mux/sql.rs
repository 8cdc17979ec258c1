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
use sqlx::postgres::{PgArguments, PgRow, Postgres};
use sqlx::query::Query;

use super::super::sql::{bind_key, millis_setting};
use crate::key::KeyArgs;
use crate::{FencingToken, LockKey};

type PgQuery<'q> = Query<'q, Postgres, PgArguments>;

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
    pub(super) locked: bool,
    pub(super) pid: i32,
    pub(super) key: ServerKey,
    pub(super) token: Option<FencingToken>,
}

/// The token half of the fencing try statement, shared by every key shape:
/// a token only when the lock was taken, as in the dedicated-connection mode.
macro_rules! fencing_tail {
    () => {
        "t AS (INSERT INTO distlock.fencing_tokens AS f (lock_key, token) \
         SELECT $1, 1 FROM l WHERE l.ok \
         ON CONFLICT (lock_key) DO UPDATE SET token = f.token + 1, issued_at = now() \
         RETURNING f.token) \
         SELECT l.ok, l.pid, l.k, (SELECT token FROM t) FROM l"
    };
}

/// The try statement: lock attempt, backend pid and resolved key in one round
/// trip; with fencing, the token is issued by the same statement when the
/// lock was taken (`$1` is the counter's name, the key binds after it).
pub(super) fn try_lock<'q>(args: KeyArgs<'q>, fencing: Option<&'q str>) -> PgQuery<'q> {
    // Columns: locked, pid, resolved key (int8, or int4 for the pair's second
    // half), token. The subquery computes `hashtext` once for both uses.
    let Some(counter) = fencing else {
        let sql = match args {
            KeyArgs::Text(_) => {
                "SELECT pg_try_advisory_lock(k), pg_backend_pid(), k \
                 FROM (SELECT hashtext($1)::int8 AS k) s"
            }
            KeyArgs::BigInt(_) => {
                "SELECT pg_try_advisory_lock($1::int8), pg_backend_pid(), $1::int8"
            }
            KeyArgs::Pair(..) => {
                "SELECT pg_try_advisory_lock($1::int4, k), pg_backend_pid(), k \
                 FROM (SELECT hashtext($2) AS k) s"
            }
        };
        return bind_key(sqlx::query(sql), args);
    };
    let sql = match args {
        KeyArgs::Text(_) => concat!(
            "WITH l AS (SELECT pg_try_advisory_lock(k) AS ok, pg_backend_pid() AS pid, k \
             FROM (SELECT hashtext($2)::int8 AS k) s), ",
            fencing_tail!()
        ),
        KeyArgs::BigInt(_) => concat!(
            "WITH l AS (SELECT pg_try_advisory_lock($2::int8) AS ok, pg_backend_pid() AS pid, \
             $2::int8 AS k), ",
            fencing_tail!()
        ),
        KeyArgs::Pair(..) => concat!(
            "WITH l AS (SELECT pg_try_advisory_lock($2::int4, k) AS ok, pg_backend_pid() AS pid, k \
             FROM (SELECT hashtext($3) AS k) s), ",
            fencing_tail!()
        ),
    };
    bind_key(sqlx::query(sql).bind(counter), args)
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
    let locked: bool = row.try_get(0)?;
    let token = if fencing && locked {
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

/// Unlocks one level of a resolved key; returns whether it was held, and the
/// backend pid (checked like every answer on a shared connection).
pub(super) fn unlock(key: ServerKey) -> PgQuery<'static> {
    match key {
        ServerKey::BigInt(k) => {
            sqlx::query("SELECT pg_advisory_unlock($1::int8), pg_backend_pid()").bind(k)
        }
        ServerKey::Pair(a, b) => {
            sqlx::query("SELECT pg_advisory_unlock($1::int4, $2::int4), pg_backend_pid()")
                .bind(a)
                .bind(b)
        }
    }
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

/// The heartbeat: which backend answers.
pub(super) const HEARTBEAT: &str = "SELECT pg_backend_pid()";
