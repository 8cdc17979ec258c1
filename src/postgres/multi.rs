//! Several session locks at once, all or nothing: `PgLocker::try_lock_all`,
//! `PgLocker::lock_all` and the guard they return, [`MultiLock`].
//!
//! All keys are taken on one connection, in one canonical order (the keys
//! as the server resolves them: key space, then value), so two callers whose
//! sets overlap take their common keys in the same order and cannot
//! deadlock. A failed attempt leaves none of the keys held: a try that got
//! only some of them gives them back in the same statement; a wait that
//! fails closes its connection.

use std::collections::HashSet;
use std::fmt;
use std::time::{Duration, Instant};

use sqlx::Row;
use tracing::Instrument;

use super::conn::HeldConn;
use super::keeper::Hold;
use super::key_args::KeyArgs;
use super::locker::PgLocker;
use super::session_lock::SessionLock;
use super::sql::{PgQuery, client_check, keepalives, millis_setting, session_marker};
use super::sqlstate::{LOCK_NOT_AVAILABLE, locking_error, sqlstate};
use crate::{Error, LockKey, LossReason};

/// Session locks on several keys, held together on one dedicated
/// connection until [`release`](Self::release) or drop.
///
/// Released together, and lost together: [`lost`](Self::lost) completes
/// when the connection can no longer vouch for them (all keys are then to
/// be treated as gone). Carries no fencing token.
///
/// # Dropping
///
/// As for [`SessionLock`]: dropping never blocks; a background task unlocks
/// every key, or closes the connection.
#[must_use = "the locks are released as soon as the guard is dropped"]
pub struct MultiLock {
    keys: Vec<LockKey>,
    inner: SessionLock,
}

impl fmt::Debug for MultiLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MultiLock")
            .field("keys", &self.keys)
            .field("backend_pid", &self.inner.backend_pid())
            .field("lost", &self.is_lost())
            .finish()
    }
}

impl MultiLock {
    /// The keys held, in the order they were given.
    pub fn keys(&self) -> &[LockKey] {
        &self.keys
    }

    /// Completes when the locks can no longer be trusted (see
    /// [`SessionLock::lost`]); all of them are lost at once.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only watches a channel.
    pub async fn lost(&self) -> LossReason {
        self.inner.lost().await
    }

    /// `true` once [`lost`](Self::lost) would complete.
    pub fn is_lost(&self) -> bool {
        self.inner.is_lost()
    }

    /// Releases every key in 1 round trip (`pg_advisory_unlock_all()` on the
    /// dedicated connection, which holds nothing else) and returns the
    /// connection to the pool. Errors as for [`SessionLock::release`].
    ///
    /// # Cancel safety
    ///
    /// As for [`SessionLock::release`].
    pub async fn release(self) -> Result<(), Error> {
        self.inner.release().await
    }
}

/// The keys of one attempt, split by how each binds: names (hashed by the
/// server), bigints, and `(int, name)` pairs.
#[derive(Debug, Default)]
struct KeySet<'a> {
    names: Vec<&'a str>,
    ids: Vec<i64>,
    pair_ns: Vec<i32>,
    pair_names: Vec<&'a str>,
}

impl<'a> KeySet<'a> {
    /// Validates `keys`: at least one, each valid, none listed twice.
    /// (Two spellings of one server lock are caught by the statement.)
    fn new(keys: &'a [LockKey]) -> Result<Self, Error> {
        if keys.is_empty() {
            return Err(Error::InvalidKey {
                name: String::new(),
                reason: "no keys to lock",
            });
        }
        let mut seen = HashSet::new();
        let mut set = Self::default();
        for key in keys {
            if !seen.insert(key) {
                return Err(Error::InvalidKey {
                    name: key.to_string().chars().take(64).collect(),
                    reason: "listed twice",
                });
            }
            match key.args()? {
                KeyArgs::Text(name) => set.names.push(name),
                KeyArgs::BigInt(id) => set.ids.push(id),
                KeyArgs::Pair(ns, name) => {
                    set.pair_ns.push(ns);
                    set.pair_names.push(name);
                }
            }
        }
        Ok(set)
    }

