//! The loss state every guard embeds: one watch channel from whoever keeps
//! the lock (a keeper task, a renewal task, a watchdog, a lock table) to the
//! guard, read the same way by every backend.
//!
//! A guard's `lost()`, `is_lost()` and `loss()` all come from here, so they
//! cannot disagree: `is_lost()` is `true` exactly when `loss()` is `Some`,
//! and `lost()` completes with that reason. A keeper that goes away without
//! reporting a reason (its task was dropped, its runtime shut down) counts
//! as a loss too: nothing keeps the lock any more.

use tokio::sync::watch;

use crate::LossReason;

/// The keeper's end: it reports a loss by sending `Some(reason)`.
pub(crate) type LossSender = watch::Sender<Option<LossReason>>;

/// The guard's end of its loss channel.
#[derive(Debug, Clone)]
pub(crate) struct LossState {
    rx: watch::Receiver<Option<LossReason>>,
    /// What a keeper that went away without a reason reads as.
    orphaned: LossReason,
}

/// A new loss channel, not lost yet; `orphaned` is what the guard reports
/// if the sender is dropped without sending a reason.
pub(crate) fn channel(orphaned: LossReason) -> (LossSender, LossState) {
    let (tx, rx) = watch::channel(None);
    (tx, LossState::watching(rx, orphaned))
}

impl LossState {
    /// The guard's end of a channel made elsewhere (a multiplexed
    /// connection's driver keeps one sender per lock).
    pub(crate) fn watching(rx: watch::Receiver<Option<LossReason>>, orphaned: LossReason) -> Self {
        Self { rx, orphaned }
    }

    /// Completes with the reason once the lock is lost. Cancel safe: it only
    /// watches the channel.
    pub(crate) async fn lost(&self) -> LossReason {
        let mut rx = self.rx.clone();
        if let Ok(reason) = rx.wait_for(Option::is_some).await
            && let Some(reason) = reason.clone()
        {
            return reason;
        }
        // The sender is gone; a reason it sent last still counts.
        self.loss().unwrap_or_else(|| self.orphaned.clone())
    }

    /// Whether the lock is lost: a reason was reported, or the keeper is gone.
    pub(crate) fn is_lost(&self) -> bool {
        self.rx.borrow().is_some() || self.rx.has_changed().is_err()
    }

    /// The reason the keeper reported, if any, whether or not the keeper is
    /// still there: for a guard that stops its keeper itself on release.
    pub(crate) fn reported(&self) -> Option<LossReason> {
        self.rx.borrow().clone()
    }

    /// Why the lock was lost, if it was.
    pub(crate) fn loss(&self) -> Option<LossReason> {
        if let Some(reason) = self.rx.borrow().clone() {
            return Some(reason);
        }
        self.rx
            .has_changed()
            .is_err()
            .then(|| self.orphaned.clone())
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
}
