//! The error of a missed deadline and whom the caller waited behind: the
//! one place where every PostgreSQL wait (session, shared, multi-key,
//! transaction-scoped, multiplexed) builds [`Error::Timeout`] and looks up
//! its wait chain.
//!
//! The lookup runs only after the deadline passed: 1 round trip, one
//! statement that reads the database's advisory locks (`pg_locks`) once and
//! returns only what the chain needs: the rows on the keys that were not
//! granted and those of the sessions reached from their holders by
//! following waits (`pg_blocking_pids`, `pg_stat_activity` for those
//! alone). It has the deadline `within`, so that a stalled network cannot
//! hang the caller here either.

use std::time::{Duration, Instant};

use sqlx::{PgConnection, PgPool};

use crate::postgres::conn::held::HeldConn;
use crate::postgres::conn::warm::is_broken;
use crate::postgres::holder::{AdvisoryKey, Holder, LockMode};
use crate::postgres::holders::{self, Snapshot};
use crate::postgres::request::key::BoundAll;
use crate::postgres::wait_chain::{WaitChain, chain_from};
use crate::{Error, LockKey, LossReason};

/// A try's statements (the pooler probe, the lock statement), answered
/// within `within`, the heartbeat deadline: a try waits for nothing, so no
/// answer by then is a stalled network or server, and the caller gets
/// [`Error::CommandTimedOut`] instead of waiting until TCP gives up. The
/// statement is dropped mid-flight: the caller's connection is armed, so
/// the error closes it, which frees anything the statement took.
pub(crate) async fn answered<T>(
    key: &LockKey,
    within: Duration,
    statements: impl Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    tokio::time::timeout(within, statements)
        .await
        .unwrap_or_else(|_| {
            Err(Error::CommandTimedOut {
                key: key.clone(),
                after: within,
            })
        })
}

/// One statement of a call that waits for nothing (a read, or a record of
/// the crate's own) on a pooled connection, answered within `within` as
/// [`answered`] once the pool handed the connection out (a pool that pings
/// connections first waits up to its own `acquire_timeout` for that). The
/// connection goes back to the pool only once the statement answered (with
/// a server error too); unanswered or dropped mid-flight it is closed
/// instead: sqlx gives a dropped query's connection back through a ping
/// without a deadline, which under a stalled network keeps the pool slot
/// until TCP gives up.
pub(crate) async fn answered_on_pool<T>(
    pool: &PgPool,
    (key, within): (&LockKey, Duration),
    statement: impl AsyncFnOnce(&mut PgConnection) -> Result<T, Error>,
) -> Result<T, Error> {
    let pooled = crate::postgres::conn::pooled::acquire(pool).await;
    let pooled = pooled.map_err(|err| crate::postgres::conn::pooled::pool_error(pool, key, err))?;
    let timed_out = || Error::CommandTimedOut {
        key: key.clone(),
        after: within,
    };
    answered_on(pooled, (within, timed_out), statement).await
}

/// [`answered_on_pool`] for a call that takes no lock (`call`, as
/// `Type::method`, for [`Error::NoReply`]): a full pool is sqlx's
/// `PoolTimedOut`, as for any other work of the caller's.
pub(crate) async fn read_on_pool<T>(
    pool: &PgPool,
    (call, within): (&'static str, Duration),
    statement: impl AsyncFnOnce(&mut PgConnection) -> Result<T, Error>,
) -> Result<T, Error> {
    let pooled = crate::postgres::conn::pooled::acquire(pool).await?;
    let timed_out = || Error::NoReply {
        call,
        after: within,
    };
    answered_on(pooled, (within, timed_out), statement).await
}

/// `statement` on `pooled`, answered within `within` or `timed_out()`;
/// the connection back to the pool only once answered.
async fn answered_on<T>(
    pooled: sqlx::pool::PoolConnection<sqlx::Postgres>,
    (within, timed_out): (Duration, impl FnOnce() -> Error),
    statement: impl AsyncFnOnce(&mut PgConnection) -> Result<T, Error>,
) -> Result<T, Error> {
    let mut conn = HeldConn::new(pooled, true);
    let answer = tokio::time::timeout(within, statement(conn.conn())).await;
    let answer = answer.map_err(|_| timed_out())?;
    conn.into_pool();
    answer
}

/// How a wait wanted its key, for naming whom it waited for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wanted {
    /// The key alone, or shared with readers.
    Mode(LockMode),
    /// Upgradeable: the key's upgrade intent alone, then the key shared.
    Upgradeable,
}

