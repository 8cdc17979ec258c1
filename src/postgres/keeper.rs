//! The task that owns a session lock's connection: it runs the heartbeat,
//! reports loss, and performs the release (requested or on drop).

use std::time::Duration;

use sqlx::Row;
use tokio::sync::{oneshot, watch};
use tokio::time::{Instant, sleep_until, timeout, timeout_at};

use super::conn::HeldConn;
use super::locker::Config;
use super::sql::{bind_key, keyed};
use crate::{Error, LockKey, LossReason};

/// What `SessionLock::release` sends: where to put the outcome.
pub(crate) type ReleaseRequest = oneshot::Sender<Result<(), Error>>;

/// The keeper's end of a session lock.
pub(crate) struct Keeper {
    pub(crate) conn: HeldConn,
    pub(crate) key: LockKey,
    pub(crate) pid: i32,
    pub(crate) heartbeat: Duration,
    pub(crate) heartbeat_timeout: Duration,
    pub(crate) release_timeout: Duration,
    pub(crate) loss: watch::Sender<Option<LossReason>>,
    pub(crate) release: oneshot::Receiver<ReleaseRequest>,
}

impl Keeper {
    pub(crate) fn new(
        conn: HeldConn,
        key: LockKey,
        pid: i32,
        config: &Config,
    ) -> (
        Self,
        watch::Receiver<Option<LossReason>>,
        oneshot::Sender<ReleaseRequest>,
    ) {
        let (loss, loss_rx) = watch::channel(None);
        let (release_tx, release) = oneshot::channel();
        let keeper = Self {
            conn,
            key,
            pid,
            heartbeat: config.heartbeat,
            heartbeat_timeout: config.heartbeat_timeout,
            release_timeout: config.release_timeout,
            loss,
            release,
        };
        (keeper, loss_rx, release_tx)
    }

    /// Runs until the lock is released (on request or because the guard was
    /// dropped). If the task is cancelled instead, the armed connection is
    /// closed on drop and the server frees the lock.
    pub(crate) async fn run(mut self) {
        // `sleep_until` rather than `interval`: an interval's first tick fires
        // at once and would put a heartbeat in front of a quick release.
        let mut next = Instant::now() + self.heartbeat;
        let mut first = true;
        let held_since = Instant::now();
        loop {
            let step = tokio::select! {
                biased;
                request = &mut self.release => {
                    Step::Release(request.ok(), Instant::now() + self.release_timeout)
                }
                () = sleep_until(next) => {
                    let sql = if first { FIRST_HEARTBEAT } else { HEARTBEAT };
                    self.beat(sql).await
                }
            };
            match step {
                Step::Beat => {
                    first = false;
                    next = Instant::now() + self.heartbeat;
                }
                Step::Lost(reason) => return self.lost(reason).await,
                Step::Release(request, deadline) => {
                    let budget = self.release_timeout;
                    let outcome = release(self.conn, &self.key, self.pid, deadline, budget).await;
                    if outcome.is_ok() {
                        crate::metrics::released("postgres", &self.key, held_since.elapsed());
                    }
                    report_release(&self.key, request, outcome);
                    return;
                }
                Step::LostWhileReleasing(request, reason) => {
                    let key = self.key.to_string();
                    self.publish_loss(reason.clone());
                    report_release(&self.key, request, Err(Error::LockLost { key, reason }));
                    return;
                }
            }
        }
    }

    /// One heartbeat. A release requested meanwhile does not wait for the
    /// heartbeat's own deadline: the beat gets what is left of the release
    /// deadline, then the unlock runs on what remains after it.
    async fn beat(&mut self, sql: &'static str) -> Step {
        let beat = heartbeat(&mut self.conn, sql, self.pid, self.heartbeat_timeout);
        tokio::pin!(beat);
        tokio::select! {
            biased;
            outcome = &mut beat => match outcome {
                Ok(()) => Step::Beat,
                Err(reason) => Step::Lost(reason),
            },
            request = &mut self.release => {
                let request = request.ok();
                let deadline = Instant::now() + self.release_timeout;
                match timeout_at(deadline, beat).await {
                    Ok(Ok(())) => Step::Release(request, deadline),
                    Ok(Err(reason)) => Step::LostWhileReleasing(request, reason),
                    Err(_) => Step::LostWhileReleasing(
                        request,
                        LossReason::HeartbeatTimedOut(self.release_timeout),
                    ),
                }
            }
        }
    }

