//! Several session locks at once, all or nothing: `PgLocker::try_lock_all`,
//! `PgLocker::lock_all`, which return a [`MultiLock`] (`multi_lock.rs`).
//!
//! All keys are taken on one connection, in one canonical order (the keys
//! as the server resolves them: key space, then value), so two callers whose
//! sets overlap take their common keys in the same order and cannot
//! deadlock. A failed attempt leaves none of the keys held: a try that got
//! only some of them gives them back in the same statement; a wait that
//! fails closes its connection.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use sqlx::Row;

use crate::postgres::conn::held::HeldConn;
use crate::postgres::conn::warm::Ran;
use crate::postgres::locker::PgLocker;
use crate::postgres::pooler::session_locking_error;
use crate::postgres::request::fragments::PgQuery;
use crate::postgres::request::key::BoundAll;
use crate::postgres::request::sql::{TRY_ALL, WAIT_ALL};
use crate::postgres::request::unlimited;
use crate::postgres::session::guard::SessionLock;
use crate::postgres::session::hold::Hold;
use crate::postgres::session::multi_lock::MultiLock;
use crate::postgres::sqlstate::lock_not_available;
use crate::postgres::timeout::answered;
use crate::{Error, LockKey, span};

/// The keys of one attempt, in the caller's order, in the one shape
/// every statement binds (see [`BoundAll`]).
#[derive(Debug)]
struct KeySet<'a> {
    bound: BoundAll<'a>,
}

impl<'a> KeySet<'a> {
    /// Validates `keys`: at least one, each valid, none listed twice.
    /// (Two spellings of one server lock are caught by the statement.)
    fn new(keys: &'a [LockKey]) -> Result<Self, Error> {
        if keys.is_empty() {
            return Err(Error::NoKeys);
        }
        let mut seen = HashSet::new();
        let mut bound = BoundAll::default();
        for key in keys {
            if !seen.insert(key) {
                return Err(Error::DuplicateKey { key: key.clone() });
            }
            bound.push(key.args()?.into());
        }
        Ok(Self { bound })
    }

    fn bind(&self, query: PgQuery<'a>) -> PgQuery<'a> {
        self.bound.bind(query)
    }
}

impl PgLocker {
    /// Takes the session locks on all `keys` if every one is free, without
    /// waiting; `Ok(None)` if any is held elsewhere, in which case none is
    /// left held.
    ///
    /// All keys are taken on one connection, in a canonical order (so
    /// overlapping sets taken by different callers never deadlock), in 1
    /// round trip: the statement gives back the keys it took if another one
    /// was busy. The connection is a [warm one](crate::PgLockerBuilder::keep_warm)
    /// when the locker keeps one (as for [`try_lock`](Self::try_lock)), or
    /// else one from the pool, which adds what the pool spends handing it
    /// out; a busy try's connection, which holds nothing, is kept warm. No keys is [`Error::NoKeys`], a key listed
    /// twice [`Error::DuplicateKey`], two spellings of one server lock (such
    /// as `"x"` and `LockKey::id(hashtext('x'))`) [`Error::SameServerLock`],
    /// and an invalid key [`Error::InvalidKey`]. No fencing token. In multiplexed mode it takes
    /// a connection of its own as well. Bounded on a stalled network as
    /// [`try_lock`](Self::try_lock) is ([`Error::CommandTimedOut`]).
    ///
    /// ```no_run
    /// # async fn demo(locker: distlock::PgLocker) -> Result<(), distlock::Error> {
    /// if let Some(both) = locker.try_lock_all(["account:7", "account:9"]).await? {
    ///     // ... move money between the two accounts ...
    ///     both.release().await?;
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// As for [`try_lock`](Self::try_lock): dropped before it returns, the
    /// connection is closed, which frees whatever it took.
    pub async fn try_lock_all<K>(
        &self,
        keys: impl IntoIterator<Item = K>,
    ) -> Result<Option<MultiLock>, Error>
    where
        K: Into<LockKey>,
    {
        let keys: Vec<LockKey> = keys.into_iter().map(Into::into).collect();
        let first = first_key(&keys)?;
        let span = multi_span(&keys, Hold::All.mode(false));
        span::traced_in(span, &first, "postgres", Option::is_some, async {
            let set = KeySet::new(&keys)?;
            let (conn, taken) = self
                .inner
                .warm
                .acquire(
                    || self.pooled(&keys[0]),
                    |conn| self.try_all_on(conn, &set, &keys, None),
                )
                .await?;
            let Tried::Taken(pid) = taken else {
                conn.into_pool();
                return Ok(None);
            };
            Ok(Some(self.multi_lock(conn, keys, pid)))
        })
        .await
    }

