//! What a multiplexed [`SessionLock`](crate::SessionLock) holds of its lock:
//! the ticket the shared connection's driver granted (with the lock's place
//! under `max_locks`, which goes with the unlock). `release()` hands the unlock
//! to the driver and awaits its answer on the caller's task; a dropped guard
//! drops the ticket, which queues the unlock. Nothing runs on the caller's
//! runtime in between, so that runtime shutting down leaves the lock with its
//! guard and its keeper (the driver), as it should.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tokio::time::timeout;

use super::request::Ticket;
use crate::postgres::session::kept_elsewhere::KeptElsewhere;
use crate::{Error, LockKey, LossReason};

/// One lock on a shared connection, as its guard holds it.
pub(super) struct Held {
    pub(super) key: LockKey,
    /// Holds the lock's place under `max_locks`: the driver gives it back
    /// once it has run the unlock.
    pub(super) ticket: Ticket,
    pub(super) loss: watch::Receiver<Option<LossReason>>,
    /// The locker's release deadline.
    pub(super) deadline: Duration,
}

impl KeptElsewhere for Held {
    fn release(self: Box<Self>) -> Pin<Box<dyn Future<Output = Result<(), Error>> + Send>> {
        let Held {
            key,
            ticket,
            loss,
            deadline,
        } = *self;
        Box::pin(async move { release(&key, ticket, &loss, deadline).await })
    }
}

async fn release(
    key: &LockKey,
    ticket: Ticket,
    loss: &watch::Receiver<Option<LossReason>>,
    deadline: Duration,
) -> Result<(), Error> {
    let lost = || Error::LockLost {
        key: key.clone(),
        reason: loss.borrow().clone().unwrap_or(LossReason::KeeperStopped),
    };
    if loss.borrow().is_some() {
        return Err(lost());
    }
    let (reply, outcome) = oneshot::channel();
    if !ticket.unlock(reply) {
        return Err(lost());
    }
    match timeout(deadline, outcome).await {
        Ok(Ok(result)) => result,
        // The driver dropped the request: its connection was lost.
        Ok(Err(_)) => Err(lost()),
        // The unlock is still queued or running; the driver's own statement
        // deadline closes the connection if the server does not answer.
        Err(_) => Err(Error::ReleaseTimedOut {
            key: key.clone(),
            after: deadline,
        }),
    }
}