    fn bind(self, query: PgQuery<'a>) -> PgQuery<'a> {
        query
            .bind(self.names)
            .bind(self.ids)
            .bind(self.pair_ns)
            .bind(self.pair_names)
    }
}

/// The keys as the server resolves them, in canonical order, with the
/// number of distinct server locks (a key given twice under two spellings
/// is one lock: refused). Binds `$1` names, `$2` bigints, `$3`/`$4` pairs.
macro_rules! resolved_keys {
    () => {
        "k AS (SELECT DISTINCT space, a, b FROM ( \
           SELECT 1 AS space, hashtext(n)::int8 AS a, 0::int8 AS b FROM unnest($1::text[]) n \
           UNION ALL SELECT 1, i, 0 FROM unnest($2::int8[]) i \
           UNION ALL SELECT 2, p.ns::int8, hashtext(p.n)::int8 \
             FROM unnest($3::int4[], $4::text[]) AS p(ns, n)) all_keys), \
         o AS (SELECT space, a, b FROM k ORDER BY space, a, b OFFSET 0)"
    };
}

/// The try: every key attempted in canonical order on a session that holds
/// no distlock lock; if any was busy, the ones taken are given back in the
/// same statement. Columns: all taken (NULL: refused, the session is
/// shared), pid, distinct server locks.
const TRY_ALL: &str = concat!(
    "WITH ",
    resolved_keys!(),
    ", m AS (SELECT ",
    session_marker!(unmarked),
    " THEN true END AS free, ",
    client_check!(session),
    ", ",
    keepalives!(session),
    "), t AS (SELECT o.space, o.a, o.b, CASE WHEN m.free THEN \
       CASE WHEN o.space = 1 THEN pg_try_advisory_lock(o.a) \
       ELSE pg_try_advisory_lock(o.a::int4, o.b::int4) END END AS ok FROM o, m), \
     v AS (SELECT bool_and(ok) AS all_ok FROM t), \
     undo AS (SELECT count(CASE WHEN t.space = 1 THEN pg_advisory_unlock(t.a) \
       ELSE pg_advisory_unlock(t.a::int4, t.b::int4) END) AS n FROM t, v \
       WHERE t.ok AND NOT v.all_ok) \
     SELECT v.all_ok, pg_backend_pid(), (SELECT count(*) FROM k), (SELECT n FROM undo), \
       CASE WHEN v.all_ok THEN set_config('distlock.locks', '1', false) END FROM v"
);

/// The wait: every key taken in canonical order, each under the
/// statement-local `lock_timeout` `$5` (set in the first step of every row,
/// before its lock, by the order of a `CASE`).
const WAIT_ALL: &str = concat!(
    "WITH ",
    resolved_keys!(),
    ", t AS (SELECT CASE WHEN set_config('lock_timeout', $5, true) IS NULL THEN NULL \
       WHEN o.space = 1 THEN (SELECT true FROM pg_advisory_lock(o.a)) \
       ELSE (SELECT true FROM pg_advisory_lock(o.a::int4, o.b::int4)) END AS ok FROM o) \
     SELECT count(*) FILTER (WHERE ok), pg_backend_pid(), \
       set_config('distlock.locks', '1', false) FROM t"
);

impl PgLocker {
    /// Takes the session locks on all `keys` if every one is free, without
    /// waiting; `Ok(None)` if any is held elsewhere, in which case none is
    /// left held.
    ///
    /// All keys are taken on one connection from the pool, in a canonical
    /// order (so overlapping sets taken by different callers never
    /// deadlock), in 1 round trip: the statement gives back the keys it took
    /// if another one was busy. No keys, a key listed twice (also under two
    /// spellings of one server lock, such as `"x"` and
    /// `LockKey::id(hashtext('x'))`) or an invalid key is an
    /// [`Error::InvalidKey`]. No fencing token. In multiplexed mode it takes
    /// a connection of its own as well.
    ///
    /// ```no_run
    /// # async fn demo(locker: distlock::PgLocker) -> Result<(), distlock::Error> {
    /// if let Some(both) = locker.try_lock_all(["account:7", "account:9"]).await? {
    ///     // ... move money between the two accounts ...
    ///     both.release().await?;
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// As for [`try_lock`](Self::try_lock): dropped before it returns, the
    /// connection is closed, which frees whatever it took.
    pub async fn try_lock_all<K>(
        &self,
        keys: impl IntoIterator<Item = K>,
    ) -> Result<Option<MultiLock>, Error>
    where
        K: Into<LockKey>,
    {
        let keys: Vec<LockKey> = keys.into_iter().map(Into::into).collect();
        let span = multi_span(&keys, "try_all");
        async {
            let mut conn = HeldConn::new(self.pool().acquire().await?, true);
            let started = Instant::now();
            let taken = self.try_all(&mut conn, &keys).await?;
            let Some(pid) = taken else {
                tracing::Span::current().record("outcome", "busy");
                conn.into_pool();
                return Ok(None);
            };
            tracing::Span::current().record("outcome", "acquired");
            tracing::Span::current().record("wait_ms", started.elapsed().as_secs_f64() * 1e3);
            Ok(Some(self.multi_lock(conn, keys, pid)))
        }
        .instrument(span)
        .await
    }

