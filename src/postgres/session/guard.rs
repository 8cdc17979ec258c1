//! The guard of a session-scoped lock, `SessionLock`: what `try_lock` and
//! `lock` hand out, in the default and the multiplexed mode.

use std::fmt;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::loss_state::LossState;
use crate::postgres::config::Config;
use crate::postgres::conn::held::HeldConn;
use crate::postgres::session::hold::Hold;
use crate::postgres::session::in_flight::InFlight;
use crate::postgres::session::keeper::{Keeper, KeeperSlot};
use crate::postgres::session::kept_elsewhere::KeptElsewhere;
use crate::postgres::session::timer::Timer;
use crate::{Error, FencingToken, LockKey, LossReason};

/// A session-scoped advisory lock, held on a dedicated pooled connection until
/// [`release`](Self::release) or drop.
///
/// A background task keeps the connection: it reads the connection while no
/// statement runs on it, so a session the server ends is learnt from the
/// server's goodbye at once, and every heartbeat interval it checks that the
/// same backend still answers within the heartbeat deadline. When either
/// fails, [`lost`](Self::lost) completes and the connection is closed. Treat
/// a lost lock as gone: another process may hold it already.
///
/// There is no `Deref` to the connection: run the protected work on your own
/// connections (the lock protects *work*, not a connection).
///
/// # Dropping
///
/// Dropping the guard without [`release`](Self::release) never blocks: the
/// background task unlocks and returns the connection to the pool, or closes
/// the connection if that fails or does not finish within the release
/// deadline. If the runtime has shut down, the connection is closed, so
/// PostgreSQL frees the lock when the session ends.
///
/// # Outliving the runtime
///
/// The task keeping the lock runs on the runtime that took it, also when
/// the locker is shared between runtimes: a runtime that sits idle (a
/// current-thread runtime outside `block_on`) holds up the keepers of its
/// own locks only. In the multiplexed mode that is the runtime that opened
/// the shared connection; for a PostgreSQL semaphore's permit, the runtime
/// of the task that took its slot, which for a permit handed over in the
/// process may be another waiter's. When that runtime shuts down while the
/// guard lives on, nothing keeps the lock any more: its connection is
/// closed (PostgreSQL frees the lock) and [`lost`](Self::lost) completes
/// with [`LossReason::KeeperStopped`], on any runtime. A lock whose keeper's
/// runtime is not driven gets no heartbeat and does not see its loss. A
/// multiplexed lock taken on another runtime than its connection's stays
/// held when the taking runtime shuts down: nothing of it runs there.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct SessionLock {
    key: LockKey,
    token: Option<FencingToken>,
    pid: i32,
    acquired_at: Instant,
    loss: LossState,
    holding: Holding,
}

/// Where the lock's connection is, and so how `release()` works.
enum Holding {
    /// Its own connection, shared with its keeper task: `release()` unlocks
    /// on the caller's task; a guard dropped without it asks the keeper to.
    Own {
        slot: KeeperSlot,
        hold: Hold,
        released: bool,
        release_timeout: Duration,
    },
    /// A connection shared by many locks (multiplexed mode), driven by
    /// another task: `release()` and `Drop` are messages to it, sent by
    /// what the guard holds of the lock (`None` once released).
    Shared(Option<Box<dyn KeptElsewhere>>),
}

impl fmt::Debug for SessionLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionLock")
            .field("key", &self.key)
            .field("fencing_token", &self.token)
            .field("backend_pid", &self.pid)
            .field("lost", &self.is_lost())
            .finish()
    }
}

impl Drop for SessionLock {
    fn drop(&mut self) {
        if let Holding::Own { slot, released, .. } = &self.holding {
            // Never blocks: the keeper task does the unlock. A `release()`
            // dropped before it took the connection leaves it in the slot,
            // so the keeper is asked in that case too.
            let still_held = !*released || slot.holds_connection();
            if still_held {
                slot.guard_dropped();
            }
        }
    }
}

impl SessionLock {
    pub(crate) fn start(
        conn: HeldConn,
        (key, hold): (LockKey, Hold),
        pid: i32,
        token: Option<FencingToken>,
        (config, timer): (&Config, &Timer),
    ) -> Self {
        let (keeper, guard) = Keeper::new(conn, (key.clone(), hold), pid, config);
        keeper.park(timer);
        Self {
            key,
            token,
            pid,
            acquired_at: Instant::now(),
            loss: guard.loss,
            holding: Holding::Own {
                slot: guard.slot,
                hold,
                released: false,
                release_timeout: config.release_timeout,
            },
        }
    }

    /// A guard for a lock kept by someone else (a multiplexed connection's
    /// driver): `release` unlocks it, or, dropped, queues the unlock.
    pub(crate) fn from_parts(
        key: LockKey,
        token: Option<FencingToken>,
        pid: i32,
        loss: watch::Receiver<Option<LossReason>>,
        release: Box<dyn KeptElsewhere>,
    ) -> Self {
        Self {
            key,
            token,
            pid,
            acquired_at: Instant::now(),
            loss: LossState::watching(loss, LossReason::KeeperStopped),
            holding: Holding::Shared(Some(release)),
        }
    }

