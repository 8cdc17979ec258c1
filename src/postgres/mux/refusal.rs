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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::PoolerEvidence;

    /// What each of `tries` tries queued for a connection that did not open
    /// (for `err`) is answered.
    fn answers(err: Option<Error>, tries: usize) -> Vec<Result<(), Option<Error>>> {
        let (requests, mut queued) = mpsc::unbounded_channel();
        let mut replies = Vec::new();
        for k in (0..).take(tries) {
            let (reply, answer) = oneshot::channel();
            let request = Request::Try {
                key: crate::LockKey::id(k),
                fencing: false,
                reply,
                place: Place::unlimited(),
            };
            requests.send(request).expect("queued");
            replies.push(answer);
        }
        refuse_all(&mut queued, err);
        let answer = |mut reply: oneshot::Receiver<TryOutcome>| match reply.try_recv() {
            Ok(Err(TryError::Failed(err))) => Err(Some(err)),
            Ok(Err(TryError::Gone)) => Err(None),
            other => panic!("expected a refusal, got {other:?}"),
        };
        replies.into_iter().map(answer).collect()
    }

    /// Every error opening a shared connection can give reaches every try
    /// queued for it, each with the same fields: the multiplexed
    /// integration tests cause `ConnectFailed`, `PermissionDenied`,
    /// `ConnectTimedOut` and `TooManyConnections`; the others are hard to
    /// cause on purpose at that moment (a pooler that moves the probe
    /// between backends; a missing schema, which opening does not read
    /// today), so their copies are checked here.
    #[test]
    fn every_try_queued_for_a_connection_that_did_not_open_gets_its_error() {
        let driver_error = || sqlx::Error::Protocol("refused".to_owned());
        let errors = [
            Error::Database(driver_error()),
            Error::ConnectFailed {
                cause: Arc::new(driver_error()),
            },
            Error::TooManyConnections {
                message: "too many clients".to_owned(),
            },
            Error::PermissionDenied {
                message: "permission denied for database".to_owned(),
            },
            Error::NotMigrated {
                message: "schema \"distlock\" does not exist".to_owned(),
            },
            Error::ConnectTimedOut {
                after: Duration::from_millis(1_500),
            },
            Error::PoolerDetected {
                evidence: PoolerEvidence::BackendChanged { from: 10, to: 11 },
            },
            Error::PoolerDetected {
                evidence: PoolerEvidence::MarkerSeen { pid: 12 },
            },
        ];
        for err in errors {
            // A driver error is shared, as `ConnectFailed`.
            let expected = match &err {
                Error::Database(_) => format!(
                    "{:?}",
                    Error::ConnectFailed {
                        cause: Arc::new(driver_error())
                    }
                ),
                other => format!("{other:?}"),
            };
            let got = answers(Some(err), 8);
            for answer in &got {
                let Err(Some(told)) = answer else {
                    panic!("{expected}: expected every try told, got {got:?}");
                };
                assert_eq!(format!("{told:?}"), expected, "{got:?}");
            }
        }
    }

    /// An error that cannot be copied reaches one try; the others may go
    /// again on a fresh connection. With no error (the driver ended under
    /// them), every try may.
    #[test]
    fn an_error_that_cannot_be_copied_reaches_one_try_and_the_rest_go_again() {
        let got = answers(Some(Error::NoRuntime("test")), 4);
        assert!(
            matches!(got[0], Err(Some(Error::NoRuntime("test")))),
            "{got:?}"
        );
        assert!(got[1..].iter().all(|a| matches!(a, Err(None))), "{got:?}");
        let got = answers(None, 3);
        assert!(got.iter().all(|a| matches!(a, Err(None))), "{got:?}");
    }
}
