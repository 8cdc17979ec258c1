//! A semaphore's permits on PostgreSQL: one statement tries every slot, and
//! one connection per process waits for a slot behind a queue lock, so that
//! waiters of every process are served in the order they queued on the
//! server.
//!
//! The slots are the same advisory locks the generic semaphore takes
//! (`LockKey::namespaced(SLOT_NAMESPACE, "{name}#{i}")`), so both kinds of
//! users of one semaphore see each other's permits. The queue is one more
//! lock in that namespace, `"{name}#queue"`: a slot's name ends in digits,
//! so no slot of any semaphore is a queue.

use std::sync::Arc;
use std::time::Instant;

use sqlx::Row;
use sqlx::postgres::PgRow;

use crate::postgres::conn::held::HeldConn;
use crate::postgres::conn::watched::WatchedConn;
use crate::postgres::locker::PgLocker;
use crate::postgres::request::fragments::{
    PgQuery, client_check, keepalives, millis_setting, session_marker,
};
use crate::postgres::session::guard::SessionLock;
use crate::postgres::session::hold::Hold;
use crate::postgres::sqlstate::{LOCK_NOT_AVAILABLE, locking_error, sqlstate};
use crate::{Error, FencingToken, LockKey, Semaphore};

/// How long after its deadline a waiter still waits for the server's
/// answer before it closes the connection and times out.
const ANSWER_GRACE: std::time::Duration = std::time::Duration::from_millis(50);

/// The PostgreSQL side of a [`Semaphore`] built by [`PgLocker::semaphore`].
#[derive(Debug, Clone)]
pub(crate) struct PgSlots {
    locker: PgLocker,
    /// `"{name}#{i}"` for every slot `i`, bound as one `text[]`.
    slots: Arc<[String]>,
    /// `"{name}#queue"`.
    queue: String,
}

/// What one semaphore statement found.
enum Outcome {
    /// Slot `.0` is held by the statement's connection.
    Granted(u32, i32, Option<FencingToken>),
    /// Every slot was held (or, for a try, a waiter queued first).
    Busy,
}

impl PgLocker {
    /// A [`Semaphore`] of `permits` permits named `name` on this locker's
    /// PostgreSQL database, with the PostgreSQL costs: a try is one
    /// statement whatever the number of permits, and the waiters of one
    /// `Semaphore` (and its clones) hold one pooled connection between them
    /// while they wait, served in the order they queued on the server across
    /// processes. See [`Semaphore`] for the layout and the costs. In the
    /// multiplexed mode too, each held permit keeps a pooled connection of
    /// its own (a [`SessionLock`] of the default mode).
    ///
    /// Refused with [`Error::InvalidConfig`] for zero permits and with
    /// [`Error::InvalidKey`] for a name that is not a valid key. Makes no
    /// round trip.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), distlock::Error> {
    /// use std::time::Duration;
    /// let locker = distlock::PgLocker::new(pool);
    /// let exports = locker.semaphore("exports", 3)?;
    /// let permit = exports.acquire(Duration::from_secs(30)).await?;
    /// // ... at most three exports run at once, cluster-wide ...
    /// permit.release().await?;
    /// # Ok(()) }
    /// ```
    pub fn semaphore(&self, name: &str, permits: u32) -> Result<Semaphore, Error> {
        let slots: Arc<[String]> = (0..permits).map(|i| format!("{name}#{i}")).collect();
        let postgres = PgSlots {
            locker: self.clone(),
            slots,
            queue: format!("{name}#queue"),
        };
        Semaphore::on_postgres(postgres, name, permits)
    }
}

impl PgSlots {
    fn key(&self, slot: &str) -> LockKey {
        LockKey::namespaced(Semaphore::SLOT_NAMESPACE, slot)
    }

    fn queue_key(&self) -> LockKey {
        self.key(&self.queue)
    }

    fn fencing(&self) -> bool {
        self.locker.config().fencing
    }

    /// A free slot without waiting, unless a waiter is queued on the server
    /// (it is served first: a freed permit goes to the queue's head). One statement on a pooled connection.
    pub(crate) async fn try_acquire(&self) -> Result<Option<(u32, SessionLock)>, Error> {
        let mut conn = HeldConn::watched(WatchedConn::acquire(self.locker.pool()).await?, true);
        match self.try_on(&mut conn).await? {
            Outcome::Granted(slot, pid, token) => Ok(Some(self.start(conn, slot, pid, token)?)),
            Outcome::Busy => {
                conn.into_pool();
                Ok(None)
            }
        }
    }

