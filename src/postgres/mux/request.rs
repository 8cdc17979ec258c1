//! Messages between lock callers and a shared connection's driver, and the
//! ticket that stands for one lock held on it.

use tokio::sync::{mpsc, oneshot, watch};

use super::place::Place;
use crate::{Error, FencingToken, LockKey, LossReason};

/// A driver's inbox. Unbounded so that a `Drop` (of a ticket) can queue an
/// unlock without awaiting; every message is answered or dropped promptly.
pub(super) type Inbox = mpsc::UnboundedSender<Request>;

/// What a driver is asked to do.
#[derive(Debug)]
pub(super) enum Request {
    /// Try to take `key` on the shared connection.
    Try {
        key: LockKey,
        /// Whether to issue a fencing token with the lock.
        fencing: bool,
        reply: oneshot::Sender<TryOutcome>,
        /// The attempt's place under `max_locks`: a grant's ticket keeps
        /// it, so that it goes with the lock's unlock even when the caller
        /// went away before the grant reached it.
        place: Place,
    },
    /// Unlock the lock `id` (a released or dropped guard, or a grant whose
    /// caller went away). `reply` is `None` for background releases.
    Unlock {
        id: u64,
        reply: Option<oneshot::Sender<Result<(), Error>>>,
        /// The lock's place under `max_locks`, given back once the unlock
        /// has run (or the request is dropped with the connection).
        place: Option<Place>,
    },
}

/// A driver's answer to [`Request::Try`].
pub(super) type TryOutcome = Result<Option<Granted>, TryError>;

/// Why a try did not produce an answer about the lock.
#[derive(Debug)]
pub(super) enum TryError {
    /// The shared connection failed before or while the try ran; nothing is
    /// held for it (the session is gone or being closed), so the caller may
    /// retry on a fresh connection.
    Gone,
    /// The statement failed on a healthy connection (for example the lock
    /// table is full); reported to the caller as is.
    Failed(Error),
}

/// A lock taken on a shared connection.
#[derive(Debug)]
pub(super) struct Granted {
    pub(super) ticket: Ticket,
    pub(super) pid: i32,
    pub(super) token: Option<FencingToken>,
    pub(super) loss: watch::Receiver<Option<LossReason>>,
}

/// One lock held on a shared connection. Dropping a ticket queues the unlock,
/// so whoever ends up owning a grant (a guard, or nobody because the
/// caller's future was dropped while the answer was in flight) cannot leak
/// the lock.
#[derive(Debug)]
pub(super) struct Ticket {
    id: u64,
    inbox: Inbox,
    armed: bool,
    place: Option<Place>,
}

impl Ticket {
    pub(super) fn new(id: u64, inbox: Inbox) -> Self {
        Self {
            id,
            inbox,
            armed: true,
            place: None,
        }
    }

    /// Keeps the lock's place under `max_locks` until its unlock has run.
    pub(super) fn keep(&mut self, place: Place) {
        self.place = Some(place);
    }

    /// Asks the driver to unlock and report the outcome on `reply`; returns
    /// `false` if the driver is gone (its connection was lost, which freed
    /// the lock on the server).
    pub(super) fn unlock(mut self, reply: oneshot::Sender<Result<(), Error>>) -> bool {
        self.armed = false;
        let request = Request::Unlock {
            id: self.id,
            reply: Some(reply),
            place: self.place.take(),
        };
        self.inbox.send(request).is_ok()
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.armed {
            // A closed inbox means the driver is gone and its connection with
            // it: the server freed the lock already.
            let _ = self.inbox.send(Request::Unlock {
                id: self.id,
                reply: None,
                place: self.place.take(),
            });
        }
    }
}
