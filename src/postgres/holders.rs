//! Introspection: who holds (or waits for) advisory locks in this database.

use std::time::{Duration, SystemTime};

use sqlx::postgres::{PgConnection, PgRow};
use sqlx::{Executor, Postgres, Row};

use crate::postgres::holder::{AdvisoryKey, Holder, LockMode};
use crate::postgres::request::key::BoundAll;
use crate::postgres::request::sql::{KEY_AND_INTENT_AS_LOCKED, KEYS_AS_LOCKED};
use crate::postgres::wait_chain::resolve;
use crate::{Error, LockKey};

/// The deadline of the answer of [`PgLocker::holders`](crate::PgLocker::holders)
/// and [`holders_of`](crate::PgLocker::holders_of), and of the lease
/// table's [`holders`](crate::postgres::TableLocker::holders) (the
/// heartbeat or renewal deadline when longer): it reads the whole lock
/// table, about half a second at 100,000 locks held (BENCHMARKS.md), so
/// the heartbeat deadline alone could cut a healthy read short.
pub(crate) const READ_WITHIN: Duration = Duration::from_secs(5);

/// The CTE `h`: the advisory locks of this database, read once from
/// `pg_locks`, in `pg_locks`' shape: `c` (`classid`), `o` (`objid`), `s`
/// (`objsubid`, the key space), `pid`, `mode`, `granted`, `waitstart`.
const LOCK_ROWS: &str = "h AS MATERIALIZED (SELECT l.classid::pg_catalog.int8 AS c, \
     l.objid::pg_catalog.int8 AS o, l.objsubid::pg_catalog.int4 AS s, l.pid, l.mode, l.granted, \
     l.waitstart FROM pg_catalog.pg_locks l WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory' \
     AND l.database OPERATOR(pg_catalog.=) (SELECT oid FROM pg_catalog.pg_database \
       WHERE datname OPERATOR(pg_catalog.=) pg_catalog.current_database()))";

/// The columns [`decode`] reads, of the rows `x` (the columns of [`LOCK_ROWS`]
/// and `blocked`, the `pg_blocking_pids` of a waiting row) joined with
/// their sessions: `SELECT` this, then `FROM x` and [`ACTIVITY`].
const SHOWN: &str = "SELECT x.c, x.o, x.s, x.pid, x.mode, x.granted, a.application_name, \
     pg_catalog.host(a.client_addr), \
     (extract(epoch FROM COALESCE(x.waitstart, a.xact_start, a.backend_start)) OPERATOR(pg_catalog.*) 1000000)::pg_catalog.int8, \
     x.blocked";

const ACTIVITY: &str =
    " LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid OPERATOR(pg_catalog.=) x.pid";

/// The rows of `h` as `x`, each waiting row with its blockers, and `tail`
/// after `FROM h` (a join or a filter).
fn every_row(tail: &str) -> String {
    [
        ", x AS (SELECT h.c, h.o, h.s, h.pid, h.mode, h.granted, h.waitstart, \
         CASE WHEN h.granted THEN NULL ELSE pg_catalog.pg_blocking_pids(h.pid) END AS blocked \
         FROM h",
        tail,
        ") ",
        SHOWN,
        " FROM x",
        ACTIVITY,
        " ORDER BY x.granted DESC, x.pid",
    ]
    .concat()
}

/// Every advisory lock held or awaited in the database, on `conn`.
pub(crate) async fn all(conn: &mut PgConnection) -> Result<Vec<Holder>, Error> {
    let sql: String = ["WITH ", LOCK_ROWS, &every_row("")].concat();
    let rows = conn
        .fetch_all(sqlx::query(sqlx::AssertSqlSafe(sql)))
        .await?;
    decode_all(&rows)
}

/// The sessions holding or awaiting `key`, on `conn`.
pub(crate) async fn holders_of(
    conn: &mut PgConnection,
    key: &LockKey,
) -> Result<Vec<Holder>, Error> {
    let mut keys = BoundAll::default();
    keys.push(key.args()?.into());
    let on_key = " JOIN w ON h.s OPERATOR(pg_catalog.=) w.s AND h.c OPERATOR(pg_catalog.=) w.c AND h.o OPERATOR(pg_catalog.=) w.o";
    let sql: String = ["WITH ", KEYS_AS_LOCKED, ", ", LOCK_ROWS, &every_row(on_key)].concat();
    let query = keys.bind(sqlx::query::<Postgres>(sqlx::AssertSqlSafe(sql)));
    let rows = query.fetch_all(conn).await?;
    decode_all(&rows)
}

