//! `Observer`: who leads an election, followed over time.

use std::pin::pin;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::watch;
use tracing::Instrument;

use super::permanent::permanent;
use super::{Election, LeaderInfo};
use crate::{Error, LockKey};

/// The shortest deadline for one read of who leads: a read that takes
/// longer is taken as "cannot tell", and nobody is named until one answers.
const MIN_READ_DEADLINE: Duration = Duration::from_secs(1);

/// Follows who leads an election; from
/// [`LeaderElection::observe`](crate::LeaderElection::observe).
///
/// Its value is the leader as last read, `None` when nobody led, or when
/// the backend could not be read within the deadline (the poll interval,
/// at least one second): a leader that cannot be confirmed is not named.
/// So a leader is named at most one poll interval plus two read deadlines
/// after the backend last looked and saw it holding the election's lock
/// (that answer may take a deadline to arrive, and the next read another
/// to give up). Once the reader has ended (a failure, or its runtime shut
/// down) nobody is named.
///
/// Cheap to clone; clones share one background reader, which stops when
/// the last clone is dropped.
///
/// ```no_run
/// # async fn demo(election: distlock::LeaderElection) -> Result<(), distlock::Error> {
/// let mut observer = election.observe();
/// loop {
///     match observer.changed().await? {
///         Some(leader) => println!("{} leads, term {}", leader.identity, leader.term),
///         None => println!("nobody leads"),
///     }
/// }
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Observer {
    key: LockKey,
    leader: watch::Receiver<Option<LeaderInfo>>,
    failure: Arc<OnceLock<Error>>,
}

impl Observer {
    /// Spawns the reader for `election`, or an observer that has already
    /// ended (no runtime, or a backend without a record of leaders).
    pub(super) fn start(election: Arc<Election>) -> Self {
        let (tx, leader) = watch::channel(None);
        let failure = Arc::new(OnceLock::new());
        let observer = Self {
            key: election.key.clone(),
            leader,
            failure: Arc::clone(&failure),
        };
        let refused = match (
            election.key.validate(),
            election.locker.election(),
            tokio::runtime::Handle::try_current(),
        ) {
            (Err(err), _, _) => Some(err),
            (_, None, _) => Some(Error::Unsupported {
                what: "LeaderElection::observe",
                backend: election.locker.backend(),
            }),
            (_, _, Err(_)) => Some(Error::NoRuntime("LeaderElection::observe")),
            (Ok(()), Some(_), Ok(_)) => None,
        };
        if let Some(err) = refused {
            let _ = failure.set(err);
            return observer; // `tx` is dropped: the channel is closed
        }
        let span = tracing::debug_span!("distlock.observe", key = %election.key);
        tokio::spawn(read(election, tx, failure).instrument(span));
        observer
    }

    /// The leader as last read; `None` if nobody led, the read failed, or
    /// the observer has ended (its reader went with its runtime: nobody
    /// confirms the leader any more). No round trip.
    pub fn leader(&self) -> Option<LeaderInfo> {
        if self.leader.has_changed().is_err() {
            return None;
        }
        self.leader.borrow().clone()
    }

    /// Waits for the next change of who leads (another leader, another
    /// term, nobody) and returns it; a change since the last call (or since
    /// this observer was made) returns at once. Once the observer has
    /// ended, returns why: [`failure`](Self::failure)'s error, or
    /// [`Error::TaskStopped`] if the runtime shut down.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only watches a channel.
    pub async fn changed(&mut self) -> Result<Option<LeaderInfo>, Error> {
        match self.leader.changed().await {
            Ok(()) => Ok(self.leader.borrow_and_update().clone()),
            Err(_) => {
                Err(self
                    .failure()
                    .and_then(permanent)
                    .unwrap_or_else(|| Error::TaskStopped {
                        key: self.key.clone(),
                        task: "observe",
                    }))
            }
        }
    }

    /// A receiver of the leader as read, for code that composes watch
    /// channels. Its channel closes when the reader ends; the value it
    /// shows then is the last one read (a failure sends `None` first; a
    /// runtime shut down under the reader cannot), so a closed channel
    /// names nobody, as [`leader`](Self::leader) does.
    pub fn receiver(&self) -> watch::Receiver<Option<LeaderInfo>> {
        self.leader.clone()
    }

    /// Why the observer ended, if it did: an error no retry cures
    /// ([`Error::Unsupported`], [`Error::NoRuntime`],
    /// [`Error::NotMigrated`], ...). Errors that may pass are retried at
    /// the next poll (nobody is named meanwhile).
    pub fn failure(&self) -> Option<&Error> {
        self.failure.get()
    }
}

/// The reader: reads who leads every poll interval (or when a campaign of
/// this process changed something), publishes changes, stops when every
/// observer is gone.
async fn read(
    election: Arc<Election>,
    tx: watch::Sender<Option<LeaderInfo>>,
    failure: Arc<OnceLock<Error>>,
) {
    let deadline = election.poll.max(MIN_READ_DEADLINE);
    loop {
        // Registered before the read, so a change during it is not missed.
        let mut changed = pin!(election.changed.notified());
        changed.as_mut().enable();
        let read = tokio::select! {
            biased;
            () = tx.closed() => return,
            read = tokio::time::timeout(deadline, election.leader()) => read,
        };
        let seen = match read {
            Ok(Ok(leader)) => leader,
            Ok(Err(err)) if permanent(&err).is_some() => {
                tracing::warn!(key = %election.key, error = %err, "distlock observer cannot read the leader; it ends");
                tx.send_replace(None);
                let _ = failure.set(err);
                return;
            }
            Ok(Err(err)) => {
                tracing::debug!(key = %election.key, error = %err, "distlock observer read failed");
                None
            }
            Err(_) => None,
        };
        tx.send_if_modified(|current| {
            let changed = *current != seen;
            *current = seen;
            changed
        });
        tokio::select! {
            biased;
            () = tx.closed() => return,
            () = changed => {}
            () = tokio::time::sleep(election.poll) => {}
        }
    }
}
