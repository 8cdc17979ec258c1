//! Introspection: who holds (or waits for) advisory locks in this database.

use std::fmt;
use std::time::{Duration, SystemTime};

use sqlx::postgres::{PgConnection, PgRow};
use sqlx::{Executor, Postgres, Row};

use super::sql::bind_key;
use crate::postgres::key_args::KeyArgs;
use crate::{Error, LockKey};

/// An advisory lock key as PostgreSQL's `pg_locks` shows it.
///
/// Server-hashed keys (`LockKey::from("name")`) appear as the `bigint` that
/// `hashtext('name')` yields; the name itself is not recoverable, so use
/// [`PgLocker::holders_of`](super::PgLocker::holders_of) to look one up by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AdvisoryKey {
    /// The single-`bigint` keyspace.
    BigInt(i64),
    /// The two-`int4` keyspace.
    Pair(i32, i32),
}

impl fmt::Display for AdvisoryKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BigInt(k) => write!(f, "{k}"),
            Self::Pair(a, b) => write!(f, "({a}, {b})"),
        }
    }
}

/// Whether a lock is exclusive or shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LockMode {
    /// Held alone (`pg_advisory_lock`, `pg_try_advisory_xact_lock`, ...).
    Exclusive,
    /// Held alongside other shared holders (`..._shared` functions).
    Shared,
}

/// One row of [`PgLocker::holders`](super::PgLocker::holders): a session holding or awaiting an
/// advisory lock.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Holder {
    /// The lock's key.
    pub key: AdvisoryKey,
    /// Backend process id of the session.
    pub pid: i32,
    /// The session's `application_name`, if set.
    pub application_name: Option<String>,
    /// The client's address, if connected over TCP.
    pub client_addr: Option<String>,
    /// When waiting: when the wait began. When granted: the start of the
    /// holder's transaction or, outside a transaction, of its session.
    /// PostgreSQL does not record when a lock was granted, so for a session
    /// lock this is the earliest moment it can have been taken.
    pub since: Option<SystemTime>,
    /// `true` if held, `false` if waiting for it.
    pub granted: bool,
    /// Exclusive or shared.
    pub mode: LockMode,
}

const HOLDERS_SQL: &str = "SELECT l.classid::int8, l.objid::int8, l.objsubid::int4, l.pid, \
     l.mode, l.granted, a.application_name, host(a.client_addr), \
     (extract(epoch FROM COALESCE(l.waitstart, a.xact_start, a.backend_start)) * 1000000)::int8 \
     FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
     WHERE l.locktype = 'advisory' \
     AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())";

/// The filter `holders_of` appends for each key shape.
fn key_filter(args: KeyArgs<'_>) -> &'static str {
    match args {
        KeyArgs::Text(_) => {
            " AND l.objsubid = 1 AND ((l.classid::int8 << 32) | l.objid::int8) = hashtext($1)::int8"
        }
        KeyArgs::BigInt(_) => {
            " AND l.objsubid = 1 AND ((l.classid::int8 << 32) | l.objid::int8) = $1::int8"
        }
        KeyArgs::Pair(..) => {
            " AND l.objsubid = 2 AND l.classid::int8 = ($1::int4::int8 & 4294967295) \
             AND l.objid::int8 = (hashtext($2)::int8 & 4294967295)"
        }
    }
}

const ORDER: &str = " ORDER BY l.granted DESC, l.pid";

/// Every advisory lock held or awaited in the database of `pool`.
pub(crate) async fn all(pool: &sqlx::PgPool) -> Result<Vec<Holder>, Error> {
    let sql: String = [HOLDERS_SQL, ORDER].concat();
    let rows = pool
        .fetch_all(sqlx::query(sqlx::AssertSqlSafe(sql)))
        .await?;
    rows.iter().map(decode).collect()
}

/// The sessions holding or awaiting `key`, on `conn`.
pub(crate) async fn holders_of(
    conn: &mut PgConnection,
    key: &LockKey,
) -> Result<Vec<Holder>, Error> {
    let args = key.args()?;
    let sql: String = [HOLDERS_SQL, key_filter(args), ORDER].concat();
    let query = bind_key(sqlx::query::<Postgres>(sqlx::AssertSqlSafe(sql)), args);
    let rows = query.fetch_all(conn).await?;
    rows.iter().map(decode).collect()
}

/// The first session *holding* `key`, to name it in a timeout.
pub(crate) async fn first_holder(
    conn: &mut PgConnection,
    key: &LockKey,
) -> Result<Option<Holder>, Error> {
    Ok(holders_of(conn, key).await?.into_iter().find(|h| h.granted))
}

fn decode(row: &PgRow) -> Result<Holder, Error> {
    let classid: i64 = row.try_get(0)?;
    let objid: i64 = row.try_get(1)?;
    let objsubid: i32 = row.try_get(2)?;
    let key = if objsubid == 2 {
        AdvisoryKey::Pair(low_i32(classid), low_i32(objid))
    } else {
        AdvisoryKey::BigInt((classid << 32) | objid)
    };
    let mode: String = row.try_get(4)?;
    let since_us: Option<i64> = row.try_get(8)?;
    Ok(Holder {
        key,
        pid: row.try_get(3)?,
        mode: if mode == "ShareLock" {
            LockMode::Shared
        } else {
            LockMode::Exclusive
        },
        granted: row.try_get(5)?,
        application_name: row
            .try_get::<Option<String>, _>(6)?
            .filter(|s| !s.is_empty()),
        client_addr: row.try_get(7)?,
        since: since_us.map(|us| SystemTime::UNIX_EPOCH + Duration::from_micros(us.unsigned_abs())),
    })
}

/// An `oid` column widened to `int8` holds 0..2^32; PostgreSQL stored the
/// two-`int4` key's halves as their bit patterns, so reinterpret them.
fn low_i32(oid: i64) -> i32 {
    i32::from_ne_bytes(u32::try_from(oid & 0xFFFF_FFFF).unwrap_or(0).to_ne_bytes())
}
