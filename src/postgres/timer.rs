//! Starts session locks' keepers when their first heartbeat is due: one
//! task per `PgLocker` instead of one task per lock at grant time, so a lock
//! held for less than one heartbeat interval never spawns anything.
//!
//! Scheduling a keeper is a push onto a heap under a short mutex. The timer
//! task is woken only when the new keeper is due before every other (in
//! practice: when the heap was empty), since all keepers of a locker share
//! one heartbeat interval and so arrive in the order they are due. A lock
//! taken and released at once therefore costs no task wake-up.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};

use tokio::sync::Notify;
use tokio::time::{Instant, sleep_until};
use tracing::Instrument;

use super::keeper::Shared;

/// A locker's timer; its task starts with the locker's first session lock
/// and ends once the locker is gone and no keeper waits.
#[derive(Debug, Default)]
pub(crate) struct Timer {
    state: OnceLock<Arc<State>>,
}

#[derive(Debug, Default)]
struct State {
    heap: Mutex<Heap>,
    /// Woken when a keeper is due before the task's next wake-up, or the
    /// locker is gone.
    wake: Notify,
    /// The locker is gone: the task ends once the heap is empty.
    closed: AtomicBool,
}

#[derive(Debug, Default)]
struct Heap {
    due: BinaryHeap<Reverse<Due>>,
    /// Whether a task runs for this heap (false once its runtime dropped it).
    running: bool,
}

impl Timer {
    /// Starts the keeper parked in `slot` at `due`, unless the lock is gone
    /// by then. Never blocks (a short mutex); spawns the timer task when
    /// none runs.
    pub(crate) fn schedule(&self, due: Instant, slot: Weak<Shared>) {
        let state = self.state.get_or_init(Arc::default);
        let mut heap = state.lock();
        let first = heap.due.peek().is_none_or(|Reverse(next)| due < next.at);
        heap.due.push(Reverse(Due { at: due, slot }));
        if !heap.running {
            heap.running = true;
            drop(heap);
            tokio::spawn(run(Arc::clone(state)));
        } else if first {
            drop(heap);
            state.wake.notify_one();
        }
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        if let Some(state) = self.state.get() {
            state.closed.store(true, Ordering::Release);
            state.wake.notify_one();
        }
    }
}

impl State {
    fn lock(&self) -> MutexGuard<'_, Heap> {
        self.heap.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes out what is due at `now`; returns it, when the next keeper is
    /// due, and whether the task should end (the locker is gone, nothing
    /// waits). Ending is decided under the mutex, so a keeper scheduled at
    /// the same moment spawns a new task.
    fn take_due(&self, now: Instant) -> (Vec<Due>, Option<Instant>, bool) {
        let mut heap = self.lock();
        let mut due = Vec::new();
        while heap.due.peek().is_some_and(|Reverse(next)| next.at <= now) {
            if let Some(Reverse(next)) = heap.due.pop() {
                due.push(next);
            }
        }
        let next = heap.due.peek().map(|Reverse(next)| next.at);
        let end = next.is_none() && self.closed.load(Ordering::Acquire);
        if end {
            heap.running = false;
        }
        (due, next, end)
    }
}

/// The timer task.
async fn run(state: Arc<State>) {
    // If the runtime drops this task, the next `schedule` spawns another.
    let mut running = Running(Some(Arc::clone(&state)));
    loop {
        let (due, next, end) = state.take_due(Instant::now());
        for due in &due {
            start(due);
        }
        if end {
            // `take_due` marked the heap task-less already; a task spawned
            // since then must stay marked as running.
            running.0 = None;
            return;
        }
        match next {
            Some(next) => tokio::select! {
                () = sleep_until(next) => {}
                () = state.wake.notified() => {}
            },
            None => state.wake.notified().await,
        }
    }
}

/// Marks the heap as having no task when the task is dropped by its
/// runtime.
struct Running(Option<Arc<State>>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(state) = self.0.take() {
            state.lock().running = false;
        }
    }
}

/// Starts the keeper parked in `due`'s slot, if the lock is still held and
/// its keeper still parked.
fn start(due: &Due) {
    if let Some(shared) = due.slot.upgrade()
        && let Some(keeper) = shared.unpark()
    {
        let span = keeper.span();
        tokio::spawn(keeper.run(due.at).instrument(span));
    }
}

/// A parked keeper's first heartbeat.
#[derive(Debug)]
struct Due {
    at: Instant,
    slot: Weak<Shared>,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
    }
}

impl Eq for Due {}

impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Due {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.at.cmp(&other.at)
    }
}
