//! The loss state every guard embeds: one watch channel from whoever keeps
//! the lock (a keeper task, a renewal task, a watchdog, a lock table) to the
//! guard, read the same way by every backend.
//!
//! A guard's `lost()`, `is_lost()` and `loss()` all come from here, so they
//! cannot disagree: `is_lost()` is `true` exactly when `loss()` is `Some`,
//! and `lost()` completes with that reason. A keeper that goes away without
//! reporting a reason (its task was dropped, its runtime shut down) counts
//! as a loss too: nothing keeps the lock any more.
//!
//! A lease with a time to live (Redis, the lease table) also carries its
//! [`Validity`]: until when the holder knows it holds the lease, by its own
//! clock. Past that instant the guard reports the loss itself, so a holder
//! whose keeper could not run (a starved runtime, a process stopped and
//! continued) learns it at its first look, not at the keeper's next turn.
//! Such a guard keeps the first reason it saw (the clock's, or the
//! keeper's if that came first), so `loss()` and `lost()` keep agreeing
//! when the keeper reports its own reason a moment later. A keeper whose
//! renewals have been failing, or whose renewal is still unanswered, tells
//! the validity why ([`Validity::failing`]): while it retries, the clock
//! reports that reason (a refused connection, say) rather than its own, so
//! the holder learns why the renewals failed even if the clock is read
//! first. A keeper that finds the lease lost settles its reason with the
//! validity ([`Validity::lose`]): before the deadline its own reason ends
//! the validity, after it the clock's reason is the keeper's too, so the
//! reason a holder reads does not depend on which task ran first.

use tokio::sync::watch;
use tokio::time::{Instant, sleep_until};

use crate::LossReason;

/// The keeper's end: it reports a loss by sending `Some(reason)`.
pub(crate) type LossSender = watch::Sender<Option<LossReason>>;

/// The guard's end of its loss channel.
#[derive(Debug, Clone)]
pub(crate) struct LossState {
    rx: watch::Receiver<Option<LossReason>>,
    /// What a keeper that went away without a reason reads as.
    orphaned: LossReason,
    /// For a lease with a time to live: until when it is known held (boxed:
    /// every guard embeds this state, most without a time to live).
    expiry: Option<Box<Expiry>>,
}

/// Until when a lease is known held, and why its renewals are failing if
/// they are.
#[derive(Debug, Clone)]
struct Window {
    until: Instant,
    /// The last failure of a renewal since the last one that succeeded (a
    /// renewal still unanswered counts).
    failing: Option<LossReason>,
    /// What the guard reports once the clock passed `until` before the
    /// keeper said anything, unless the keeper noted a failure.
    by_clock: LossReason,
}

impl Window {
    /// The clock's reason, once `until` has passed.
    fn reason(&self) -> LossReason {
        self.failing
            .clone()
            .unwrap_or_else(|| self.by_clock.clone())
    }
}

/// The guard's end of a lease's validity.
#[derive(Debug, Clone)]
struct Expiry {
    window: watch::Receiver<Window>,
    /// The first reason this guard reported, kept.
    seen: std::sync::OnceLock<LossReason>,
}

/// The keeper's end of a lease's validity: it moves the instant forward
/// after each renewal the server confirmed.
#[derive(Debug)]
pub(crate) struct Validity {
    tx: watch::Sender<Window>,
}

impl Validity {
    /// Until when the lease is known held.
    pub(crate) fn until(&self) -> Instant {
        self.tx.borrow().until
    }

    /// Moves the validity to `until`; `false`, changing nothing, if it had
    /// run out already. A renewal confirmed only after that (its reply read
    /// late by a starved runtime) comes too late: the guard may have
    /// reported the loss by the clock, and a loss is never taken back. The
    /// check and the move happen under the channel's lock, which the guard
    /// holds while it reads the clock, so the two cannot interleave.
    /// A renewal that succeeds also clears the failure noted before it.
    pub(crate) fn extend(&self, until: Instant) -> bool {
        let mut moved = false;
        self.tx.send_if_modified(|current| {
            moved = Instant::now() < current.until;
            if moved {
                current.until = until;
                current.failing = None;
            }
            moved
        });
        moved
    }

    /// Notes why a renewal failed while the keeper retries: should the
    /// validity run out before the keeper reports the loss, the guard gives
    /// this reason. Ignored once the validity has run out, so the reason a
    /// guard reads by the clock does not change after the fact.
    pub(crate) fn failing(&self, reason: LossReason) {
        self.tx.send_if_modified(|current| {
            let open = Instant::now() < current.until;
            if open {
                current.failing = Some(reason);
            }
            open
        });
    }

