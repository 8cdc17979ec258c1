//! A semaphore's permits on PostgreSQL: one statement tries every slot;
//! one connection per process waits behind the other processes on the
//! server, holding the semaphore's queue lock; while it does, a permit given
//! up in the process goes straight to the process's next waiter, and a
//! freed permit of another process is announced to it (`NOTIFY`), so that a
//! waiter is served without a poll.
//!
//! The slots are the same advisory locks the generic semaphore takes
//! (`LockKey::namespaced(namespace, "{name}#{i}")`), so both kinds of users
//! of one semaphore see each other's permits. The queue is one more lock in
//! that namespace, `"{name}#queue"`: a slot's name ends in digits, so no slot
//! of any semaphore is a queue.
//!
//! # How a process waits
//!
//! A waiter with no waiter of its process ahead of it tries the slots at
//! once (the plain try: it takes the queue shared, so it takes nothing
//! while a head of any process holds or waits for the queue). The others
//! line up in the process, first come first served, in two lines kept in
//! the same order: a `tokio` semaphore whose first waiter, the head, talks
//! to the server, and the relay (`permit_relay.rs`), where every waiter
//! waits for a permit handed to it.
//!
//! The head `LISTEN`s on the permit channel and takes the queue lock
//! exclusively, on one pooled connection, waiting in PostgreSQL's lock
//! queue behind the other processes' heads. From then on the process has
//! its turn: it is first in line across every process, no plain try of any
//! process takes a slot, and
//! - a permit given up in the process is handed, as it is, to its earliest
//!   waiter (no round trip);
//! - at the start of the turn, at each announcement of a freed slot of this
//!   semaphore, and every [`FALLBACK`] (for a holder that vanished without
//!   unlocking), a background fill tries the slots on other pooled
//!   connections, as many at once as the process has waiters (up to
//!   [`TRIES`]; at the start of the turn, when any number of slots may be
//!   free, up to the permits), and hands every permit taken to the
//!   earliest waiters.
//!
//! The head is a waiter too: served, it leaves the connection holding the
//! queue to the next head, or gives the queue back when no waiter is left.
//! After [`TURN`] hand-overs per permit the head asks the server whether
//! another process waits for the queue (1 round trip); if one does, it
//! gives the queue back and takes it again, behind it. A process's waiters
//! hold one connection between them, however many they are, plus up to
//! [`TRIES`] for the moment of a fill (up to the permits, and never more
//! than the pool has idle or may open, at the start of a turn: a try that
//! takes a slot keeps its connection as the permit's, one that finds the
//! slots taken gives it back after 1 round trip).

use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::Row;
use sqlx::postgres::PgRow;
use tokio::sync::Semaphore as Line;

use crate::postgres::conn::held::HeldConn;
use crate::postgres::conn::pooled::ACQUIRE_FLOOR;
use crate::postgres::conn::watched::WatchedConn;
use crate::postgres::locker::PgLocker;
use crate::postgres::permit_relay::{Pass, Passed, Relay, TURN, Tenure, Waiting};
use crate::postgres::pooler::session_locking_error;
use crate::postgres::request::fragments::{
    PgQuery, client_check, keepalives, millis_setting, permit_channel, session_marker, token_draw,
    wait_limit,
};
use crate::postgres::request::unlimited;
use crate::postgres::session::guard::SessionLock;
use crate::postgres::session::hold::Hold;
use crate::postgres::sqlstate::lock_not_available;
use crate::postgres::timeout::{answered, answered_on_pool};
use crate::{Error, FencingToken, LockKey};

/// How long after its deadline a waiter still waits for the server's
/// answer before it closes the connection and times out.
const ANSWER_GRACE: Duration = Duration::from_millis(50);

/// How often the head tries the slots without having been told of a freed
/// one: a holder whose session ended without an unlock (a crash, a
/// partition, `pg_terminate_backend`) frees its slot silently, and so does
/// a slot taken through a plain lock (`Semaphore::new` over a `PgLocker`).
const FALLBACK: Duration = Duration::from_millis(200);

/// How many tries a head runs at once while its process holds the queue
/// and slots may be free (each on a pooled connection): enough to fill free
/// permits in parallel, few enough to leave the pool to others. Not at the
/// start of a turn: then any number of slots may be free (a burst of
/// waiters on an idle semaphore), and rounds of this many left permits idle
/// for a round trip each (3 rounds for 9 free permits).
const TRIES: usize = 4;

/// The PostgreSQL side of a semaphore built by `PgLocker::semaphore`.
#[derive(Debug, Clone)]
pub(crate) struct PgSlots {
    locker: PgLocker,
    namespace: i32,
    /// `"{name}#{i}"` for every slot `i`, bound as one `text[]`.
    slots: Arc<[String]>,
    /// `"{name}#queue"`.
    queue: String,
    /// The semaphore's name: what its errors name (as `LockKey::from`),
    /// never the internal keys of its slots or queue.
    name: LockKey,
    /// The process's line, first come first served: its first waiter is
    /// the head.
    line: Arc<Line>,
    /// The process's turn: where its holders hand a permit they give up to
    /// its earliest waiter while it holds the queue.
    relay: Relay,
}

