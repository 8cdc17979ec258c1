//! The task that keeps a session lock: it runs the heartbeat, reports loss,
//! and releases the lock of a guard dropped without `release()`.
//!
//! The lock's connection sits in a [`Slot`] shared by the guard and this
//! task. `SessionLock::release` takes it out and unlocks on the caller's own
//! task: no hop to the keeper and back sits on the release path. The keeper
//! holds the slot's mutex only while a heartbeat is in flight.

use std::sync::Arc;
use std::time::Duration;

use sqlx::Row;
use tokio::sync::{Mutex, Notify, oneshot, watch};
use tokio::time::{Instant, sleep_until, timeout, timeout_at};
use tracing::Instrument;

use super::conn::HeldConn;
use super::sql::{bind_key, keyed, session_marker};
use super::timer::Timer;
use crate::postgres::config::Config;
use crate::{Error, LockKey, LossReason};

/// What a multiplexed lock's `release()` sends: where to put the outcome.
pub(crate) type ReleaseRequest = oneshot::Sender<Result<(), Error>>;

/// What the guard and the keeper share.
#[derive(Debug)]
pub(crate) struct Shared {
    /// The lock's connection while the lock is held (`None` once released
    /// or lost).
    conn: Mutex<Option<HeldConn>>,
    /// Signalled when the guard is dropped without `release()`. A released
    /// guard does not signal: the keeper finds the slot empty at its next
    /// beat and ends, so no wake-up sits on the release path.
    dropped: Notify,
    /// The keeper until its first heartbeat is due: a lock held for less
    /// than one heartbeat interval never spawns a task (see [`Timer`]).
    parked: std::sync::Mutex<Option<Keeper>>,
}

/// The shared state of one session lock.
pub(crate) type Slot = Arc<Shared>;

impl Shared {
    /// Tells the keeper that the guard went away without `release()`: a
    /// parked keeper is started now to release the lock in the background
    /// (or, without a runtime, dropped, which closes the connection); a
    /// running one is woken.
    pub(crate) fn guard_dropped(&self) {
        match self.unpark() {
            Some(keeper) => match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    let span = keeper.span();
                    runtime.spawn(
                        async move {
                            let held_since = Instant::now();
                            keeper.release_dropped(held_since).await;
                        }
                        .instrument(span),
                    );
                }
                Err(_) => drop(keeper),
            },
            None => self.dropped.notify_one(),
        }
    }

    /// Takes the parked keeper, if it has not been started.
    pub(super) fn unpark(&self) -> Option<Keeper> {
        match self.parked.lock() {
            Ok(mut parked) => parked.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        }
    }

    /// Whether the connection may still be in the slot (`true` when the
    /// slot is busy, to be safe).
    pub(crate) fn holds_connection(&self) -> bool {
        self.conn.try_lock().map_or(true, |conn| conn.is_some())
    }
}

/// The keeper's end of a session lock.
/// What a session lock's connection holds, and so how it is unlocked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hold {
    /// `pg_advisory_lock(key)`.
    Exclusive,
    /// `pg_advisory_lock_shared(key)`.
    Shared,
    /// Several keys (a `MultiLock`): unlocked with `pg_advisory_unlock_all()`,
    /// which is sound because the connection holds nothing else.
    All,
}

pub(crate) struct Keeper {
    slot: Slot,
    key: LockKey,
    hold: Hold,
    pid: i32,
    heartbeat: Duration,
    heartbeat_timeout: Duration,
    release_timeout: Duration,
    loss: watch::Sender<Option<LossReason>>,
}

impl std::fmt::Debug for Keeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keeper")
            .field("key", &self.key)
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

/// The guard's end of a session lock.
pub(crate) struct GuardEnd {
    pub(crate) slot: Slot,
    pub(crate) loss: watch::Receiver<Option<LossReason>>,
}

impl Keeper {
    pub(crate) fn new(
        conn: HeldConn,
        (key, hold): (LockKey, Hold),
        pid: i32,
        config: &Config,
    ) -> (Self, GuardEnd) {
        let slot: Slot = Arc::new(Shared {
            conn: Mutex::new(Some(conn)),
            dropped: Notify::new(),
            parked: std::sync::Mutex::new(None),
        });
        let (loss, loss_rx) = watch::channel(None);
        let keeper = Self {
            slot: Arc::clone(&slot),
            key,
            hold,
            pid,
            heartbeat: config.heartbeat,
            heartbeat_timeout: config.heartbeat_timeout,
            release_timeout: config.release_timeout,
            loss,
        };
        let guard = GuardEnd {
            slot,
            loss: loss_rx,
        };
        (keeper, guard)
    }

