//! The small task behind each multiplexed [`SessionLock`](crate::SessionLock):
//! it waits for the guard's release request (or its drop) and hands the
//! unlock to the shared connection's driver. It runs no heartbeat and owns no
//! connection; it exists because a guard's `Drop` cannot await.

use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tokio::time::timeout;

use super::request::Ticket;
use crate::postgres::session::guard::ReleaseRequest;
use crate::{Error, LockKey, LossReason};

/// Waits for the guard: `release()` sends where to put the outcome, a dropped
/// guard closes the channel (then dropping the ticket queues the unlock).
pub(super) async fn run(
    key: LockKey,
    ticket: Ticket,
    loss: watch::Receiver<Option<LossReason>>,
    request: oneshot::Receiver<ReleaseRequest>,
    deadline: Duration,
    place: super::Place,
) {
    // The place under `max_locks` is given back when this task ends, after
    // the unlock was handed to the driver.
    let _place = place;
    let Ok(reply) = request.await else {
        drop(ticket);
        return;
    };
    let outcome = release(&key, ticket, &loss, deadline).await;
    let _ = reply.send(outcome);
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