    /// The reason a keeper that found the lease lost reports: `found` while
    /// the validity lasts, and the validity ends there, on that reason;
    /// once it has run out, the reason the guard's clock gives (the
    /// failure noted last, or the clock's own). So the keeper's report and
    /// the guard's look at the clock agree, whichever comes first: the
    /// reason does not depend on which task the runtime ran first.
    pub(crate) fn lose(&self, found: LossReason) -> LossReason {
        let mut reason = found;
        self.tx.send_modify(|current| {
            let now = Instant::now();
            if now < current.until {
                current.until = now;
                current.failing = Some(reason.clone());
            } else {
                reason = current.reason();
            }
        });
        reason
    }
}

/// A new loss channel, not lost yet; `orphaned` is what the guard reports
/// if the sender is dropped without sending a reason.
pub(crate) fn channel(orphaned: LossReason) -> (LossSender, LossState) {
    let (tx, rx) = watch::channel(None);
    (tx, LossState::watching(rx, orphaned))
}

/// A new loss channel for a lease known held until `until`: past it (unless
/// the keeper extended it) the guard reports `by_clock` on its own.
pub(crate) fn channel_with_validity(
    orphaned: LossReason,
    until: Instant,
    by_clock: LossReason,
) -> (LossSender, Validity, LossState) {
    let (tx, mut state) = channel(orphaned);
    let (validity, window) = watch::channel(Window {
        until,
        failing: None,
        by_clock,
    });
    state.expiry = Some(Box::new(Expiry {
        window,
        seen: std::sync::OnceLock::new(),
    }));
    (tx, Validity { tx: validity }, state)
}

impl Expiry {
    /// The clock's reason, if the validity has run out: why the renewals
    /// failed, if the keeper said, else the clock's own. The clock is read
    /// while the channel is borrowed (see [`Validity::extend`]).
    fn ran_out(&self) -> Option<LossReason> {
        let window = self.window.borrow();
        (Instant::now() >= window.until).then(|| window.reason())
    }

    /// Until when the lease is known held.
    fn until(&self) -> Instant {
        self.window.borrow().until
    }

    /// Completes once the validity has run out.
    async fn run_out(&self) -> LossReason {
        let mut window = self.window.clone();
        loop {
            if let Some(reason) = self.ran_out() {
                return reason;
            }
            let at = window.borrow_and_update().until;
            tokio::select! {
                () = sleep_until(at) => {}
                // Extended or a failure noted (or the keeper gone, the
                // window final): look again.
                changed = window.changed() => {
                    if changed.is_err() {
                        sleep_until(at).await;
                    }
                }
            }
        }
    }
}

impl LossState {
    /// The guard's end of a channel made elsewhere (a multiplexed
    /// connection's driver keeps one sender per lock).
    pub(crate) fn watching(rx: watch::Receiver<Option<LossReason>>, orphaned: LossReason) -> Self {
        Self {
            rx,
            orphaned,
            expiry: None,
        }
    }

    /// Completes with the reason once the lock is lost: reported, or (for a
    /// lease with a validity) run out by the clock. Cancel safe: it only
    /// watches channels and the clock.
    pub(crate) async fn lost(&self) -> LossReason {
        let reason = match &self.expiry {
            None => return self.reported_loss().await,
            Some(expiry) => tokio::select! {
                biased;
                reason = self.reported_loss() => reason,
                reason = expiry.run_out() => reason,
            },
        };
        // The first reason seen, as `loss()` reports it from now on.
        self.loss().unwrap_or(reason)
    }

    /// How long the lease is still known held: `None` for a lock without a
    /// validity, zero once lost.
    pub(crate) fn validity(&self) -> Option<std::time::Duration> {
        let expiry = self.expiry.as_deref()?;
        if self.is_lost() {
            return Some(std::time::Duration::ZERO);
        }
        Some(expiry.until().saturating_duration_since(Instant::now()))
    }

    /// Completes with the reason the keeper reported, or the orphaned one.
    async fn reported_loss(&self) -> LossReason {
        let mut rx = self.rx.clone();
        if let Ok(reason) = rx.wait_for(Option::is_some).await
            && let Some(reason) = reason.clone()
        {
            return reason;
        }
        // The sender is gone; a reason it sent last still counts.
        self.reported().unwrap_or_else(|| self.orphaned.clone())
    }

