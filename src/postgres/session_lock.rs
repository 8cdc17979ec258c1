//! The guard of a session-scoped lock, `SessionLock`: what `try_lock` and
//! `lock` hand out, in the default and the multiplexed mode.

use std::fmt;
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, watch};

use super::config::Config;
use super::conn::HeldConn;
use super::keeper::{Hold, Keeper, ReleaseRequest, Slot, release_from_slot};
use super::timer::Timer;
use crate::{Error, FencingToken, LockKey, LossReason};

/// A session-scoped advisory lock, held on a dedicated pooled connection until
/// [`release`](Self::release) or drop.
///
/// A background task keeps the connection: every heartbeat interval it checks
/// that the same backend still answers within the heartbeat deadline, and if
/// not, [`lost`](Self::lost) completes and the connection is closed. Treat a
/// lost lock as gone: another process may hold it already.
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
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct SessionLock {
    key: LockKey,
    token: Option<FencingToken>,
    pid: i32,
    acquired_at: Instant,
    loss: watch::Receiver<Option<LossReason>>,
    holding: Holding,
}

/// Where the lock's connection is, and so how `release()` works.
enum Holding {
    /// Its own connection, shared with its keeper task: `release()` unlocks
    /// on the caller's task; a guard dropped without it asks the keeper to.
    Own {
        slot: Slot,
        hold: Hold,
        released: bool,
        release_timeout: Duration,
    },
    /// A connection shared by many locks (multiplexed mode), driven by
    /// another task: `release()` and `Drop` are messages to it.
    Shared(Option<oneshot::Sender<ReleaseRequest>>),
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
    pub(super) fn start(
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
    /// driver): `release` is where `release()` and `Drop` are sent.
    pub(crate) fn from_parts(
        key: LockKey,
        token: Option<FencingToken>,
        pid: i32,
        loss: watch::Receiver<Option<LossReason>>,
        release: oneshot::Sender<ReleaseRequest>,
    ) -> Self {
        Self {
            key,
            token,
            pid,
            acquired_at: Instant::now(),
            loss,
            holding: Holding::Shared(Some(release)),
        }
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
        let mut loss = self.loss.clone();
        match loss.wait_for(Option::is_some).await {
            Ok(reason) => reason.clone().unwrap_or(LossReason::KeeperStopped),
            Err(_) => LossReason::KeeperStopped,
        }
    }

    /// `true` once [`lost`](Self::lost) would complete.
    pub fn is_lost(&self) -> bool {
        self.loss.borrow().is_some() || self.loss.has_changed().is_err()
    }

    /// Why the lock was lost, if it was.
    pub fn loss(&self) -> Option<LossReason> {
        if let Some(reason) = self.loss.borrow().clone() {
            return Some(reason);
        }
        self.loss
            .has_changed()
            .is_err()
            .then_some(LossReason::KeeperStopped)
    }

    /// How long the lock has been held.
    pub fn held_for(&self) -> Duration {
        self.acquired_at.elapsed()
    }

    /// Releases the lock and returns its connection to the pool.
    ///
    /// Costs 1 round trip. Fails with [`Error::LockLost`] if the lock had been
    /// lost (it may be held by someone else now), and with
    /// [`Error::ReleaseTimedOut`] if the server did not answer within the
    /// release deadline; in both cases, and on any other error, the
    /// connection is closed, so PostgreSQL frees whatever the session held.
    ///
    /// # Cancel safety
    ///
    /// The unlock runs on the caller's task. Dropping this future after it
    /// took the connection closes the connection, so the server frees the
    /// lock; dropped earlier, it drops the guard, whose background task then
    /// releases the lock.
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
                let result =
                    release_from_slot(slot, &self.loss, held, self.pid, *release_timeout).await;
                if result.is_ok() {
                    crate::metrics::released("postgres", &self.key, self.acquired_at.elapsed());
                }
                result
            }
            Holding::Shared(request) => {
                let (reply, outcome) = oneshot::channel();
                let sent = request.take().map(|tx| tx.send(reply).is_ok());
                match (sent, outcome.await) {
                    (Some(true), Ok(result)) => result,
                    _ => Err(Error::LockLost {
                        key: self.key.to_string(),
                        reason: self.loss().unwrap_or(LossReason::KeeperStopped),
                    }),
                }
            }
        };
        span.record("outcome", if result.is_ok() { "released" } else { "error" });
        result
    }
}
