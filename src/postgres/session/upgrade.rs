//! Changing what an upgradeable read lock holds: `UpgradeableLock::upgrade`,
//! `try_upgrade` and `downgrade`, each one operation on the lock's own
//! connection, holding its slot (`in_flight.rs`). The statements are the
//! acquisition core's (`request/`): the upgrade is the session lock
//! statement's `held` shape, so it carries the same standby check, marker,
//! `lock_timeout`, keepalives, client check and token as every lock.

use std::future::Future;
use std::time::Duration;

use sqlx::Row;
use sqlx::postgres::PgRow;
use tokio::time::{Instant, timeout_at};
use tracing::Instrument;

use crate::postgres::conn::held::HeldConn;
use crate::postgres::conn::warm::is_broken;
use crate::postgres::pooler;
use crate::postgres::request::lock_request::Request;
use crate::postgres::request::row::SessionRow;
use crate::postgres::request::{Lock, Step, unlimited};
use crate::postgres::session::in_flight::Failure;
use crate::postgres::session::upgradeable_lock::{Mode, UpgradeableLock};
use crate::postgres::sqlstate::{lock_not_available, locking_error};
use crate::{Error, FencingToken, LockKey, LossReason};

/// What an upgrade attempt found.
enum Upgrade {
    /// The key is held exclusively now, with this token.
    Granted(Option<FencingToken>),
    /// Another reader holds the key (a try only).
    Busy,
}

impl UpgradeableLock {
    /// Upgrades the lock to exclusive if no other session reads the key
    /// now: `Ok(true)` upgraded (or already was, at no cost, if not lost),
    /// `Ok(false)` another session reads it, and the lock is still a read
    /// lock.
    ///
    /// It waits on the server for at most a millisecond rather than using
    /// PostgreSQL's try: a writer queued for the key (behind this lock's own
    /// read) would make a try fail for as long as it waits, while a wait is
    /// granted ahead of it at once. Costs 1 round trip when upgraded (none if
    /// already upgraded), 2 when another session reads the key (the second
    /// gives back an exclusive lock granted in the instant the wait gave
    /// up); on a session with a `statement_timeout` or a
    /// `transaction_timeout`, where the first statement only tries, 3 more
    /// whenever that try fails (the wait in a transaction of its own that
    /// lifts the limits, and its end). With
    /// fencing, the upgrade draws a fresh token (a sequence draw, no durable
    /// write). The statements run on the lock's connection, after a
    /// heartbeat in flight, if any. Fails with [`Error::LockLost`] if the
    /// lock was lost, or is found lost (its connection is then closed).
    ///
    /// # Cancel safety
    ///
    /// Dropped while it waits for a heartbeat in flight, nothing changes.
    /// Dropped once its statement is sent, the lock's connection is closed,
    /// which frees the whole lock (read included) on the server, and
    /// [`lost`](Self::lost) completes with [`LossReason::Interrupted`]: a
    /// statement left running could upgrade the lock behind the guard's
    /// back.
    pub async fn try_upgrade(&mut self) -> Result<bool, Error> {
        if self.is_upgraded() {
            return self.still_held().map(|()| true);
        }
        let span = upgrade_span(self.key(), "try");
        let upgraded = self.upgrade_within(None).instrument(span.clone()).await;
        record(&span, &upgraded);
        match upgraded? {
            Upgrade::Granted(token) => {
                self.mode = Mode::Upgraded(token);
                Ok(true)
            }
            Upgrade::Busy => Ok(false),
        }
    }