impl From<LockMode> for Wanted {
    fn from(mode: LockMode) -> Self {
        Wanted::Mode(mode)
    }
}

/// Builds [`Error::Timeout`] for `key`, wanted as `wanted`, with the chain
/// behind whom it waited for: looked up on `conn` when the caller still has
/// a usable connection (it must hold nothing), else on one from `pool`.
/// Only a connection that answered goes back to the pool.
pub(crate) async fn timeout_error(
    pool: &PgPool,
    within: Duration,
    (key, wanted): (&LockKey, Wanted),
    started: Instant,
    conn: Option<HeldConn>,
) -> Error {
    let conn = match conn {
        Some(conn) => Some(conn),
        None => {
            match tokio::time::timeout(within, crate::postgres::conn::pooled::acquire(pool)).await {
                Ok(Ok(pooled)) => Some(HeldConn::new(pooled, true)),
                _ => None,
            }
        }
    };
    let chain = match conn {
        Some(mut conn) => {
            let around = Around::of(wanted);
            let found = look(&mut conn, std::slice::from_ref(key), around, within)
                .await
                .found();
            if found.is_some() {
                conn.into_pool();
            }
            found.map(|snapshot| blocked_as(&snapshot, wanted))
        }
        None => None,
    };
    timeout_of(key, started, chain.unwrap_or_default())
}

/// Builds [`Error::Timeout`] for a multi-key wait, naming the key that was
/// not granted and the chain behind its holder, looked up on `conn` itself
/// (so the caller's own session is never named as the holder). `conn` goes
/// back to the pool only if it holds nothing (`holds_nothing`) and
/// answered; otherwise it is closed, which frees what it took.
pub(crate) async fn timeout_error_all(
    within: Duration,
    keys: &[LockKey],
    started: Instant,
    mut conn: HeldConn,
    holds_nothing: bool,
) -> Error {
    let found = look(&mut conn, keys, Around::Keys, within).await.found();
    if holds_nothing && found.is_some() {
        conn.into_pool();
    } else {
        drop(conn);
    }
    let (at, chain) = found
        .map(|snapshot| blocked(&snapshot, keys.len(), LockMode::Exclusive))
        .unwrap_or_default();
    let key = keys.get(at).or(keys.first());
    let Some(key) = key else {
        return Error::NoKeys;
    };
    timeout_of(key, started, chain)
}

/// Builds [`Error::Timeout`] for `key` on `conn`, a connection that stays
/// the caller's and holds `key` itself in a weaker mode (an upgrade waiting
/// beside its own read): the chain is that of another session holding
/// `key`. A lookup that fails on a healthy connection leaves it empty; one that gets no
/// answer within `within`, or finds the connection failed, leaves what the
/// connection holds unknown: `Err` with the reason, for the caller to
/// close it and report the lock lost.
pub(crate) async fn timeout_error_beside(
    conn: &mut HeldConn,
    within: Duration,
    key: &LockKey,
    started: Instant,
) -> Result<Error, LossReason> {
    let snapshot = match look(conn, std::slice::from_ref(key), Around::Keys, within).await {
        Looked::Found(snapshot) => Some(snapshot),
        Looked::Refused => None,
        Looked::Unanswered(reason) => return Err(reason),
    };
    let chain = snapshot.and_then(|snapshot| {
        let (_, wanted) = *snapshot.wanted.first()?;
        let holder = snapshot
            .holders
            .iter()
            .find(|h| h.granted && h.key == wanted && h.pid != snapshot.me)?;
        Some(chain_from(&snapshot.holders, holder))
    });
    Ok(timeout_of(key, started, chain.unwrap_or_default()))
}

/// Builds [`Error::Timeout`] where no connection can look (the caller's
/// transaction was aborted by the timeout): the chain is empty.
pub(crate) fn timed_out(key: &LockKey, started: Instant) -> Error {
    timeout_of(key, started, WaitChain::default())
}