/// Why a waiting head woke.
enum Wake {
    /// A freed slot was announced: try on another connection.
    Announced,
    /// The fallback pause ended: try on the queue's connection.
    Fallback,
    /// A holder of this process handed its permit over.
    Passed(Passed),
    /// The turn's hand-overs are used up.
    UsedUp,
    /// The deadline passed.
    TimedOut,
    /// Not a wake: the head tries on the queue's connection at once.
    OnQueue,
}

/// What a rotation came to.
enum Rotated {
    /// The queue is held again: the turn starts over.
    Kept(Tenure),
    /// A permit was handed to the head before the turn closed: it is
    /// served, and the queue is still held.
    Served(Tenure, Passed),
    /// The queue's connection is closed (the deadline, a failure).
    Lost,
}

/// A permit handed over, as a head's grant: its hold starts now.
fn handed(passed: Passed) -> (u32, SessionLock) {
    let Passed { slot, mut lock } = passed;
    lock.handed_over();
    (slot, lock)
}

/// What one semaphore statement found.
enum Outcome {
    /// Slot `.0` is held by the statement's connection.
    Granted(u32, i32, Option<FencingToken>),
    /// Every slot was held (or, for a plain try, a waiter holds the
    /// queue).
    Busy(Waiting),
}

/// The `idle_session_timeout` of a head's connection while it holds the
/// queue. A live process runs a statement on it at least every [`FALLBACK`]; a head
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
    /// [`LINE_UP`] with no slot: waits for the queue until the deadline,
    /// and takes nothing else; `true`: the session has a limit on a wait,
    /// which the line-up lifts (see `unlimited`).
    Queue(tokio::time::Instant, bool),
    /// [`HEAD_TRY`]: the connection holds the queue.
    Head(&'a Waiting),
    /// [`AHEAD`]: another connection of the process holds the queue.
    Ahead,
}

impl PgSlots {
    /// The slots `"{name}#0"` … of `name` in `namespace`. Makes no round
    /// trip.
    pub(crate) fn new(locker: PgLocker, namespace: i32, name: &str, permits: u32) -> Self {
        Self {
            relay: Relay::new(turn(permits, locker.config().fencing)),
            locker,
            namespace,
            slots: (0..permits).map(|i| format!("{name}#{i}")).collect(),
            queue: format!("{name}#queue"),
            name: LockKey::from(name),
            line: Arc::new(Line::new(1)),
        }
    }

    /// Where a permit of this semaphore is given up (see
    /// `permit_relay.rs`).
    pub(crate) fn relay(&self) -> Relay {
        self.relay.clone()
    }

    fn key(&self, slot: &str) -> LockKey {
        LockKey::namespaced(self.namespace, slot)
    }

    fn queue_key(&self) -> LockKey {
        self.key(&self.queue)
    }

    /// The key a caller's error names: the semaphore's own name, as its
    /// timeouts do.
    fn named(&self) -> LockKey {
        self.name.clone()
    }

    fn fencing(&self) -> bool {
        self.locker.config().fencing
    }