    /// Upgrades the lock to exclusive, waiting up to `timeout` for the
    /// other readers to leave, without letting go of the read.
    ///
    /// The wait happens on the server (`pg_advisory_lock` on the session
    /// that holds the key shared, under a statement-local `lock_timeout`):
    /// it is granted the moment the last other reader leaves, ahead of any
    /// writer queued behind this lock, and readers that ask after it queue
    /// behind it. Readers of this process count as readers: an upgrade that
    /// waits for a read lock its own task holds waits until `timeout`, and
    /// so does a reader that, still reading, waits for the upgradeable lock
    /// of the key while this upgrade waits for its read (each lock is a
    /// session of its own, so PostgreSQL sees no cycle to break): the
    /// upgrade's timeout ends it, keeping the read.
    ///
    /// Costs 1 round trip, whether it waits or not (the lock's connection
    /// already checks for a vanished client, so the first statement waits); 4
    /// on a session with a `statement_timeout` or `transaction_timeout` (a try,
    /// then the wait in a transaction block of its own that lifts the limit);
    /// none if already upgraded. On timeout it fails with [`Error::Timeout`]
    /// (naming a reader when PostgreSQL shows one) and the lock is still a read
    /// lock: PostgreSQL may grant the exclusive lock in the instant its
    /// `lock_timeout` fires, so 1 more round trip gives it back if it was
    /// granted (2 with either limit), and 1 names the reader. A `timeout` of
    /// zero waits a millisecond, as [`try_upgrade`](Self::try_upgrade) does;
    /// one longer than `lock_timeout` can express (about 24.8 days) means "as
    /// long as the server allows". With fencing, the upgrade draws a fresh
    /// token. If the server does not answer within `timeout` plus the heartbeat
    /// deadline (each statement after the wait: within the heartbeat deadline),
    /// or ends the session, the lock counts as lost ([`Error::LockLost`]) and
    /// its connection is closed. While an upgrade waits, its statement stands
    /// in for the heartbeat.
    ///
    /// # Cancel safety
    ///
    /// As for [`try_upgrade`](Self::try_upgrade): dropped while it waits on
    /// the server, the whole lock is given up (the connection is closed and
    /// the server ends the wait within 100 ms; [`lost`](Self::lost) reports
    /// [`LossReason::Interrupted`]). To bound the wait, pass a `timeout`
    /// rather than dropping the future: a timed-out upgrade keeps the read.
    pub async fn upgrade(&mut self, timeout: Duration) -> Result<(), Error> {
        if self.is_upgraded() {
            return self.still_held();
        }
        let span = upgrade_span(self.key(), "wait");
        let deadline = crate::deadline::from_now(timeout);
        let key = self.key().clone();
        let upgrading = crate::span::waiting(&key, self.upgrade_within(Some(deadline)));
        let upgraded = upgrading.instrument(span.clone()).await;
        record(&span, &upgraded);
        match upgraded? {
            Upgrade::Granted(token) => {
                self.mode = Mode::Upgraded(token);
                Ok(())
            }
            // Not reached: a waiting attempt reports a busy key as a
            // timeout.
            Upgrade::Busy => Err(Error::NotGranted {
                key: self.key().clone(),
            }),
        }
    }

    /// Downgrades an upgraded lock back to an upgradeable read lock: other
    /// readers may read again, and the lock may upgrade again later. Does
    /// nothing (no round trip) if the lock is not upgraded, but fails with
    /// [`Error::LockLost`] if it is lost.
    ///
    /// Costs 1 round trip (`pg_advisory_unlock` of the exclusive mode only,
    /// on the lock's own session; the read and the intent stay). The
    /// [`fencing_token`](Self::fencing_token) is `None` afterwards. Fails
    /// with [`Error::LockLost`] if the lock was lost, or is found lost.
    ///
    /// # Cancel safety
    ///
    /// As for [`try_upgrade`](Self::try_upgrade): dropped once its
    /// statement is sent, the whole lock is given up
    /// ([`LossReason::Interrupted`]).
    pub async fn downgrade(&mut self) -> Result<(), Error> {
        if !self.is_upgraded() {
            return self.still_held();
        }
        let mut flight = self.inner.in_flight().await?;
        let outcome = match flight.conn() {
            Some(conn) => self.on(conn).downgrade().await,
            None => Err(Failure::Broken(LossReason::KeeperStopped)),
        };
        flight.finish(outcome)?;
        self.mode = Mode::Read;
        Ok(())
    }

    /// What a call that has nothing to change answers: [`Error::LockLost`]
    /// if the lock is lost (no round trip).
    fn still_held(&self) -> Result<(), Error> {
        match self.loss() {
            Some(reason) => Err(Error::LockLost {
                key: self.key().clone(),
                reason,
            }),
            None => Ok(()),
        }
    }

    /// The upgrade, within `deadline` (`None`: a try).
    async fn upgrade_within(&self, deadline: Option<Instant>) -> Result<Upgrade, Error> {
        let started = std::time::Instant::now();
        let mut flight = self.inner.in_flight().await?;
        let outcome = match flight.conn() {
            Some(conn) => self.on(conn).upgrade(deadline, started).await,
            None => Err(Failure::Broken(LossReason::KeeperStopped)),
        };
        flight.finish(outcome)
    }

    fn on<'a>(&'a self, conn: &'a mut HeldConn) -> OnLock<'a> {
        OnLock {
            conn,
            key: self.inner.key(),
            pid: self.inner.backend_pid(),
            fencing: self.fencing,
            answer_within: self.answer_within,
        }
    }
}

/// The statements of one operation, on the lock's connection.
struct OnLock<'a> {
    conn: &'a mut HeldConn,
    key: &'a LockKey,
    /// The backend that holds the read lock.
    pid: i32,
    fencing: bool,
    /// How long a statement may go unanswered beyond its own deadline.
    answer_within: Duration,
}