/// The error; `holder_pid` and `holder_application` are the chain's first
/// link, so the two never disagree.
fn timeout_of(key: &LockKey, started: Instant, chain: WaitChain) -> Error {
    let first = chain.links.first();
    Error::Timeout {
        key: key.clone(),
        waited: started.elapsed(),
        holder_pid: first.map(|link| link.pid),
        holder_application: first.and_then(|link| link.application_name.clone()),
        chain,
    }
}

/// What a lookup on a caller's connection found.
enum Looked {
    /// The snapshot around the keys.
    Found(Snapshot),
    /// The server refused the statement, or its answer could not be read
    /// (read whole all the same): the connection is as it was.
    Refused,
    /// No answer within the deadline (the statement may still run), or the
    /// connection failed: what it holds is unknown.
    Unanswered(LossReason),
}

impl Looked {
    fn found(self) -> Option<Snapshot> {
        match self {
            Looked::Found(snapshot) => Some(snapshot),
            Looked::Refused | Looked::Unanswered(_) => None,
        }
    }
}

/// What a lookup reads besides the wanted keys' rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Around {
    /// The keys alone.
    Keys,
    /// One key and its upgrade intent (wanted places 0 and 1).
    KeyAndIntent,
}

impl Around {
    fn of(wanted: Wanted) -> Self {
        match wanted {
            Wanted::Mode(_) => Around::Keys,
            Wanted::Upgradeable => Around::KeyAndIntent,
        }
    }
}

/// The snapshot around `keys` on `conn`, within `within`.
async fn look(conn: &mut HeldConn, keys: &[LockKey], around: Around, within: Duration) -> Looked {
    let mut bound = BoundAll::default();
    for key in keys {
        let Ok(args) = key.args() else {
            return Looked::Refused;
        };
        bound.push(args.into());
    }
    let lookup = async {
        match around {
            Around::Keys => holders::around(conn.conn(), &bound).await,
            Around::KeyAndIntent => holders::around_upgradeable(conn.conn(), &bound).await,
        }
    };
    match tokio::time::timeout(within, lookup).await {
        Ok(Ok(snapshot)) => Looked::Found(snapshot),
        // An answer read whole (a server error, a row that did not
        // decode) leaves the connection as it was; a failed connection
        // does not.
        Ok(Err(Error::Database(err))) if is_broken(&err) => {
            Looked::Unanswered(LossReason::ConnectionFailed(err.to_string()))
        }
        Ok(Err(_)) => Looked::Refused,
        Err(_) => Looked::Unanswered(LossReason::HeartbeatTimedOut(within)),
    }
}

/// Whom a wait for one key, wanted as `wanted`, waited for. An upgradeable
/// wait takes the key's intent first: another session holding the intent
/// is whom it waited for (a plain reader beside it never is); with the
/// intent free, the wait was for the key shared, behind a writer.
fn blocked_as(snapshot: &Snapshot, wanted: Wanted) -> WaitChain {
    let mode = match wanted {
        Wanted::Mode(mode) => mode,
        Wanted::Upgradeable => {
            let intent_holder = snapshot
                .wanted
                .iter()
                .find(|&&(place, _)| place == 1)
                .and_then(|&(_, intent)| {
                    snapshot
                        .holders
                        .iter()
                        .find(|h| h.granted && h.key == intent && h.pid != snapshot.me)
                });
            if let Some(holder) = intent_holder {
                return chain_from(&snapshot.holders, holder);
            }
            LockMode::Shared
        }
    };
    blocked(snapshot, 1, mode).1
}