    /// Runs until the guard is released or dropped; a dropped guard's lock is
    /// released here. If the task is cancelled instead (the runtime shuts
    /// down), the armed connection is closed when the last owner of the slot
    /// drops it, and the server frees the lock.
    pub(crate) async fn run(mut self, first_beat: Instant) {
        // `sleep_until` rather than `interval`: an interval's first tick fires
        // at once and would put a heartbeat in front of a quick release.
        let mut next = first_beat;
        let held_since = Instant::now();
        loop {
            tokio::select! {
                biased;
                () = self.slot.dropped.notified() => return self.release_dropped(held_since).await,
                () = sleep_until(next) => {
                    match self.beat(HEARTBEAT).await {
                        Beat::Alive => {}
                        Beat::Released => return,
                        // The loss stays readable through the guard's watch
                        // receiver after this task ends.
                        Beat::Lost => return,
                    }
                    next = crate::deadline::from_now(self.heartbeat);
                }
            }
        }
    }

    pub(super) fn span(&self) -> tracing::Span {
        tracing::debug_span!("distlock.keeper", key = %self.key, pid = self.pid)
    }

    /// Parks the keeper in its slot until its first heartbeat is due, when
    /// `timer` starts it; a guard released before then never spawns a task.
    pub(crate) fn park(self, timer: &Timer) {
        let due = crate::deadline::from_now(self.heartbeat);
        let shared = Arc::clone(&self.slot);
        match shared.parked.lock() {
            Ok(mut parked) => *parked = Some(self),
            Err(poisoned) => *poisoned.into_inner() = Some(self),
        }
        timer.schedule(due, Arc::downgrade(&shared));
    }

    /// One heartbeat, holding the slot so `release()` waits for it (within
    /// the release deadline). On failure the connection is closed and the loss
    /// published *before* the slot is let go, so a `release()` that finds the
    /// slot empty also finds the reason.
    async fn beat(&mut self, sql: &'static str) -> Beat {
        let mut slot = self.slot.conn.lock().await;
        let Some(conn) = slot.as_mut() else {
            return Beat::Released;
        };
        let Err(reason) = heartbeat(conn, sql, self.pid, self.heartbeat_timeout).await else {
            return Beat::Alive;
        };
        tracing::warn!(key = %self.key, %reason, "distlock session lock lost");
        crate::metrics::lost("postgres", &self.key);
        if let Some(mut conn) = slot.take() {
            conn.close_now();
        }
        self.loss.send_replace(Some(reason));
        Beat::Lost
    }

    /// The guard was dropped without `release()` (or `release()` took the
    /// connection already): unlock in the background if it is still here.
    async fn release_dropped(self, held_since: Instant) {
        let conn = self.slot.conn.lock().await.take();
        let Some(conn) = conn else {
            return;
        };
        let deadline = crate::deadline::from_now(self.release_timeout);
        let held = (&self.key, self.hold);
        let outcome = release(conn, held, self.pid, deadline, self.release_timeout).await;
        match outcome {
            Ok(()) => {
                crate::metrics::released("postgres", &self.key, held_since.elapsed());
                tracing::debug!(key = %self.key, "distlock session lock released in the background");
            }
            Err(err) => tracing::warn!(
                key = %self.key, error = %err,
                "background release of a dropped session lock failed; connection closed"
            ),
        }
    }
}

/// What a heartbeat found.
enum Beat {
    Alive,
    Lost,
    /// The slot was empty: `release()` took the connection.
    Released,
}

