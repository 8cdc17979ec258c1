//! A semaphore's permits on PostgreSQL: one statement tries every slot, one
//! connection per process waits behind the other processes on the server,
//! and a freed permit is announced to it (`NOTIFY`), so that a waiter is
//! served without a poll.
//!
//! The slots are the same advisory locks the generic semaphore takes
//! (`LockKey::namespaced(namespace, "{name}#{i}")`), so both kinds of users
//! of one semaphore see each other's permits. The queue is one more lock in
//! that namespace, `"{name}#queue"`: a slot's name ends in digits, so no slot
//! of any semaphore is a queue.
//!
//! # How a process waits
//!
//! The waiters of a process line up in a `tokio` semaphore (first come,
//! first served); its first two, the heads, talk to the server, each on
//! one pooled connection. A head's first try is the plain one: it takes the
//! queue shared, so it takes nothing while another head waits. When every
//! permit is held, the head `LISTEN`s on the permit channel and takes the
//! queue lock exclusively, waiting in PostgreSQL's lock queue behind the
//! other heads (of every process), and tries the slots in the same
//! statement. While
//! it holds the queue, no plain try of any process takes a slot; the head
//! tries the slots again each time a permit's unlock announces a freed slot
//! of this semaphore, or every [`FALLBACK`] (for a holder that vanished
//! without unlocking). The statement that takes a slot lets go of the queue,
//! so the next head in PostgreSQL's queue takes its turn, and the head's connection
//! becomes the permit's. A process's waiters hold two connections between
//! them, however many they are (see [`HEADS`]).

use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use sqlx::Row;
use sqlx::postgres::PgRow;
use tokio::sync::Semaphore as Line;

use crate::postgres::conn::held::HeldConn;
use crate::postgres::conn::watched::WatchedConn;
use crate::postgres::locker::PgLocker;
use crate::postgres::request::fragments::{
    PgQuery, client_check, keepalives, millis_setting, permit_channel, session_marker,
};
use crate::postgres::session::guard::SessionLock;
use crate::postgres::session::hold::Hold;
use crate::postgres::sqlstate::{LOCK_NOT_AVAILABLE, locking_error, sqlstate};
use crate::{Error, FencingToken, LockKey};

/// How long after its deadline a waiter still waits for the server's
/// answer before it closes the connection and times out.
const ANSWER_GRACE: Duration = Duration::from_millis(50);

/// How often the head tries the slots without having been told of a freed
/// one: a holder whose session ended without an unlock (a crash, a
/// partition, `pg_terminate_backend`) frees its slot silently, and so does
/// a slot taken through a plain lock (`Semaphore::new` over a `PgLocker`).
const FALLBACK: Duration = Duration::from_millis(200);

/// How many of a process's waiters talk to the server at once. The second
/// waits in PostgreSQL's lock queue right behind the first, so that when
/// the first takes a slot (and lets go of the queue) the second is at the
/// front at once, instead of a connection, a try, a `LISTEN` and a line-up
/// later: hand-offs then follow each other as fast as permits are freed.
const HEADS: usize = 2;

/// The PostgreSQL side of a semaphore built by `PgLocker::semaphore`.
#[derive(Debug, Clone)]
pub(crate) struct PgSlots {
    locker: PgLocker,
    namespace: i32,
    /// `"{name}#{i}"` for every slot `i`, bound as one `text[]`.
    slots: Arc<[String]>,
    /// `"{name}#queue"`.
    queue: String,
    /// The process's line, first come first served: its [`HEADS`] first
    /// waiters are heads.
    line: Arc<Line>,
    /// Passed from head to head in the order of the line: a head holds it
    /// until its line-up is on its way to the server, so that a head that
    /// waits longer for its connection (one the pool must open) is not
    /// overtaken on the server by the next.
    baton: Arc<tokio::sync::Mutex<()>>,
}

/// What one semaphore statement found.
enum Outcome {
    /// Slot `.0` is held by the statement's connection.
    Granted(u32, i32, Option<FencingToken>),
    /// Every slot was held (or, for a plain try, a waiter holds the
    /// queue).
    Busy(Waiting),
}