    /// Whether the lock is lost: a reason was reported, the keeper is gone,
    /// or the lease's validity ran out by the clock.
    pub(crate) fn is_lost(&self) -> bool {
        self.loss().is_some()
    }

    /// The reason the keeper reported, if any, whether or not the keeper is
    /// still there: for a guard that stops its keeper itself on release.
    pub(crate) fn reported(&self) -> Option<LossReason> {
        self.rx.borrow().clone()
    }

    /// Why the lock was lost, if it was: the keeper's reason, a keeper
    /// gone, or the clock's reason; for a lease with a validity, whichever
    /// this guard saw first, kept.
    pub(crate) fn loss(&self) -> Option<LossReason> {
        let Some(expiry) = self.expiry.as_deref() else {
            return self.keeper_loss();
        };
        if let Some(seen) = expiry.seen.get() {
            return Some(seen.clone());
        }
        let reason = self.keeper_loss().or_else(|| expiry.ran_out())?;
        Some(expiry.seen.get_or_init(|| reason).clone())
    }

    /// The keeper's reason, or the orphaned one if it went away silently.
    fn keeper_loss(&self) -> Option<LossReason> {
        if let Some(reason) = self.rx.borrow().clone() {
            return Some(reason);
        }
        self.rx
            .has_changed()
            .is_err()
            .then(|| self.orphaned.clone())
    }

