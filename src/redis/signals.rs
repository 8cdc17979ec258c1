//! Release signals: a release publishes on a channel named after the lock,
//! and a waiting `lock` sleeps until a message comes, instead of polling.
//!
//! One locker (all its clones) keeps one subscriber connection per server,
//! shared by all its waiters, whatever their number: the first waiter of a
//! key subscribes to the key's channel, the last one to leave unsubscribes.
//! In the process, a message wakes one waiter of the key, the longest
//! waiting; a waiter that is woken and dropped before its try passes the
//! wake on. Every waiter also polls, slowly, as a fallback: pub/sub is
//! at-most-once, and a holder that vanishes without releasing sends
//! nothing (its key expires).

use std::collections::HashMap;
use std::collections::hash_map::Entry as MapEntry;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures_util::future::join_all;
use tokio::sync::{Semaphore, watch};
use tokio::time::{sleep, timeout};
use tokio_util::sync::CancellationToken;

use super::node::Node;
use super::subscriber::Subscriber;

/// Prefix of the channel a release publishes on: `distlock:released`, a NUL
/// byte, then the lock's Redis key. Lock names cannot contain NUL, so the
/// channel of one lock is never another's, nor anything a user names
/// `distlock:released:...`.
pub(crate) const CHANNEL_PREFIX: &str = "distlock:released\0";

/// The channel on which releases of the Redis key `name` are signalled.
pub(crate) fn channel(name: &str) -> String {
    format!("{CHANNEL_PREFIX}{name}")
}

/// The release signals of one locker and its clones. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Signals {
    shared: Arc<Shared>,
}

/// What the waiters and the subscriber tasks share.
pub(super) struct Shared {
    registry: Mutex<Registry>,
    /// Bumped whenever a subscriber's connection comes up or goes down, so
    /// that every waiter looks again (and tries: a release may have gone
    /// unheard meanwhile).
    links: watch::Sender<u64>,
    /// One per server, in the order of the nodes.
    subscribers: Vec<Subscriber>,
    /// How many subscribers must hear a release for a waiter to rely on
    /// the signal: 1 of 1, or a Redlock quorum (a holder's keys are on at
    /// least a quorum of nodes, so a quorum of subscribers shares a node
    /// with them).
    needed: usize,
    /// Stops the subscriber tasks when the last clone is dropped.
    stop: CancellationToken,
}

/// The channels this locker's waiters listen on.
#[derive(Default)]
pub(super) struct Registry {
    /// Bumped on every change of `channels`; subscribers report how far
    /// they have applied it.
    pub(super) seq: u64,
    pub(super) channels: HashMap<String, Slot>,
}

/// A channel with waiters.
pub(super) struct Slot {
    pub(super) waiters: Arc<Waiters>,
    /// The `seq` at which the channel was added: a subscriber that has
    /// applied this far listens on it.
    since: u64,
    listeners: usize,
}

/// The waiters of one key in this process.
pub(super) struct Waiters {
    /// Wakes: a FIFO of waiters, and at most one wake kept for the next one
    /// when nobody waits at the moment a message comes.
    wakes: Semaphore,
}

impl Waiters {
    /// Wakes the longest-waiting waiter, or keeps the wake for the next.
    pub(super) fn wake(&self) {
        if self.wakes.available_permits() == 0 {
            self.wakes.add_permits(1);
        }
    }
}

impl Signals {
    /// Signals over `nodes`, relied on when `needed` of their subscribers
    /// listen. Nothing connects until a waiter listens.
    pub(crate) fn new(nodes: &[Node], needed: usize) -> Self {
        Self {
            shared: Arc::new(Shared {
                registry: Mutex::new(Registry::default()),
                links: watch::Sender::new(0),
                subscribers: nodes.iter().map(Subscriber::new).collect(),
                needed,
                stop: CancellationToken::new(),
            }),
        }
    }

    /// Starts listening for releases of the Redis key `name`. Returns once
    /// every subscriber listens on its channel or has failed to (a server
    /// down, a missing ACL permission), or after `within`. A release
    /// published before that may be missed: try once more before waiting.
    ///
    /// The first waiter of a locker opens its subscriber connections (one
    /// per server); the first waiter of a key costs a `SUBSCRIBE` on them.
    pub(crate) async fn listen(&self, name: &str, within: Duration) -> Listener {
        let channel = channel(name);
        let (waiters, since, added) = self.shared.register(&channel);
        let mut listener = Listener {
            signals: self.clone(),
            channel,
            waiters,
            since,
            links: self.shared.links.subscribe(),
        };
        for subscriber in &self.shared.subscribers {
            subscriber.ensure_running(&self.shared);
            if added {
                subscriber.changed();
            }
        }
        let settled = self
            .shared
            .subscribers
            .iter()
            .map(|subscriber| subscriber.settled(since));
        let _ = timeout(within, join_all(settled)).await;
        // A connection that came up meanwhile is what was waited for: not a
        // reason to wake this waiter once more. (`is_heard` reads the links
        // as they are whenever the waiter decides how to wait.)
        listener.links.borrow_and_update();
        listener
    }
}

impl Shared {
    pub(super) fn registry(&self) -> MutexGuard<'_, Registry> {
        // The registry holds plain counts: a panic while it was locked
        // leaves nothing half-done.
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn stop(&self) -> &CancellationToken {
        &self.stop
    }

