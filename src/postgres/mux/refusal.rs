//! Answers to tries that took nothing: busy, failed, or queued for a
//! shared connection that failed to open. Each gives its place under
//! `max_locks` back first, and each try queued for a connection that did
//! not open is told the reason, in the round that failed (a try told
//! nothing goes again on a fresh connection, and a queue longer than a
//! try's attempts ran out of them: `MultiplexFailed`, each round up to
//! twice the pool's `acquire_timeout` against an unreachable server).

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use super::place::Place;
use super::request::{Request, TryError, TryOutcome};
use crate::Error;

/// Answers a try that took nothing, after giving back its place under
/// `max_locks`: a caller woken by the answer may try again at once, and
/// must find the place free (a place dropped after the answer, at the end
/// of the driver's frame, made that try fail with `TooManyLocks`).
pub(super) fn answer(reply: oneshot::Sender<TryOutcome>, place: Place, outcome: TryOutcome) {
    drop(place);
    let _ = reply.send(outcome);
}

/// Answers every queued and future request of a driver that has no
/// connection: tries get `err` (or, where there is none, the driver ended
/// under them and they may retry elsewhere); unlocks have nothing to do
/// (the server freed the locks with the session).
pub(super) fn refuse_all(requests: &mut mpsc::UnboundedReceiver<Request>, err: Option<Error>) {
    requests.close();
    let mut cause = err.map(Cause::new);
    while let Ok(request) = requests.try_recv() {
        match request {
            Request::Try { reply, place, .. } => {
                let outcome = match cause.as_mut().and_then(Cause::next) {
                    Some(err) => Err(TryError::Failed(err)),
                    None => Err(TryError::Gone),
                };
                answer(reply, place, outcome);
            }
            // Dropping the reply tells the releaser the lock is gone.
            Request::Unlock { .. } => {}
        }
    }
}

/// Why a shared connection did not open, for as many tries as queued.
enum Cause {
    /// An error each try gets a copy of.
    Every(Error),
    /// An error that cannot be copied: the first try gets it, the others
    /// go again. Opening a connection gives none (every error it can give
    /// is copied); kept so that a new one is still told to one try.
    Once(Option<Error>),
}

impl Cause {
    fn new(err: Error) -> Self {
        // A driver error cannot be copied; shared, every try gets it.
        let err = match err {
            Error::Database(cause) => Error::ConnectFailed {
                cause: Arc::new(cause),
            },
            other => other,
        };
        match copy(&err) {
            Some(_) => Self::Every(err),
            None => Self::Once(Some(err)),
        }
    }

    fn next(&mut self) -> Option<Error> {
        match self {
            Self::Every(err) => copy(err),
            Self::Once(err) => err.take(),
        }
    }
}

/// The errors opening a shared connection can give, copied (each carries
/// only data, or a shared driver error).
fn copy(err: &Error) -> Option<Error> {
    Some(match err {
        Error::ConnectFailed { cause } => Error::ConnectFailed {
            cause: Arc::clone(cause),
        },
        Error::TooManyConnections { message } => Error::TooManyConnections {
            message: message.clone(),
        },
        Error::PermissionDenied { message } => Error::PermissionDenied {
            message: message.clone(),
        },
        Error::NotMigrated { message } => Error::NotMigrated {
            message: message.clone(),
        },
        Error::ConnectTimedOut { after } => Error::ConnectTimedOut { after: *after },
        Error::PoolerDetected { evidence } => Error::PoolerDetected {
            evidence: evidence.clone(),
        },
        _ => return None,
    })
}
