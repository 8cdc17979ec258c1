//! A counting semaphore: at most `permits` holders at once across all
//! processes, over any backend, with a PostgreSQL-specialised path.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Mutex;

use super::permit::SemaphorePermit;
use crate::postgres::locker::PgLocker;
use crate::postgres::semaphore::PgSlots;
use crate::{Error, LockKey, Locker};

/// The longest pause between two tries of every slot while a waiter polls a
/// backend that cannot wait for "any of these keys" (every backend but
/// PostgreSQL's specialised path). Pauses start at 1 ms and double.
const MAX_POLL_PAUSE: Duration = Duration::from_millis(50);

/// At most `permits` holders at once, across every process and locker that
/// uses the same backend and name.
///
/// The permits are `permits` ordinary locks, the slots `"{name}#0"` …
/// `"{name}#{permits-1}"` in the reserved namespace
/// [`SLOT_NAMESPACE`](Self::SLOT_NAMESPACE), so a plain lock named
/// `"{name}#0"` is another lock. A holder of any one slot holds a permit, so
/// the bound is exactly as strong as the backend's mutual exclusion, and each
/// [`SemaphorePermit`] is the backend's guard of its slot (with its fencing
/// token where the backend issues them, and its loss).
///
/// On PostgreSQL a slot's name is hashed to 32 bits (`hashtext`), as every
/// text key is, so two slots of one semaphore can be one server lock: one
/// permit fewer, never one more. The chance is about `permits²` in 2³³
/// (one in 860,000 at 100 permits, 1% at 10,000).
///
/// # Two ways to build one
///
/// - [`PgLocker::semaphore`](crate::PgLocker::semaphore), on PostgreSQL: a
///   try is **one statement** whatever the number of permits (it tries every
///   slot in order and stops at the first granted); a permit given up while
///   a waiter of the same `Semaphore` (or a clone) queues is **handed to
///   it** with no round trip, and a waiting [`acquire`](Self::acquire) is
///   **woken by the release** of another process's permit (`NOTIFY`), not by
///   a poll; waiters are served **in arrival order within the process, and
///   processes take turns** on the server; the waiters of one `Semaphore`
///   (and its clones) **hold one pooled connection between them** however
///   many they are, plus one connection per held permit (and up to four for
///   the moment of a try). See "Waiting on PostgreSQL".
/// - [`Semaphore::new`] over any [`Locker`]. Over a `PgLocker` it is the
///   semaphore above (the locker's [`Locker::native_semaphore`]). Over the
///   others (Redis, the lease table, the in-memory backend) a try is one
///   `try_lock` per slot, in order, up to `permits` of them; a waiter polls
///   every slot, pausing 1 ms and then twice as long each time up to 50 ms,
///   and holds no connection between tries. Waiters of one `Semaphore` are
///   served in arrival order within the process; across processes there is
///   no order.
///
/// # Waiting on PostgreSQL
///
/// A waiter with no other waiter of its process ahead of it tries at once
/// (1 round trip: the whole cost of an `acquire` when a permit is free).
/// The others line up in the process, first come first served. The first
/// of them, the head, `LISTEN`s on the channel `distlock_semaphore` (1 round
/// trip) and takes the semaphore's queue lock (one more lock in
/// [`SLOT_NAMESPACE`](Self::SLOT_NAMESPACE), `"{name}#queue"`)
/// exclusively, on one pooled connection, waiting in PostgreSQL's own lock
/// queue behind the other processes' heads (1 round trip once at the
/// front; 2 more where the session has a `statement_timeout` or
/// `transaction_timeout`, which that wait lifts for itself). From then on
/// the process has its turn: it is first in line across every process, and
/// no [`try_acquire`](Self::try_acquire) takes a permit (of another
/// process, nor of this one: a try does not skip the line of waiters).
///
/// - A permit of this process given up (released or dropped) during its
///   turn is **handed to the earliest waiter as it is**, its slot still
///   locked by the same connection: no round trip, and the permit is never
///   idle. Only if it is lost, or the semaphore is fenced (each holder draws
///   its own token on the server), is it released instead.
/// - At the start of the turn, at each release of another process's permit
///   (announced in its unlock statement, no extra round trip), and every
///   200 ms (for a holder whose session ended without an unlock), the
///   process tries the slots in the background, on up to four pooled
///   connections at once (1 round trip each, answered within the heartbeat
///   deadline or its connection closed), and hands every permit taken
///   to its earliest waiters. At the start of the turn, when any number of
///   permits may be free, it tries on as many connections at once as it
///   has waiters, up to `permits` and never more than the pool has idle or
///   may open, for as long as every try takes one, so that a burst of
///   waiters on an idle semaphore is not filled four permits at a time. A
///   release announced to a head that waits alone is tried on the queue's
///   own connection instead (1 round trip: the statement takes the slot and
///   gives the queue back).
///
/// A served head leaves the queue's connection to the next head; the last
/// waiter gives the queue back before its `acquire` returns (1 round trip).
/// After `4 × permits` hand-overs in a turn, the head asks the server
/// whether another process waits for the queue (1 round trip); if one does,
/// the process gives the queue back and takes it again behind it: so a
/// process keeps its turn for at most about `4 × permits` hand-overs while
/// another waits.
///
/// The queue's connection runs a statement at least every 200 ms. Its
/// session carries `idle_session_timeout = 2s` meanwhile (given back with
/// the queue), so that a process that is paused or cut off does not keep
/// the queue, and every freed permit, from the others: the server ends its
/// session after 2 s of silence, and its head takes the queue again when it
/// runs again.
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
#[derive(Debug, Clone)]
pub struct Semaphore {
    name: Arc<str>,
    permits: NonZeroU32,
    backend: Backend,
    /// This process's waiters, first come first served; shared by clones.
    queue: Arc<Mutex<()>>,
}

