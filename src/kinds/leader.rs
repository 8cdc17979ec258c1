//! Leader election over any backend: campaigns hold one lock, the leader is
//! whoever holds it.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tracing::Instrument;

use crate::{Error, FencingToken, LockKey, Locker};

/// Elects one leader among the campaigns for `key`, across processes.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), distlock::Error> {
/// use std::sync::Arc;
/// let locker = Arc::new(distlock::PgLocker::builder(pool).fencing(true).build());
/// let campaign = distlock::LeaderElection::new(locker, "scheduler").campaign();
/// let mut leadership = campaign.leadership();
/// loop {
///     leadership.wait_for(|leader| *leader).await.ok();
///     // ... lead, passing campaign.fencing_token() (the term) to writes,
///     // until `leadership` turns false ...
///     # break;
/// }
/// campaign.resign().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct LeaderElection {
    locker: Arc<dyn Locker>,
    key: LockKey,
}

/// How long one wait for leadership lasts before it is renewed; on
/// PostgreSQL the wait is on the server, so the moment the leader's lock is
/// freed the next campaign holds it.
const WAIT: Duration = Duration::from_secs(3600);
/// Pause after an error (server unreachable, ...) before campaigning again.
const RETRY: Duration = Duration::from_secs(1);

impl LeaderElection {
    /// An election for `key` on `locker`.
    pub fn new(locker: Arc<dyn Locker>, key: impl Into<LockKey>) -> Self {
        Self {
            locker,
            key: key.into(),
        }
    }

    /// Starts campaigning in a background task: waits for the lock (on
    /// PostgreSQL, on the server: a takeover costs no poll), leads while it
    /// holds it, and campaigns again after a loss. Needs a Tokio runtime.
    pub fn campaign(&self) -> Campaign {
        let (leader, leadership) = watch::channel(false);
        let (term, terms) = watch::channel(None);
        let (stop, stopped) = oneshot::channel();
        let run = Run {
            locker: Arc::clone(&self.locker),
            key: self.key.clone(),
            leader,
            term,
        };
        let span = tracing::debug_span!("distlock.campaign", key = %self.key);
        tokio::spawn(run.campaign(stopped).instrument(span));
        Campaign {
            leadership,
            terms,
            stop: Some(stop),
        }
    }
}

/// A campaign for leadership; from [`LeaderElection::campaign`].
///
/// # Dropping
///
/// Dropping it resigns in the background: leadership turns false, then the
/// lock is released.
#[derive(Debug)]
pub struct Campaign {
    leadership: watch::Receiver<bool>,
    terms: watch::Receiver<Option<FencingToken>>,
    stop: Option<oneshot::Sender<oneshot::Sender<Result<(), Error>>>>,
}

impl Campaign {
    /// Whether this campaign leads now.
    pub fn is_leader(&self) -> bool {
        *self.leadership.borrow()
    }

    /// A receiver that follows leadership: it turns `true` when this
    /// campaign starts to lead, and `false` before its lock is released
    /// (resign) or as soon as a loss is known, so two campaigns never both
    /// report leadership.
    pub fn leadership(&self) -> watch::Receiver<bool> {
        self.leadership.clone()
    }

    /// The current term's fencing token, where the backend issues them
    /// (`None` while not leading). Pass it to the leader's writes.
    pub fn fencing_token(&self) -> Option<FencingToken> {
        *self.terms.borrow()
    }

    /// Stops campaigning: leadership turns false, then the lock is released
    /// (the release's error, if any, is returned).
    ///
    /// # Cancel safety
    ///
    /// Once polled, the resignation goes on in the background if this
    /// future is dropped.
    pub async fn resign(mut self) -> Result<(), Error> {
        let Some(stop) = self.stop.take() else {
            return Ok(());
        };
        let (reply, outcome) = oneshot::channel();
        if stop.send(reply).is_err() {
            return Ok(()); // the task has ended (its runtime shut down)
        }
        outcome.await.unwrap_or(Ok(()))
    }
}

/// The campaign task's state.
struct Run {
    locker: Arc<dyn Locker>,
    key: LockKey,
    leader: watch::Sender<bool>,
    term: watch::Sender<Option<FencingToken>>,
}

type Stop = oneshot::Receiver<oneshot::Sender<Result<(), Error>>>;

impl Run {
    async fn campaign(self, mut stopped: Stop) {
        loop {
            let attempt = tokio::select! {
                stop = &mut stopped => return reply(stop.ok(), Ok(())),
                attempt = self.locker.lock(self.key.clone(), WAIT) => attempt,
            };
            let lease = match attempt {
                Ok(lease) => lease,
                Err(Error::Timeout { .. }) => continue,
                Err(err) => {
                    tracing::warn!(key = %self.key, error = %err, "distlock campaign failed; trying again");
                    tokio::select! {
                        stop = &mut stopped => return reply(stop.ok(), Ok(())),
                        () = tokio::time::sleep(RETRY) => continue,
                    }
                }
            };
            self.term.send_replace(lease.fencing_token());
            self.leader.send_replace(true);
            let stop = tokio::select! {
                reason = lease.lost() => {
                    self.step_down();
                    tracing::warn!(key = %self.key, %reason, "distlock leadership lost; campaigning again");
                    continue;
                }
                stop = &mut stopped => stop,
            };
            // Leadership ends before the lock is let go.
            self.step_down();
            return reply(stop.ok(), lease.release().await);
        }
    }

    fn step_down(&self) {
        self.leader.send_replace(false);
        self.term.send_replace(None);
    }
}

fn reply(to: Option<oneshot::Sender<Result<(), Error>>>, outcome: Result<(), Error>) {
    if let Some(to) = to {
        let _ = to.send(outcome);
    }
}