    /// Takes the session locks on all `keys`, waiting up to `timeout`;
    /// fails with [`Error::Timeout`] when the deadline passes, with none of
    /// the keys held.
    ///
    /// It first tries all of them (1 round trip, as
    /// [`try_lock_all`](Self::try_lock_all)); if any is busy, it waits on the
    /// server, taking the keys one after another in the canonical order and
    /// holding the ones it has while it waits for the next (so overlapping
    /// sets never deadlock), each wait under `lock_timeout`; the caller gives
    /// up at `timeout` (plus the heartbeat deadline on a stalled network). A
    /// wait that fails closes its connection, which frees what it had taken.
    ///
    /// # Cancel safety
    ///
    /// As for [`lock`](Self::lock).
    pub async fn lock_all<K>(
        &self,
        keys: impl IntoIterator<Item = K>,
        timeout: Duration,
    ) -> Result<MultiLock, Error>
    where
        K: Into<LockKey>,
    {
        let keys: Vec<LockKey> = keys.into_iter().map(Into::into).collect();
        let span = multi_span(&keys, "wait_all");
        self.lock_all_inner(keys, timeout).instrument(span).await
    }

    async fn lock_all_inner(
        &self,
        keys: Vec<LockKey>,
        timeout: Duration,
    ) -> Result<MultiLock, Error> {
        KeySet::new(&keys)?;
        let started = Instant::now();
        let deadline = crate::deadline::after_std(started, timeout);
        let label = keys[0].clone();
        let pooled = tokio::time::timeout_at(deadline, self.pool().acquire()).await;
        let Ok(pooled) = pooled else {
            return Err(self.timeout_error(&label, started, None).await);
        };
        let mut conn = HeldConn::new(pooled?, true);
        if let Some(pid) = self.try_all(&mut conn, &keys).await? {
            return Ok(self.multi_lock(conn, keys, pid));
        }
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        if remaining.is_zero() {
            return Err(self.timeout_error(&label, started, Some(conn)).await);
        }
        let grace = crate::deadline::after(deadline, self.config().heartbeat_timeout);
        let wait = wait_all(&mut conn, &keys, remaining);
        match tokio::time::timeout_at(grace, wait).await {
            Ok(Ok(pid)) => Ok(self.multi_lock(conn, keys, pid)),
            // Some keys may be held: the connection is closed, not pooled.
            Ok(Err(err)) if sqlstate(&err).as_deref() == Some(LOCK_NOT_AVAILABLE) => {
                drop(conn);
                Err(self.timeout_error(&label, started, None).await)
            }
            Ok(Err(err)) => Err(locking_error(err, &label)),
            Err(_) => {
                drop(conn);
                Err(self.timeout_error(&label, started, None).await)
            }
        }
    }

    /// One all-or-nothing try; `Some(pid)` when every key was taken.
    async fn try_all(&self, conn: &mut HeldConn, keys: &[LockKey]) -> Result<Option<i32>, Error> {
        let set = KeySet::new(keys)?;
        self.inner.pooler.ensure_session(conn.conn()).await?;
        let label = &keys[0];
        let row = set
            .bind(sqlx::query(TRY_ALL))
            .fetch_one(conn.conn())
            .await
            .map_err(|err| locking_error(err, label))?;
        let pid: i32 = row.try_get(1)?;
        distinct(&row, keys.len())?;
        match row.try_get::<Option<bool>, _>(0)? {
            Some(true) => Ok(Some(pid)),
            Some(false) => Ok(None),
            None => Err(Error::PoolerDetected {
                expected_pid: pid,
                actual_pid: pid,
            }),
        }
    }

    fn multi_lock(&self, conn: HeldConn, keys: Vec<LockKey>, pid: i32) -> MultiLock {
        let label = keys[0].clone();
        let inner = SessionLock::start(
            conn,
            (label, Hold::All),
            pid,
            None,
            (self.config(), &self.inner.keepers),
        );
        MultiLock { keys, inner }
    }
}

/// Refuses two spellings of one server lock (they would be granted twice to
/// this session, re-entrantly, and count as one).
fn distinct(row: &sqlx::postgres::PgRow, given: usize) -> Result<(), Error> {
    let resolved: i64 = row.try_get(2)?;
    if usize::try_from(resolved).ok() != Some(given) {
        return Err(Error::InvalidKey {
            name: String::new(),
            reason: "two of the keys name the same server lock",
        });
    }
    Ok(())
}

/// Waits for every key in canonical order; returns the backend pid.
async fn wait_all(
    conn: &mut HeldConn,
    keys: &[LockKey],
    timeout: Duration,
) -> Result<i32, sqlx::Error> {
    let set = match KeySet::new(keys) {
        Ok(set) => set,
        Err(err) => return Err(sqlx::Error::Protocol(err.to_string())),
    };
    let row = set
        .bind(sqlx::query(WAIT_ALL))
        .bind(millis_setting(timeout))
        .fetch_one(conn.conn())
        .await?;
    row.try_get(1)
}

fn multi_span(keys: &[LockKey], mode: &'static str) -> tracing::Span {
    let names: Vec<String> = keys.iter().map(ToString::to_string).collect();
    tracing::debug_span!(
        "distlock.acquire_all",
        keys = ?names,
        mode,
        outcome = tracing::field::Empty,
        wait_ms = tracing::field::Empty,
    )
}