    /// Takes the session locks on all `keys`, waiting up to `timeout`;
    /// fails with [`Error::Timeout`] when the deadline passes, with none of
    /// the keys held.
    ///
    /// It first tries all of them (1 round trip, as
    /// [`try_lock_all`](Self::try_lock_all)); if any is busy, it waits on the
    /// server, taking the keys one after another in the canonical order and
    /// holding the ones it has while it waits for the next (so overlapping sets
    /// never deadlock), each wait under `lock_timeout`; the caller gives up at
    /// `timeout` (plus the heartbeat deadline on a stalled network); a
    /// `timeout` longer than `lock_timeout` can express (about 24.8 days) means
    /// "as long as the server allows", as for [`lock`](Self::lock). A wait that
    /// fails closes its connection, which frees what it had taken. On a session
    /// with a `statement_timeout` (or a `transaction_timeout`) the wait lifts
    /// it for itself, in a transaction of its own (2 round trips more).
    ///
    /// # Cancel safety
    ///
    /// As for [`lock`](Self::lock).
    pub async fn lock_all<K>(
        &self,
        keys: impl IntoIterator<Item = K>,
        timeout: Duration,
    ) -> Result<MultiLock, Error>
    where
        K: Into<LockKey>,
    {
        let keys: Vec<LockKey> = keys.into_iter().map(Into::into).collect();
        let first = first_key(&keys)?;
        let span = multi_span(&keys, Hold::All.mode(true));
        let waiting = span::waiting(&first, self.lock_all_inner(keys, timeout));
        span::traced_in(span, &first, "postgres", |_| true, waiting).await
    }

    async fn lock_all_inner(
        &self,
        keys: Vec<LockKey>,
        timeout: Duration,
    ) -> Result<MultiLock, Error> {
        let set = KeySet::new(&keys)?;
        let started = Instant::now();
        let deadline = crate::deadline::after_std(started, timeout);
        let pooled = || {
            crate::postgres::conn::pooled::watched_before(self.pool(), &keys[0], started, deadline)
        };
        let warm = &self.inner.warm;
        let taken = warm.connection(pooled()).await?;
        // The server gives up at the deadline; no answer a heartbeat
        // deadline later means the network is stalled, as in `lock()`.
        let grace = crate::deadline::after(deadline, self.config().heartbeat_timeout);
        let tried = warm.first_statement(taken, pooled, |conn| {
            self.try_all_on(conn, &set, &keys, Some(grace))
        });
        let (mut conn, tried) = match tried.await {
            Err(Error::CommandTimedOut { .. }) => {
                return Err(self.timeout_error(&keys[0], started, None).await);
            }
            tried => tried?,
        };
        let limited = match tried {
            Tried::Taken(pid) => return Ok(self.multi_lock(conn, keys, pid)),
            Tried::Busy { limited } => limited,
        };
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        if remaining.is_zero() {
            // The try gave back what it took: the connection holds nothing.
            let by = crate::deadline::after(
                tokio::time::Instant::now(),
                self.config().heartbeat_timeout,
            );
            return Err(self.blocked(conn, &keys, started, true, by).await);
        }
        let wait = wait_all(&mut conn, &set, remaining, limited);
        match tokio::time::timeout_at(grace, wait).await {
            Ok(Ok(Ok(pid))) => Ok(self.multi_lock(conn, keys, pid)),
            Ok(Ok(Err(pid))) => Err(shared_session(pid)),
            // Some keys are held: the connection is closed, not pooled, once
            // it has named the key that was not granted.
            Ok(Err(err)) if lock_not_available(&err) => {
                // The block's end and the lookup share one heartbeat
                // deadline, so the call keeps its bound.
                let by = crate::deadline::after(
                    tokio::time::Instant::now(),
                    self.config().heartbeat_timeout,
                );
                if limited {
                    end_aborted_block(&mut conn, by).await;
                }
                Err(self.blocked(conn, &keys, started, false, by).await)
            }
            Ok(Err(err)) => Err(session_locking_error(err, &keys[0])),
            Err(_) => {
                drop(conn);
                Err(self.timeout_error(&keys[0], started, None).await)
            }
        }
    }

    /// [`Error::Timeout`] naming the key that was not granted and the chain
    /// behind its holder (see [`timeout`](super::timeout)), looked up on
    /// `conn` itself by `by`.
    async fn blocked(
        &self,
        conn: HeldConn,
        keys: &[LockKey],
        started: Instant,
        holds_nothing: bool,
        by: tokio::time::Instant,
    ) -> Error {
        let within = by.saturating_duration_since(tokio::time::Instant::now());
        crate::postgres::timeout::timeout_error_all(within, keys, started, conn, holds_nothing)
            .await
    }

    /// [`try_all`](Self::try_all) as an acquisition's first statement (see
    /// `Warm::first_statement`): it hands its connection back.
    async fn try_all_on(
        &self,
        mut conn: HeldConn,
        set: &KeySet<'_>,
        keys: &[LockKey],
        grace: Option<tokio::time::Instant>,
    ) -> Ran<Tried> {
        let tried = self.try_all(&mut conn, set, keys, grace).await;
        (conn, tried)
    }

