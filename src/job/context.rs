//! What a running job gets: its lease and a cancellation token.

use std::time::SystemTime;

use tokio_util::sync::CancellationToken;

use crate::{FencingToken, Lease, LockKey};

/// Handed to a job run by [`SingletonJob::run`](crate::SingletonJob::run).
///
/// The [cancellation token](Self::cancellation_token) is cancelled the moment
/// the lease is lost, and also when the run ends, so tasks the job spawned
/// can stop with it. Pass a clone to such tasks: they are told, not waited
/// for (the runner releases the lease, or reports the loss, meanwhile). The
/// job itself is dropped at its next `.await` once the lease is lost,
/// unless the runner gives it a
/// [`stop_grace`](crate::SingletonJobBuilder::stop_grace): only then does
/// it see the token fire, and can race its work against
/// [`cancelled`](Self::cancelled) to stop cleanly.
#[derive(Debug, Clone)]
pub struct JobContext<'a> {
    pub(crate) lease: &'a dyn Lease,
    pub(crate) token: CancellationToken,
    pub(crate) window_start: Option<SystemTime>,
}

impl JobContext<'_> {
    /// The lease the job runs under.
    pub fn lease(&self) -> &dyn Lease {
        self.lease
    }

    /// The job's lock key.
    pub fn key(&self) -> &LockKey {
        self.lease.key()
    }

    /// The lease's fencing token, if the backend issues them. Present it with
    /// every write to a fenced resource (`distlock::fence`).
    pub fn fencing_token(&self) -> Option<FencingToken> {
        self.lease.fencing_token()
    }

    /// A token cancelled when the lease is lost or the run ends.
    pub fn cancellation_token(&self) -> &CancellationToken {
        &self.token
    }

    /// Completes when the lease is lost (or the run ends).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn cancelled(&self) {
        self.token.cancelled().await;
    }

    /// `true` once the lease is lost (or the run ended).
    pub fn is_cancelled(&self) -> bool {
        self.token.is_cancelled()
    }

    /// The start of the current window when the job runs
    /// [once per window](crate::SingletonJobBuilder::once_per_window).
    pub fn window_start(&self) -> Option<SystemTime> {
        self.window_start
    }
}
