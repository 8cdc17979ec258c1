//! The task that keeps a session lock: it watches the lock's connection
//! while idle, runs the heartbeat, reports loss, and releases the lock of a
//! guard dropped without `release()`.
//!
//! It waits parked in the lock's [`Slot`] until [`WATCH_AFTER`] after the
//! grant, when the locker's [`Timer`] starts it; a lock released before then
//! never spawns a task.
//!
//! Running, it reads the connection's socket whenever no statement runs on
//! it ([`HeldConn::poll_goodbye`]), so a session the server ends
//! (terminated, shut down, crashed, switched over: it sends its goodbye and
//! closes the socket) is lost at once, not at the next heartbeat. A goodbye
//! that came before the keeper started is read as it starts. The heartbeat
//! stays for the failures nobody announces (a partition, a stalled server).
//! The socket is read without holding the connection between reads, so
//! `release()` still takes it at once, on the caller's task.

use std::future::Future;
use std::sync::{Arc, Weak};
use std::task::Poll;
use std::time::Duration;

use tokio::sync::MutexGuard;
use tokio::time::{Instant, sleep_until};
use tracing::Instrument;

use crate::loss_state::{self, LossSender, LossState};
use crate::postgres::config::Config;
use crate::postgres::conn::held::HeldConn;
use crate::postgres::session::heartbeat::{HEARTBEAT, heartbeat};
use crate::postgres::session::hold::Hold;
use crate::postgres::session::slot::Slot;
use crate::postgres::session::timer::{Parked, Timer};
use crate::postgres::session::unlock::unlock;
use crate::{LockKey, LossReason};

/// The slot of a session lock, as its guard holds it.
pub(crate) type KeeperSlot = Arc<Slot<Keeper>>;

/// How long after the grant a lock's keeper starts, and with it the watch
/// on its connection. Short against the 50 ms within which a holder must
/// learn of a server-ended session (a goodbye that came earlier is read as
/// the keeper starts); long enough that a lock taken and released at once
/// never spawns a task.
pub(crate) const WATCH_AFTER: Duration = Duration::from_millis(10);

/// The keeper's end of a session lock.
pub(crate) struct Keeper {
    slot: KeeperSlot,
    key: LockKey,
    hold: Hold,
    pid: i32,
    heartbeat: Duration,
    heartbeat_timeout: Duration,
    release_timeout: Duration,
    /// When the keeper is due to start, and with it the watch.
    watch_from: Instant,
    /// When the first heartbeat is due.
    first_beat: Instant,
    loss: LossSender,
}

impl std::fmt::Debug for Keeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keeper")
            .field("key", &self.key)
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

/// A keeper that goes away while its lock is still in the slot was stopped
/// from outside: its runtime shut down (dropping its task, or the timer that
/// would have started it), or it was dropped unstarted. Nothing keeps the
/// lock any more, so the guard is told it is lost and the connection is
/// closed, which frees the lock on the server. A keeper that ends normally
/// finds the slot empty (released, lost, or released in the background).
impl Drop for Keeper {
    fn drop(&mut self) {
        // A busy slot is being released, or a heartbeat dropped mid-flight
        // still holds it (its connection then closes with the slot), or an
        // upgrade or downgrade does, which finds the lock lost when it ends
        // (`InFlight::finish`) and closes the connection then.
        let Some(mut slot) = self.slot.try_conn() else {
            return;
        };
        let Some(mut conn) = slot.take() else {
            return;
        };
        tracing::warn!(key = %self.key, "distlock session lock lost: its keeper stopped");
        crate::metrics::lost("postgres", &self.key);
        conn.close_now();
        self.loss.send_if_modified(|loss| {
            let unset = loss.is_none();
            if unset {
                *loss = Some(LossReason::KeeperStopped);
            }
            unset
        });
    }
}

/// The guard's end of a session lock.
pub(crate) struct GuardEnd {
    pub(crate) slot: KeeperSlot,
    pub(crate) loss: LossState,
}

