//! The campaign's background task: wait for the lock, proclaim, wait out
//! the grace, lead a term, step down.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tokio_util::sync::DropGuard;

use super::permanent::permanent;
use super::{Election, Term};
use crate::capability::WITHDRAW_WITHIN;
use crate::{ElectionLocker, Error, Lease, LossReason, Proclamation, Seat};

/// Where a stop request wants the outcome of the release.
pub(super) type Reply = oneshot::Sender<Result<(), Error>>;
/// Completes with a stop request, or with `Err` once every handle is gone
/// (which is a stop too).
type Stop = oneshot::Receiver<Reply>;

/// The campaign task's state.
pub(super) struct Run {
    election: Arc<Election>,
    leader: watch::Sender<bool>,
    term: watch::Sender<Option<Term>>,
    failure: Arc<OnceLock<Error>>,
}

/// How one round of campaigning ended.
enum Round {
    /// Asked to stop: reply with the release's outcome.
    Stopped(Option<Reply>, Result<(), Error>),
    /// Campaign again at once (the wait timed out, the lock was lost).
    Again,
    /// Campaign again after the retry pause (an error that may pass).
    Pause(Error),
    /// An error no retry cures: the campaign ends with it.
    Failed(Error),
}

/// What ended a wait while the lock is held.
enum Held<T> {
    Stop(Option<Reply>),
    Lost(LossReason),
    Done(T),
}

/// The backend's record of leaders and this holder's seat in it, when the
/// backend keeps one.
type Record<'a> = Option<(&'a dyn ElectionLocker, Seat)>;

impl Run {
    pub(super) fn new(
        election: Arc<Election>,
        leader: watch::Sender<bool>,
        term: watch::Sender<Option<Term>>,
        failure: Arc<OnceLock<Error>>,
    ) -> Self {
        Self {
            election,
            leader,
            term,
            failure,
        }
    }

    pub(super) async fn campaign(self, mut stopped: Stop) {
        let key = &self.election.key;
        loop {
            match self.round(&mut stopped).await {
                Round::Stopped(to, outcome) => return reply(to, outcome),
                Round::Again => {}
                Round::Pause(err) => {
                    tracing::warn!(%key, error = %err, "distlock campaign failed; trying again");
                    tokio::select! {
                        biased;
                        stop = &mut stopped => return reply(stop.ok(), Ok(())),
                        () = tokio::time::sleep(self.election.retry) => {}
                    }
                }
                Round::Failed(err) => {
                    tracing::warn!(%key, error = %err, "distlock campaign cannot lead; it ends");
                    // Set before the task ends: a `stop` that finds the
                    // task gone reads it.
                    let _ = self.failure.set(err);
                    // Ending drops the senders, which closes every
                    // receiver: a watcher learns the campaign ended
                    // instead of waiting for ever.
                    return;
                }
            }
        }
    }

    /// Waits for the lock, then holds it until it is lost or the campaign
    /// is stopped.
    async fn round(&self, stopped: &mut Stop) -> Round {
        let e = &self.election;
        let board = e.locker.election();
        let acquire = async {
            match board {
                Some(board) => {
                    let (lease, seat) = board.lock_seat(e.key.clone(), e.wait).await?;
                    Ok((lease, Some((board, seat))))
                }
                None => Ok((e.locker.lock(e.key.clone(), e.wait).await?, None)),
            }
        };
        let acquired = tokio::select! {
            biased;
            stop = &mut *stopped => return Round::Stopped(stop.ok(), Ok(())),
            acquired = acquire => acquired,
        };
        match acquired {
            Ok((lease, record)) => self.take_office(lease, record, stopped).await,
            Err(Error::Timeout { .. }) => Round::Again,
            Err(err) => failed_or_paused(err),
        }
    }

    /// Proclaims, waits out the grace if the predecessor did not step
    /// down, then leads one term.
    async fn take_office(
        &self,
        lease: Box<dyn Lease>,
        record: Record<'_>,
        stopped: &mut Stop,
    ) -> Round {
        let e = &self.election;
        let (mut number, mut after_loss) = (None, true);
        if let Some((board, seat)) = record {
            let proclamation = Proclamation {
                identity: e.identity.to_string(),
                value: e.value.to_string(),
                fencing_token: lease.fencing_token(),
                grace: e.grace(),
            };
            let proclaimed = while_held(
                &*lease,
                stopped,
                board.proclaim(&e.key, seat, &proclamation),
            );
            match proclaimed.await {
                Held::Done(Ok(Some(proclaimed))) => {
                    number = Some(proclaimed.leader.term);
                    after_loss = proclaimed.after_loss;
                }
                Held::Done(Ok(None)) => {
                    // The backend does not see this lease hold the lock:
                    // it was lost, and `lost()` will say so.
                    drop(lease);
                    return Round::Pause(Error::LockLost {
                        key: e.key.clone(),
                        reason: LossReason::NotHeld,
                    });
                }
                Held::Done(Err(err)) => return self.give_up(lease, record, None, err).await,
                Held::Stop(to) => return self.let_go(lease, record, None, to).await,
                Held::Lost(reason) => return self.lost(lease, record, None, reason).await,
            }
        }
        let grace = if after_loss {
            e.grace()
        } else {
            Duration::ZERO
        };
        if !grace.is_zero() {
            tracing::debug!(key = %e.key, ?grace, "distlock campaign waits out its predecessor's grace");
            match while_held(&*lease, stopped, tokio::time::sleep(grace)).await {
                Held::Done(()) => {}
                Held::Stop(to) => return self.let_go(lease, record, number, to).await,
                Held::Lost(reason) => return self.lost(lease, record, number, reason).await,
            }
        }
        self.lead(lease, record, number, stopped).await
    }