#[derive(Debug, Clone)]
enum Backend {
    Any(Arc<dyn Locker>),
    Postgres(PgSlots),
}

impl Semaphore {
    /// The [`LockKey::namespaced`] namespace of permit slots: slot `i` of the
    /// semaphore `name` is `LockKey::namespaced(SLOT_NAMESPACE, "{name}#{i}")`.
    ///
    /// It keeps slots out of reach of every plain key, on every backend: on
    /// PostgreSQL (advisory locks and [`TableLocker`](crate::postgres::TableLocker)) a
    /// namespaced key is a lock in the two-`int4` keyspace, which no
    /// `LockKey::from`, [`LockKey::id`] or [`LockKey::hashed64`] key reaches;
    /// on Redis (single instance and Redlock) it is the key
    /// `distlock:semaphore`, a NUL byte, the slot's name, which no lock name
    /// can spell (names cannot contain NUL); the in-memory backend keeps every
    /// key form apart. The namespace is reserved: do not use it for your own
    /// namespaced locks (Redis refuses every other namespace). On PostgreSQL
    /// [`PgLocker::semaphore`](crate::PgLocker::semaphore) also takes
    /// `"{name}#queue"` in it.
    ///
    /// Earlier versions took the slots as plain keys (`LockKey::from("{name}#{i}")`):
    /// processes of both versions on one semaphore do not see each other's
    /// permits, so upgrade all of its users together (or drain it first).
    pub const SLOT_NAMESPACE: i32 = i32::MIN;

    /// The most permits a semaphore may have. Every permit is a lock of
    /// its own: a PostgreSQL try sends every slot's name, and a try on
    /// another backend may try every slot in turn, so a count far beyond
    /// what holders can use would cost every call (and `u32::MAX` slot
    /// names would not fit in memory). More is refused with
    /// [`Error::InvalidArgument`].
    pub const MAX_PERMITS: u32 = 10_000;

    /// A semaphore of `permits` permits named `name` on any `locker`. Makes
    /// no round trip.
    ///
    /// Refused with [`Error::InvalidArgument`] for zero permits or more than
    /// [`MAX_PERMITS`](Self::MAX_PERMITS), and with
    /// [`Error::InvalidKey`] for a name that is not a valid key. A backend
    /// with a semaphore of its own ([`Locker::native_semaphore`]) gives
    /// that one: over a [`PgLocker`](crate::PgLocker) this is
    /// [`PgLocker::semaphore`](crate::PgLocker::semaphore), whose tries and
    /// waits cost less (see above).
    pub fn new(locker: Arc<dyn Locker>, name: &str, permits: u32) -> Result<Self, Error> {
        if let Some(native) = locker.native_semaphore(name, permits) {
            return native;
        }
        Self::build(name, permits, |_| Backend::Any(locker))
    }

    /// Checks the name and the count, then makes the backend's side (after
    /// the checks: the PostgreSQL side names every slot).
    fn build(
        name: &str,
        permits: u32,
        backend: impl FnOnce(NonZeroU32) -> Backend,
    ) -> Result<Self, Error> {
        let permits = NonZeroU32::new(permits)
            .filter(|permits| permits.get() <= Self::MAX_PERMITS)
            .ok_or_else(|| Error::InvalidArgument {
                argument: "permits",
                reason: format!(
                    "{permits}: a semaphore has 1 to {} permits",
                    Self::MAX_PERMITS
                ),
            })?;
        LockKey::from(name).validate()?;
        Ok(Self {
            name: name.into(),
            permits,
            backend: backend(permits),
            queue: Arc::new(Mutex::new(())),
        })
    }