impl Keeper {
    pub(crate) fn new(
        conn: HeldConn,
        (key, hold): (LockKey, Hold),
        pid: i32,
        config: &Config,
    ) -> (Self, GuardEnd) {
        let slot = Slot::new(conn);
        let (loss, loss_rx) = loss_state::channel(LossReason::KeeperStopped);
        let granted = Instant::now();
        let first_beat = crate::deadline::after(granted, config.heartbeat);
        let keeper = Self {
            slot: Arc::clone(&slot),
            key,
            hold,
            pid,
            heartbeat: config.heartbeat,
            heartbeat_timeout: config.heartbeat_timeout,
            release_timeout: config.release_timeout,
            watch_from: crate::deadline::after(granted, WATCH_AFTER).min(first_beat),
            first_beat,
            loss,
        };
        let guard = GuardEnd {
            slot,
            loss: loss_rx,
        };
        (keeper, guard)
    }

    /// Runs until the guard is released, dropped or lost; a dropped guard's
    /// lock is released here. If the task is cancelled instead (the runtime
    /// shuts down), dropping the keeper closes the connection, so the server
    /// frees the lock, and tells the guard it is lost (see `Drop`).
    async fn run(self) {
        // `sleep_until` rather than `interval`: an interval's first tick fires
        // at once and would put a heartbeat in front of a quick release.
        let mut next = self.first_beat;
        let held_since = Instant::now();
        let slot = Arc::clone(&self.slot);
        loop {
            tokio::select! {
                biased;
                () = slot.let_go() => return self.release_dropped(held_since).await,
                () = sleep_until(next) => {
                    match self.beat().await {
                        Beat::Alive => {}
                        Beat::Released => return,
                        // The loss stays readable through the guard's loss
                        // state after this task ends.
                        Beat::Lost => return,
                    }
                    next = crate::deadline::from_now(self.heartbeat);
                }
                // An upgrade or downgrade read the socket on its caller's
                // task: watch it again, from a fresh read.
                () = slot.rewatch() => {}
                // Released or lost: either way nothing is left to keep.
                _ = self.watch() => return,
            }
        }
    }

    /// Completes when the server has ended the session while no statement
    /// ran (the loss is then reported and the connection closed), or once
    /// the slot is empty (released).
    ///
    /// Each poll reads the socket under the slot's mutex taken without
    /// waiting, and lets go of it before returning, so `release()` and the
    /// heartbeat take the connection at once between two polls. If the slot
    /// is busy right then (a `release()` emptying it, an upgrade running on
    /// it), nothing is read: the release wakes the keeper when it is done
    /// (see `Slot::release`), the upgrade asks for a fresh watch (see
    /// `Slot::signal_rewatch`). So does an upgrade that finds the slot free:
    /// the socket wakes only the task that read it last.
    fn watch(&self) -> impl Future<Output = Beat> + '_ {
        std::future::poll_fn(move |cx| {
            let Some(mut slot) = self.slot.try_conn() else {
                return Poll::Pending;
            };
            let Some(conn) = slot.as_mut() else {
                return Poll::Ready(Beat::Released);
            };
            let Poll::Ready(reason) = conn.poll_goodbye(cx) else {
                return Poll::Pending;
            };
            self.lose(&mut slot, reason);
            Poll::Ready(Beat::Lost)
        })
    }

    /// Closes the connection of a guard dropped where no runtime can
    /// release it: the server frees the lock when the session ends. Not a
    /// loss (the guard is gone), so nothing is reported.
    fn close_unkept(self) {
        if let Some(mut slot) = self.slot.try_conn()
            && let Some(mut conn) = slot.take()
        {
            conn.close_now();
        }
    }

    fn keeper_span(&self) -> tracing::Span {
        tracing::debug_span!("distlock.keeper", key = %self.key, pid = self.pid)
    }

    /// Parks the keeper in its slot until [`WATCH_AFTER`] after the grant
    /// (or its first heartbeat, if that is due sooner), when `timer` starts
    /// it; a guard released before then never spawns a task.
    pub(crate) fn park(self, timer: &Timer) {
        let due = self.watch_from;
        let slot = Arc::clone(&self.slot);
        slot.park(self);
        let parked: Weak<Slot<Self>> = Arc::downgrade(&slot);
        timer.schedule(due, parked);
    }

    /// One heartbeat, holding the slot so `release()` waits for it (within
    /// the release deadline).
    async fn beat(&self) -> Beat {
        let mut slot = self.slot.conn().await;
        let Some(conn) = slot.as_mut() else {
            self.report_abandoned();
            return Beat::Released;
        };
        let Err(reason) = heartbeat(conn, HEARTBEAT, self.pid, self.heartbeat_timeout).await else {
            return Beat::Alive;
        };
        self.lose(&mut slot, reason);
        Beat::Lost
    }

    /// The lock is lost: the connection is closed and the loss published
    /// *before* the slot is let go, so a `release()` that finds the slot
    /// empty also finds the reason.
    fn lose(&self, slot: &mut MutexGuard<'_, Option<HeldConn>>, reason: LossReason) {
        tracing::warn!(key = %self.key, %reason, "distlock session lock lost");
        crate::metrics::lost("postgres", &self.key);
        if let Some(mut conn) = slot.take() {
            conn.close_now();
        }
        self.loss.send_replace(Some(reason));
    }

    /// The guard was dropped without `release()` (or `release()` took the
    /// connection already): unlock in the background if it is still here.
    async fn release_dropped(self, held_since: Instant) {
        let conn = self.slot.conn().await.take();
        let Some(conn) = conn else {
            self.report_abandoned();
            return;
        };
        let deadline = crate::deadline::from_now(self.release_timeout);
        let held = (&self.key, self.hold);
        let outcome = unlock(conn, held, self.pid, deadline, self.release_timeout).await;
        match outcome {
            Ok(()) => {
                crate::metrics::released("postgres", &self.key, held_since.elapsed());
                tracing::debug!(key = %self.key, "distlock session lock released in the background");
            }
            Err(err) => tracing::warn!(
                key = %self.key, error = %err,
                "background release of a dropped session lock failed; connection closed"
            ),
        }
    }
}

