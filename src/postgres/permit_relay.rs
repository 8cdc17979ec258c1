//! A process's turn at a semaphore's permits: while one of its connections
//! holds the semaphore's queue lock on the server, a permit given up in the
//! process goes straight to its earliest waiter, without a round trip, and
//! so does every permit the process's background tries take.
//!
//! While a connection of a process holds the queue, that process is first
//! in line across every process: a plain try of any process takes nothing,
//! and any freed permit would go to it (it tries the slots at the freed
//! permit's announcement). So a holder *of the same process* that gives its
//! permit up then does not unlock the slot: it hands the guard, its
//! connection still holding the slot, to the process's earliest waiter.
//! Nobody's turn changes, and the permit never sits idle for the unlock, the
//! announcement and a try (about two round trips).
//!
//! The turn is bounded: after [`TURN`] × permits hand-overs, the head asks
//! whether another process waits for the queue and, if one does, gives the
//! queue back and lines up again behind it. The connection holding the
//! queue outlives the head that took it ([`Tenure`]): a served head leaves
//! it parked here for the process's next head, as long as the process has
//! waiters.
//!
//! With fencing, a permit given up is not handed over: its holder used its
//! token, and the next holder must draw its own on the server. A permit the
//! background tries take is handed over: its token is fresh.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use tokio::sync::{Notify, oneshot};

use crate::SessionLock;
use crate::postgres::conn::held::HeldConn;

/// Hand-overs per permit in one turn of a process, before it asks whether
/// another process waits.
pub(crate) const TURN: u32 = 4;

/// A permit handed over: its slot and its guard.
#[derive(Debug)]
pub(crate) struct Passed {
    pub(crate) slot: u32,
    pub(crate) lock: SessionLock,
}

/// The turn of a semaphore's waiters in one process (a `Semaphore` and its
/// clones).
#[derive(Debug, Clone)]
pub(crate) struct Relay {
    state: Arc<Mutex<State>>,
    /// Wakes the head when the turn is used up, or a fill failed.
    used_up: Arc<Notify>,
}

#[derive(Debug)]
struct State {
    /// Counts registrations, so that each waiter ends only its own.
    last: u64,
    /// The process's waiters in arrival order, and where to send each one a
    /// permit.
    waiters: VecDeque<(u64, oneshot::Sender<Passed>)>,
    /// A connection of the process holds the queue (a [`Turn`] lives).
    open: bool,
    /// Hand-overs in this turn.
    passes: u32,
    /// A fill runs (see `PgSlots::filling`); `.1`: another was asked for
    /// meanwhile.
    filling: (bool, bool),
    /// The fill's next round may try every slot: it was asked for as the
    /// turn began, when any number of slots may be free.
    wide: bool,
    /// The latest deadline of the heads that asked for the running fill:
    /// its tries wait for a pooled connection until then, not until the
    /// deadline of the head that started it, which may have left.
    fill_until: Option<tokio::time::Instant>,
    /// What the last fill failed with, for the head to report.
    failure: Option<crate::Error>,
    /// Hand-overs a turn allows before the head asks whether another
    /// process waits; 0: none (fencing).
    limit: u32,
    /// The connection holding the queue, between two heads.
    parked: Option<Tenure>,
}

/// A connection that holds the queue, with what its line-up found.
#[derive(Debug)]
pub(crate) struct Tenure {
    pub(crate) conn: HeldConn,
    pub(crate) waiting: Waiting,
    /// When the connection ran its last statement (the idle guard counts
    /// from there).
    pub(crate) used: tokio::time::Instant,
    /// Slots may be free that no announcement will name (the turn just
    /// began, or the last head took a free slot): the next head tries at
    /// once.
    pub(crate) fresh: bool,
    /// The turn just began: its first fill may try every slot.
    pub(crate) began: bool,
    turn: Turn,
}

/// A head's connection while it holds the queue: its backend, the
/// session's `idle_session_timeout` from before the guard the line-up set
/// (given back with the queue or when the connection becomes a permit's),
/// and whether the session has a limit on a wait that the head's waits
/// lift (`unlimited`).
#[derive(Debug, Clone)]
pub(crate) struct Waiting {
    pub(crate) pid: i32,
    pub(crate) idle_timeout: String,
    pub(crate) limited: bool,
}

/// Open while it lives: dropped (the connection given back or closed), the
/// process's turn is over and no permit is handed over any more.
#[derive(Debug)]
struct Turn {
    /// Weak: a parked tenure lives in the state it points to.
    state: Weak<Mutex<State>>,
}