impl<'a> OnLock<'a> {
    fn lock_request(&self) -> Result<Request<'a>, Failure> {
        let key = self.key.args().map_err(Failure::Kept)?;
        Ok(Request {
            key: key.into(),
            lock: Lock::Exclusive,
            fencing: self.fencing,
        })
    }

    /// By when a statement that ends by `deadline` must have answered, and
    /// the allowance past it (for the loss reason).
    fn answer_by(&self, deadline: Option<Instant>) -> (Instant, Duration) {
        let base = deadline.unwrap_or_else(Instant::now).max(Instant::now());
        (
            crate::deadline::after(base, self.answer_within),
            self.answer_within,
        )
    }

    /// Waits on the server within `deadline`, as the acquisition does
    /// (`acquire.rs`, `try_then_wait`); `None`: a try, which still waits,
    /// for a millisecond. An upgrade never uses PostgreSQL's try
    /// (`pg_try_advisory_lock`): that fails whenever a writer is queued for
    /// the key, and the writer queued behind this lock's own read waits for
    /// this lock, so a try would fail as long as it waits. A wait is granted
    /// ahead of such a writer at once.
    async fn upgrade(
        mut self,
        deadline: Option<Instant>,
        started: std::time::Instant,
    ) -> Result<Upgrade, Failure> {
        let request = self.lock_request()?;
        // A zero wait is a millisecond's `lock_timeout` (`millis_setting`).
        let first = request.upgrade(Step::TryOrWait, remaining(deadline), self.pid);
        let by = self.answer_by(deadline);
        let first = match answered(by, first.fetch_one(self.conn.conn())).await? {
            Ok(row) => self.decode(&row)?,
            Err(err) => return self.recover(request, err, false, deadline, started).await,
        };
        match first.taken {
            None => return Err(self.elsewhere(first.pid)),
            Some(true) => return Ok(Upgrade::Granted(first.token)),
            // The session has a `statement_timeout`, so the statement only
            // tried; the wait follows.
            Some(false) => {}
        }
        let wait = request.upgrade(Step::Wait, remaining(deadline), self.pid);
        // The acquisition's statement set client_connection_check_interval,
        // so the server abandons this wait soon after the connection closes;
        // a session statement_timeout is lifted for it.
        let waited = unlimited::session_wait(self.conn.conn(), first.limited, async |conn| {
            wait.fetch_one(conn).await
        });
        let waited = match answered(by, waited).await? {
            Ok(row) => self.decode(&row)?,
            Err(err) => {
                let in_block = first.limited;
                return self
                    .recover(request, err, in_block, deadline, started)
                    .await;
            }
        };
        match waited.taken {
            None => Err(self.elsewhere(waited.pid)),
            Some(true) => Ok(Upgrade::Granted(waited.token)),
            Some(false) => Err(Failure::Kept(Error::NotGranted {
                key: self.key.clone(),
            })),
        }
    }

    /// Gives the exclusive mode back.
    async fn downgrade(self) -> Result<(), Failure> {
        let request = self.lock_request()?;
        let by = self.answer_by(None);
        let row = answered(by, request.downgrade(self.pid).fetch_one(self.conn.conn())).await?;
        let row = row.map_err(|err| self.failed(err))?;
        let (unlocked, actual) = read_pair(&row)?;
        match unlocked {
            Some(true) => Ok(()),
            None => Err(self.elsewhere(actual)),
            // The session held no exclusive lock on the key: it does not
            // hold what the guard says, so it cannot be trusted.
            Some(false) => Err(Failure::Broken(LossReason::NotHeld)),
        }
    }

    /// A failed statement that waited for nothing: a server error leaves
    /// the lock as it was; anything else leaves it unknown.
    fn failed(&self, err: sqlx::Error) -> Failure {
        if session_unknown(&err) {
            return Failure::Broken(pooler::loss_reason(&err));
        }
        Failure::Kept(locking_error(err, self.key))
    }

    /// After an upgrade statement failed: a server error leaves the session
    /// usable, but its wait may have been granted as it failed, so the
    /// exclusive mode is given back if held (`in_block`: the wait ran in a
    /// transaction block of its own, now aborted), and a busy key is
    /// [`Upgrade::Busy`] for a try (`deadline` `None`), [`Error::Timeout`]
    /// for a wait. Anything else leaves the lock unknown.
    async fn recover(
        &mut self,
        request: Request<'_>,
        err: sqlx::Error,
        in_block: bool,
        deadline: Option<Instant>,
        started: std::time::Instant,
    ) -> Result<Upgrade, Failure> {
        if session_unknown(&err) {
            return Err(Failure::Broken(pooler::loss_reason(&err)));
        }
        self.undo(request, in_block).await?;
        if !lock_not_available(&err) {
            return Err(Failure::Kept(locking_error(err, self.key)));
        }
        if deadline.is_none() {
            return Ok(Upgrade::Busy);
        }
        Err(Failure::Kept(self.timeout(started).await?))
    }

    /// Ends the failed wait's transaction block, if any (session locks
    /// outlive it), and gives back an exclusive mode granted as it failed.
    async fn undo(&mut self, request: Request<'_>, in_block: bool) -> Result<(), Failure> {
        if in_block {
            let by = self.answer_by(None);
            let rollback = sqlx::raw_sql("ROLLBACK").execute(self.conn.conn());
            answered(by, rollback)
                .await?
                .map_err(|err| Failure::Broken(pooler::loss_reason(&err)))?;
        }
        let by = self.answer_by(None);
        let undo = request.undo_upgrade(self.pid).fetch_one(self.conn.conn());
        let row = answered(by, undo)
            .await?
            .map_err(|err| Failure::Broken(pooler::loss_reason(&err)))?;
        match read_pair(&row)? {
            (Some(_), _) => Ok(()),
            (None, actual) => Err(self.elsewhere(actual)),
        }
    }

    /// [`Error::Timeout`], naming another session that holds the key and
    /// whom it waits behind, looked up on the lock's connection; a lookup
    /// left without an answer leaves the lock unknown (lost).
    async fn timeout(&mut self, started: std::time::Instant) -> Result<Error, Failure> {
        let within = self.answer_within;
        crate::postgres::timeout::timeout_error_beside(self.conn, within, self.key, started)
            .await
            .map_err(Failure::Broken)
    }

    /// The statement ran on a session other than the lock's, or one whose
    /// marker no longer counts the lock: it took nothing, and the lock
    /// cannot be trusted.
    fn elsewhere(&self, actual: i32) -> Failure {
        Failure::Broken(if actual == self.pid {
            LossReason::SessionShared("the session's lock count is not this lock's one".to_owned())
        } else {
            LossReason::BackendChanged {
                expected_pid: self.pid,
                actual_pid: actual,
            }
        })
    }

    fn decode(&self, row: &PgRow) -> Result<SessionRow, Failure> {
        SessionRow::decode(row, self.key, self.fencing).map_err(unreadable)
    }
}