/// A head's connection while it holds the queue: its backend, and the
/// session's `idle_session_timeout` from before the guard (see [`GUARD`]),
/// given back when the connection becomes a permit's.
#[derive(Debug, Clone)]
struct Waiting {
    pid: i32,
    idle_timeout: String,
}

/// The `idle_session_timeout` of a head's connection while it holds the
/// queue. A live head runs a statement at least every [`FALLBACK`]; a head
/// whose process is paused (SIGSTOP, a debugger, a stalled VM) or cut off
/// runs none, and without the guard it would keep every other head, and
/// every try, away from the freed permits for as long as its session lasts.
/// With it, the server ends that session after 2 s idle, which frees the
/// queue. A head whose session was ended so lines up again.
const GUARD: &str = "2s";

/// The statements that try the slots.
#[derive(Clone, Copy)]
enum Try<'a> {
    /// [`TRY`]: takes nothing while a process waits.
    Plain,
    /// [`LINE_UP`]: waits for the queue until the deadline, then tries.
    LineUp(tokio::time::Instant),
    /// [`HEAD_TRY`]: the connection holds the queue.
    Head(&'a Waiting),
}

impl PgSlots {
    /// The slots `"{name}#0"` … of `name` in `namespace`. Makes no round
    /// trip.
    pub(crate) fn new(locker: PgLocker, namespace: i32, name: &str, permits: u32) -> Self {
        Self {
            locker,
            namespace,
            slots: (0..permits).map(|i| format!("{name}#{i}")).collect(),
            queue: format!("{name}#queue"),
            line: Arc::new(Line::new(HEADS)),
            baton: Arc::new(tokio::sync::Mutex::new(())),
        }
    }

    fn key(&self, slot: &str) -> LockKey {
        LockKey::namespaced(self.namespace, slot)
    }

    fn queue_key(&self) -> LockKey {
        self.key(&self.queue)
    }

    fn fencing(&self) -> bool {
        self.locker.config().fencing
    }

    /// A free slot without waiting, unless a waiting process holds the
    /// queue (a freed permit is theirs). One statement on a pooled
    /// connection; the pool's own timeout is [`Error::PoolExhausted`] when
    /// every connection is in use.
    pub(crate) async fn try_acquire(&self) -> Result<Option<(u32, SessionLock)>, Error> {
        let pool = self.locker.pool();
        let acquired = WatchedConn::acquire(pool).await;
        let conn = acquired.map_err(|err| {
            crate::postgres::conn::pooled::pool_error(pool, &self.queue_key(), err)
        })?;
        let mut conn = HeldConn::watched(conn, true);
        match self.try_on(&mut conn, Try::Plain).await? {
            Some(Outcome::Granted(slot, pid, token)) => {
                Ok(Some(self.start(conn, slot, pid, token)?))
            }
            // A plain try always answers.
            Some(Outcome::Busy(_)) | None => {
                conn.into_pool();
                Ok(None)
            }
        }
    }

    /// Runs a try statement on `conn`; `Ok(None)` when the deadline of a
    /// [`Try::LineUp`] passed (with the queue held or not: the caller
    /// closes the connection). Every other kind answers at once.
    async fn try_on(&self, conn: &mut HeldConn, kind: Try<'_>) -> Result<Option<Outcome>, Error> {
        self.locker.inner.pooler.ensure_session(conn.conn()).await?;
        let fenced = self.fencing();
        let query = self.bind(sqlx::query(match (kind, fenced) {
            (Try::Plain, false) => TRY,
            (Try::Plain, true) => TRY_FENCED,
            (Try::LineUp(_), false) => LINE_UP,
            (Try::LineUp(_), true) => LINE_UP_FENCED,
            (Try::Head(_), false) => HEAD_TRY,
            (Try::Head(_), true) => HEAD_TRY_FENCED,
        }));
        let Try::LineUp(deadline) = kind else {
            let query = match kind {
                Try::Head(waiting) => query.bind(waiting.pid).bind(waiting.idle_timeout.as_str()),
                _ => query,
            };
            let row = query.fetch_one(conn.conn()).await;
            let row = row.map_err(|err| locking_error(err, &self.queue_key()))?;
            return self.outcome(&row).map(Some);
        };
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        if remaining.is_zero() {
            return Ok(None);
        }
        let statement = query
            .bind(millis_setting(remaining))
            .bind(GUARD)
            .fetch_one(conn.conn());
        // The server gives up at the deadline (lock_timeout). An answer
        // that has not arrived shortly after it (a slow or stalled network)
        // is not waited for, so that the call keeps its deadline.
        let grace = crate::deadline::after(deadline, ANSWER_GRACE);
        let queue = self.queue_key();
        match crate::span::waiting(&queue, tokio::time::timeout_at(grace, statement)).await {
            Err(_) => Ok(None),
            Ok(Err(err)) if sqlstate(&err).as_deref() == Some(LOCK_NOT_AVAILABLE) => Ok(None),
            Ok(row) => {
                let row = row.map_err(|err| locking_error(err, &self.queue_key()))?;
                self.outcome(&row).map(Some)
            }
        }
    }