    /// Holds the lock's own connection for one operation on it (an
    /// upgradeable lock's upgrade or downgrade; see [`InFlight`]).
    pub(crate) async fn in_flight(&self) -> Result<InFlight<'_>, Error> {
        match &self.holding {
            Holding::Own { slot, .. } => InFlight::begin(slot, &self.key, &self.loss).await,
            // Only the default mode's locks change what they hold: a lock
            // on a multiplexed connection has no connection of its own.
            Holding::Shared(_) => Err(Error::LockLost {
                key: self.key.clone(),
                reason: self.loss().unwrap_or(LossReason::KeeperStopped),
            }),
        }
    }

    /// The lock changes hands within the process (a semaphore permit
    /// handed to a waiter, see `permit_relay.rs`): its hold starts again.
    pub(crate) fn handed_over(&mut self) {
        self.acquired_at = Instant::now();
    }

    /// The key this lock holds.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// The fencing token issued with this lock, when the locker was built with
    /// `.fencing(true)`; `None` otherwise.
    pub fn fencing_token(&self) -> Option<FencingToken> {
        self.token
    }

    /// The backend process id of the session holding the lock.
    pub fn backend_pid(&self) -> i32 {
        self.pid
    }

    /// Completes when the lock can no longer be trusted: the connection
    /// closed or was terminated, a heartbeat failed or got no answer in time,
    /// or a different backend answered. Returns why.
    ///
    /// How soon: the lock's connection is read while no statement runs on
    /// it, so a session the server ends (terminated, shut down, crashed,
    /// switched over: it sends an error and closes the socket) is learnt from
    /// that goodbye at once, in every mode. A lock on a connection of its own
    /// is read from 10 ms after its grant on (a lock released sooner costs
    /// no background task); a goodbye that came earlier is read then. Every
    /// mode stayed within 30 ms of the goodbye in RELIABILITY.md's
    /// measurements. Silent failures (a partition, a stalled server, a lost
    /// host) are learnt by the heartbeat, within one heartbeat interval plus
    /// the heartbeat deadline.
    ///
    /// Typical use is racing the work against it:
    ///
    /// ```no_run
    /// # async fn demo(lock: distlock::SessionLock) -> Result<(), distlock::Error> {
    /// # async fn work() {}
    /// tokio::select! {
    ///     () = work() => lock.release().await?,
    ///     reason = lock.lost() => eprintln!("stopped: lock lost ({reason})"),
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only watches a channel.
    pub async fn lost(&self) -> LossReason {
        match self.abandoned() {
            Some(reason) => reason,
            None => self.loss.lost().await,
        }
    }

    /// `true` once [`lost`](Self::lost) would complete; exactly when
    /// [`loss`](Self::loss) is `Some`. No round trip: it reads what the
    /// heartbeat (or the multiplexed driver) last reported.
    pub fn is_lost(&self) -> bool {
        self.loss.is_lost() || self.abandoned().is_some()
    }

    /// Why the lock was lost, if it was: `None` while it is held. No round
    /// trip, as for [`is_lost`](Self::is_lost).
    pub fn loss(&self) -> Option<LossReason> {
        self.loss.loss().or_else(|| self.abandoned())
    }

    /// Why an operation on the lock's own connection (an upgrade, a
    /// downgrade) closed it, on the guard's own task: known here before the
    /// keeper, woken by it, reports it on the loss channel.
    fn abandoned(&self) -> Option<LossReason> {
        match &self.holding {
            Holding::Own { slot, .. } => slot.abandoned(),
            Holding::Shared(_) => None,
        }
    }

    /// How long the lock has been held, from the grant as this process saw
    /// it. No round trip.
    pub fn held_for(&self) -> Duration {
        self.acquired_at.elapsed()
    }

    /// Releases the lock and returns its connection to the pool.
    ///
    /// Costs 1 round trip. Fails with [`Error::LockLost`] if the lock had been
    /// lost (it may be held by someone else now; a connection that answers
    /// from another backend than the lock's, as a pooler would make it, is
    /// such a loss: [`LossReason::BackendChanged`](crate::LossReason::BackendChanged)), and with
    /// [`Error::ReleaseTimedOut`] if the server did not answer within the
    /// release deadline; in both cases, and on any other error, the
    /// connection is closed, so PostgreSQL frees whatever the session held
    /// (a heartbeat that held the connection at the deadline ends the lock
    /// when it ends: unlocked in the background, or the connection closed
    /// if it times out too).
    /// In the multiplexed mode the shared connection holds other locks: it
    /// is not closed for one release; the unlock stays queued on it, and
    /// its driver closes it (every lock on it lost) if the server does not
    /// answer a statement within the heartbeat deadline.
    ///
    /// # Cancel safety
    ///
    /// The unlock runs on the caller's task. Dropping this future after it
    /// took the connection closes the connection, so the server frees the
    /// lock; dropped earlier, it drops the guard, whose background task then
    /// releases the lock. In the multiplexed mode, dropped at any point, the
    /// unlock is queued on the shared connection all the same.
    pub async fn release(mut self) -> Result<(), Error> {
        let span = tracing::debug_span!(
            "distlock.release",
            key = %self.key,
            hold_ms = self.acquired_at.elapsed().as_secs_f64() * 1e3,
            outcome = tracing::field::Empty,
        );
        let result = match &mut self.holding {
            Holding::Own {
                slot,
                hold,
                released,
                release_timeout,
            } => {
                // From here on the keeper is not woken: it finds the slot
                // empty at its next beat, or the connection still there if
                // this future is dropped before taking it (see `Drop`).
                *released = true;
                let held = (&self.key, *hold);
                let result = slot
                    .release(&self.loss, held, self.pid, *release_timeout)
                    .await;
                if result.is_ok() {
                    crate::metrics::released("postgres", &self.key, self.acquired_at.elapsed());
                }
                result
            }
            Holding::Shared(kept) => match kept.take() {
                Some(kept) => kept.release().await,
                None => Err(Error::LockLost {
                    key: self.key.clone(),
                    reason: self.loss().unwrap_or(LossReason::KeeperStopped),
                }),
            },
        };
        span.record("outcome", if result.is_ok() { "released" } else { "error" });
        result
    }
}
