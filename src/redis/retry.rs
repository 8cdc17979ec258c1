//! The wait that both Redis strategies share: try; after a busy key listen
//! for the release signal and try again at once; then sleep until a signal
//! or the next poll, and try again, until the deadline.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use super::claim::Claim;
use super::signals::{Listener, Signals, Wake};
use crate::{Error, deadline};

/// What one try found.
pub(super) enum Tried<L> {
    Granted(L),
    /// Another holder has the key: its release will be signalled.
    Held,
    /// Not granted, for a reason that no release will signal (for Redlock:
    /// a split vote, or a quorum reached too late).
    Missed,
    Failed(Failed),
}

/// Why one try did not grant the lease.
pub(super) struct Failed {
    pub error: Error,
    /// A passing failure (a node down, slow, loading, …): worth another try.
    pub transient: bool,
}

/// Why the wait pauses, for the strategy to choose how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Cause {
    /// The key is held.
    Held,
    /// See [`Tried::Missed`].
    Missed,
    /// The try failed for a passing reason.
    Failing,
}

/// The strategy's side of a wait.
pub(super) struct Pacing<P> {
    /// Where releases are signalled.
    pub signals: Signals,
    /// How long listening may take to be set up before the wait goes on
    /// without it (the strategy's command deadline).
    pub listen_within: Duration,
    /// The pause after a try, given why and whether releases are heard;
    /// `None` means no tries are left.
    pub pause: P,
}

/// How a wait ended.
pub(super) enum Waited<L> {
    Granted(L),
    /// The deadline passed (or the tries ran out); `failing` says whether
    /// some tries failed rather than finding the key held, in which case a
    /// `SET` may have landed unseen.
    TimedOut {
        failing: bool,
    },
    /// A permanent failure ended the wait at once.
    Failed(Error),
}

/// Calls `attempt` until it grants, fails for good, or `timeout` (from
/// `started`) has passed.
///
/// After the first try that does not grant, the wait listens for the key's
/// release signal, and where the key was held tries again at once: a
/// release between that try and the subscription was not heard (a split
/// vote or a failing try waits its pause as any later one does). It tries
/// again at once too when listening starts to work later (a subscriber
/// connection that came up). Between the other
/// tries it sleeps until a signal wakes it or the pause the strategy
/// chooses has passed, capped at the deadline.
pub(super) async fn until_granted<L, Fut, P>(
    claim: &Claim,
    started: Instant,
    timeout: Duration,
    mut pacing: Pacing<P>,
    mut attempt: impl FnMut() -> Fut,
) -> Waited<L>
where
    Fut: Future<Output = Tried<L>>,
    P: FnMut(Cause, bool) -> Option<Duration>,
{
    let deadline = deadline::after(started, timeout);
    let mut failed = None;
    let mut listener: Option<Listener> = None;
    // Whether releases were heard at the last pause.
    let mut was_heard = false;
    let mut wake: Option<Wake> = None;
    loop {
        let tried = attempt().await;
        // The wake (if any) led to a try that ended: not to be passed on.
        if let Some(wake) = wake.take() {
            wake.settle();
        }
        let cause = match tried {
            Tried::Granted(lease) => return Waited::Granted(lease),
            Tried::Held => Cause::Held,
            Tried::Missed => Cause::Missed,
            Tried::Failed(Failed {
                error,
                transient: true,
            }) => {
                tracing::debug!(%error, "distlock: Redis try failed; trying again until the deadline");
                failed = Some(error);
                Cause::Failing
            }
            Tried::Failed(Failed { error, .. }) => return Waited::Failed(error),
        };
        let now = Instant::now();
        let heard = listener.as_ref().is_some_and(Listener::is_heard);
        let delay = if now < deadline {
            (pacing.pause)(cause, heard)
        } else {
            None
        };
        let Some(delay) = delay else {
            if let Some(error) = &failed {
                tracing::warn!(key = %claim.key, %error, "distlock: Redis wait timed out; tries were failing");
            }
            return Waited::TimedOut {
                failing: failed.is_some(),
            };
        };
        let listening = match &mut listener {
            Some(listening) => listening,
            None => {
                let within = pacing.listen_within.min(deadline - now);
                let started = pacing.signals.listen(&claim.name, within).await;
                was_heard = started.is_heard();
                let listening = listener.insert(started);
                // A held key's release before the subscription was not
                // heard: try again at once. A split vote or a failing try
                // signals nothing: its pause is waited out below.
                if cause == Cause::Held {
                    continue;
                }
                listening
            }
        };
        let heard = listening.is_heard();
        if heard && !was_heard {
            was_heard = true;
            continue;
        }
        was_heard = heard;
        let left = deadline.saturating_duration_since(Instant::now());
        wake = listening.wait(delay.min(left)).await;
    }
}