    /// The clock's reason, if the lease's validity has run out (whatever
    /// the keeper said; a keeper that found the lease lost ends the
    /// validity with its reason, see [`Validity::lose`]).
    pub(crate) fn ran_out(&self) -> Option<LossReason> {
        self.expiry.as_deref().and_then(Expiry::ran_out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_reported_reason_is_seen_by_all_three_readers() {
        let (tx, state) = channel(LossReason::KeeperStopped);
        assert!(!state.is_lost());
        assert_eq!(state.loss(), None);
        tx.send_replace(Some(LossReason::Expired));
        assert!(state.is_lost());
        assert_eq!(state.loss(), Some(LossReason::Expired));
        assert_eq!(state.lost().await, LossReason::Expired);
        // The reason outlives its sender.
        drop(tx);
        assert_eq!(state.loss(), Some(LossReason::Expired));
        assert_eq!(state.lost().await, LossReason::Expired);
    }

    #[tokio::test]
    async fn a_keeper_gone_without_a_reason_is_a_loss() {
        let (tx, state) = channel(LossReason::KeeperStopped);
        drop(tx);
        assert!(state.is_lost());
        assert_eq!(state.loss(), Some(LossReason::KeeperStopped));
        assert_eq!(state.lost().await, LossReason::KeeperStopped);
    }

    #[tokio::test(start_paused = true)]
    async fn a_validity_run_out_is_a_loss_the_keeper_cannot_take_back() {
        let ms = std::time::Duration::from_millis;
        let start = Instant::now();
        let (tx, validity, state) = channel_with_validity(
            LossReason::KeeperStopped,
            start + ms(100),
            LossReason::Expired,
        );
        assert_eq!(state.validity(), Some(ms(100)));
        // Extended in time: the guard waits for the new instant.
        tokio::time::sleep(ms(60)).await;
        assert!(validity.extend(start + ms(200)));
        assert_eq!(state.loss(), None);
        assert_eq!(state.lost().await, LossReason::Expired);
        assert_eq!(
            Instant::now(),
            start + ms(200),
            "lost() woke at the moved instant"
        );
        assert_eq!(state.loss(), Some(LossReason::Expired));
        assert_eq!(state.validity(), Some(std::time::Duration::ZERO));
        // Too late: refused, and the loss stands.
        assert!(!validity.extend(start + ms(400)));
        assert_eq!(state.loss(), Some(LossReason::Expired));
        // The keeper's own reason, reported later, does not change what the
        // guard said.
        tx.send_replace(Some(LossReason::HeartbeatTimedOut(ms(200))));
        assert_eq!(state.loss(), Some(LossReason::Expired));
        assert_eq!(state.lost().await, LossReason::Expired);
        // Reported before the guard looked, the keeper's reason is the one.
        let (tx, _validity, state) =
            channel_with_validity(LossReason::KeeperStopped, start, LossReason::Expired);
        tx.send_replace(Some(LossReason::NotHeld));
        assert_eq!(state.lost().await, LossReason::NotHeld);
        assert_eq!(state.loss(), Some(LossReason::NotHeld));
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_the_keeper_noted_is_the_clocks_reason() {
        let ms = std::time::Duration::from_millis;
        let start = Instant::now();
        let refused = LossReason::ConnectionFailed("refused".into());
        let (_tx, validity, state) = channel_with_validity(
            LossReason::KeeperStopped,
            start + ms(100),
            LossReason::Expired,
        );
        // A failure, then a renewal that lands: the note is cleared.
        validity.failing(refused.clone());
        assert!(validity.extend(start + ms(200)));
        tokio::time::sleep(ms(150)).await;
        validity.failing(LossReason::NotHeld);
        validity.failing(refused.clone());
        assert_eq!(state.loss(), None, "a noted failure is not a loss");
        // The keeper is still retrying as the validity runs out: the guard
        // gives the last failure, waking at the window's end.
        assert_eq!(state.lost().await, refused);
        assert_eq!(Instant::now(), start + ms(200));
        assert_eq!(state.loss(), Some(refused.clone()));
        // Noted too late: ignored.
        validity.failing(LossReason::NotHeld);
        assert_eq!(state.loss(), Some(refused));
        // Noted while `lost()` waits: it wakes at the window's end all the
        // same, with the note.
        let (_tx, validity, state) = channel_with_validity(
            LossReason::KeeperStopped,
            start + ms(260),
            LossReason::Expired,
        );
        let waiting = tokio::spawn(async move { (state.lost().await, Instant::now()) });
        tokio::time::sleep(ms(30)).await;
        validity.failing(LossReason::NotHeld);
        assert_eq!(
            waiting.await.expect("lost()"),
            (LossReason::NotHeld, start + ms(260))
        );
        // Cleared by the renewal: a later run-out is the clock's own.
        let (_tx, validity, state) = channel_with_validity(
            LossReason::KeeperStopped,
            start + ms(300),
            LossReason::Expired,
        );
        validity.failing(LossReason::NotHeld);
        assert!(validity.extend(start + ms(400)));
        assert_eq!(state.lost().await, LossReason::Expired);
    }

    #[tokio::test(start_paused = true)]
    async fn the_keeper_and_the_clock_give_one_reason_whoever_is_first() {
        let ms = std::time::Duration::from_millis;
        let start = Instant::now();
        let refused = LossReason::ConnectionFailed("refused".into());
        let unanswered = LossReason::HeartbeatTimedOut(ms(100));
        // The keeper finds the loss in time, and reports it only after the
        // validity would have run out (a task preempted between the two):
        // the guard, looking in between, reads the keeper's reason.
        let (tx, validity, state) = channel_with_validity(
            LossReason::KeeperStopped,
            start + ms(100),
            LossReason::Expired,
        );
        let found = validity.lose(LossReason::NotHeld);
        assert_eq!(found, LossReason::NotHeld);
        assert_eq!(state.validity(), Some(std::time::Duration::ZERO));
        tokio::time::sleep(ms(150)).await;
        assert_eq!(state.loss(), Some(LossReason::NotHeld));
        tx.send_replace(Some(found));
        assert_eq!(state.lost().await, LossReason::NotHeld);
        // The keeper finds it only past the validity: it reports what the
        // guard's clock gives, the failure noted last (an extension sent
        // and unanswered), whichever of the two is read first.
        let (_tx, validity, state) = channel_with_validity(
            LossReason::KeeperStopped,
            Instant::now() + ms(100),
            LossReason::Expired,
        );
        validity.failing(refused.clone());
        validity.failing(unanswered.clone());
        tokio::time::sleep(ms(150)).await;
        assert_eq!(validity.lose(refused.clone()), unanswered);
        assert_eq!(state.loss(), Some(unanswered));
        // Nothing noted: the clock's own reason.
        let (_tx, validity, _state) = channel_with_validity(
            LossReason::KeeperStopped,
            Instant::now() + ms(100),
            LossReason::Expired,
        );
        tokio::time::sleep(ms(150)).await;
        assert_eq!(validity.lose(refused), LossReason::Expired);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lock_without_a_validity_is_lost_only_when_reported() {
        let (tx, state) = channel(LossReason::KeeperStopped);
        tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
        assert_eq!(state.loss(), None);
        assert_eq!(state.validity(), None);
        tx.send_replace(Some(LossReason::NotHeld));
        assert_eq!(state.lost().await, LossReason::NotHeld);
    }
}