    /// Runs the try statement on `conn`. It also asks the server to check
    /// for a vanished client during later statements, which the wait needs.
    async fn try_on(&self, conn: &mut HeldConn) -> Result<Outcome, Error> {
        self.locker.inner.pooler.ensure_session(conn.conn()).await?;
        let sql = if self.fencing() { TRY_FENCED } else { TRY };
        let row = self
            .bind(sqlx::query(sql))
            .fetch_one(conn.conn())
            .await
            .map_err(|err| locking_error(err, &self.queue_key()))?;
        self.outcome(&row)
    }

    /// A slot, waiting until `deadline` on `conn` (which has run the try
    /// statement). `Ok(None)` when the deadline passed with every slot held.
    async fn wait_on(
        &self,
        conn: &mut HeldConn,
        deadline: tokio::time::Instant,
    ) -> Result<Option<(u32, i32, Option<FencingToken>)>, Error> {
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        if remaining.is_zero() {
            return Ok(None);
        }
        let sql = if self.fencing() { WAIT_FENCED } else { WAIT };
        // As `lock_timeout` can express: about 24.8 days.
        let millis = i64::try_from(remaining.as_millis())
            .map_or(i64::from(i32::MAX), |ms| ms.min(i64::from(i32::MAX)));
        let row = self
            .bind(sqlx::query(sql))
            .bind(millis_setting(remaining))
            .bind(millis)
            .fetch_one(conn.conn())
            .await
            .map_err(|err| locking_error(err, &self.queue_key()))?;
        match self.outcome(&row)? {
            Outcome::Granted(slot, pid, token) => Ok(Some((slot, pid, token))),
            Outcome::Busy => Ok(None),
        }
    }

    /// Takes a slot, waiting until `deadline`: the caller is the head of
    /// this process's waiters. One statement when a slot is free, two when
    /// it waits; pool errors are retried until the deadline.
    pub(crate) async fn acquire(
        &self,
        name: &str,
        started: Instant,
        deadline: tokio::time::Instant,
    ) -> Result<(u32, SessionLock), Error> {
        let mut conn = self.connection(started, deadline).await?;
        if let Outcome::Granted(slot, pid, token) = self.try_on(&mut conn).await? {
            return self.start(conn, slot, pid, token);
        }
        // The server gives up at the deadline (lock_timeout, then the
        // poll's clock). An answer that has not arrived shortly after it
        // (a slow or stalled network) is not waited for, so that the call
        // keeps its deadline: dropping the connection closes it, and the
        // server frees whatever the statement took.
        let grace = crate::deadline::after(deadline, ANSWER_GRACE);
        match tokio::time::timeout_at(grace, self.wait_on(&mut conn, deadline)).await {
            Ok(Ok(Some((slot, pid, token)))) => self.start(conn, slot, pid, token),
            Ok(Ok(None)) => {
                // The statement let go of the queue and took no slot.
                conn.into_pool();
                Err(timeout(name, started))
            }
            // The queue lock may have been granted as lock_timeout fired:
            // dropping `conn` closes it, which frees whatever it holds.
            Ok(Err(Error::Database(err)))
                if sqlstate(&err).as_deref() == Some(LOCK_NOT_AVAILABLE) =>
            {
                Err(timeout(name, started))
            }
            Ok(Err(err)) => Err(err),
            Err(_) => Err(timeout(name, started)),
        }
    }

    /// A pooled connection before `deadline`. A pool that times out is
    /// asked again: a waiter gives up at its own deadline, not the pool's.
    async fn connection(
        &self,
        started: Instant,
        deadline: tokio::time::Instant,
    ) -> Result<HeldConn, Error> {
        let pool = self.locker.pool();
        loop {
            match tokio::time::timeout_at(deadline, WatchedConn::acquire(pool)).await {
                Ok(Ok(conn)) => return Ok(HeldConn::watched(conn, true)),
                Ok(Err(sqlx::Error::PoolTimedOut)) => {}
                Ok(Err(err)) => return Err(err.into()),
                Err(_) => {
                    return Err(crate::postgres::conn::pooled::no_connection(
                        pool,
                        &self.queue_key(),
                        started,
                    ));
                }
            }
        }
    }