    /// Takes a slot, waiting until `deadline` behind this process's earlier
    /// waiters and, on the server, behind the other processes' (see the
    /// file's documentation): 1 round trip when a permit is free and no one
    /// waits, 3 when it waits (the try, `LISTEN`, the line-up), and 1 more
    /// per announced freed slot. Pool errors are retried until the
    /// deadline.
    pub(crate) async fn acquire(
        &self,
        name: &str,
        started: Instant,
        deadline: tokio::time::Instant,
    ) -> Result<(u32, SessionLock), Error> {
        let Ok(Ok(_head)) = tokio::time::timeout_at(deadline, self.line.acquire()).await else {
            return Err(timeout(name, started));
        };
        // Every step keeps the deadline (the first use's pooler probe and
        // the tries too): an answer later than shortly after it is not
        // waited for. Dropped, the head's connection is closed, which frees
        // whatever its statement took.
        let grace = crate::deadline::after(deadline, ANSWER_GRACE);
        match tokio::time::timeout_at(grace, self.head(name, started, deadline)).await {
            Ok(result) => result,
            Err(_) => Err(timeout(name, started)),
        }
    }

    /// The head's part of [`acquire`](Self::acquire).
    async fn head(
        &self,
        name: &str,
        started: Instant,
        deadline: tokio::time::Instant,
    ) -> Result<(u32, SessionLock), Error> {
        // The other head, if there is one, came first: a plain try could
        // take a slot freed while it lines up, ahead of it. This one then
        // lines up at once, behind it on the server.
        let alone = self.line.available_permits() + 1 >= HEADS;
        let baton = self.baton.lock().await;
        let mut conn = self.connection(started, deadline).await?;
        if alone {
            // A plain try never answers `None` (only a line-up can time out).
            if let Some(Outcome::Granted(slot, pid, token)) =
                self.try_on(&mut conn, Try::Plain).await?
            {
                drop(baton);
                return self.start(conn, slot, pid, token);
            }
        }
        self.listen(&mut conn).await?;
        let mut outcome = {
            let line_up = self.try_on(&mut conn, Try::LineUp(deadline));
            let mut line_up = std::pin::pin!(line_up);
            // Polled once, the statement is written to the socket (the
            // pooler probe has run at the plain try or an earlier use): the
            // next head may go.
            let first = std::future::poll_fn(|cx| Poll::Ready(line_up.as_mut().poll(cx))).await;
            drop(baton);
            match first {
                Poll::Ready(outcome) => outcome?,
                Poll::Pending => line_up.await?,
            }
        };
        loop {
            let waiting = match outcome {
                Some(Outcome::Granted(slot, pid, token)) => {
                    return self.start(conn, slot, pid, token);
                }
                // The line-up timed out: the connection may hold the queue
                // (granted as the timeout fired), so it is closed.
                None => return Err(timeout(name, started)),
                Some(Outcome::Busy(waiting)) => waiting,
            };
            let tried = match self.until_freed(&mut conn, deadline).await {
                Ok(false) => {
                    self.leave(conn, &waiting).await;
                    return Err(timeout(name, started));
                }
                Ok(true) => self.try_on(&mut conn, Try::Head(&waiting)).await,
                Err(err) => Err(err),
            };
            outcome = match tried {
                Ok(outcome) => outcome,
                // The session ended while it held the queue (the guard, an
                // operator, a failover), which freed the queue: this head
                // lines up again on another connection.
                Err(err) if ended(&err) => {
                    conn = self.connection(started, deadline).await?;
                    self.listen(&mut conn).await?;
                    self.try_on(&mut conn, Try::LineUp(deadline)).await?
                }
                Err(err) => return Err(err),
            };
        }
    }