/// Whether a failed statement leaves what the session holds unknown: no
/// answer from the server (the connection failed, the answer could not be
/// read), the server ending the session (a FATAL goodbye, SQLSTATE 57P01 and
/// the like, is a database error too), or another client's session.
fn session_unknown(err: &sqlx::Error) -> bool {
    err.as_database_error().is_none() || is_broken(err) || pooler::shared_session(err)
}

/// Waits for `statement` until `by`; past it the server is not answering,
/// and the lock is lost (its connection is then mid-statement).
async fn answered<T>(
    (by, within): (Instant, Duration),
    statement: impl Future<Output = T>,
) -> Result<T, Failure> {
    timeout_at(by, statement)
        .await
        .map_err(|_| Failure::Broken(LossReason::HeartbeatTimedOut(within)))
}

/// An answer this code cannot read: what the session holds is unknown.
fn unreadable(err: impl std::fmt::Display) -> Failure {
    Failure::Broken(LossReason::ConnectionFailed(format!(
        "unreadable answer: {err}"
    )))
}

/// Columns 0 (a nullable flag) and 1 (the backend pid).
fn read_pair(row: &PgRow) -> Result<(Option<bool>, i32), Failure> {
    let flag = row.try_get(0).map_err(unreadable)?;
    let pid = row.try_get(1).map_err(unreadable)?;
    Ok((flag, pid))
}

/// What is left until `deadline`; zero for a try.
fn remaining(deadline: Option<Instant>) -> Duration {
    deadline.map_or(Duration::ZERO, |deadline| {
        deadline.saturating_duration_since(Instant::now())
    })
}

/// The `distlock.upgrade` span.
fn upgrade_span(key: &LockKey, mode: &'static str) -> tracing::Span {
    tracing::debug_span!(
        "distlock.upgrade",
        key = %key,
        mode,
        outcome = tracing::field::Empty,
    )
}

fn record(span: &tracing::Span, upgraded: &Result<Upgrade, Error>) {
    let outcome = match upgraded {
        Ok(Upgrade::Granted(_)) => "upgraded",
        Ok(Upgrade::Busy) => "busy",
        Err(Error::Timeout { .. }) => "timeout",
        Err(_) => "error",
    };
    span.record("outcome", outcome);
}
