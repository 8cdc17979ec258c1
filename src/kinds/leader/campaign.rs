//! `Campaign`: the cloneable handle of one campaign for leadership.

use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use tokio::sync::{oneshot, watch};
use tracing::Instrument;

use super::permanent::permanent;
use super::run::{Reply, Run};
use super::{Election, Term};
use crate::{Error, FencingToken, LockKey};

/// A campaign for leadership; from [`LeaderElection::campaign`](crate::LeaderElection::campaign).
///
/// Cheap to clone: every clone is a handle on the same campaign, so one can
/// go to an HTTP handler that reports [`is_leader`](Self::is_leader) or
/// [`term`](Self::term), and any clone can [`stop`](Self::stop) it.
///
/// It leads in [`Term`]s: [`elected`](Self::elected) waits for the next
/// one, and each term's [`ended`](Term::ended) /
/// [`cancellation`](Term::cancellation) fires when it ends: before the
/// lock is released on resignation, as soon as a loss is known otherwise.
/// A loss followed at once by a new win is two terms, never one.
///
/// None of its methods costs a round trip but [`stop`](Self::stop) and
/// [`resign`](Self::resign) (the backend's release, and on PostgreSQL the
/// withdrawal of the leader record: 2 round trips while leading, none
/// otherwise).
///
/// # Dropping
///
/// When its last clone is dropped the campaign resigns in the background:
/// the term ends, then the lock is released.
#[derive(Clone)]
pub struct Campaign {
    shared: Arc<Shared>,
    leadership: watch::Receiver<bool>,
    terms: watch::Receiver<Option<Term>>,
}

/// What the clones share. Dropping the last one drops `stop`, which the
/// task takes as a resignation.
struct Shared {
    key: LockKey,
    stop: Mutex<Option<oneshot::Sender<Reply>>>,
    /// Why the campaign ended without being asked to, once it has.
    failure: Arc<OnceLock<Error>>,
}

impl fmt::Debug for Campaign {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Campaign")
            .field("key", &self.shared.key)
            .field("is_leader", &self.is_leader())
            .field("term", &*self.terms.borrow())
            .field("failure", &self.failure())
            .finish()
    }
}

impl Campaign {
    /// Spawns the campaign task for `election`, or a campaign that has
    /// already ended on a bad key or without a runtime.
    pub(super) fn start(election: Arc<Election>) -> Self {
        let (leader, leadership) = watch::channel(false);
        let (term, terms) = watch::channel(None);
        let failure = Arc::new(OnceLock::new());
        let key = election.key.clone();
        let handle = |stop| Campaign {
            shared: Arc::new(Shared {
                key: key.clone(),
                stop: Mutex::new(stop),
                failure: Arc::clone(&failure),
            }),
            leadership: leadership.clone(),
            terms: terms.clone(),
        };
        let refused =
            election
                .key
                .validate()
                .err()
                .or_else(|| match tokio::runtime::Handle::try_current() {
                    Ok(_) => None,
                    Err(_) => Some(Error::NoRuntime("LeaderElection::campaign")),
                });
        if let Some(err) = refused {
            // No task takes `leader` and `term`: they are dropped when this
            // returns, so watchers see the channels closed.
            let _ = failure.set(err);
            return handle(None);
        }
        let (stop, stopped) = oneshot::channel();
        let span = tracing::debug_span!("distlock.campaign", key = %election.key);
        let run = Run::new(election, leader, term, Arc::clone(&failure));
        tokio::spawn(run.campaign(stopped).instrument(span));
        handle(Some(stop))
    }

    /// The election's key.
    pub fn key(&self) -> &LockKey {
        &self.shared.key
    }

    /// Whether this campaign leads now: a term has started and not ended
    /// (as [`term`](Self::term) and [`elected`](Self::elected) see it).
    pub fn is_leader(&self) -> bool {
        self.terms
            .borrow()
            .as_ref()
            .is_some_and(|term| !term.is_over())
    }

    /// A receiver that follows leadership as a flag: `true` while a term
    /// lasts (set just after the term is published; already set when
    /// [`elected`](Self::elected) returns), `false` from its end (set
    /// just after the term's token is cancelled), which comes before the
    /// lock is released (resign) or as soon as a loss is known. The channel
    /// closes when the campaign ends.
    ///
    /// A flag cannot tell "lost, then won again" from "still leading": a
    /// loop that must not carry work over from one term to the next uses
    /// [`elected`](Self::elected) and the [`Term`] instead.
    pub fn leadership(&self) -> watch::Receiver<bool> {
        self.leadership.clone()
    }