    /// The semaphore's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The number of permits.
    pub fn permits(&self) -> u32 {
        self.permits.get()
    }

    /// How many permits no one holds right now, where the backend can tell:
    /// an estimate, stale as soon as it is read (another process may take or
    /// free a permit the next instant).
    ///
    /// On PostgreSQL ([`PgLocker::semaphore`](crate::PgLocker::semaphore))
    /// one statement reading `pg_locks` on a pooled connection; no answer
    /// within the heartbeat deadline (a stalled network) is
    /// [`Error::CommandTimedOut`], naming the semaphore, and that
    /// connection is closed. `Ok(None)` on every other backend, without a
    /// round trip.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it reads and takes nothing.
    pub async fn available_permits(&self) -> Result<Option<u32>, Error> {
        match &self.backend {
            Backend::Postgres(slots) => slots.available().await.map(Some),
            Backend::Any(_) => Ok(None),
        }
    }

    fn slot(&self, i: u32) -> LockKey {
        // The index after the last `#` tells slots apart: "a#1" slot 0
        // ("a#1#0") is never slot 10 of "a" ("a#10").
        LockKey::namespaced(Self::SLOT_NAMESPACE, &format!("{}#{i}", self.name))
    }

    /// Takes a free permit, without waiting; `Ok(None)` if all are held.
    ///
    /// On PostgreSQL ([`PgLocker::semaphore`](crate::PgLocker::semaphore))
    /// one statement on a pooled connection whatever the number of permits;
    /// it also answers `Ok(None)` while a waiter of any process is queued,
    /// since a freed permit is theirs; no answer within the heartbeat
    /// deadline (a stalled network) is [`Error::CommandTimedOut`], its
    /// connection closed; its errors name the semaphore
    /// (`LockKey::from(name)`), as its timeouts do. Elsewhere one
    /// `try_lock` per slot, in order, until one is granted: up to `permits`
    /// of them; a backend error names the semaphore too.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped call holds nothing (on PostgreSQL the
    /// connection is closed rather than pooled until the permit is handed
    /// out, so the server frees whatever it took).
    pub async fn try_acquire(&self) -> Result<Option<SemaphorePermit>, Error> {
        match &self.backend {
            Backend::Postgres(slots) => {
                let key = LockKey::from(&*self.name);
                let tried = async {
                    let taken = slots.try_acquire().await?;
                    Ok(taken
                        .map(|(slot, lock)| SemaphorePermit::on_session(slot, lock, slots.relay())))
                };
                crate::span::traced(&key, "postgres", "semaphore_try", Option::is_some, tried).await
            }
            Backend::Any(locker) => self.try_any(locker).await,
        }
    }

    async fn try_any(&self, locker: &Arc<dyn Locker>) -> Result<Option<SemaphorePermit>, Error> {
        // The caller named the semaphore, not its slots.
        let named = |err: Error| err.naming(&LockKey::from(&*self.name));
        for i in 0..self.permits.get() {
            if let Some(lease) = locker.try_lock(self.slot(i)).await.map_err(named)? {
                return Ok(Some(SemaphorePermit::any(i, lease)));
            }
        }
        Ok(None)
    }

