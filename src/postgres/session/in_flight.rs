//! An operation on a held lock's own connection (an upgrade, a downgrade):
//! it runs holding the slot, so the heartbeat waits for it, and a failure
//! that leaves the session in a state no guard knows, or a future dropped
//! midway, closes the connection and reports the lock lost.
//!
//! A statement dropped midway may still run on the server, and a lock it
//! waits for may be granted after the caller went away; a connection left
//! mid-statement would also hand its unread answer to the next heartbeat.
//! Closing it is the one outcome that leaves nothing held that no guard
//! owns: the server ends the session and frees all it held.

use tokio::sync::MutexGuard;

use crate::loss_state::LossState;
use crate::postgres::conn::held::HeldConn;
use crate::postgres::session::keeper::Keeper;
use crate::postgres::session::slot::Slot;
use crate::{Error, LockKey, LossReason};

/// How an operation on the lock's connection failed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The lock is as it was before the operation: the connection stays.
    Kept(Error),
    /// What the session holds is no longer known (the connection broke, the
    /// server did not answer in time, another session answered): the
    /// connection is closed and the lock reported lost with the reason.
    Broken(LossReason),
}

/// The slot, held for one operation on its connection.
pub(crate) struct InFlight<'a> {
    slot: &'a Slot<Keeper>,
    key: &'a LockKey,
    loss: &'a LossState,
    /// `None` once the operation has finished, one way or the other.
    conn: Option<MutexGuard<'a, Option<HeldConn>>>,
}

impl<'a> InFlight<'a> {
    /// Waits for the slot (an in-flight heartbeat finishes first) and holds
    /// it; [`Error::LockLost`] if the lock is gone already.
    pub(crate) async fn begin(
        slot: &'a Slot<Keeper>,
        key: &'a LockKey,
        loss: &'a LossState,
    ) -> Result<Self, Error> {
        let conn = slot.conn().await;
        if conn.is_none() {
            return Err(Error::LockLost {
                key: key.clone(),
                reason: slot.loss_of(loss),
            });
        }
        Ok(Self {
            slot,
            key,
            loss,
            conn: Some(conn),
        })
    }

    /// The lock's connection.
    pub(crate) fn conn(&mut self) -> Option<&mut HeldConn> {
        self.conn.as_mut().and_then(|conn| conn.as_mut())
    }

    /// Ends the operation: the connection stays with the lock on `Ok` and
    /// [`Failure::Kept`]; on [`Failure::Broken`] it is closed and the lock
    /// reported lost, and the caller gets [`Error::LockLost`]. So it is, and
    /// the caller told so, when the guard reads the lock as lost by now: its
    /// keeper stopped meanwhile (dropped with its runtime, it could not take
    /// the connection this operation held, to close it), and a connection
    /// put back would hold the lock with no one keeping it.
    ///
    /// A kept connection was read on the caller's task, which took the
    /// socket's wake-up from the keeper: the keeper is asked to watch it
    /// again, or a server ending the session would go unnoticed until the
    /// next heartbeat.
    pub(crate) fn finish<T>(mut self, outcome: Result<T, Failure>) -> Result<T, Error> {
        let kept = match outcome {
            Ok(value) => self.keep().map(|()| Ok(value)),
            Err(Failure::Kept(err)) => self.keep().map(|()| Err(err)),
            Err(Failure::Broken(reason)) => {
                self.abandon(reason.clone());
                Err(reason)
            }
        };
        kept.unwrap_or_else(|reason| {
            Err(Error::LockLost {
                key: self.key.clone(),
                reason,
            })
        })
    }

    /// Lets go of the slot, the connection still in it, unless the guard
    /// reads the lock lost by then: the connection is then closed, and the
    /// reason returned. Read after letting go, so that a keeper stopping
    /// at any moment before is seen (it never waits for the slot, so it
    /// leaves a busy slot's connection to whoever holds it).
    fn keep(&mut self) -> Result<(), LossReason> {
        self.conn = None;
        self.slot.signal_rewatch();
        let Some(reason) = self.loss.loss() else {
            return Ok(());
        };
        // Only a connection still in the slot: one the keeper took and
        // closed after a loss of its own was reported (and counted) there.
        if let Some(mut conn) = self.slot.try_conn().filter(|conn| conn.is_some()) {
            self.slot.abandon(&mut conn, self.key, reason.clone());
        }
        Err(reason)
    }

    fn abandon(&mut self, reason: LossReason) {
        if let Some(mut conn) = self.conn.take() {
            self.slot.abandon(&mut conn, self.key, reason);
        }
    }
}

/// Dropped before [`finish`](InFlight::finish): the operation's future was
/// dropped at an `.await`, its statement perhaps still running.
impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.abandon(LossReason::Interrupted);
    }
}