/// A waiter's registration, from [`Relay::expect`] until drop.
#[derive(Debug)]
pub(crate) struct Pass {
    relay: Relay,
    id: u64,
    /// How many waiters of the process were ahead of it on arrival.
    ahead: usize,
    /// `None` once it has completed (a oneshot receiver must not be
    /// polled again then).
    passed: Option<oneshot::Receiver<Passed>>,
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // Nothing that runs under the lock panics; a poisoned lock still holds
    // a consistent state.
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Relay {
    /// A relay that allows `limit` hand-overs a turn (0: none).
    pub(crate) fn new(limit: u32) -> Self {
        Self {
            state: Arc::new(Mutex::new(State {
                last: 0,
                waiters: VecDeque::new(),
                open: false,
                passes: 0,
                filling: (false, false),
                wide: false,
                fill_until: None,
                failure: None,
                limit,
                parked: None,
            })),
            used_up: Arc::new(Notify::new()),
        }
    }

    /// Registers a waiter, behind the process's earlier ones. Never waits.
    pub(crate) fn expect(&self) -> Pass {
        let (send, passed) = oneshot::channel();
        let mut state = lock(&self.state);
        state.last = state.last.wrapping_add(1);
        let id = state.last;
        state.waiters.retain(|(_, waiter)| !waiter.is_closed());
        let ahead = state.waiters.len();
        state.waiters.push_back((id, send));
        Pass {
            relay: self.clone(),
            id,
            ahead,
            passed: Some(passed),
        }
    }

    /// Hands `lock` (slot `slot`) to the process's earliest waiter during
    /// its turn; gives it back when there is no turn, no waiter, or the
    /// lock is lost (the caller then releases it as usual), and, with
    /// fencing, when it is not `fresh` (a permit given up, whose token its
    /// holder used; a fresh grant's token is its own). Never waits.
    pub(crate) fn offer(&self, slot: u32, lock: SessionLock, fresh: bool) -> Option<SessionLock> {
        if lock.is_lost() {
            return Some(lock);
        }
        let mut state = self::lock(&self.state);
        if !state.open || (state.limit == 0 && !fresh) {
            return Some(lock);
        }
        let mut passed = Passed { slot, lock };
        // Sent under the lock, so that a waiter that ends its registration
        // either finds it still there or finds the permit in its channel.
        while let Some((_, waiter)) = state.waiters.pop_front() {
            match waiter.send(passed) {
                Ok(()) => {
                    state.passes = state.passes.saturating_add(1);
                    if state.passes == state.limit {
                        self.used_up.notify_one();
                    }
                    return None;
                }
                Err(back) => passed = back,
            }
        }
        Some(passed.lock)
    }

    /// Opens the process's turn: `conn` holds the queue now.
    pub(crate) fn open(&self, conn: HeldConn, waiting: Waiting) -> Tenure {
        let mut state = lock(&self.state);
        state.open = true;
        state.passes = 0;
        // A failure of an earlier turn's fill is not this turn's.
        state.failure = None;
        Tenure {
            conn,
            waiting,
            used: tokio::time::Instant::now(),
            fresh: true,
            began: true,
            turn: Turn {
                state: Arc::downgrade(&self.state),
            },
        }
    }

    /// The connection a head left holding the queue, if one did.
    pub(crate) fn adopt(&self) -> Option<Tenure> {
        lock(&self.state).parked.take()
    }

    /// Leaves `tenure` for the process's next head; gives it back when no
    /// waiter is left to take it over.
    pub(crate) fn park(&self, tenure: Tenure) -> Option<Tenure> {
        let mut state = lock(&self.state);
        state.waiters.retain(|(_, waiter)| !waiter.is_closed());
        if state.waiters.is_empty() || state.parked.is_some() {
            return Some(tenure);
        }
        state.parked = Some(tenure);
        None
    }

    /// How many of the process's waiters are registered.
    pub(crate) fn waiters(&self) -> usize {
        lock(&self.state).waiters.len()
    }

    /// Marks a fill as running for a head whose wait ends at `deadline`
    /// (`wide`: its next round may try every slot): `true` when the caller
    /// starts it, `false` when one runs already (which then runs once
    /// more, until the later deadline).
    pub(crate) fn begin_fill(&self, deadline: tokio::time::Instant, wide: bool) -> bool {
        let mut state = lock(&self.state);
        state.wide |= wide;
        state.fill_until = Some(
            state
                .fill_until
                .map_or(deadline, |until| until.max(deadline)),
        );
        if state.filling.0 {
            state.filling.1 = true;
            return false;
        }
        state.filling = (true, false);
        true
    }

    /// A fill's round ended (`again`: every try took a slot): `true` when
    /// it runs once more.
    pub(crate) fn end_fill(&self, again: bool) -> bool {
        let mut state = lock(&self.state);
        let more = (again || state.filling.1) && state.open && !state.waiters.is_empty();
        state.filling = (more, false);
        if !more {
            state.fill_until = None;
            state.wide = false;
        }
        more
    }

    /// Whether the fill's round about to start may try every slot (once).
    pub(crate) fn take_wide(&self) -> bool {
        std::mem::take(&mut lock(&self.state).wide)
    }

    /// Until when the running fill's tries wait for a pooled connection
    /// (see [`begin_fill`](Self::begin_fill)).
    pub(crate) fn fill_until(&self) -> Option<tokio::time::Instant> {
        lock(&self.state).fill_until
    }

    /// Keeps a fill's failure for the head.
    pub(crate) fn fail(&self, err: crate::Error) {
        lock(&self.state).failure = Some(err);
        self.used_up.notify_one();
    }

    /// A fill's failure, once.
    pub(crate) fn take_failure(&self) -> Option<crate::Error> {
        lock(&self.state).failure.take()
    }

    /// Whether a connection of the process holds the queue.
    pub(crate) fn is_open(&self) -> bool {
        lock(&self.state).open
    }

    /// Whether this turn's hand-overs are used up: the head asks whether
    /// another process waits for the queue, and if one does, gives the
    /// queue back and lines up again.
    pub(crate) fn used_up(&self) -> bool {
        let state = lock(&self.state);
        state.limit > 0 && state.passes >= state.limit
    }

    /// No other process waits: the turn starts over.
    pub(crate) fn renew(&self) {
        lock(&self.state).passes = 0;
    }

    /// Completes once the turn's hand-overs are used up (or spuriously:
    /// check [`used_up`](Self::used_up)).
    pub(crate) async fn until_used_up(&self) {
        self.used_up.notified().await;
    }
}

impl Tenure {
    /// Ends the turn, for the caller to give the queue back (or to let the
    /// statement that took a slot on the connection have given it back).
    pub(crate) fn close(self) -> (HeldConn, Waiting) {
        let Tenure {
            conn,
            waiting,
            turn,
            ..
        } = self;
        drop(turn);
        (conn, waiting)
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        if let Some(state) = self.state.upgrade() {
            lock(&state).open = false;
        }
    }
}

impl Pass {
    /// How many waiters of the process were ahead of this one on arrival.
    pub(crate) fn ahead(&self) -> usize {
        self.ahead
    }

