//! Starts session locks' keepers when they are due (a short, fixed delay
//! after the grant, see `keeper.rs`): one task per `PgLocker` and runtime
//! instead of one task per lock at grant time, so a lock held for less than
//! that delay never spawns anything.
//!
//! A keeper starts on the runtime that took its lock: a locker shared
//! between runtimes has a task on each, so that a runtime that sits idle
//! (a current-thread runtime outside `block_on`) holds up only its own
//! locks' keepers, never another runtime's.
//!
//! Scheduling a keeper is a push onto a heap under a short mutex. The timer
//! task is woken only when the new keeper is due before every other (in
//! practice: when the heap was empty), since all keepers of a locker are due
//! the same delay after their grant and so arrive in the order they are due.
//! A lock taken and released at once while others are scheduled therefore
//! costs no task wake-up.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use tokio::runtime::{Handle, Id};
use tokio::sync::Notify;
use tokio::time::{Instant, sleep_until};

/// A keeper parked until it is due to start, as the timer sees it.
/// A trait, so that the timer depends on nothing of the keeper's (the
/// keeper parks itself here, see `keeper.rs`).
pub(crate) trait Parked: Send + Sync {
    /// Starts the parked keeper; nothing if it was started or taken
    /// meanwhile.
    fn start(&self);

    /// Stops the parked keeper: its runtime is going away.
    fn stop(&self);
}

/// A locker's timer: on each runtime, a task that starts with the first
/// session lock the locker takes there and ends once the locker is gone and
/// no keeper waits.
#[derive(Debug, Default)]
pub(crate) struct Timer {
    /// One per runtime that has a task, or keepers waiting for one.
    runtimes: Mutex<Vec<(Id, Arc<State>)>>,
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
    /// Starts the keeper parked in `slot` at `due` on the current runtime,
    /// unless the lock is gone by then. Never blocks (two short mutexes: the
    /// locker's list of runtimes, then the runtime's heap); spawns the
    /// runtime's timer task when none runs.
    pub(crate) fn schedule(&self, due: Instant, slot: Weak<dyn Parked>) {
        let Ok(runtime) = Handle::try_current() else {
            // No runtime to keep the lock on: stopped, the keeper closes the
            // connection and reports the loss (a false alarm, never a
            // missed one).
            if let Some(parked) = slot.upgrade() {
                parked.stop();
            }
            return;
        };
        let mut runtimes = self.runtimes.lock().unwrap_or_else(PoisonError::into_inner);
        let state = on(&mut runtimes, runtime.id());
        let mut heap = state.lock();
        let first = heap.due.peek().is_none_or(|Reverse(next)| due < next.at);
        heap.due.push(Reverse(Due { at: due, slot }));
        if !heap.running {
            heap.running = true;
            drop(heap);
            // The guard is made here, not inside the task: a runtime that is
            // shutting down drops a new task without polling it, and the
            // guard must still see that (or `running` would stay set and no
            // keeper of this locker would ever start again).
            let running = Running(Some(Arc::clone(&state)));
            tokio::spawn(run(Arc::clone(&state), running));
        } else if first {
            drop(heap);
            state.wake.notify_one();
        }
    }
}

/// The state of `runtime` among `runtimes`, added if it has none. Before a
/// state is added, those without a task and without waiting keepers are
/// dropped (their task ended, or their runtime shut down), so runtimes that
/// come and go leave nothing behind; a grant on a runtime that has a state
/// looks at no other.
fn on(runtimes: &mut Vec<(Id, Arc<State>)>, runtime: Id) -> Arc<State> {
    if let Some((_, state)) = runtimes.iter().find(|(id, _)| *id == runtime) {
        return Arc::clone(state);
    }
    runtimes.retain(|(_, state)| !state.lock().idle());
    let state = Arc::new(State::default());
    runtimes.push((runtime, Arc::clone(&state)));
    state
}

impl Drop for Timer {
    fn drop(&mut self) {
        let runtimes = self
            .runtimes
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        for (_, state) in runtimes.iter() {
            state.closed.store(true, Ordering::Release);
            state.wake.notify_one();
        }
    }
}

