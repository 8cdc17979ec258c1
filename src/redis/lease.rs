//! The one lease type of the Redis backend, whichever strategy granted it:
//! a single instance ([`RedisLocker`](super::RedisLocker)) or a quorum of
//! nodes ([`Redlock`](super::Redlock)). The strategy lives behind the
//! watchdog's `Backend`; the lease only forwards to its watchdog handle,
//! which embeds the loss state every guard shares (`loss_state.rs`).

use std::fmt;
use std::time::Duration;

use super::watchdog::Handle;
use crate::{Error, FencingToken, LockKey, LossReason};

/// A lease on Redis, kept alive by a watchdog until
/// [`release`](Self::release) or drop.
///
/// Treat a lost lease as gone: another holder may have the key already.
/// On a single instance, present [`fencing_token`](Self::fencing_token) with
/// every write to the protected resource, so that a holder that was
/// overtaken (a long GC or VM pause, a network partition) cannot write after
/// its successor; a Redlock lease has none (see the [module docs](super) for
/// pairing it with the PostgreSQL fence).
///
/// # Dropping
///
/// Dropping the lease never blocks: the watchdog task deletes the key
/// (compare-then-`DEL`, on every node for Redlock) in the background. If the
/// runtime has shut down, the key expires after its TTL.
#[must_use = "the lease is released as soon as it is dropped"]
pub struct RedisLease {
    handle: Handle,
    token: Option<FencingToken>,
    /// The strategy's name: "redis" or "redlock".
    strategy: &'static str,
}

/// The lease [`Redlock`](super::Redlock) grants: the same type as a single
/// instance's, without a fencing token.
pub type RedlockLease = RedisLease;

impl fmt::Debug for RedisLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLease")
            .field("strategy", &self.strategy)
            .field("key", self.key())
            .field("fencing_token", &self.token)
            .field("validity", &self.validity())
            .field("lost", &self.is_lost())
            .finish()
    }
}

impl RedisLease {
    pub(super) fn new(handle: Handle, token: Option<FencingToken>, strategy: &'static str) -> Self {
        Self {
            handle,
            token,
            strategy,
        }
    }

    /// The key this lease holds.
    pub fn key(&self) -> &LockKey {
        self.handle.key()
    }

    /// The fencing token issued with this lease by a single instance:
    /// strictly greater than every token issued before for this key by this
    /// server (as long as the server keeps its data; see the
    /// [module docs](super)). `None` for a locker built with
    /// [`fencing(false)`](super::RedisLockerBuilder::fencing), and always `None` for Redlock, whose tokens
    /// would not be strictly increasing across holders.
    pub fn fencing_token(&self) -> Option<FencingToken> {
        self.token
    }

    /// How long the lease is still known to be held: TTL − elapsed − drift,
    /// where elapsed counts from the start of the last successful write
    /// (acquire or extension; for Redlock, the last round that reached a
    /// quorum) until now, and drift is TTL × 1% + 2 ms. Zero once lost.
    /// Work that must finish while the lease holds should fit into this.
    pub fn validity(&self) -> Duration {
        self.handle.validity()
    }

    /// The lease's time to live.
    pub fn ttl(&self) -> Duration {
        self.handle.ttl()
    }

    /// How long the lease has been held, from its grant as this process saw
    /// it. No round trip.
    pub fn held_for(&self) -> Duration {
        self.handle.held_for()
    }

    /// Completes when the lease can no longer be trusted, with the reason:
    /// an extension found, within the validity, the key gone or holding
    /// another token (on too many nodes, for Redlock:
    /// [`LossReason::Expired`]), failed
    /// ([`LossReason::ConnectionFailed`]), or got no reply before the
    /// validity ran out ([`LossReason::HeartbeatTimedOut`]; for Redlock
    /// also when every node that kept a quorum out was silent past its
    /// command deadline). It watches the clock too: once the
    /// [`validity`](Self::validity) has run out it completes even if the
    /// watchdog has not run since, with the reason the watchdog gives
    /// (the failure of the extension it was retrying, or
    /// [`LossReason::HeartbeatTimedOut`] for one still unanswered), or
    /// [`LossReason::Expired`] if it had sent none. The watchdog and the
    /// clock agree on the reason, whichever is read first, and
    /// [`loss`](Self::loss) keeps reporting it.
    ///
    /// ```no_run
    /// # async fn demo(lease: distlock::redis::RedisLease) -> Result<(), distlock::Error> {
    /// # async fn work() {}
    /// tokio::select! {
    ///     () = work() => lease.release().await?,
    ///     reason = lease.lost() => eprintln!("stopped: lease lost ({reason})"),
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only watches a channel and the clock.
    pub async fn lost(&self) -> LossReason {
        self.handle.lost().await
    }

    /// `true` once [`lost`](Self::lost) would complete, or once the
    /// [`validity`](Self::validity) has run out; exactly when
    /// [`loss`](Self::loss) is `Some`. No round trip.
    pub fn is_lost(&self) -> bool {
        self.handle.is_lost()
    }

    /// Why the lease was lost, if it was: `None` while it is held; once
    /// the validity ran out by the clock, even before the watchdog
    /// noticed, the reason [`lost`](Self::lost) gives. The first reason
    /// seen is kept. No round trip.
    pub fn loss(&self) -> Option<LossReason> {
        self.handle.loss()
    }

    /// Deletes the key where it still holds this lease's token.
    ///
    /// A lease already lost (by the clock, its validity run out even if the
    /// watchdog has not run since, or as the watchdog found) fails at once
    /// with [`Error::LockLost`], no round trip: the key is then deleted in
    /// the background where it still holds this lease's token. Otherwise,
    /// single instance: 1 round trip. Redlock: 1 round trip to every node,
    /// concurrently, including nodes that did not grant it (a late `SET` may
    /// have landed there); it succeeds when a quorum deleted the key. Fails
    /// with [`Error::LockLost`] if the lease had been lost or the key had
    /// expired ([`LossReason::Expired`](crate::LossReason::Expired): it may
    /// belong to another holder now, whose lease stays untouched; on Redlock
    /// also when the nodes that answered are enough to show it, whatever
    /// the others did), with [`Error::ReleaseTimedOut`] if no answer came in
    /// time, and with [`Error::Redis`] for another failure of the command
    /// (a connection error, a missing ACL permission).
    ///
    /// # Cancel safety
    ///
    /// Once polled, the release is carried out by the watchdog even if this
    /// future is dropped (the outcome is then only logged).
    pub async fn release(self) -> Result<(), Error> {
        self.handle.release(self.strategy).await
    }
}

crate::lease::lease_from_inherent!(RedisLease, validity = validity);
