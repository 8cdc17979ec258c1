//! The wait that both Redis strategies share: try, and after a busy key or
//! a passing failure pause and try again, until the deadline.

use std::future::Future;
use std::time::Duration;

use redis::RedisError;
use tokio::time::{Instant, sleep};

use super::claim::Claim;
use super::node;

/// Why one try did not grant the lease.
pub(super) struct Failed {
    pub error: RedisError,
    /// A passing failure (a node down, slow, loading, …): worth another try.
    pub transient: bool,
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
    Failed(RedisError),
}

/// Calls `attempt` until it grants, fails for good, or `timeout` (from
/// `started`) has passed. Between tries it sleeps `pause()`, capped at the
/// deadline; `pause` returning `None` means no tries are left.
pub(super) async fn until_granted<L, Fut>(
    claim: &Claim,
    started: Instant,
    timeout: Duration,
    mut pause: impl FnMut() -> Option<Duration>,
    mut attempt: impl FnMut() -> Fut,
) -> Waited<L>
where
    Fut: Future<Output = Result<Option<L>, Failed>>,
{
    let deadline = node::deadline(started, timeout);
    let mut failed = None;
    loop {
        match attempt().await {
            Ok(Some(lease)) => return Waited::Granted(lease),
            Ok(None) => {}
            Err(Failed {
                error,
                transient: true,
            }) => {
                tracing::debug!(%error, "distlock: Redis try failed; trying again until the deadline");
                failed = Some(error);
            }
            Err(Failed { error, .. }) => return Waited::Failed(error),
        }
        let now = Instant::now();
        let delay = if now < deadline { pause() } else { None };
        let Some(delay) = delay else {
            if let Some(error) = &failed {
                tracing::warn!(key = %claim.key, %error, "distlock: Redis wait timed out; tries were failing");
            }
            return Waited::TimedOut {
                failing: failed.is_some(),
            };
        };
        sleep(delay.min(deadline - now)).await;
    }
}