    /// The current term while this campaign leads; `None` otherwise.
    pub fn term(&self) -> Option<Term> {
        self.terms.borrow().clone()
    }

    /// A receiver that follows the terms: `Some` of each term while it
    /// lasts, `None` between terms. The channel closes when the campaign
    /// ends.
    pub fn terms(&self) -> watch::Receiver<Option<Term>> {
        self.terms.clone()
    }

    /// The current term's fencing token, where the backend issues them
    /// (`None` while not leading). Pass it to the leader's writes.
    pub fn fencing_token(&self) -> Option<FencingToken> {
        self.terms.borrow().as_ref().and_then(Term::fencing_token)
    }

    /// Waits until this campaign leads, and returns the term (at once if it
    /// leads now). Once the campaign has ended, returns why:
    /// [`failure`](Self::failure)'s error, or [`Error::CampaignEnded`] after
    /// a resignation.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only watches two channels (the term and the flag).
    pub async fn elected(&self) -> Result<Term, Error> {
        let (mut terms, mut flag) = (self.terms.clone(), self.leadership.clone());
        loop {
            let current = terms
                .wait_for(|term| term.as_ref().is_some_and(|term| !term.is_over()))
                .await
                .map(|term| term.clone());
            let term = match current {
                Ok(Some(term)) => term,
                // Ended between the check and the clone: wait again.
                Ok(None) => continue,
                Err(_) => return Err(self.ended()),
            };
            // The flag is set just after the term is published: once it is,
            // every view of the campaign agrees that it leads.
            tokio::select! {
                flagged = flag.wait_for(|leads| *leads) => match flagged {
                    Ok(_) if !term.is_over() => return Ok(term),
                    Ok(_) => {}
                    Err(_) => return Err(self.ended()),
                },
                () = term.ended() => {}
            }
        }
    }

    /// Why this campaign ended without being asked to and will never lead
    /// again, if it did: an error no retry can cure (see
    /// [`LeaderElection::campaign`](crate::LeaderElection::campaign)).
    /// `None` while it campaigns or leads (errors that may pass, such as an
    /// unreachable server, are retried and logged), and after a
    /// resignation.
    pub fn failure(&self) -> Option<&Error> {
        self.shared.failure.get()
    }

    /// Stops the campaign for every handle: the term ends (its token is
    /// cancelled, leadership turns false), the leader record is withdrawn,
    /// then the lock is released; the release's error, if any, is
    /// returned. For a campaign that ended on its own, returns the error of
    /// [`failure`](Self::failure). A second call, from this handle or a
    /// clone, waits for the campaign to end and returns `Ok(())` (or the
    /// failure).
    ///
    /// Costs, while leading, the withdrawal (1 round trip on PostgreSQL,
    /// durable row write) and the backend's release (1 round trip);
    /// nothing otherwise.
    ///
    /// # Cancel safety
    ///
    /// Once polled, the resignation goes on in the background if this
    /// future is dropped.
    pub async fn stop(&self) -> Result<(), Error> {
        let stop = self
            .shared
            .stop
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        if let Some(stop) = stop {
            let (reply, outcome) = oneshot::channel();
            if stop.send(reply).is_ok()
                && let Ok(outcome) = outcome.await
            {
                return outcome;
            }
            // The task has ended: on a failure, or its runtime shut down.
            return self.failed();
        }
        // Stopped by another handle, or ended: wait for the task to end
        // (it drops the leadership sender).
        let mut leadership = self.leadership.clone();
        while leadership.changed().await.is_ok() {}
        self.failed()
    }

    /// [`stop`](Self::stop), consuming this handle: resigns the campaign
    /// for every clone.
    ///
    /// # Cancel safety
    ///
    /// As for [`stop`](Self::stop).
    pub async fn resign(self) -> Result<(), Error> {
        self.stop().await
    }

    /// `Err` with (a copy of) the failure, if the campaign ended on one.
    fn failed(&self) -> Result<(), Error> {
        match self.failure().and_then(permanent) {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    /// Why the campaign is over, for [`elected`](Self::elected).
    fn ended(&self) -> Error {
        self.failure()
            .and_then(permanent)
            .unwrap_or_else(|| Error::CampaignEnded {
                key: self.shared.key.clone(),
            })
    }
}