    /// Leads one term, until the lock is lost or the campaign is stopped.
    async fn lead(
        &self,
        lease: Box<dyn Lease>,
        record: Record<'_>,
        number: Option<u64>,
        stopped: &mut Stop,
    ) -> Round {
        let e = &self.election;
        let term = Term::start(
            number,
            lease.fencing_token(),
            Arc::clone(&e.identity),
            Arc::clone(&e.value),
        );
        // The term first, then the flag (no `.await` between): a reader of
        // the flag finds the term; `elected()` waits for the flag too.
        let leading = Leading::start(self, &term);
        e.changed.notify_waiters();
        let ended = while_held(&*lease, stopped, std::future::pending::<()>()).await;
        // The term ends before anything else happens: before the lock is
        // released, and as soon as the loss is known.
        drop(leading);
        match ended {
            Held::Stop(to) => self.let_go(lease, record, number, to).await,
            Held::Lost(reason) => self.lost(lease, record, number, reason).await,
            Held::Done(()) => Round::Again,
        }
    }

    /// Stopped while holding the lock: withdraw, then release.
    async fn let_go(
        &self,
        lease: Box<dyn Lease>,
        record: Record<'_>,
        number: Option<u64>,
        to: Option<Reply>,
    ) -> Round {
        self.withdraw(record, number).await;
        Round::Stopped(to, lease.release().await)
    }

    /// The lock was lost: withdraw (the record is not believed any more,
    /// but a successor that finds it withdrawn, its term started, need not
    /// wait), campaign again.
    async fn lost(
        &self,
        lease: Box<dyn Lease>,
        record: Record<'_>,
        number: Option<u64>,
        reason: LossReason,
    ) -> Round {
        tracing::warn!(key = %self.election.key, %reason, "distlock leadership lost; campaigning again");
        drop(lease);
        self.withdraw(record, number).await;
        Round::Again
    }

    /// Proclaiming failed: withdraw what may have been written, release.
    async fn give_up(
        &self,
        lease: Box<dyn Lease>,
        record: Record<'_>,
        number: Option<u64>,
        err: Error,
    ) -> Round {
        self.withdraw(record, number).await;
        if let Err(release) = lease.release().await {
            tracing::debug!(key = %self.election.key, error = %release, "distlock campaign release failed");
        }
        failed_or_paused(err)
    }

    /// Clears the leader record (bounded: a partition must not hold the
    /// campaign up), then wakes this process's observers.
    async fn withdraw(&self, record: Record<'_>, number: Option<u64>) {
        let e = &self.election;
        if let Some((board, seat)) = record {
            let withdrawal = board.withdraw(&e.key, seat, number);
            match tokio::time::timeout(WITHDRAW_WITHIN, withdrawal).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) => {
                    tracing::debug!(key = %e.key, error = %err, "distlock leader record not withdrawn");
                }
                Err(_) => {
                    tracing::debug!(key = %e.key, "distlock leader record withdrawal timed out");
                }
            }
        }
        e.changed.notify_waiters();
    }
}

/// Runs `work` while holding `lease`, unless the campaign is stopped or
/// the lease lost first.
async fn while_held<T>(
    lease: &dyn Lease,
    stopped: &mut Stop,
    work: impl Future<Output = T>,
) -> Held<T> {
    tokio::select! {
        biased;
        stop = stopped => Held::Stop(stop.ok()),
        reason = lease.lost() => Held::Lost(reason),
        done = work => Held::Done(done),
    }
}

fn failed_or_paused(err: Error) -> Round {
    if permanent(&err).is_some() {
        Round::Failed(err)
    } else {
        Round::Pause(err)
    }
}

fn reply(to: Option<Reply>, outcome: Result<(), Error>) {
    if let Some(to) = to {
        let _ = to.send(outcome);
    }
}

/// A term being led, as its campaign's readers see it: published on start,
/// ended and taken back when dropped, however the leading task lets go of
/// it (the lock lost, the campaign stopped, or the task dropped with its
/// runtime, which takes the lease with it). Never blocks; needs no runtime.
struct Leading<'a> {
    run: &'a Run,
    ends: Option<DropGuard>,
}

impl<'a> Leading<'a> {
    fn start(run: &'a Run, term: &Term) -> Self {
        let ends = term.ends_with();
        run.term.send_replace(Some(term.clone()));
        run.leader.send_replace(true);
        Self {
            run,
            ends: Some(ends),
        }
    }
}

impl Drop for Leading<'_> {
    fn drop(&mut self) {
        // The term's token first: the leader's work stops before the flag
        // and the term say so.
        drop(self.ends.take());
        self.run.leader.send_replace(false);
        self.run.term.send_replace(None);
    }
}