    /// Takes a permit, waiting up to `timeout` for the whole call (the wait
    /// behind this process's other waiters, for a pooled connection, and on
    /// the server); [`Error::Timeout`] when the deadline passes, naming the
    /// semaphore, or [`Error::NoConnection`] when the pool had no connection
    /// to give before it. A pool that times out sooner is asked again until
    /// the deadline. A zero `timeout` is one [`try_acquire`](Self::try_acquire).
    /// Over other backends a try that fails for a reason that passes (no
    /// reply within the command deadline, a Redis server restarting or
    /// loading its data) counts as a busy one until the deadline, as the
    /// backend's own `lock` does; a permanent error ends the wait at once.
    /// On PostgreSQL the call returns at most 50 ms after the later of its
    /// deadline and the end of its first 250 ms (so a short timeout can
    /// take up to 300 ms: one shorter than the pool's round trips for a
    /// connection still gets one, and its try, as every waiting lock call
    /// does): a server answer slower than that (a slow or
    /// stalled network) is not waited for, its connection is closed
    /// instead, as is that of a background try of the slots (below) that
    /// gets no answer within the heartbeat deadline.
    ///
    /// On PostgreSQL ([`PgLocker::semaphore`](crate::PgLocker::semaphore)):
    /// 1 round trip when a permit is free and no waiter of the process is
    /// ahead; otherwise none for a permit handed over, and for a head 2 to
    /// take the queue, 1 to give it back if it is the last waiter (none when
    /// its own try on the queue's connection takes the slot: that statement
    /// gives the queue back), and the background tries (see "Waiting on
    /// PostgreSQL"), in arrival order. A permit handed over whose session
    /// ended before this call took it is not returned (the server freed its
    /// slot): the wait goes on, behind the process's waiters that came
    /// since.
    /// Elsewhere: tries every slot and polls (see the type's documentation).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future leaves no permit held, and the next
    /// waiter of the process takes its place in line. On PostgreSQL a
    /// dropped head closes the queue's connection (the server abandons the
    /// wait within 100 ms and frees anything it took), and a permit handed
    /// to a dropped waiter goes on to the next one (or is released).
    pub async fn acquire(&self, timeout: Duration) -> Result<SemaphorePermit, Error> {
        let started = Instant::now();
        if timeout.is_zero() {
            return self
                .try_acquire()
                .await?
                .ok_or_else(|| self.timed_out(started));
        }
        let deadline = crate::deadline::after_std(started, timeout);
        match &self.backend {
            // It keeps its own line, with its waiting connection.
            Backend::Postgres(slots) => {
                let key = LockKey::from(&*self.name);
                let waited = async {
                    let (slot, lock) = slots.acquire(&self.name, started, deadline).await?;
                    Ok(SemaphorePermit::on_session(slot, lock, slots.relay()))
                };
                crate::span::traced(&key, "postgres", "semaphore_wait", |_| true, waited).await
            }
            Backend::Any(locker) => {
                let Ok(_head) = tokio::time::timeout_at(deadline, self.queue.lock()).await else {
                    return Err(self.timed_out(started));
                };
                self.poll_any(locker, started, deadline).await
            }
        }
    }

    /// Tries every slot until one is granted or `deadline` passes. A try
    /// that fails for a reason that passes ([`Error::passes`]: a missed
    /// command deadline, a Redis restart) counts as a busy one.
    async fn poll_any(
        &self,
        locker: &Arc<dyn Locker>,
        started: Instant,
        deadline: tokio::time::Instant,
    ) -> Result<SemaphorePermit, Error> {
        let mut pause = Duration::from_millis(1);
        loop {
            match tokio::time::timeout_at(deadline, self.try_any(locker)).await {
                Ok(Ok(Some(permit))) => return Ok(permit),
                Ok(Ok(None)) => {}
                Ok(Err(err)) if err.passes() => {
                    tracing::debug!(error = %err, "distlock semaphore try failed; trying again");
                }
                Ok(Err(err)) => return Err(err),
                Err(_) => return Err(self.timed_out(started)),
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Err(self.timed_out(started));
            }
            tokio::time::sleep_until(crate::deadline::after(now, pause).min(deadline)).await;
            pause = (pause * 2).min(MAX_POLL_PAUSE);
        }
    }

    fn timed_out(&self, started: Instant) -> Error {
        crate::postgres::semaphore::timeout(&self.name, started)
    }
}

impl PgLocker {
    /// A [`Semaphore`] of `permits` permits named `name` on this locker's
    /// PostgreSQL database, with the PostgreSQL costs: a try is one
    /// statement whatever the number of permits; a waiter is told of a freed
    /// permit by its unlock (`NOTIFY`) instead of polling; the waiters of one
    /// `Semaphore` (and its clones) hold one pooled connection between them
    /// while they wait (the one holding the queue), and up to four more for
    /// the moment of a try (up to `permits` as a turn begins, never more
    /// than the pool has idle or may open); processes with waiters take
    /// turns on the server. See [`Semaphore`] ("Waiting on PostgreSQL"). In
    /// the multiplexed mode too, each held permit keeps a pooled connection
    /// of its own (a [`SessionLock`](crate::SessionLock) of the default
    /// mode).
    ///
    /// Refused with [`Error::InvalidArgument`] for zero permits or more than
    /// [`Semaphore::MAX_PERMITS`], and with [`Error::InvalidKey`] for a
    /// name that is not a valid key. Makes no round trip.
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
        Semaphore::build(name, permits, |permits| {
            Backend::Postgres(PgSlots::new(
                self.clone(),
                Semaphore::SLOT_NAMESPACE,
                name,
                permits.get(),
            ))
        })
    }
}