    /// One all-or-nothing try; `Some(pid)` when every key was taken.
    /// [`Error::CommandTimedOut`] when a statement gets no answer within
    /// the heartbeat deadline, or by `grace` (a waiting call's deadline
    /// plus the heartbeat deadline) when given.
    async fn try_all(
        &self,
        conn: &mut HeldConn,
        set: &KeySet<'_>,
        keys: &[LockKey],
        grace: Option<tokio::time::Instant>,
    ) -> Result<Tried, Error> {
        let heartbeat_timeout = self.config().heartbeat_timeout;
        let within = || {
            grace.map_or(heartbeat_timeout, |grace| {
                grace.saturating_duration_since(tokio::time::Instant::now())
            })
        };
        // The probe and the try each get the whole budget (see `try_lock`).
        let probe = self.inner.pooler.ensure_session(conn.conn());
        answered(&keys[0], within(), probe).await?;
        let row = set.bind(sqlx::query(TRY_ALL)).fetch_one(conn.conn());
        let row = async {
            row.await
                .map_err(|err| session_locking_error(err, &keys[0]))
        };
        let row = answered(&keys[0], within(), row).await?;
        let pid: i32 = row.try_get(1)?;
        distinct(&row, keys)?;
        let limit: Option<String> = row.try_get(5)?;
        match row.try_get::<Option<bool>, _>(0)? {
            Some(true) => Ok(Tried::Taken(pid)),
            Some(false) => Ok(Tried::Busy {
                limited: unlimited::limited(limit.as_deref()),
            }),
            None => Err(shared_session(pid)),
        }
    }

    fn multi_lock(&self, conn: HeldConn, keys: Vec<LockKey>, pid: i32) -> MultiLock {
        let label = keys[0].clone();
        let inner = SessionLock::start(
            conn,
            (label, Hold::All),
            pid,
            None,
            (self.config(), &self.inner.keepers),
        );
        MultiLock { keys, inner }
    }
}

/// Ends the transaction block a wait under a session `statement_timeout`
/// ran in (see `unlimited::session_wait`), which its failure left aborted,
/// so that the lookup of whom it waited behind can run on the connection
/// (the keys it took outlive the block; the connection is closed after the
/// lookup). 1 round trip, by `by`; if it fails, so does the lookup, and the
/// `Timeout` names no holder.
async fn end_aborted_block(conn: &mut HeldConn, by: tokio::time::Instant) {
    let rollback = sqlx::raw_sql("ROLLBACK").execute(conn.conn());
    let _ = tokio::time::timeout_at(by, rollback).await;
}

/// Refuses two spellings of one server lock (they would be granted twice to
/// this session, re-entrantly, and count as one).
fn distinct(row: &sqlx::postgres::PgRow, keys: &[LockKey]) -> Result<(), Error> {
    let resolved: i64 = row.try_get(2)?;
    if usize::try_from(resolved).ok() != Some(keys.len()) {
        return Err(Error::SameServerLock {
            keys: keys.to_vec(),
        });
    }
    Ok(())
}

/// The error for a session that already holds another client's distlock
/// lock: it is shared through a pooler.
fn shared_session(pid: i32) -> Error {
    crate::postgres::pooler::marker_seen(pid)
}

/// What the all-or-nothing try found.
enum Tried {
    /// Every key, on the backend with this pid.
    Taken(i32),
    /// None (the busy ones made it give back the others); `limited`: the
    /// session's `statement_timeout` or `transaction_timeout` would cut a wait
    /// short.
    Busy { limited: bool },
}

/// Waits for every key in canonical order, within `timeout` all told (with a
/// session `statement_timeout` and `transaction_timeout` lifted if `limited`);
/// returns the backend pid: `Ok` when every key was taken, `Err` where the
/// session already held another distlock lock (shared through a pooler: nothing
/// was taken).
async fn wait_all(
    conn: &mut HeldConn,
    set: &KeySet<'_>,
    timeout: Duration,
    limited: bool,
) -> Result<Result<i32, i32>, sqlx::Error> {
    let millis = i64::try_from(timeout.as_millis().clamp(1, i32::MAX as u128)).unwrap_or(1);
    let wait = set.bind(sqlx::query(WAIT_ALL)).bind(millis);
    let row = unlimited::session_wait(conn.conn(), limited, async |conn| {
        wait.fetch_one(conn).await
    })
    .await?;
    let taken: Option<bool> = row.try_get(0)?;
    let pid: i32 = row.try_get(1)?;
    Ok(if taken == Some(true) {
        Ok(pid)
    } else {
        Err(pid)
    })
}

/// The key a multi-key acquisition's metrics carry (its first), or
/// [`Error::NoKeys`].
fn first_key(keys: &[LockKey]) -> Result<LockKey, Error> {
    keys.first().cloned().ok_or(Error::NoKeys)
}

fn multi_span(keys: &[LockKey], mode: &'static str) -> tracing::Span {
    let names: Vec<String> = keys.iter().map(ToString::to_string).collect();
    tracing::debug_span!(
        "distlock.acquire_all",
        keys = ?names,
        mode,
        outcome = tracing::field::Empty,
        wait_ms = tracing::field::Empty,
    )
}