    /// Completes with a permit handed over; never, once it has been
    /// received or the registration ended.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a permit sent meanwhile stays in the channel for the
    /// next call or [`take`](Self::take).
    pub(crate) async fn recv(&mut self) -> Passed {
        if let Some(passed) = self.passed.as_mut() {
            let outcome = passed.await;
            self.passed = None;
            if let Ok(passed) = outcome {
                return passed;
            }
        }
        std::future::pending().await
    }

    /// A permit handed over already, if one is: the registration stays.
    pub(crate) fn ready(&mut self) -> Option<Passed> {
        let passed = self.passed.as_mut()?;
        match passed.try_recv() {
            Ok(passed) => {
                self.passed = None;
                Some(passed)
            }
            Err(oneshot::error::TryRecvError::Closed) => {
                self.passed = None;
                None
            }
            Err(oneshot::error::TryRecvError::Empty) => None,
        }
    }

    /// Ends the registration; a permit handed over before it ended is
    /// returned.
    pub(crate) fn take(&mut self) -> Option<Passed> {
        self.end();
        self.ready()
    }

    fn end(&self) {
        let mut state = lock(&self.relay.state);
        if let Some(at) = state.waiters.iter().position(|(id, _)| *id == self.id) {
            state.waiters.remove(at);
        }
        state.waiters.retain(|(_, waiter)| !waiter.is_closed());
        // No waiter is left to take the parked connection over: closing it
        // gives the queue back at once (outside the lock: its turn's drop
        // takes it).
        let orphan = if state.waiters.is_empty() {
            state.parked.take()
        } else {
            None
        };
        drop(state);
        drop(orphan);
    }
}

impl Drop for Pass {
    /// A permit handed over that the waiter did not take goes on to the
    /// next waiter, or is released by its guard in the background.
    fn drop(&mut self) {
        // Nobody used it: its token, if any, is still fresh.
        if let Some(Passed { slot, lock }) = self.take() {
            drop(self.relay.offer(slot, lock, true));
        }
    }
}