    /// How many slots no session holds, read from `pg_locks`: one
    /// statement on a pooled connection.
    pub(crate) async fn available(&self) -> Result<u32, Error> {
        let held: i64 = sqlx::query_scalar(AVAILABLE)
            .bind(Semaphore::SLOT_NAMESPACE)
            .bind(&*self.slots)
            .fetch_one(self.locker.pool())
            .await?;
        let total = u32::try_from(self.slots.len()).unwrap_or(u32::MAX);
        Ok(total.saturating_sub(u32::try_from(held).unwrap_or(u32::MAX)))
    }

    fn bind<'q>(&'q self, query: PgQuery<'q>) -> PgQuery<'q> {
        query
            .bind(Semaphore::SLOT_NAMESPACE)
            .bind(self.queue.as_str())
            .bind(&*self.slots)
    }

    /// Reads a row of [`TRY`] or [`WAIT`].
    fn outcome(&self, row: &PgRow) -> Result<Outcome, Error> {
        let pid: i32 = row.try_get(1)?;
        let Some(queued) = row.try_get::<Option<bool>, _>(0)? else {
            // The session marker says another client shares this server
            // session (a transaction-pooling proxy): nothing was taken.
            return Err(crate::postgres::pooler::marker_seen(pid));
        };
        let slot: Option<i64> = row.try_get(2)?;
        let (true, Some(slot)) = (queued, slot) else {
            return Ok(Outcome::Busy);
        };
        let slot = u32::try_from(slot).map_err(|_| Error::NotGranted {
            key: self.queue_key(),
        })?;
        let token = if self.fencing() {
            match row.try_get::<Option<i64>, _>(5)? {
                Some(token) => Some(FencingToken::new(token)),
                None => {
                    return Err(Error::MissingFencingToken {
                        key: self.queue_key(),
                    });
                }
            }
        } else {
            None
        };
        Ok(Outcome::Granted(slot, pid, token))
    }

    /// Hands the connection holding `slot` to a guard of its own.
    fn start(
        &self,
        conn: HeldConn,
        slot: u32,
        pid: i32,
        token: Option<FencingToken>,
    ) -> Result<(u32, SessionLock), Error> {
        let name = usize::try_from(slot)
            .ok()
            .and_then(|i| self.slots.get(i))
            .ok_or_else(|| Error::NotGranted {
                key: self.queue_key(),
            })?;
        let lock = SessionLock::start(
            conn,
            (self.key(name), Hold::Exclusive),
            pid,
            token,
            (self.locker.config(), &self.locker.inner.keepers),
        );
        Ok((slot, lock))
    }
}

/// [`Error::Timeout`] for the semaphore `name`.
pub(crate) fn timeout(name: &str, started: Instant) -> Error {
    Error::Timeout {
        key: LockKey::from(name),
        waited: started.elapsed(),
        holder_pid: None,
        holder_application: None,
        chain: Default::default(),
    }
}

/// The slot try shared by both statements: the first slot of `$3` (in
/// order) that `pg_try_advisory_lock` grants, as a 0-based index. `$row`
/// is a column of the calling row, so that the try runs again for every
/// row (a subquery that references nothing outside would run once).
macro_rules! first_free_slot {
    ($row:literal) => {
        concat!(
            "(SELECT k.i - 1 FROM pg_catalog.unnest($3::pg_catalog.text[]) WITH ORDINALITY k(name, i) \
             WHERE ", $row, " IS NOT NULL \
             AND pg_catalog.pg_try_advisory_lock($1::pg_catalog.int4, pg_catalog.hashtext(k.name)) LIMIT 1)"
        )
    };
}

/// The try statement (`$1` the namespace, `$2` the queue's name, `$3` the
/// slots' names). It takes the queue lock *shared* without waiting first:
/// tries never exclude each other, but PostgreSQL refuses a shared request
/// while a waiter holds the queue or is queued for it, so a try takes no
/// slot ahead of a waiter. Then it tries the slots in order and lets go of
/// the queue. Columns: queue taken (NULL: the session marker refused),
/// pid, slot (NULL: none), queue unlocked, marker, token. It also sets the
/// client check and the keepalives, as every lock statement does.
macro_rules! try_statement {
    ($token:literal) => {
        concat!(
            "WITH q AS MATERIALIZED (SELECT ", session_marker!(unmarked),
            " THEN pg_catalog.pg_try_advisory_lock_shared($1::pg_catalog.int4, pg_catalog.hashtext($2)) END AS ok, \
             pg_catalog.pg_backend_pid() AS pid, ", client_check!(session), ", ", keepalives!(session), "), \
             t AS MATERIALIZED (SELECT q.ok, q.pid, CASE WHEN q.ok THEN ", first_free_slot!("q.ok"),
            " END AS slot FROM q) \
             SELECT t.ok, t.pid, t.slot, \
             CASE WHEN t.ok THEN pg_catalog.pg_advisory_unlock_shared($1::pg_catalog.int4, pg_catalog.hashtext($2)) END, \
             CASE WHEN t.slot IS NOT NULL THEN pg_catalog.set_config('distlock.locks', '1', false) END, ",
            $token, " FROM t"
        )
    };
}