/// The advisory locks a timeout's chain is built from, around the keys a
/// caller waited for: one snapshot.
#[derive(Debug)]
pub(crate) struct Snapshot {
    /// The rows on the wanted keys, and of the sessions reached from their
    /// holders by following waits: their waiting rows (with blockers) and
    /// their rows on the keys those wait for. Granted rows first.
    pub(crate) holders: Vec<Holder>,
    /// Each wanted key's place in the caller's list, and the key as
    /// `pg_locks` shows it.
    pub(crate) wanted: Vec<(usize, AdvisoryKey)>,
    /// The backend pid of the connection that looked.
    pub(crate) me: i32,
}

/// From `h` and the wanted keys `w`: `reach`, the sessions holding or
/// awaiting a wanted key (a shared wait queues behind an awaiting writer)
/// and, transitively, those they wait behind (`UNION` ends at a cycle);
/// `wt`, their waiting rows with their blockers; `xs`, the rows a chain
/// needs; `x`, those with every wanted key (a FULL JOIN, so that a key
/// nobody holds still comes back, resolved: a name's hash is the server's
/// to compute) and its place `i`. `pg_blocking_pids` runs only for the
/// sessions reached, so the cost follows the chain, not the lock table. A
/// prepared transaction's lock has no pid and starts no chain: a NULL in
/// `reach` would make every `NOT pid = ANY (reach)` NULL and drop the
/// other waiters' rows.
const AROUND: &str = ", reach(pid) AS (\
       SELECT h.pid FROM h JOIN w ON h.s OPERATOR(pg_catalog.=) w.s AND h.c OPERATOR(pg_catalog.=) w.c AND h.o OPERATOR(pg_catalog.=) w.o WHERE h.pid IS NOT NULL \
       UNION SELECT b.pid FROM reach r JOIN h ON h.pid OPERATOR(pg_catalog.=) r.pid AND NOT h.granted, \
         pg_catalog.unnest(pg_catalog.pg_blocking_pids(r.pid)) AS b(pid)), \
     wt AS MATERIALIZED (SELECT h.c, h.o, h.s, h.pid, h.mode, h.granted, h.waitstart, \
       pg_catalog.pg_blocking_pids(h.pid) AS blocked FROM h \
       WHERE NOT h.granted AND h.pid OPERATOR(pg_catalog.=) ANY (SELECT pid FROM reach)), \
     xs AS (SELECT * FROM wt UNION ALL \
       SELECT h.c, h.o, h.s, h.pid, h.mode, h.granted, h.waitstart, NULL::pg_catalog.int4[] FROM h \
       WHERE EXISTS (SELECT FROM w WHERE w.s OPERATOR(pg_catalog.=) h.s AND w.c OPERATOR(pg_catalog.=) h.c AND w.o OPERATOR(pg_catalog.=) h.o) \
         AND (h.granted OR NOT h.pid OPERATOR(pg_catalog.=) ANY (SELECT pid FROM reach)) \
       OR h.granted AND h.pid OPERATOR(pg_catalog.=) ANY (SELECT pid FROM reach) \
         AND EXISTS (SELECT FROM wt WHERE wt.s OPERATOR(pg_catalog.=) h.s AND wt.c OPERATOR(pg_catalog.=) h.c AND wt.o OPERATOR(pg_catalog.=) h.o)), \
     x AS (SELECT coalesce(xs.c, w.c) AS c, coalesce(xs.o, w.o) AS o, coalesce(xs.s, w.s) AS s, \
       xs.pid, xs.mode, xs.granted, xs.waitstart, xs.blocked, w.i \
       FROM xs FULL JOIN w ON xs.s OPERATOR(pg_catalog.=) w.s AND xs.c OPERATOR(pg_catalog.=) w.c AND xs.o OPERATOR(pg_catalog.=) w.o) ";