/// Of the first `n` wanted keys, the one the caller was not granted, and the
/// chain behind whom it waited for. That is a key the looking session does
/// not hold (in a multi-key wait the keys before the blocked one were granted
/// and are still held: session locks outlive the statement's error),
/// preferring one that another session holds, first in the canonical order
/// (key space, then value: [`AdvisoryKey`]'s order). With no holder seen,
/// the first such key and an empty chain.
///
/// Wanted `Shared`, the key waited for a writer: one that holds it, or one
/// queued for it (PostgreSQL queues a shared request behind a waiting
/// exclusive one), never a reader, whose read it would share.
fn blocked(snapshot: &Snapshot, n: usize, mode: LockMode) -> (usize, WaitChain) {
    let granted_on = |key: AdvisoryKey| {
        snapshot
            .holders
            .iter()
            .filter(move |h| h.granted && h.key == key)
    };
    let conflicts = |h: &Holder| {
        h.pid != snapshot.me && (mode == LockMode::Exclusive || h.mode == LockMode::Exclusive)
    };
    let blocker = |key: AdvisoryKey| {
        let writer_queued = || {
            snapshot
                .holders
                .iter()
                .filter(|h| !h.granted && h.key == key && conflicts(h))
                .min_by_key(|h| h.since)
        };
        granted_on(key)
            .find(|h| conflicts(h))
            .or_else(|| (mode == LockMode::Shared).then(writer_queued).flatten())
    };
    let mut open: Vec<(AdvisoryKey, usize)> = snapshot
        .wanted
        .iter()
        .filter(|&&(place, key)| place < n && !granted_on(key).any(|h| h.pid == snapshot.me))
        .map(|&(place, key)| (key, place))
        .collect();
    open.sort_unstable();
    let held = open.iter().find_map(|&(key, place)| {
        let holder = blocker(key)?;
        Some((place, chain_from(&snapshot.holders, holder)))
    });
    held.unwrap_or_else(|| {
        let place = open.first().map_or(0, |&(_, place)| place);
        (place, WaitChain::default())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::postgres::holder::{Holder, LockMode};

    fn row(pid: i32, key: AdvisoryKey, blocked_by: Vec<i32>) -> Holder {
        Holder {
            key,
            pid,
            application_name: Some(format!("app-{pid}")),
            client_addr: None,
            since: None,
            granted: blocked_by.is_empty(),
            mode: LockMode::Exclusive,
            blocked_by,
            waits_for: Vec::new(),
        }
    }

    fn snapshot(mut holders: Vec<Holder>, wanted: Vec<(usize, AdvisoryKey)>) -> Snapshot {
        crate::postgres::wait_chain::resolve(&mut holders);
        Snapshot {
            holders,
            wanted,
            me: 100,
        }
    }

    const A: AdvisoryKey = AdvisoryKey::BigInt(1);
    const B: AdvisoryKey = AdvisoryKey::BigInt(2);
    const P: AdvisoryKey = AdvisoryKey::Pair(-5, 3);

    /// The key is one the looker does not hold and another session does,
    /// and the chain runs from that holder to the root.
    #[test]
    fn the_blocked_key_is_the_first_one_held_by_another() {
        let s = snapshot(
            vec![
                row(100, A, vec![]),
                row(7, P, vec![]),
                row(8, B, vec![]),
                row(7, B, vec![8]),
            ],
            // The caller listed P first, B second, A third.
            vec![(0, P), (1, B), (2, A)],
        );
        let (at, chain) = blocked(&s, 3, LockMode::Exclusive);
        // B comes before P in the canonical order; A is the looker's own.
        assert_eq!(at, 1);
        assert_eq!(chain.pids(), [8]);
        let (at, chain) = blocked(&s, 1, LockMode::Exclusive);
        assert_eq!(at, 0);
        assert_eq!(chain.pids(), [7, 8], "P's holder waits behind 8");
        assert!(
            chain
                .root()
                .is_some_and(|root| root.key == B && root.granted)
        );
    }

    /// Nobody else holds any of the keys: the first open one, no chain.
    #[test]
    fn with_no_holder_seen_the_chain_is_empty() {
        let s = snapshot(vec![row(100, A, vec![])], vec![(0, A), (1, P), (2, B)]);
        let (at, chain) = blocked(&s, 3, LockMode::Exclusive);
        assert_eq!(at, 2, "B, the first open key in the canonical order");
        assert!(chain.is_empty());
    }

    #[test]
    fn holder_fields_are_the_chains_first_link() {
        let s = snapshot(
            vec![row(7, A, vec![]), row(8, B, vec![]), row(7, B, vec![8])],
            vec![(0, A)],
        );
        let (_, chain) = blocked(&s, 1, LockMode::Exclusive);
        match timeout_of(&LockKey::id(1), Instant::now(), chain) {
            Error::Timeout {
                holder_pid,
                holder_application,
                chain,
                ..
            } => {
                assert_eq!(holder_pid, Some(7));
                assert_eq!(holder_application.as_deref(), Some("app-7"));
                assert_eq!(chain.pids(), [7, 8]);
            }
            other => panic!("{other:?}"),
        }
    }
}