    /// A free slot without waiting, unless a waiting process holds the
    /// queue (a freed permit is theirs). One statement on a pooled
    /// connection; the pool's own timeout is [`Error::PoolExhausted`] when
    /// every connection is in use, and no answer within the heartbeat
    /// deadline (a stalled network) [`Error::CommandTimedOut`].
    pub(crate) async fn try_acquire(&self) -> Result<Option<(u32, SessionLock)>, Error> {
        let pool = self.locker.pool();
        let acquired = WatchedConn::acquire(pool).await;
        let conn = acquired
            .map_err(|err| crate::postgres::conn::pooled::pool_error(pool, &self.named(), err))?;
        let mut conn = HeldConn::watched(conn, true);
        // As a session try: the probe and the statement each answer within
        // the heartbeat deadline, or the armed connection is closed.
        let (key, within) = (self.named(), self.locker.config().heartbeat_timeout);
        let probe = self.locker.inner.pooler.ensure_session(conn.conn());
        answered(&key, within, probe).await?;
        match answered(&key, within, self.try_on(&mut conn, Try::Plain)).await? {
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
    /// [`Try::Queue`] passed (with the queue held or not: the caller
    /// closes the connection). Every other kind answers at once.
    async fn try_on(&self, conn: &mut HeldConn, kind: Try<'_>) -> Result<Option<Outcome>, Error> {
        self.locker.inner.pooler.ensure_session(conn.conn()).await?;
        let fenced = self.fencing();
        // The queue's line-up tries no slot: the process's tries run on
        // other connections, so that this one keeps the queue.
        let slots: &[String] = match kind {
            Try::Queue(..) => &[],
            _ => &self.slots,
        };
        let query = self.bind(
            slots,
            sqlx::query(match (kind, fenced) {
                (Try::Plain, false) => TRY,
                (Try::Plain, true) => TRY_FENCED,
                (Try::Queue(..), false) => LINE_UP,
                (Try::Queue(..), true) => LINE_UP_FENCED,
                (Try::Head(_), false) => HEAD_TRY,
                (Try::Head(_), true) => HEAD_TRY_FENCED,
                (Try::Ahead, false) => AHEAD,
                (Try::Ahead, true) => AHEAD_FENCED,
            }),
        );
        let Try::Queue(deadline, limited) = kind else {
            let query = match kind {
                Try::Head(waiting) => query.bind(waiting.pid).bind(waiting.idle_timeout.as_str()),
                _ => query,
            };
            let row = query.fetch_one(conn.conn()).await;
            let row = row.map_err(|err| session_locking_error(err, &self.named()))?;
            return self.outcome(&row).map(Some);
        };
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        if remaining.is_zero() {
            return Ok(None);
        }
        let query = query.bind(millis_setting(remaining)).bind(GUARD);
        // A session limit on the wait (statement_timeout, transaction_timeout)
        // is lifted for it; a failed wait leaves the transaction open, and
        // the caller closes the connection.
        let statement = unlimited::session_wait(conn.conn(), limited, async |conn| {
            query.fetch_one(conn).await
        });
        // The server gives up at the deadline (lock_timeout). An answer
        // that has not arrived shortly after it (a slow or stalled network)
        // is not waited for, so that the call keeps its deadline.
        let grace = crate::deadline::after(deadline, ANSWER_GRACE);
        let queue = self.queue_key();
        match crate::span::waiting(&queue, tokio::time::timeout_at(grace, statement)).await {
            Err(_) => Ok(None),
            Ok(Err(err)) if lock_not_available(&err) => Ok(None),
            Ok(row) => {
                let row = row.map_err(|err| session_locking_error(err, &self.named()))?;
                self.outcome(&row).map(Some)
            }
        }
    }

    /// Takes a slot, waiting until `deadline` behind this process's earlier
    /// waiters and, on the server, behind the other processes' (see the
    /// file's documentation): 1 round trip when a permit is free and no one
    /// waits, 3 when it waits (the try, `LISTEN`, the line-up; 2 more where
    /// the session has a limit on a wait), and 1 more per announced freed
    /// slot; none for a permit handed over in the process's turn. Pool
    /// errors are retried until the deadline.
    ///
    /// A permit lost before the caller gets it (handed over, then its
    /// session ended while this waiter's task had not run yet) is no
    /// permit: the server freed its slot, and another process may hold it.
    /// It is dropped, and the wait goes on as a new arrival.
    pub(crate) async fn acquire(
        &self,
        name: &str,
        started: Instant,
        deadline: tokio::time::Instant,
    ) -> Result<(u32, SessionLock), Error> {
        loop {
            let (slot, lock) = self.acquire_once(name, started, deadline).await?;
            if !lock.is_lost() {
                return Ok((slot, lock));
            }
            drop(lock);
            if tokio::time::Instant::now() >= deadline {
                return Err(timeout(name, started));
            }
        }
    }

    /// One registration's part of [`acquire`](Self::acquire).
    async fn acquire_once(
        &self,
        name: &str,
        started: Instant,
        deadline: tokio::time::Instant,
    ) -> Result<(u32, SessionLock), Error> {
        let mut pass = self.relay.expect();
        // Every step keeps the deadline (the first use's pooler probe and
        // the tries too), or the floor a connection may take: an answer
        // later than shortly after it is not waited for. Dropped, the
        // head's connection is closed, which frees whatever its statement
        // took.
        let grace = crate::deadline::after(deadline.max(floor(started)), ANSWER_GRACE);
        let waited = self.wait(&mut pass, name, started, deadline);
        let failed = match tokio::time::timeout_at(grace, waited).await {
            Ok(Ok(taken)) => return Ok(taken),
            Ok(Err(err)) => err,
            Err(_) => timeout(name, started),
        };
        // A permit handed over as the wait failed is this waiter's.
        match pass.take() {
            Some(passed) => Ok(handed(passed)),
            None => Err(failed),
        }
    }

    /// Waits for a permit handed over, or for its turn as the head.
    async fn wait(
        &self,
        pass: &mut Pass,
        name: &str,
        started: Instant,
        deadline: tokio::time::Instant,
    ) -> Result<(u32, SessionLock), Error> {
        if let Some(taken) = self.arrival_try(pass, started, deadline).await? {
            return Ok(taken);
        }
        let head = tokio::select! {
            passed = pass.recv() => return Ok(handed(passed)),
            head = tokio::time::timeout_at(deadline, self.line.acquire()) => head,
        };
        let Ok(Ok(_head)) = head else {
            return Err(timeout(name, started));
        };
        self.head(pass, name, started, deadline).await
    }

    /// A waiter's try as it arrives, if no waiter of the process is ahead
    /// of it (`ahead`): 1 round trip on a pooled connection, the whole
    /// cost of an `acquire` when a permit is free. A plain
    /// try takes nothing while another process holds the queue; while this
    /// process holds it, the try skips the queue step.
    async fn arrival_try(
        &self,
        pass: &mut Pass,
        started: Instant,
        deadline: tokio::time::Instant,
    ) -> Result<Option<(u32, SessionLock)>, Error> {
        // Waiters ahead of it are served first.
        if pass.ahead() > 0 {
            return Ok(None);
        }
        // A permit can be handed to it while it waits for a connection (a
        // turn of the process is open): it takes that one rather than
        // leave it idle until the pool has room.
        let mut conn = tokio::select! {
            biased;
            passed = pass.recv() => return Ok(Some(handed(passed))),
            conn = self.connection(started, deadline) => conn?,
        };
        // While this process holds the queue its waiters are first: they
        // try without the queue step (which the queue's holder refuses).
        let kind = if self.relay.is_open() {
            Try::Ahead
        } else {
            Try::Plain
        };
        match self.try_on(&mut conn, kind).await? {
            Some(Outcome::Granted(slot, pid, token)) => {
                self.start(conn, slot, pid, token).map(Some)
            }
            Some(Outcome::Busy(_)) | None => {
                conn.into_pool();
                Ok(None)
            }
        }
    }

    /// The head's part of [`acquire`](Self::acquire): it takes over the
    /// process's turn if a head left it, or takes the queue; then, holding
    /// it, it waits for a permit handed over, and tries the slots on
    /// another connection at each announcement.
    async fn head(
        &self,
        pass: &mut Pass,
        name: &str,
        started: Instant,
        deadline: tokio::time::Instant,
    ) -> Result<(u32, SessionLock), Error> {
        let mut tenure = match self.relay.adopt() {
            Some(tenure) => tenure,
            None => self.take_queue(name, started, deadline).await?,
        };
        let mut announced = false;
        loop {
            // A permit handed over while the head was busy (a check, a
            // statement, a wake that won the race) is served first: the
            // head must not give the queue back and wait for it again
            // holding one.
            if let Some(passed) = pass.ready() {
                self.hand_on(tenure).await;
                return Ok(handed(passed));
            }
            if let Some(err) = self.relay.take_failure() {
                self.hand_on(tenure).await;
                return Err(err);
            }
            if self.relay.used_up() && !self.others_wait(&mut tenure).await {
                // Nobody else waits for the queue: the turn goes on.
                self.relay.renew();
            }
            if self.relay.used_up() {
                tenure = match self.rotate(tenure, pass, deadline).await {
                    Rotated::Kept(tenure) => tenure,
                    Rotated::Served(tenure, passed) => {
                        self.hand_on(tenure).await;
                        return Ok(handed(passed));
                    }
                    Rotated::Lost if tokio::time::Instant::now() >= deadline => {
                        return Err(timeout(name, started));
                    }
                    Rotated::Lost => self.take_queue(name, started, deadline).await?,
                };
            }
            // A release announced to a head that waits alone is tried on the
            // queue's own connection (1 round trip; granted, the statement
            // gives the queue back and the connection becomes the permit's):
            // a background try would cost a pool checkout, a task hop, and
            // giving the queue back. Not at the turn's start, where more
            // waiters of the process are often about to line up behind it.
            let alone = std::mem::take(&mut announced) && self.relay.waiters() <= 1;
            let fresh = std::mem::take(&mut tenure.fresh);
            let began = std::mem::take(&mut tenure.began);
            let woke = if !fresh || (!alone && self.fill(deadline, began)) {
                self.until_freed(&mut tenure, deadline, pass).await
            } else {
                // Alone, or the pool has no connection to spare: the head
                // tries on the queue's own connection.
                Ok(Wake::OnQueue)
            };
            let tried = match woke {
                Ok(Wake::Passed(passed)) => {
                    self.hand_on(tenure).await;
                    return Ok(handed(passed));
                }
                Ok(Wake::UsedUp) => continue,
                Ok(Wake::TimedOut) => {
                    let passed = pass.take();
                    // Its registration ended: the turn goes on for the
                    // process's next waiter, which arrived before any
                    // waiter of another process that the queue would go to.
                    self.hand_on(tenure).await;
                    return passed.map(handed).ok_or_else(|| timeout(name, started));
                }
                Ok(Wake::Announced) => {
                    tenure.fresh = true;
                    announced = true;
                    continue;
                }
                // A statement on the queue's connection, so that its
                // session is never idle for the guard; then the slots are
                // tried (a holder may have vanished without announcing).
                Ok(Wake::Fallback) => {
                    self.others_wait(&mut tenure).await;
                    tenure.fresh = true;
                    continue;
                }
                Ok(Wake::OnQueue) => {
                    let waiting = tenure.waiting.clone();
                    tenure.used = tokio::time::Instant::now();
                    self.try_on(&mut tenure.conn, Try::Head(&waiting)).await
                }
                Err(err) => Err(err),
            };
            match tried {
                Ok(Some(Outcome::Granted(slot, pid, token))) => {
                    // The statement gave the queue back: the turn is over.
                    let (conn, _) = tenure.close();
                    return self.start(conn, slot, pid, token);
                }
                Ok(_) => {}
                // The session ended while it held the queue (the guard, an
                // operator, a failover), which freed the queue: this head
                // takes it again on another connection.
                Err(err) if ended(&err) => {
                    drop(tenure);
                    tenure = self.take_queue(name, started, deadline).await?;
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// Takes the queue on a pooled connection: `LISTEN` (1 round trip),
    /// then the queue lock, waiting in the server's queue behind the other
    /// processes' heads (1 round trip once at the front; 2 more around it
    /// where the session has a limit on a wait, which it lifts). The
    /// process's turn begins; its head tries the slots at once.
    async fn take_queue(
        &self,
        name: &str,
        started: Instant,
        deadline: tokio::time::Instant,
    ) -> Result<Tenure, Error> {
        let mut conn = self.connection(started, deadline).await?;
        let limited = self.listen(&mut conn).await?;
        match self
            .try_on(&mut conn, Try::Queue(deadline, limited))
            .await?
        {
            Some(Outcome::Busy(waiting)) => {
                let waiting = Waiting { limited, ..waiting };
                Ok(self.relay.open(conn, waiting))
            }
            // It tries no slot, so it takes none.
            Some(Outcome::Granted(..)) => Err(Error::NotGranted { key: self.named() }),
            // Timed out: the connection may hold the queue (granted as the
            // timeout fired), so it is closed.
            None => Err(timeout(name, started)),
        }
    }

    /// The turn is used up: in one statement (1 round trip when no other
    /// process waits; 2 more where the session has a limit on a wait) the
    /// queue is given back, which lets a head of another process that
    /// waits for it go first, and taken again, behind it. The turn starts
    /// over once it is.
    async fn rotate(
        &self,
        tenure: Tenure,
        pass: &mut Pass,
        deadline: tokio::time::Instant,
    ) -> Rotated {
        let (mut conn, waiting) = tenure.close();
        // Closed, the turn hands nothing over any more; a permit handed to
        // this head before is served first. Holding it, the head must not
        // wait behind another process, which would wait for it.
        if let Some(passed) = pass.ready() {
            return Rotated::Served(self.relay.open(conn, waiting), passed);
        }
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        let query = sqlx::query(ROTATE)
            .bind(self.namespace)
            .bind(self.queue.as_str())
            .bind(waiting.pid)
            .bind(millis_setting(remaining));
        // Its wait, too, lifts the session's limit (a failure closes the
        // connection, below).
        let statement = unlimited::session_wait(conn.conn(), waiting.limited, async |conn| {
            query.fetch_one(conn).await
        });
        let grace = crate::deadline::after(deadline, ANSWER_GRACE);
        let queue = self.queue_key();
        let answer = crate::span::waiting(&queue, tokio::time::timeout_at(grace, statement)).await;
        let taken = matches!(answer, Ok(Ok(row)) if row.try_get::<Option<bool>, _>(0).ok().flatten() == Some(true));
        // Anything else (the deadline, another session, a broken
        // connection): the connection is closed, which frees the queue.
        if taken {
            Rotated::Kept(self.relay.open(conn, waiting))
        } else {
            Rotated::Lost
        }
    }

    /// Whether a session of another process waits for the queue (1 round
    /// trip on the queue's connection, at most [`ANSWER_GRACE`]; `true`
    /// when it cannot tell). Hand-overs go on meanwhile.
    async fn others_wait(&self, tenure: &mut Tenure) -> bool {
        tenure.used = tokio::time::Instant::now();
        let check = sqlx::query_scalar::<_, bool>(OTHERS_WAIT)
            .bind(self.namespace)
            .bind(self.queue.as_str())
            .fetch_one(tenure.conn.conn());
        !matches!(
            tokio::time::timeout(ANSWER_GRACE, check).await,
            Ok(Ok(false))
        )
    }

    /// Starts the process's fill if none runs (see [`filling`](Self::filling));
    /// `began`: the turn just began, so its next round may try every slot.
    /// `false` when the pool has no connection to spare for it.
    fn fill(&self, deadline: tokio::time::Instant, began: bool) -> bool {
        if self.room() == 0 {
            return false;
        }
        if self.relay.begin_fill(deadline, began) {
            let slots = self.clone();
            tokio::spawn(async move { slots.filling().await });
        }
        true
    }

    /// Connections the pool can still give: idle ones, and the ones it may
    /// open.
    fn room(&self) -> usize {
        let pool = self.locker.pool();
        let may_open = pool
            .options()
            .get_max_connections()
            .saturating_sub(pool.size());
        pool.num_idle()
            .saturating_add(usize::try_from(may_open).unwrap_or(usize::MAX))
    }

    /// While this process holds the queue: tries the slots on other pooled
    /// connections, as many at once as the process has waiters (up to
    /// [`TRIES`], or up to the permits from the start of a turn for as long
    /// as every try takes a slot, and as the pool has room), 1 round trip
    /// each, and hands every permit taken to the process's earliest waiter.
    /// Runs again as long as every try took a slot, or another fill was
    /// asked for meanwhile. Off the waiters' path: they keep taking permits
    /// handed over while it runs.
    async fn filling(&self) {
        // Wide rounds go on while every try takes a slot: as a burst of
        // waiters arrives, the first round sees only the first few of them.
        let mut wide = false;
        loop {
            wide |= self.relay.take_wide();
            let most = if wide { self.slots.len() } else { TRIES };
            let tries = self.relay.waiters().min(most).min(self.room());
            let deadline = self.relay.fill_until();
            // No deadline (never while a fill runs) is no round, so that the
            // loop cannot spin without an await.
            let mut all = tries > 0 && self.relay.is_open() && deadline.is_some();
            if let (true, Some(deadline)) = (all, deadline) {
                let started = Instant::now();
                let tried = (0..tries).map(|_| self.try_other(started, deadline));
                for outcome in futures_util::future::join_all(tried).await {
                    match outcome {
                        Ok(Some((slot, lock))) => drop(self.relay.offer(slot, lock, true)),
                        Ok(None) => all = false,
                        // Past the deadline every head that asked for this
                        // round has left: nobody waits for its error.
                        Err(_) if tokio::time::Instant::now() >= deadline => all = false,
                        Err(err) => {
                            all = false;
                            self.relay.fail(err);
                        }
                    }
                }
            }
            wide &= all;
            if !self.relay.end_fill(all) {
                return;
            }
        }
    }

    /// One try on another pooled connection (see [`filling`](Self::filling)).
    async fn try_other(
        &self,
        started: Instant,
        deadline: tokio::time::Instant,
    ) -> Result<Option<(u32, SessionLock)>, Error> {
        let mut conn = self.connection(started, deadline).await?;
        // No caller waits on this task's deadline: a stalled try would keep
        // its connection, and the process's fill, until TCP gives up. Its
        // armed connection is closed instead, which frees whatever the
        // statement took, and the try counts as one that took no slot: the
        // waiters go on (a process resumed after a pause finds its timers
        // due before the answers it got meanwhile are read).
        let within = self.locker.config().heartbeat_timeout;
        let tried = answered(&self.named(), within, self.try_on(&mut conn, Try::Ahead)).await;
        if let Err(Error::CommandTimedOut { .. }) = tried {
            return Ok(None);
        }
        match tried? {
            Some(Outcome::Granted(slot, pid, token)) => {
                self.start(conn, slot, pid, token).map(Some)
            }
            Some(Outcome::Busy(_)) | None => {
                conn.into_pool();
                Ok(None)
            }
        }
    }

    /// Leaves the turn to the process's next head, or, when no waiter is
    /// left, gives the queue back (1 round trip) before the head returns,
    /// so that a try of any process right after it is not refused.
    async fn hand_on(&self, tenure: Tenure) {
        if let Some(tenure) = self.relay.park(tenure) {
            self.leave(tenure).await;
        }
    }

    /// Subscribes the head's connection to the permit channel and sets its
    /// client check, in one simple query ([`LISTEN`]): 1 round trip.
    /// `true` when the session has a limit on a wait, which the line-up
    /// and the rotations then lift.
    async fn listen(&self, conn: &mut HeldConn) -> Result<bool, Error> {
        let row = sqlx::raw_sql(LISTEN).fetch_one(conn.conn()).await?;
        let limit: Option<String> = row.try_get(1)?;
        Ok(unlimited::limited(limit.as_deref()))
    }

    /// Waits on the queue's connection for an announced freed slot of this
    /// semaphore, for a permit handed over (`pass`), for the end of the
    /// turn, or until [`FALLBACK`] after the connection's last statement;
    /// [`Wake::TimedOut`] once `deadline` has passed.
    async fn until_freed(
        &self,
        tenure: &mut Tenure,
        deadline: tokio::time::Instant,
        pass: &mut Pass,
    ) -> Result<Wake, Error> {
        if tokio::time::Instant::now() >= deadline {
            return Ok(Wake::TimedOut);
        }
        // Counted from the connection's last statement, not from this
        // head's start: with permits handed over quickly, heads follow
        // each other, and the session must still run a statement within
        // the guard.
        let wake = crate::deadline::after(tenure.used, FALLBACK).min(deadline);
        let Some(watched) = tenure.conn.watched_mut() else {
            return Ok(tokio::select! {
                biased;
                passed = pass.recv() => Wake::Passed(passed),
                () = self.relay.until_used_up() => Wake::UsedUp,
                () = tokio::time::sleep_until(wake) => Wake::Fallback,
            });
        };
        let announced = async {
            loop {
                let payload = watched.notice().await?;
                if self.slots.contains(&payload) {
                    return Ok(());
                }
            }
        };
        let woke = tokio::time::timeout_at(wake, async {
            tokio::select! {
                biased;
                passed = pass.recv() => Ok(Wake::Passed(passed)),
                () = self.relay.until_used_up() => Ok(Wake::UsedUp),
                announced = announced => announced.map(|()| Wake::Announced),
            }
        });
        match woke.await {
            Ok(Err(reason)) => Err(Error::LockLost {
                key: self.named(),
                reason,
            }),
            Ok(Ok(woke)) => Ok(woke),
            Err(_) if tokio::time::Instant::now() >= deadline => Ok(Wake::TimedOut),
            Err(_) => Ok(Wake::Fallback),
        }
    }

    /// Gives back the queue, its marker and the session's idle timeout on
    /// `conn` (1 round trip, at most [`ANSWER_GRACE`]): `true` when the same
    /// backend confirmed the unlock; otherwise the caller closes the
    /// connection, which frees the queue on the server.
    async fn give_back(&self, conn: &mut HeldConn, waiting: &Waiting) -> bool {
        let unlock = sqlx::query(LEAVE)
            .bind(self.namespace)
            .bind(self.queue.as_str())
            .bind(waiting.idle_timeout.as_str())
            .bind(waiting.pid)
            .fetch_one(conn.conn());
        matches!(
            tokio::time::timeout(ANSWER_GRACE, unlock).await,
            Ok(Ok(row)) if row.try_get::<Option<bool>, _>(0).ok() == Some(Some(true))
                && row.try_get::<i32, _>(1).ok() == Some(waiting.pid)
        )
    }

    /// Ends the turn when no waiter of the process is left: the queue given
    /// back, the connection returns to the pool; anything else closes it.
    async fn leave(&self, tenure: Tenure) {
        let (mut conn, waiting) = tenure.close();
        if self.give_back(&mut conn, &waiting).await {
            conn.into_pool();
        }
    }

    /// A pooled connection before `deadline`, or [`ACQUIRE_FLOOR`] after
    /// `started` if that is later (a timeout too short for the pool's
    /// round trips means "try once", as every lock's does). A pool that
    /// times out is asked again: a waiter gives up at its own deadline,
    /// not the pool's.
    async fn connection(
        &self,
        started: Instant,
        deadline: tokio::time::Instant,
    ) -> Result<HeldConn, Error> {
        let pool = self.locker.pool();
        let until = deadline.max(floor(started));
        loop {
            match tokio::time::timeout_at(until, WatchedConn::acquire(pool)).await {
                Ok(Ok(conn)) => return Ok(HeldConn::watched(conn, true)),
                Ok(Err(sqlx::Error::PoolTimedOut)) => {}
                Ok(Err(err)) => return Err(err.into()),
                Err(_) => {
                    return Err(crate::postgres::conn::pooled::no_connection(
                        pool,
                        &self.named(),
                        started,
                    ));
                }
            }
        }
    }

    /// How many slots no session holds, read from `pg_locks`: one
    /// statement on a pooled connection, answered within the heartbeat
    /// deadline (see [`answered_on_pool`]).
    pub(crate) async fn available(&self) -> Result<u32, Error> {
        let query = sqlx::query_scalar(AVAILABLE)
            .bind(self.namespace)
            .bind(&*self.slots);
        let within = (&self.named(), self.locker.config().heartbeat_timeout);
        let held: i64 = answered_on_pool(self.locker.pool(), within, async |conn| {
            Ok(query.fetch_one(conn).await?)
        })
        .await?;
        let total = u32::try_from(self.slots.len()).unwrap_or(u32::MAX);
        Ok(total.saturating_sub(u32::try_from(held).unwrap_or(u32::MAX)))
    }

    fn bind<'q>(&'q self, slots: &'q [String], query: PgQuery<'q>) -> PgQuery<'q> {
        query
            .bind(self.namespace)
            .bind(self.queue.as_str())
            .bind(slots)
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
            // Whether the session limits a wait is the head's `LISTEN`'s
            // answer, which `take_queue` puts in.
            let limited = false;
            return Ok(Outcome::Busy(Waiting {
                pid,
                idle_timeout,
                limited,
            }));
        };
        let slot = u32::try_from(slot).map_err(|_| Error::NotGranted { key: self.named() })?;
        let token = if self.fencing() {
            match row.try_get::<Option<i64>, _>(5)? {
                Some(token) => Some(FencingToken::new(token)),
                None => {
                    return Err(Error::MissingFencingToken { key: self.named() });
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
            .ok_or_else(|| Error::NotGranted { key: self.named() })?;
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

/// How many hand-overs one turn of a process allows: none with fencing
/// (each holder draws its own token on the server).
fn turn(permits: u32, fencing: bool) -> u32 {
    if fencing {
        0
    } else {
        permits.saturating_mul(TURN)
    }
}

/// How long after `started` a waiter may still take a connection, however
/// short its timeout ([`ACQUIRE_FLOOR`]).
fn floor(started: Instant) -> tokio::time::Instant {
    tokio::time::Instant::from_std(started) + ACQUIRE_FLOOR
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
    ($may:expr, $leave:literal, $mark:literal, $token:expr, $guard:literal) => {
        concat!(
            "WITH q AS MATERIALIZED (SELECT ",
            $may,
            " AS ok, \
             pg_catalog.pg_backend_pid() AS pid, \
             pg_catalog.current_setting('idle_session_timeout') AS idle, ",
            client_check!(),
            ", ",
            keepalives!(),
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
    ($token:expr) => {
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
    ($token:expr) => {
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
    ($token:expr) => {
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

/// A try on another connection while this process holds the queue: no
/// queue step, the process is first in line.
macro_rules! ahead_try {
    ($token:expr) => {
        slot_statement!(
            concat!(session_marker!(unmarked), " THEN true END"),
            "NULL::pg_catalog.bool",
            "t.slot IS NOT NULL",
            $token,
            "NULL::pg_catalog.text"
        )
    };
}

/// The token of a slot taken by this statement ([`token_draw`]).
macro_rules! slot_token {
    () => {
        concat!("CASE WHEN t.slot IS NOT NULL THEN ", token_draw!(), " END")
    };
}

const TRY: &str = plain_try!("NULL::pg_catalog.int8");
const AHEAD: &str = ahead_try!("NULL::pg_catalog.int8");
const AHEAD_FENCED: &str = ahead_try!(slot_token!());
const TRY_FENCED: &str = plain_try!(slot_token!());
const LINE_UP: &str = line_up!("NULL::pg_catalog.int8");
const LINE_UP_FENCED: &str = line_up!(slot_token!());
const HEAD_TRY: &str = head_try!("NULL::pg_catalog.int8");
const HEAD_TRY_FENCED: &str = head_try!(slot_token!());

/// The head's `LISTEN`, and the client check its line-up needs: the
/// server reads `client_connection_check_interval` when a statement
/// starts, so the line-up's own `set_config` would come too late for its
/// wait, and a head dropped while it waits in the server's lock queue
/// (its connection closed) would stay there until granted or its
/// `lock_timeout`. The notifications reach the connection's listener
/// whichever statement subscribed it.
const LISTEN: &str = concat!(
    "LISTEN ",
    permit_channel!(),
    "; SELECT ",
    client_check!(),
    ", ",
    wait_limit!()
);

/// The head gives the queue back and waits for it again (`$3` its backend,
/// which the marker check confirms, `$4` the `lock_timeout`): PostgreSQL
/// grants it to the sessions that waited for it first. Columns: taken
/// again (NULL: the marker refused, nothing was given back).
const ROTATE: &str = concat!(
    "WITH g AS MATERIALIZED (SELECT ",
    session_marker!(held, "$3"),
    " AND pg_catalog.set_config('lock_timeout', $4, true) IS NOT NULL \
     THEN pg_catalog.pg_advisory_unlock($1::pg_catalog.int4, pg_catalog.hashtext($2)) END AS ok OFFSET 0) \
     SELECT CASE WHEN g.ok THEN (SELECT true FROM pg_catalog.pg_advisory_lock($1::pg_catalog.int4, pg_catalog.hashtext($2))) END FROM g"
);

/// Whether a session waits for the queue `$2` (in namespace `$1`) of this
/// database: a head of another process (a plain try never waits).
const OTHERS_WAIT: &str = "SELECT pg_catalog.count(*) OPERATOR(pg_catalog.>) 0 FROM pg_catalog.pg_locks l \
     WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory' AND NOT l.granted AND l.objsubid OPERATOR(pg_catalog.=) 2 \
     AND l.database OPERATOR(pg_catalog.=) (SELECT oid FROM pg_catalog.pg_database WHERE datname OPERATOR(pg_catalog.=) pg_catalog.current_database()) \
     AND l.classid OPERATOR(pg_catalog.=) ($1::pg_catalog.int8 OPERATOR(pg_catalog.&) 4294967295)::pg_catalog.oid \
     AND l.objid OPERATOR(pg_catalog.=) (pg_catalog.hashtext($2)::pg_catalog.int8 OPERATOR(pg_catalog.&) 4294967295)::pg_catalog.oid";

/// The head gives back the queue, its marker and the session's idle
/// timeout (`$3`) after a wait that timed out, only on the head's own
/// session (backend `$4`, the marker counting the queue): on a session a
/// pooler moved the connection to, it would reset another client's marker.
/// Columns: unlocked (NULL: not the head's session, nothing given back),
/// pid.
const LEAVE: &str = concat!(
    "SELECT CASE WHEN ",
    session_marker!(ours, "$4::pg_catalog.int4"),
    " THEN CASE WHEN pg_catalog.pg_advisory_unlock($1::pg_catalog.int4, pg_catalog.hashtext($2)) \
     THEN (",
    session_marker!(unmark),
    " OPERATOR(pg_catalog.||) pg_catalog.set_config('idle_session_timeout', $3, false)) IS NOT NULL \
     ELSE false END END, pg_catalog.pg_backend_pid()"
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
            AHEAD,
            AHEAD_FENCED,
            ROTATE,
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