    /// Subscribes the head's connection to the permit channel: 1 round trip.
    async fn listen(&self, conn: &mut HeldConn) -> Result<(), Error> {
        if let Some(watched) = conn.watched_mut() {
            watched.listen(permit_channel!()).await?;
        }
        Ok(())
    }

    /// Waits on the head's connection for an announced freed slot of this
    /// semaphore, at most [`FALLBACK`]: `Ok(true)` to try again, `Ok(false)`
    /// once `deadline` has passed.
    async fn until_freed(
        &self,
        conn: &mut HeldConn,
        deadline: tokio::time::Instant,
    ) -> Result<bool, Error> {
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Ok(false);
        }
        let wake = crate::deadline::after(now, FALLBACK).min(deadline);
        let Some(watched) = conn.watched_mut() else {
            tokio::time::sleep_until(wake).await;
            return Ok(true);
        };
        let announced = async {
            loop {
                let payload = watched.notice().await?;
                if self.slots.contains(&payload) {
                    return Ok(());
                }
            }
        };
        match tokio::time::timeout_at(wake, announced).await {
            Ok(Err(reason)) => Err(Error::LockLost {
                key: self.queue_key(),
                reason,
            }),
            Ok(Ok(())) | Err(_) => Ok(true),
        }
    }

    /// Gives back the queue after a wait that timed out (1 round trip, at
    /// most [`ANSWER_GRACE`]): a confirmed unlock by the same backend
    /// returns the connection to the pool; anything else closes it, which
    /// frees the queue on the server.
    async fn leave(&self, mut conn: HeldConn, waiting: &Waiting) {
        let unlock = sqlx::query(LEAVE)
            .bind(self.namespace)
            .bind(self.queue.as_str())
            .bind(waiting.idle_timeout.as_str())
            .fetch_one(conn.conn());
        if let Ok(Ok(row)) = tokio::time::timeout(ANSWER_GRACE, unlock).await
            && row.try_get::<bool, _>(0).ok() == Some(true)
            && row.try_get::<i32, _>(1).ok() == Some(waiting.pid)
        {
            conn.into_pool();
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
            .bind(self.namespace)
            .bind(&*self.slots)
            .fetch_one(self.locker.pool())
            .await?;
        let total = u32::try_from(self.slots.len()).unwrap_or(u32::MAX);
        Ok(total.saturating_sub(u32::try_from(held).unwrap_or(u32::MAX)))
    }

    fn bind<'q>(&'q self, query: PgQuery<'q>) -> PgQuery<'q> {
        query
            .bind(self.namespace)
            .bind(self.queue.as_str())
            .bind(&*self.slots)
    }

    /// Reads a row of a try statement.
    fn outcome(&self, row: &PgRow) -> Result<Outcome, Error> {
        let pid: i32 = row.try_get(1)?;
        let Some(queued) = row.try_get::<Option<bool>, _>(0)? else {
            // The session marker says another client shares this server
            // session (a transaction-pooling proxy): nothing was taken.
            return Err(crate::postgres::pooler::marker_seen(pid));
        };
        let slot: Option<i64> = row.try_get(2)?;
        let (true, Some(slot)) = (queued, slot) else {
            let idle_timeout = row.try_get::<Option<String>, _>(6)?.unwrap_or_default();
            return Ok(Outcome::Busy(Waiting { pid, idle_timeout }));
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

    /// Hands the connection holding `slot` to a guard of its own, whose
    /// unlock announces the freed slot.
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
            (self.key(name), Hold::Permit),
            pid,
            token,
            (self.locker.config(), &self.locker.inner.keepers),
        );
        Ok((slot, lock))
    }
}

