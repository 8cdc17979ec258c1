//! Multiplexed session locks: many session locks held over a few shared,
//! dedicated connections (`PgLocker::builder(pool).multiplex(n)`).
//!
//! # Design
//!
//! - **Pinning.** A key always goes to the same connection (its hash modulo
//!   `n`), so each connection's driver task sees every request for its keys
//!   in order and can keep the set of keys it holds without any lock.
//! - **Re-entrancy.** PostgreSQL session locks are re-entrant per session:
//!   two tries of one key on one shared session would both succeed. The
//!   driver treats a key it already holds as busy (no round trip), and since
//!   two different `LockKey`s can name one server lock, the try statement
//!   returns the resolved key and a re-entrant grant is taken back at once
//!   (one extra round trip, only in that case).
//! - **Loss.** One heartbeat per connection; every answer is checked for the
//!   backend pid. A failed, stalled or moved connection publishes the loss
//!   on one watch channel that all its guards share, so all its locks are
//!   lost at once; the socket is dropped (the server frees the locks) and the
//!   next acquisition pinned there opens a fresh connection. So does an
//!   unlock that finds its lock gone: on the driver's own session only
//!   another client sharing it can have released it, which puts every other
//!   lock there in doubt.
//! - **Waiting.** `lock()` never waits on a shared connection (that would
//!   stall every other lock on it). It tries on the shared connection, and
//!   while the key is busy waits on a temporary pooled connection for the
//!   holder to let go (`pg_advisory_lock` then `pg_advisory_unlock` in one
//!   statement, under `lock_timeout`: exclusive, as the lock it wakes up
//!   for is, so a reader holding the key keeps it waiting), then tries
//!   again, until the deadline. A hand-off therefore costs two round trips
//!   after the holder's unlock (the wake-up's answer, then the try) instead
//!   of none, and is not FIFO: another process may take the key between the
//!   wake-up and the try. Each waiter on the server gives the key back the
//!   moment it gets it, so they all wake one after the other within
//!   moments: the waiters of one key in this process queue on an
//!   in-process gate and only the first waits on the server; otherwise
//!   every hand-off would wake (and retry) all of them, each on a pooled
//!   connection of its own.
//! - **Cancellation.** Callers only exchange messages with drivers. A grant
//!   travels as a [`request::Ticket`] whose `Drop` queues the unlock, so a
//!   caller that goes away at any `.await` leaves nothing held; a waiting
//!   connection is closed, not pooled, if dropped mid-wait. This is also
//!   what lets `lock()` abandon a try on a stalled connection at its
//!   deadline.

mod driver;
mod gate;
mod place;
mod refusal;
mod release;
mod request;
mod sql;
mod wait;

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, PoisonError};

use sqlx::PgPool;
use tokio::sync::mpsc::error::SendError;
use tokio::sync::oneshot;

use crate::postgres::config::Config;
use crate::postgres::session::guard::SessionLock;
use crate::{Error, LockKey};
use driver::DriverConfig;
use place::Place;
use request::{Granted, Inbox, Request, TryError};

/// How many times a try moves to a fresh connection when the shared one
/// fails under it before the failure is reported.
const ATTEMPTS: usize = 3;

/// The shared connections of one multiplexed `PgLocker`.
#[derive(Debug)]
pub(crate) struct Mux {
    pool: PgPool,
    config: Config,
    /// One inbox per shared connection; replaced when its driver has ended.
    slots: Box<[Mutex<Option<Inbox>>]>,
    /// Where this process's waiters for one key queue (see `gate`).
    gates: gate::Gates,
    /// Locks held (or being acquired) through this multiplexer, against
    /// `config.max_locks`.
    held: Arc<AtomicUsize>,
}