/// Releases the lock in `slot` on the caller's task, within `budget`.
///
/// Waits for an in-flight heartbeat only as long as the budget allows. An
/// empty slot means the lock was lost; the reason is in `loss`.
pub(crate) async fn release_from_slot(
    slot: &Slot,
    loss: &watch::Receiver<Option<LossReason>>,
    (key, hold): (&LockKey, Hold),
    pid: i32,
    budget: Duration,
) -> Result<(), Error> {
    let deadline = crate::deadline::from_now(budget);
    let Ok(mut guard) = timeout_at(deadline, slot.conn.lock()).await else {
        // A heartbeat is stuck on a stalled network; it will time out and
        // close the connection, which frees the lock on the server.
        return Err(Error::ReleaseTimedOut {
            key: key.to_string(),
            after: budget,
        });
    };
    let Some(conn) = guard.take() else {
        return Err(Error::LockLost {
            key: key.to_string(),
            reason: loss.borrow().clone().unwrap_or(LossReason::KeeperStopped),
        });
    };
    drop(guard);
    // A keeper that never started has nothing left to do.
    drop(slot.unpark());
    release(conn, (key, hold), pid, deadline, budget).await
}

/// The heartbeat: which backend answers, and whether the session still
/// counts this connection's one lock (see [`session_marker`]).
const HEARTBEAT: &str = concat!("SELECT pg_backend_pid(), ", session_marker!(read));

/// A heartbeat that also sets the TCP keepalives (see
/// [`keepalives`](super::sql::keepalives)), for a connection opened without a
/// lock statement (a multiplexed connection). The settings are harmless for
/// the connection's later users; on a Unix-domain socket they are ignored.
pub(crate) const FIRST_HEARTBEAT: &str = concat!(
    "SELECT pg_backend_pid(), ",
    super::sql::keepalives!(session)
);

/// One heartbeat: the same backend must still answer, within the deadline.
async fn heartbeat(
    conn: &mut HeldConn,
    sql: &'static str,
    pid: i32,
    deadline: Duration,
) -> Result<(), LossReason> {
    let query = sqlx::query_as::<_, (i32, Option<String>)>(sql).fetch_one(conn.conn());
    match timeout(deadline, query).await {
        Err(_) => Err(LossReason::HeartbeatTimedOut(deadline)),
        Ok(Err(err)) => Err(super::pooler::loss_reason(&err)),
        Ok(Ok((actual, _))) if actual != pid => Err(LossReason::BackendChanged {
            expected_pid: pid,
            actual_pid: actual,
        }),
        // Someone reset or changed the session's lock count: the session
        // is not this connection's alone (a pooler's reset query, or
        // another client on the same server session).
        Ok(Ok((_, marker))) if marker.as_deref() != Some("1") => Err(LossReason::SessionShared(
            format!("the session's lock count is {marker:?}, expected this lock's 1"),
        )),
        Ok(Ok(_)) => Ok(()),
    }
}

/// Unlocks on the lock's own connection. Only a confirmed unlock by the same
/// backend returns the connection to the pool; anything else closes it, which
/// frees the lock on the server.
async fn release(
    mut conn: HeldConn,
    (key, hold): (&LockKey, Hold),
    pid: i32,
    deadline: Instant,
    budget: Duration,
) -> Result<(), Error> {
    let args = key.args()?;
    let query = match hold {
        Hold::Exclusive => bind_key(
            sqlx::query(keyed!(args; "SELECT pg_advisory_unlock(",
                concat!("), pg_backend_pid(), ", session_marker!(unmark)); "$1", "$2")),
            args,
        ),
        Hold::Shared => bind_key(
            sqlx::query(keyed!(args; "SELECT pg_advisory_unlock_shared(",
                concat!("), pg_backend_pid(), ", session_marker!(unmark)); "$1", "$2")),
            args,
        ),
        Hold::All => sqlx::query(concat!(
            "SELECT (SELECT true FROM pg_advisory_unlock_all()), pg_backend_pid(), ",
            session_marker!(unmark)
        )),
    };
    let query = query.fetch_one(conn.conn());
    let row = match timeout_at(deadline, query).await {
        Err(_) => {
            return Err(Error::ReleaseTimedOut {
                key: key.to_string(),
                after: budget,
            });
        }
        Ok(row) => row?,
    };
    let (unlocked, actual): (bool, i32) = (row.try_get(0)?, row.try_get(1)?);
    if actual != pid {
        return Err(Error::PoolerDetected {
            expected_pid: pid,
            actual_pid: actual,
        });
    }
    if !unlocked {
        return Err(Error::LockNotHeld {
            key: key.to_string(),
        });
    }
    conn.into_pool();
    Ok(())
}