impl Keeper {
    /// Reports the loss an operation left in the slot (see
    /// [`Slot::abandon`]), unless a reason was reported already.
    fn report_abandoned(&self) {
        if let Some(reason) = self.slot.abandoned() {
            self.loss.send_if_modified(|loss| {
                let unset = loss.is_none();
                if unset {
                    *loss = Some(reason);
                }
                unset
            });
        }
    }
}

impl Slot<Keeper> {
    /// Closes the lock's connection, taken out of `conn` (the slot's, which
    /// the caller holds), because an operation on it failed or was dropped
    /// midway and what the session holds is no longer known: the server
    /// frees everything the session held. The guard learns `reason` at once
    /// from a parked keeper, or as soon as a running one wakes up. Never
    /// blocks, and needs no runtime.
    pub(crate) fn abandon(&self, conn: &mut Option<HeldConn>, key: &LockKey, reason: LossReason) {
        if let Some(mut conn) = conn.take() {
            conn.close_now();
        }
        tracing::warn!(key = %key, %reason, "distlock session lock lost");
        crate::metrics::lost("postgres", key);
        self.set_abandoned(reason);
        match self.unpark() {
            // Dropping it finds the slot busy (the caller holds it) and does
            // nothing more.
            Some(keeper) => keeper.report_abandoned(),
            // A running keeper wakes, finds the slot empty and reports it.
            None => self.signal_let_go(),
        }
    }

    /// Tells the keeper that the guard went away without `release()`: a
    /// parked keeper is started now to release the lock in the background
    /// (or, without a runtime, dropped, which closes the connection); a
    /// running one is woken.
    pub(crate) fn guard_dropped(&self) {
        match self.unpark() {
            Some(keeper) => match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    let span = keeper.keeper_span();
                    runtime.spawn(
                        async move {
                            let held_since = Instant::now();
                            keeper.release_dropped(held_since).await;
                        }
                        .instrument(span),
                    );
                }
                Err(_) => keeper.close_unkept(),
            },
            None => self.signal_let_go(),
        }
    }
}

impl Parked for Slot<Keeper> {
    fn start(&self) {
        if let Some(keeper) = self.unpark() {
            let span = keeper.keeper_span();
            tokio::spawn(keeper.run().instrument(span));
        }
    }

    fn stop(&self) {
        // Dropping an unstarted keeper closes its connection and reports
        // the loss (see `Drop for Keeper`).
        drop(self.unpark());
    }
}

/// What a heartbeat (or the watch) found.
enum Beat {
    Alive,
    Lost,
    /// The slot was empty: `release()` took the connection.
    Released,
}