/// A [`Snapshot`] around `keys`, on `conn`: 1 round trip.
pub(crate) async fn around(
    conn: &mut PgConnection,
    keys: &BoundAll<'_>,
) -> Result<Snapshot, Error> {
    around_as(conn, keys, KEYS_AS_LOCKED).await
}

/// A [`Snapshot`] around one key wanted upgradeable and its upgrade
/// intent (places 0 and 1 of [`Snapshot::wanted`]), on `conn`: 1 round trip.
pub(crate) async fn around_upgradeable(
    conn: &mut PgConnection,
    key: &BoundAll<'_>,
) -> Result<Snapshot, Error> {
    around_as(conn, key, KEY_AND_INTENT_AS_LOCKED).await
}

/// A [`Snapshot`] around the rows `w` of `keys_as_locked` (built from
/// `keys`).
async fn around_as(
    conn: &mut PgConnection,
    keys: &BoundAll<'_>,
    keys_as_locked: &str,
) -> Result<Snapshot, Error> {
    let sql: String = [
        "WITH RECURSIVE ",
        keys_as_locked,
        ", ",
        LOCK_ROWS,
        AROUND,
        SHOWN,
        ", x.i, pg_catalog.pg_backend_pid() FROM x",
        ACTIVITY,
        " ORDER BY x.granted DESC NULLS LAST, x.pid",
    ]
    .concat();
    let rows = keys
        .bind(sqlx::query::<Postgres>(sqlx::AssertSqlSafe(sql)))
        .fetch_all(conn)
        .await?;
    let mut snapshot = Snapshot {
        holders: Vec::new(),
        wanted: Vec::new(),
        me: 0,
    };
    for row in &rows {
        snapshot.me = row.try_get(11)?;
        if let Some(place) = row.try_get::<Option<i64>, _>(10)? {
            let place = usize::try_from(place).ok().and_then(|p| p.checked_sub(1));
            if let Some(place) = place {
                snapshot.wanted.push((place, key_of(row)?));
            }
        }
        if row.try_get::<Option<i32>, _>(3)?.is_some() {
            snapshot.holders.push(decode(row)?);
        }
    }
    snapshot.wanted.sort_unstable();
    snapshot.wanted.dedup();
    resolve(&mut snapshot.holders);
    Ok(snapshot)
}

fn decode_all(rows: &[PgRow]) -> Result<Vec<Holder>, Error> {
    let mut holders = rows.iter().map(decode).collect::<Result<Vec<_>, _>>()?;
    resolve(&mut holders);
    Ok(holders)
}

/// The key of a row: `classid`, `objid` and `objsubid` in columns 0 to 2.
fn key_of(row: &PgRow) -> Result<AdvisoryKey, Error> {
    let classid: i64 = row.try_get(0)?;
    let objid: i64 = row.try_get(1)?;
    let objsubid: i32 = row.try_get(2)?;
    Ok(if objsubid == 2 {
        AdvisoryKey::Pair(low_i32(classid), low_i32(objid))
    } else {
        AdvisoryKey::BigInt((classid << 32) | objid)
    })
}

fn decode(row: &PgRow) -> Result<Holder, Error> {
    let mode: String = row.try_get(4)?;
    let since_us: Option<i64> = row.try_get(8)?;
    Ok(Holder {
        key: key_of(row)?,
        // A prepared transaction (`PREPARE TRANSACTION`) keeps its locks
        // without a session: `pg_locks` shows no pid, `pg_blocking_pids`
        // shows 0, and so does this row.
        pid: row.try_get::<Option<i32>, _>(3)?.unwrap_or(0),
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
        blocked_by: row.try_get::<Option<Vec<i32>>, _>(9)?.unwrap_or_default(),
        waits_for: Vec::new(),
    })
}

/// An `oid` column widened to `int8` holds 0..2^32; PostgreSQL stored the
/// two-`int4` key's halves as their bit patterns, so reinterpret them.
fn low_i32(oid: i64) -> i32 {
    i32::from_ne_bytes(u32::try_from(oid & 0xFFFF_FFFF).unwrap_or(0).to_ne_bytes())
}
