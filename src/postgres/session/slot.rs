//! The slot a session lock's guard and its keeper share: the lock's
//! connection while it is held, the guard's "let go" signal, and the keeper
//! parked until it is due to start.
//!
//! `SessionLock::release` takes the connection out of the slot and unlocks
//! on the caller's own task: no hop to the keeper and back sits on the
//! release path. The keeper holds the slot's mutex only while a heartbeat is
//! in flight, and for the instant of each read of the idle connection (taken
//! without waiting). The slot is generic over what is parked in it, so it
//! knows nothing of the keeper's task (`keeper.rs` depends on it, not the
//! reverse).

use std::sync::{Arc, PoisonError};
use std::time::Duration;

use tokio::sync::{Mutex, MutexGuard, Notify};
use tokio::time::timeout_at;

use crate::loss_state::LossState;
use crate::postgres::conn::held::HeldConn;
use crate::postgres::session::hold::Hold;
use crate::postgres::session::unlock::unlock;
use crate::{Error, LockKey, LossReason};

/// What the guard and the keeper (`K`) of one session lock share.
#[derive(Debug)]
pub(crate) struct Slot<K> {
    /// The lock's connection while the lock is held (`None` once released
    /// or lost).
    conn: Mutex<Option<HeldConn>>,
    /// Signalled when the guard lets go of the lock while a keeper runs:
    /// dropped without `release()` (the keeper then releases the lock), or
    /// released (the keeper finds the slot empty and ends). A lock released
    /// before its keeper started signals nothing, so no wake-up sits on the
    /// release path of a short lock.
    let_go: Notify,
    /// Signalled when an operation on the held lock (an upgrade, a
    /// downgrade) let go of the connection it kept: its reads of the
    /// socket, on the caller's task, took the socket's wake-up from the
    /// keeper's watch, which must read the socket again to get it back.
    rewatch: Notify,
    /// The keeper until it is due to start: a lock held for less than that
    /// never spawns a task.
    parked: std::sync::Mutex<Option<K>>,
    /// Why an operation on the held lock (an upgrade, a downgrade) closed
    /// the connection, for the keeper to report when it finds the slot
    /// empty (see [`InFlight`](super::in_flight::InFlight)).
    abandoned: std::sync::Mutex<Option<LossReason>>,
}

impl<K> Slot<K> {
    /// A slot holding `conn`, with nothing parked yet.
    pub(crate) fn new(conn: HeldConn) -> Arc<Self> {
        Arc::new(Self {
            conn: Mutex::new(Some(conn)),
            let_go: Notify::new(),
            rewatch: Notify::new(),
            parked: std::sync::Mutex::new(None),
            abandoned: std::sync::Mutex::new(None),
        })
    }

    /// Records why the connection was closed under the lock (the first
    /// reason stays).
    pub(crate) fn set_abandoned(&self, reason: LossReason) {
        self.abandoned
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert(reason);
    }

    /// Why an operation closed the connection, if one did.
    pub(crate) fn abandoned(&self) -> Option<LossReason> {
        self.abandoned
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Parks `keeper` until someone [`unpark`](Self::unpark)s it.
    pub(crate) fn park(&self, keeper: K) {
        *self.parked.lock().unwrap_or_else(PoisonError::into_inner) = Some(keeper);
    }

    /// Takes the parked keeper, if it has not been started.
    pub(crate) fn unpark(&self) -> Option<K> {
        self.parked
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// Whether the connection may still be in the slot (`true` when the
    /// slot is busy, to be safe).
    pub(crate) fn holds_connection(&self) -> bool {
        self.conn.try_lock().map_or(true, |conn| conn.is_some())
    }

    /// Wakes a running keeper: the guard let go of the lock (see
    /// `let_go`). A permit is stored if the keeper is not waiting at that
    /// moment.
    pub(crate) fn signal_let_go(&self) {
        self.let_go.notify_one();
    }

    /// Completes once [`signal_let_go`](Self::signal_let_go) was called.
    pub(crate) async fn let_go(&self) {
        self.let_go.notified().await;
    }

    /// Asks a running keeper to read the connection's socket again (see
    /// `rewatch`). A permit is stored if the keeper is not waiting at that
    /// moment (or not started: it then reads once more than it needed).
    pub(crate) fn signal_rewatch(&self) {
        self.rewatch.notify_one();
    }

    /// Completes once [`signal_rewatch`](Self::signal_rewatch) was called.
    pub(crate) async fn rewatch(&self) {
        self.rewatch.notified().await;
    }

    /// The connection, waiting for an in-flight heartbeat or release.
    pub(crate) async fn conn(&self) -> MutexGuard<'_, Option<HeldConn>> {
        self.conn.lock().await
    }

    /// The connection if nobody is using it right now.
    pub(crate) fn try_conn(&self) -> Option<MutexGuard<'_, Option<HeldConn>>> {
        self.conn.try_lock().ok()
    }

    /// Why the lock of an empty slot was lost: as reported, else as an
    /// operation left it (the keeper may not have reported that yet).
    pub(crate) fn loss_of(&self, loss: &LossState) -> LossReason {
        loss.loss()
            .or_else(|| self.abandoned())
            .unwrap_or(LossReason::KeeperStopped)
    }

    /// Releases the lock in the slot on the caller's task, within `budget`.
    ///
    /// Waits for an in-flight heartbeat only as long as the budget allows. An
    /// empty slot means the lock was lost; the reason is in `loss`.
    pub(crate) async fn release(
        &self,
        loss: &LossState,
        (key, hold): (&LockKey, Hold),
        pid: i32,
        budget: Duration,
    ) -> Result<(), Error> {
        let deadline = crate::deadline::from_now(budget);
        let Ok(mut guard) = timeout_at(deadline, self.conn.lock()).await else {
            // A heartbeat is stuck on a stalled network; it will time out and
            // close the connection, which frees the lock on the server.
            return Err(Error::ReleaseTimedOut {
                key: key.clone(),
                after: budget,
            });
        };
        let Some(conn) = guard.take() else {
            return Err(Error::LockLost {
                key: key.clone(),
                reason: self.loss_of(loss),
            });
        };
        drop(guard);
        match self.unpark() {
            // A keeper that never started has nothing left to do.
            Some(keeper) => drop(keeper),
            // A running one ends now rather than at its next beat.
            None => self.signal_let_go(),
        }
        unlock(conn, (key, hold), pid, deadline, budget).await
    }
}