    /// Every waiter looks again at the subscribers.
    pub(super) fn links_changed(&self) {
        self.links.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Wakes a waiter of `channel`, if it has any.
    pub(super) fn deliver(&self, channel: &str) {
        if let Some(slot) = self.registry().channels.get(channel) {
            slot.waiters.wake();
        }
    }

    /// Adds a listener of `channel`: its waiters, the `seq` from which the
    /// channel is wanted, and whether it was added just now.
    fn register(&self, channel: &str) -> (Arc<Waiters>, u64, bool) {
        let mut registry = self.registry();
        let next = registry.seq + 1;
        match registry.channels.entry(channel.to_owned()) {
            MapEntry::Occupied(mut slot) => {
                let slot = slot.get_mut();
                slot.listeners += 1;
                (Arc::clone(&slot.waiters), slot.since, false)
            }
            MapEntry::Vacant(vacant) => {
                let waiters = Arc::new(Waiters {
                    wakes: Semaphore::new(0),
                });
                vacant.insert(Slot {
                    waiters: Arc::clone(&waiters),
                    since: next,
                    listeners: 1,
                });
                registry.seq = next;
                (waiters, next, true)
            }
        }
    }

    /// Removes a listener of `channel`; the last one removes the channel.
    fn unregister(&self, channel: &str) {
        let removed = {
            let mut registry = self.registry();
            let last = match registry.channels.get_mut(channel) {
                Some(slot) => {
                    slot.listeners -= 1;
                    slot.listeners == 0
                }
                None => false,
            };
            if last {
                registry.channels.remove(channel);
                registry.seq += 1;
            }
            last
        };
        if removed {
            for subscriber in &self.subscribers {
                subscriber.changed();
            }
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// One waiter's registration on a key's channel; unregisters on drop.
pub(crate) struct Listener {
    signals: Signals,
    channel: String,
    waiters: Arc<Waiters>,
    since: u64,
    links: watch::Receiver<u64>,
}

impl Listener {
    /// Whether enough subscribers listen on the channel now for a release
    /// to reach this waiter.
    pub(crate) fn is_heard(&self) -> bool {
        let shared = &self.signals.shared;
        let listening = shared
            .subscribers
            .iter()
            .filter(|subscriber| subscriber.listens_since(self.since))
            .count();
        listening >= shared.needed
    }

    /// Sleeps until a release of the key wakes this waiter, a subscriber
    /// connection comes up or goes down, or `at_most` has passed. A wake
    /// comes as a [`Wake`], to be settled once the try it led to is done.
    pub(crate) async fn wait(&mut self, at_most: Duration) -> Option<Wake> {
        let links = async {
            if self.links.changed().await.is_err() {
                // The sender lives as long as `self.signals`.
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            permit = self.waiters.wakes.acquire() => {
                // The semaphore is never closed.
                permit.ok()?.forget();
                Some(Wake {
                    waiters: Some(Arc::clone(&self.waiters)),
                })
            }
            () = links => None,
            () = sleep(at_most) => None,
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.signals.shared.unregister(&self.channel);
    }
}

impl fmt::Debug for Listener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Listener")
            .field("channel", &self.channel)
            .field("since", &self.since)
            .finish_non_exhaustive()
    }
}

/// A wake taken by a waiter. Dropped before [`settle`](Self::settle) (the
/// waiter was cancelled before its try ended), it goes to the next waiter.
#[derive(Debug)]
pub(crate) struct Wake {
    waiters: Option<Arc<Waiters>>,
}

impl Wake {
    /// The try the wake led to is done.
    pub(crate) fn settle(mut self) {
        self.waiters = None;
    }
}

impl Drop for Wake {
    fn drop(&mut self) {
        if let Some(waiters) = self.waiters.take() {
            waiters.wake();
        }
    }
}

impl fmt::Debug for Waiters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Waiters")
            .field("wakes", &self.wakes.available_permits())
            .finish()
    }
}

impl fmt::Debug for Signals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Signals")
            .field("channels", &self.shared.registry().channels.len())
            .field("needed", &self.shared.needed)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channels_cannot_be_spelled_by_a_lock_name() {
        assert_eq!(channel("jobs:a"), "distlock:released\0jobs:a");
        assert_ne!(channel("a\0b"), channel("a"));
        assert!(
            crate::LockKey::from(channel("x").as_str())
                .validate()
                .is_err()
        );
    }

    #[tokio::test]
    async fn a_wake_dropped_unsettled_goes_to_the_next_waiter() {
        let waiters = Arc::new(Waiters {
            wakes: Semaphore::new(0),
        });
        waiters.wake();
        waiters.wake();
        assert_eq!(waiters.wakes.available_permits(), 1, "wakes do not pile up");
        if let Ok(permit) = waiters.wakes.acquire().await {
            permit.forget();
        }
        drop(Wake {
            waiters: Some(Arc::clone(&waiters)),
        });
        assert_eq!(waiters.wakes.available_permits(), 1, "passed on");
        if let Ok(permit) = waiters.wakes.acquire().await {
            permit.forget();
        }
        Wake {
            waiters: Some(Arc::clone(&waiters)),
        }
        .settle();
        assert_eq!(waiters.wakes.available_permits(), 0, "settled");
    }
}