/// Whether `err` says the head's session is over (its queue freed).
fn ended(err: &Error) -> bool {
    match err {
        Error::LockLost { .. } => true,
        Error::Database(err) => crate::postgres::conn::warm::is_broken(err),
        _ => false,
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

/// The slot try shared by the try statements: the first slot of `$3` (in
/// order) that `pg_try_advisory_lock` grants, as a 0-based index. It names
/// `q.ok` so that it runs once per row, after the row's queue step.
macro_rules! first_free_slot {
    () => {
        "(SELECT k.i OPERATOR(pg_catalog.-) 1 FROM pg_catalog.unnest($3::pg_catalog.text[]) WITH ORDINALITY k(name, i) \
         WHERE q.ok IS NOT NULL \
         AND pg_catalog.pg_try_advisory_lock($1::pg_catalog.int4, pg_catalog.hashtext(k.name)) LIMIT 1)"
    };
}

/// A try statement (`$1` the namespace, `$2` the queue's name, `$3` the
/// slots' names, `$4` as the kind needs): `$may` decides whether the
/// statement may take a slot (taking the queue if it must; NULL when the
/// session marker refuses), then the slots are tried in order, then
/// `$leave` gives back what is no longer needed of the queue, and the
/// session marker counts what the connection holds now (`$mark`). Columns:
/// may (NULL: the marker refused), pid, slot (NULL: none), queue given
/// back, marker, token. It also sets the client check and the keepalives,
/// as every lock statement does.
macro_rules! slot_statement {
    ($may:expr, $leave:literal, $mark:literal, $token:literal, $guard:literal) => {
        concat!(
            "WITH q AS MATERIALIZED (SELECT ",
            $may,
            " AS ok, \
             pg_catalog.pg_backend_pid() AS pid, \
             pg_catalog.current_setting('idle_session_timeout') AS idle, ",
            client_check!(session),
            ", ",
            keepalives!(session),
            " OFFSET 0), \
             t AS MATERIALIZED (SELECT q.ok, q.pid, q.idle, CASE WHEN q.ok THEN ",
            first_free_slot!(),
            " END AS slot FROM q) \
             SELECT t.ok, t.pid, t.slot, ",
            $leave,
            ", \
             CASE WHEN ",
            $mark,
            " THEN pg_catalog.set_config('distlock.locks', '1', false) END, ",
            $token,
            ", t.idle, ",
            $guard,
            " FROM t"
        )
    };
}

/// The plain try takes the queue lock *shared* without waiting: tries
/// never exclude each other, but PostgreSQL refuses a shared request while
/// a process's head holds the queue or is queued for it, so a plain try
/// takes no slot ahead of a waiter. It gives the queue back at once.
macro_rules! plain_try {
    ($token:literal) => {
        slot_statement!(
            concat!(session_marker!(unmarked),
                " THEN pg_catalog.pg_try_advisory_lock_shared($1::pg_catalog.int4, pg_catalog.hashtext($2)) END"),
            "CASE WHEN t.ok THEN pg_catalog.pg_advisory_unlock_shared($1::pg_catalog.int4, pg_catalog.hashtext($2)) END",
            "t.slot IS NOT NULL",
            $token,
            "NULL::pg_catalog.text"
        )
    };
}

/// The head lines up (`$4` the `lock_timeout`): it waits for the queue
/// exclusively, in PostgreSQL's lock queue behind the other processes'
/// heads, first come first served; then it tries the slots. A taken slot
/// lets go of the queue; otherwise the connection keeps it (and the marker
/// counts it) until a later head try takes a slot.
macro_rules! line_up {
    ($token:literal) => {
        slot_statement!(
            concat!(session_marker!(unmarked),
                " AND pg_catalog.set_config('lock_timeout', $4, true) IS NOT NULL \
                 THEN (SELECT true FROM pg_catalog.pg_advisory_lock($1::pg_catalog.int4, pg_catalog.hashtext($2))) END"),
            "CASE WHEN t.slot IS NOT NULL THEN pg_catalog.pg_advisory_unlock($1::pg_catalog.int4, pg_catalog.hashtext($2)) END",
            "t.ok",
            $token,
            // Still waiting: the guard (`$5`) against a paused head.
            "CASE WHEN t.ok AND t.slot IS NULL THEN pg_catalog.set_config('idle_session_timeout', $5, false) END"
        )
    };
}

/// The head tries again on its connection, which holds the queue (`$4` its
/// backend, which the marker check confirms); a taken slot lets go of the
/// queue.
macro_rules! head_try {
    ($token:literal) => {
        slot_statement!(
            concat!(session_marker!(held, "$4"), " THEN true END"),
            "CASE WHEN t.slot IS NOT NULL THEN pg_catalog.pg_advisory_unlock($1::pg_catalog.int4, pg_catalog.hashtext($2)) END",
            "t.slot IS NOT NULL",
            $token,
            // A permit's connection: the session's own idle timeout again.
            "CASE WHEN t.slot IS NOT NULL THEN pg_catalog.set_config('idle_session_timeout', $5, false) END"
        )
    };
}

const TRY: &str = plain_try!("NULL::pg_catalog.int8");
const TRY_FENCED: &str = plain_try!("CASE WHEN t.slot IS NOT NULL THEN distlock.next_token() END");
const LINE_UP: &str = line_up!("NULL::pg_catalog.int8");
const LINE_UP_FENCED: &str =
    line_up!("CASE WHEN t.slot IS NOT NULL THEN distlock.next_token() END");
const HEAD_TRY: &str = head_try!("NULL::pg_catalog.int8");
const HEAD_TRY_FENCED: &str =
    head_try!("CASE WHEN t.slot IS NOT NULL THEN distlock.next_token() END");

/// The head gives back the queue, its marker and the session's idle
/// timeout (`$3`) after a wait that timed out. Columns: unlocked, pid.
const LEAVE: &str = concat!(
    "SELECT pg_catalog.pg_advisory_unlock($1::pg_catalog.int4, pg_catalog.hashtext($2)), \
     pg_catalog.pg_backend_pid(), ",
    session_marker!(unmark),
    ", pg_catalog.set_config('idle_session_timeout', $3, false)"
);

/// How many of the slots `$2` (in namespace `$1`) some session of this
/// database holds. A two-`int4` advisory lock shows in `pg_locks` as
/// `classid` and `objid` (the unsigned views of the two keys) with
/// `objsubid = 2`.
const AVAILABLE: &str = "SELECT pg_catalog.count(DISTINCT l.objid) FROM pg_catalog.pg_locks l \
     WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory' AND l.granted AND l.objsubid OPERATOR(pg_catalog.=) 2 \
     AND l.database OPERATOR(pg_catalog.=) (SELECT oid FROM pg_catalog.pg_database WHERE datname OPERATOR(pg_catalog.=) pg_catalog.current_database()) \
     AND l.classid OPERATOR(pg_catalog.=) ($1::pg_catalog.int8 OPERATOR(pg_catalog.&) 4294967295)::pg_catalog.oid \
     AND l.objid OPERATOR(pg_catalog.=) ANY (SELECT (pg_catalog.hashtext(s)::pg_catalog.int8 OPERATOR(pg_catalog.&) 4294967295)::pg_catalog.oid \
     FROM pg_catalog.unnest($2::pg_catalog.text[]) s)";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_statement_polls_on_the_server() {
        for sql in [
            TRY,
            TRY_FENCED,
            HEAD_TRY,
            HEAD_TRY_FENCED,
            LINE_UP,
            LINE_UP_FENCED,
        ] {
            assert!(!sql.contains("pg_sleep"), "{sql}");
        }
    }

    #[test]
    fn only_the_plain_try_takes_the_queue() {
        assert!(TRY.contains("pg_try_advisory_lock_shared"));
        assert!(!HEAD_TRY.contains("pg_try_advisory_lock_shared"));
    }

    #[test]
    fn the_timeout_names_the_semaphore() {
        let err = timeout("exports", Instant::now() - Duration::from_millis(5));
        assert!(matches!(err, Error::Timeout { key, .. } if key == LockKey::from("exports")));
    }
}