impl Heap {
    /// No task runs for it and no keeper waits in it.
    fn idle(&self) -> bool {
        !self.running && self.due.is_empty()
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
async fn run(state: Arc<State>, mut running: Running) {
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
/// runtime (which only happens when the runtime shuts down), so the next
/// `schedule` spawns another.
///
/// The keepers still parked in the heap are stopped then: their locks were
/// taken on the runtime that is going away (their sockets belong to its I/O
/// driver), no task will ever start them there, and a guard that outlives
/// the runtime must not go on claiming its lock. Stopping a parked keeper
/// closes its connection and reports `KeeperStopped` (see `Keeper`'s
/// `Drop`). The other runtimes' keepers wait in heaps of their own.
struct Running(Option<Arc<State>>);

impl Drop for Running {
    fn drop(&mut self) {
        let Some(state) = self.0.take() else {
            return;
        };
        let parked = {
            let mut heap = state.lock();
            heap.running = false;
            std::mem::take(&mut heap.due)
        };
        // Outside the heap's mutex: stopping a keeper closes its connection.
        for Reverse(due) in parked {
            if let Some(parked) = due.slot.upgrade() {
                parked.stop();
            }
        }
    }
}

/// Starts the keeper parked in `due`'s slot, if the lock is still held and
/// its keeper still parked.
fn start(due: &Due) {
    if let Some(parked) = due.slot.upgrade() {
        parked.start();
    }
}

/// When a parked keeper is due to start.
struct Due {
    at: Instant,
    slot: Weak<dyn Parked>,
}

impl std::fmt::Debug for Due {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Due")
            .field("at", &self.at)
            .finish_non_exhaustive()
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Nothing parked: the lock was gone before its first heartbeat.
    struct Gone;

    impl Parked for Gone {
        fn start(&self) {}
        fn stop(&self) {}
    }

    fn gone() -> Weak<dyn Parked> {
        Weak::<Gone>::new()
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a current-thread runtime")
    }

    /// A keeper that records when it is started.
    #[derive(Default)]
    struct Started(AtomicBool);

    impl Parked for Started {
        fn start(&self) {
            self.0.store(true, Ordering::Release);
        }
        fn stop(&self) {}
    }

    /// Runs `runtime` until `started` says its keeper started, or fails
    /// after a generous bound.
    fn until_started(runtime: &tokio::runtime::Runtime, started: &Started) {
        runtime.block_on(async {
            let since = Instant::now();
            while !started.0.load(Ordering::Acquire) {
                assert!(
                    since.elapsed() < std::time::Duration::from_secs(5),
                    "the keeper never started"
                );
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        });
    }

    /// A keeper scheduled on one runtime starts there, while the runtime
    /// that started the locker's timer sits idle (outside `block_on`).
    #[test]
    fn a_keeper_starts_on_its_own_runtime_while_another_sits_idle() {
        let timer = Timer::default();
        let idle = runtime();
        let first = Arc::new(Started::default());
        let parked: Arc<dyn Parked> = first.clone();
        idle.block_on(async { timer.schedule(Instant::now(), Arc::downgrade(&parked)) });
        until_started(&idle, &first);
        // `idle` runs nothing from here on; its task still counts as running.
        let busy = runtime();
        let second = Arc::new(Started::default());
        let parked: Arc<dyn Parked> = second.clone();
        busy.block_on(async { timer.schedule(Instant::now(), Arc::downgrade(&parked)) });
        until_started(&busy, &second);
        assert_eq!(timer.runtimes.lock().expect("runtimes").len(), 2);
    }

    /// A timer whose first task is spawned on a runtime that is already
    /// shutting down (the task is dropped unpolled) must spawn a new one on
    /// the next runtime, or no keeper of its locker would ever start; the
    /// dead runtime's state is dropped as the next one is added.
    #[test]
    fn a_task_dropped_unpolled_does_not_leave_the_timer_stuck() {
        let timer = Timer::default();
        let dead = runtime();
        let handle = dead.handle().clone();
        drop(dead);
        {
            let _entered = handle.enter();
            timer.schedule(Instant::now(), gone());
        }
        let alive = runtime();
        alive.block_on(async {
            timer.schedule(Instant::now(), gone());
            // The task takes what is due at once; give it a generous bound.
            let started = Instant::now();
            while !timer.runtimes.lock().expect("runtimes")[..]
                .iter()
                .all(|(_, state)| state.lock().due.is_empty())
            {
                assert!(
                    started.elapsed() < std::time::Duration::from_secs(5),
                    "the timer task never ran on the second runtime"
                );
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        });
        assert_eq!(
            timer.runtimes.lock().expect("runtimes").len(),
            1,
            "the dead runtime's state is dropped"
        );
    }
}