impl Mux {
    /// A multiplexer over `connections` shared connections (at least one),
    /// opened lazily on first use. Needs no runtime until then.
    pub(crate) fn new(pool: PgPool, config: Config, connections: usize) -> Self {
        let slots = (0..connections.max(1)).map(|_| Mutex::new(None)).collect();
        Self {
            pool,
            config,
            slots,
            gates: gate::Gates::default(),
            held: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Takes a place under `max_locks`, or fails with
    /// [`Error::TooManyLocks`].
    fn place(&self) -> Result<Place, Error> {
        let Some(limit) = self.config.max_locks else {
            return Ok(Place::unlimited());
        };
        let (place, before) = Place::counted(&self.held);
        if before >= limit {
            return Err(Error::TooManyLocks { limit });
        }
        Ok(place)
    }

    /// `try_lock` on a shared connection. Costs 1 round trip, queued behind
    /// the statements of the other locks on that connection, each of which
    /// answers within the heartbeat deadline or ends the connection. A try
    /// that must open a shared connection waits for it up to the pool's
    /// acquire timeout, twice where it fails (see [`Mux::attempt`]): not
    /// bounded by the heartbeat deadline, which opening a connection under
    /// a connection limit can outlast.
    pub(crate) async fn try_lock(&self, key: LockKey) -> Result<Option<SessionLock>, Error> {
        self.attempt(&key).await
    }

    /// One try on `key`'s shared connection, moving to a fresh connection
    /// when the shared one fails under it. Records nothing. Unbounded: each
    /// fresh connection may spend twice the pool's acquire timeout failing
    /// to open (its deadline, then one direct attempt to tell why).
    ///
    /// Cancel safe: it only awaits the driver's answer, and the guard is
    /// built after that without awaiting. A grant whose caller went away is
    /// dropped in the channel, and its ticket's `Drop` queues the unlock; the
    /// place under `max_locks` travels with the request, and a grant's
    /// ticket keeps it until the unlock has run (see [`Place`]).
    async fn attempt(&self, key: &LockKey) -> Result<Option<SessionLock>, Error> {
        key.validate()?;
        let mut kept = Some(self.place()?);
        let fencing = self.config.fencing;
        for _ in 0..ATTEMPTS {
            // The driver keeps the place with a grant, or drops it.
            let place = match kept.take() {
                Some(place) => place,
                None => self.place()?,
            };
            let (reply, answer) = oneshot::channel();
            let request = Request::Try {
                key: key.clone(),
                fencing,
                reply,
                place,
            };
            if let Err(SendError(unsent)) = self.inbox(key).send(request) {
                // The driver just ended; the next call opens a new one.
                if let Request::Try { place, .. } = unsent {
                    kept = Some(place);
                }
                continue;
            }
            match answer.await {
                Ok(Ok(Some(granted))) => {
                    return Ok(Some(self.new_guard(key.clone(), granted)));
                }
                Ok(Ok(None)) => return Ok(None),
                Ok(Err(TryError::Failed(err))) => return Err(err),
                // The shared connection failed under the try; nothing is
                // held for it. Go again on a fresh one.
                Ok(Err(TryError::Gone)) | Err(_) => {}
            }
        }
        Err(Error::MultiplexFailed {
            key: key.clone(),
            attempts: ATTEMPTS,
        })
    }

    /// The inbox of the live driver for `key`'s connection, starting one if
    /// there is none (never awaits: the connection opens inside the task).
    fn inbox(&self, key: &LockKey) -> Inbox {
        let mut hasher = DefaultHasher::new();
        key.hash(&mut hasher);
        let slots = self.slots.len();
        // `slots` is at least 1; the remainder always fits in a usize.
        let slot = usize::try_from(hasher.finish() % slots as u64).unwrap_or(0);
        let mut current = self.slots[slot]
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match current.as_ref() {
            Some(inbox) if !inbox.is_closed() => inbox.clone(),
            _ => {
                let inbox = driver::spawn(self.driver_config(), slot);
                *current = Some(inbox.clone());
                inbox
            }
        }
    }

    fn driver_config(&self) -> DriverConfig {
        DriverConfig {
            connect: (*self.pool.connect_options()).clone(),
            connect_timeout: self.pool.options().get_acquire_timeout(),
            heartbeat: self.config.heartbeat,
            statement_timeout: self.config.heartbeat_timeout,
        }
    }

    /// Turns a grant into the public guard, which holds the ticket.
    fn new_guard(&self, key: LockKey, granted: Granted) -> SessionLock {
        let Granted {
            ticket,
            pid,
            token,
            loss,
        } = granted;
        let held = release::Held {
            key: key.clone(),
            ticket,
            loss: loss.clone(),
            deadline: self.config.release_timeout,
        };
        SessionLock::from_parts(key, token, pid, loss, Box::new(held))
    }

    /// The pool that temporary waiting connections come from.
    fn pool(&self) -> &PgPool {
        &self.pool
    }
}