    /// Closes the connection and tells the guard the lock is lost.
    fn publish_loss(&mut self, reason: LossReason) {
        tracing::warn!(key = %self.key, %reason, "distlock session lock lost");
        crate::metrics::lost("postgres", &self.key);
        self.conn.close_now();
        self.loss.send_replace(Some(reason));
    }

    /// Publishes the loss, then waits for the guard to be released or
    /// dropped so `release()` can report it.
    async fn lost(mut self, reason: LossReason) {
        self.publish_loss(reason.clone());
        if let Ok(reply) = self.release.await {
            let _ = reply.send(Err(Error::LockLost {
                key: self.key.to_string(),
                reason,
            }));
        }
    }
}

/// What the keeper does next.
enum Step {
    /// The heartbeat passed.
    Beat,
    /// The lock is lost.
    Lost(LossReason),
    /// Release (asked for, or the guard was dropped) before the deadline.
    Release(Option<ReleaseRequest>, Instant),
    /// Release was asked for while a heartbeat found the lock lost (or did
    /// not finish within the release deadline).
    LostWhileReleasing(Option<ReleaseRequest>, LossReason),
}

/// The heartbeat: which backend answers.
const HEARTBEAT: &str = "SELECT pg_backend_pid()";

/// The first heartbeat also asks the server to probe the client with TCP
/// keepalives, so that if this holder is cut off by a partition the server
/// ends the session (and frees the lock) after about 25 s of silence (idle
/// 10 s + 3 probes 5 s apart), or 30 s of unacknowledged data, instead of the
/// operating system's default of hours. It runs off the acquire/release path
/// so that a short-lived lock costs no extra work; the settings are harmless
/// for the connection's later users. On a Unix-domain socket they are ignored.
const FIRST_HEARTBEAT: &str = "SELECT pg_backend_pid(), \
     set_config('tcp_keepalives_idle', '10', false), \
     set_config('tcp_keepalives_interval', '5', false), \
     set_config('tcp_keepalives_count', '3', false), \
     set_config('tcp_user_timeout', '30000', false)";

/// One heartbeat: the same backend must still answer, within the deadline.
async fn heartbeat(
    conn: &mut HeldConn,
    sql: &'static str,
    pid: i32,
    deadline: Duration,
) -> Result<(), LossReason> {
    let query = sqlx::query_scalar::<_, i32>(sql).fetch_one(conn.conn());
    match timeout(deadline, query).await {
        Err(_) => Err(LossReason::HeartbeatTimedOut(deadline)),
        Ok(Err(err)) => Err(LossReason::ConnectionFailed(err.to_string())),
        Ok(Ok(actual)) if actual != pid => Err(LossReason::BackendChanged {
            expected_pid: pid,
            actual_pid: actual,
        }),
        Ok(Ok(_)) => Ok(()),
    }
}

/// Unlocks on the lock's own connection. Only a confirmed unlock by the same
/// backend returns the connection to the pool; anything else closes it, which
/// frees the lock on the server.
async fn release(
    mut conn: HeldConn,
    key: &LockKey,
    pid: i32,
    deadline: Instant,
    budget: Duration,
) -> Result<(), Error> {
    let args = key.args()?;
    let sql = keyed!(args; "SELECT pg_advisory_unlock(", "), pg_backend_pid()"; "$1", "$2");
    let query = bind_key(sqlx::query(sql), args).fetch_one(conn.conn());
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

fn report_release(key: &LockKey, reply: Option<ReleaseRequest>, outcome: Result<(), Error>) {
    match (&outcome, &reply) {
        (Ok(()), _) => tracing::debug!(%key, "distlock session lock released"),
        (Err(err), None) => {
            tracing::warn!(%key, error = %err, "background release of a dropped session lock failed; connection closed");
        }
        (Err(_), Some(_)) => {}
    }
    if let Some(reply) = reply {
        let _ = reply.send(outcome);
    }
}