/// The wait statement (`$1`–`$3` as the try's, `$4` the `lock_timeout`,
/// `$5` the milliseconds left): waits on the server for the queue lock, so
/// that the heads of every process's waiters line up in PostgreSQL's lock
/// queue, first come first served; then, at the head, tries every slot
/// every millisecond (`pg_sleep(0.001)`, about 2 ms an iteration with the
/// server's timer slack: a freed permit waits that long at most, and the
/// head costs the server about 500 tries of `permits` advisory locks a
/// second, no round trip, no write) until one is granted or the time is
/// up; lets go of the queue in the same statement. The sleep's argument
/// names the row so that it runs again on every row. Columns as the try's.
macro_rules! wait_statement {
    ($token:literal) => {
        concat!(
            "WITH RECURSIVE w(n, ok, slot) AS (\
             SELECT 0, q.ok, CASE WHEN q.ok THEN ", first_free_slot!("q.ok"), " END \
             FROM (SELECT CASE WHEN pg_catalog.set_config('lock_timeout', $4, true) IS NULL THEN NULL \
             WHEN NOT ", session_marker!(free), " THEN NULL \
             ELSE (SELECT true FROM pg_catalog.pg_advisory_lock($1::pg_catalog.int4, pg_catalog.hashtext($2))) \
             END AS ok OFFSET 0) q \
             UNION ALL \
             SELECT w.n + 1, w.ok, ", first_free_slot!("w.n"), " FROM w \
             WHERE w.ok AND w.slot IS NULL \
             AND pg_catalog.clock_timestamp() < pg_catalog.statement_timestamp() + $5::pg_catalog.int8 * interval '1 millisecond' \
             AND (SELECT true FROM pg_catalog.pg_sleep(0.001 + w.n * 0))), \
             t AS MATERIALIZED (SELECT pg_catalog.bool_or(w.ok) AS ok, pg_catalog.max(w.slot) AS slot, \
             pg_catalog.pg_backend_pid() AS pid FROM w) \
             SELECT t.ok, t.pid, t.slot, \
             CASE WHEN t.ok THEN pg_catalog.pg_advisory_unlock($1::pg_catalog.int4, pg_catalog.hashtext($2)) END, \
             CASE WHEN t.slot IS NOT NULL THEN pg_catalog.set_config('distlock.locks', '1', false) END, ",
            $token, " FROM t"
        )
    };
}

const TRY: &str = try_statement!("NULL::pg_catalog.int8");
const TRY_FENCED: &str =
    try_statement!("CASE WHEN t.slot IS NOT NULL THEN distlock.next_token() END");
const WAIT: &str = wait_statement!("NULL::pg_catalog.int8");
const WAIT_FENCED: &str =
    wait_statement!("CASE WHEN t.slot IS NOT NULL THEN distlock.next_token() END");

/// How many of the slots `$2` (in namespace `$1`) some session of this
/// database holds. A two-`int4` advisory lock shows in `pg_locks` as
/// `classid` and `objid` (the unsigned views of the two keys) with
/// `objsubid = 2`.
const AVAILABLE: &str = "SELECT pg_catalog.count(DISTINCT l.objid) FROM pg_catalog.pg_locks l \
     WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 \
     AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database()) \
     AND l.classid = ($1::pg_catalog.int8 & 4294967295)::pg_catalog.oid \
     AND l.objid IN (SELECT (pg_catalog.hashtext(s)::pg_catalog.int8 & 4294967295)::pg_catalog.oid \
     FROM pg_catalog.unnest($2::pg_catalog.text[]) s)";

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn only_the_wait_sleeps() {
        assert!(WAIT.contains("pg_sleep(0.001 + w.n * 0)"));
        assert!(!TRY.contains("pg_sleep"));
    }

    #[test]
    fn the_timeout_names_the_semaphore() {
        let err = timeout("exports", Instant::now() - Duration::from_millis(5));
        assert!(matches!(err, Error::Timeout { key, .. } if key == LockKey::from("exports")));
    }
}
