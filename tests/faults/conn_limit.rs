//! `ALTER DATABASE … CONNECTION LIMIT` lowered while many tasks contend for
//! a few keys, in the default and the multiplexed mode.
//!
//! Superusers ignore the limit, so the lockers connect as a login role of
//! their own with the README's grants. Mid-run the limit drops to the
//! number of the role's sessions in use, then to 0, and is lifted again.
//! Every call must end within its deadline plus a bounded slack with a
//! typed error or a result; holders from before keep their locks (no
//! `lost()`, their fence still accepts their token); no two holders of a
//! key overlap and fencing tokens grow in the order of the holds; and once
//! everything is released nothing is left in `pg_locks`.

use crate::common;

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::roles::{drop_role, grant_documented_rights, make_role};
use common::*;
use distlock::{Error, PgLocker, SessionLock};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Executor, PgPool};

/// Keys the workers contend for.
const KEYS: usize = 3;
/// Concurrent workers.
const WORKERS: usize = 12;
/// The role's pool size.
const POOL_SIZE: u32 = 6;
/// Deadline of the waiting calls.
const WAIT: Duration = Duration::from_secs(1);
/// The role's pool `acquire_timeout`: the deadline of calls that need a
/// pooled connection and have none of their own.
const ACQUIRE: Duration = Duration::from_secs(2);
/// The lockers' heartbeat deadline, which also bounds the lookup of the
/// holder that `Error::Timeout` names.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// What a call may take beyond its deadlines on a loaded machine.
const SLACK: Duration = Duration::from_secs(4);
/// The bound on every call: its deadlines, one after the other, plus slack.
const BOUND: Duration = ACQUIRE
    .saturating_add(WAIT)
    .saturating_add(HEARTBEAT)
    .saturating_add(SLACK);

/// The phases of a run, in order.
const FREE: u8 = 0;
const AT_USE: u8 = 1;
const ZERO: u8 = 2;
const LIFTED: u8 = 3;
const PHASES: [&str; 4] = ["no limit", "limit = in use", "limit = 0", "lifted"];

/// One hold of a key, as a worker saw it.
#[derive(Debug, Clone, Copy)]
struct Hold {
    key: usize,
    enter: Instant,
    exit: Instant,
    token: Option<i64>,
}

/// How one call ended.
#[derive(Debug, Clone)]
enum Outcome {
    Held,
    Busy,
    /// A typed error, by variant.
    Failed(&'static str),
    /// An error this run does not expect.
    Unexpected(String),
}

#[derive(Debug, Clone)]
struct Call {
    op: &'static str,
    phase: u8,
    took: Duration,
    outcome: Outcome,
}

/// What the workers record.
#[derive(Default)]
struct History {
    inside: [AtomicUsize; KEYS],
    overlaps: AtomicUsize,
    /// Session locks whose `lost()` fired, or whose release reported a
    /// loss, while nothing but the connection limit was at work.
    losses: Mutex<Vec<String>>,
    holds: Mutex<Vec<Hold>>,
    calls: Mutex<Vec<Call>>,
}

impl History {
    fn enter(&self, key: usize) -> Instant {
        if self.inside[key].fetch_add(1, Ordering::SeqCst) != 0 {
            self.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        Instant::now()
    }

    fn exit(&self, key: usize, enter: Instant, token: Option<i64>) {
        let exit = Instant::now();
        self.inside[key].fetch_sub(1, Ordering::SeqCst);
        self.holds.lock().expect("holds").push(Hold {
            key,
            enter,
            exit,
            token,
        });
    }

    fn call(&self, op: &'static str, phase: u8, started: Instant, outcome: Outcome) {
        self.calls.lock().expect("calls").push(Call {
            op,
            phase,
            took: started.elapsed(),
            outcome,
        });
    }

    fn loss(&self, what: String) {
        self.losses.lock().expect("losses").push(what);
    }
}

/// Pairs of holds of the same key whose intervals overlap.
fn overlapping(holds: &[Hold]) -> Vec<(Hold, Hold)> {
    let mut found = Vec::new();
    for key in 0..KEYS {
        let mut of_key: Vec<Hold> = holds.iter().filter(|h| h.key == key).copied().collect();
        of_key.sort_by_key(|h| h.enter);
        let mut latest: Option<Hold> = None;
        for hold in of_key {
            if let Some(before) = latest {
                if hold.enter < before.exit {
                    found.push((before, hold));
                }
                if hold.exit > before.exit {
                    latest = Some(hold);
                }
            } else {
                latest = Some(hold);
            }
        }
    }
    found
}

/// Fenced holds of the same key whose token is not above the token of an
/// earlier fenced hold.
fn token_regressions(holds: &[Hold]) -> Vec<(Hold, Hold)> {
    let mut found = Vec::new();
    for key in 0..KEYS {
        let mut fenced: Vec<Hold> = holds
            .iter()
            .filter(|h| h.key == key && h.token.is_some())
            .copied()
            .collect();
        fenced.sort_by_key(|h| h.enter);
        for pair in fenced.windows(2) {
            if pair[1].token <= pair[0].token {
                found.push((pair[0], pair[1]));
            }
        }
    }
    found
}

/// The typed errors a connection limit may cause, by variant: a waiting
/// call's deadline (`Timeout`, or `NoConnection` when it got no connection), a call that needed a new pooled connection
/// (sqlx retries SQLSTATE 53300 until the pool's `acquire_timeout`), and a
/// new multiplexed connection refused by the server.
fn classify(err: &Error) -> Outcome {
    match err {
        Error::Timeout { .. } => Outcome::Failed("Timeout"),
        Error::NoConnection { .. } => Outcome::Failed("NoConnection"),
        Error::Database(sqlx::Error::PoolTimedOut) => Outcome::Failed("Database(PoolTimedOut)"),
        Error::PoolExhausted { .. } => Outcome::Failed("PoolExhausted"),
        Error::ConnectTimedOut { .. } => Outcome::Failed("ConnectTimedOut"),
        Error::TooManyConnections { .. } => Outcome::Failed("TooManyConnections"),
        other => Outcome::Unexpected(format!("{other:?}")),
    }
}

async fn set_limit(admin: &PgPool, db: &str, limit: i64) {
    admin
        .execute(sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE \"{db}\" CONNECTION LIMIT {limit}"
        )))
        .await
        .expect("ALTER DATABASE ... CONNECTION LIMIT");
}

/// The role's sessions in the database.
async fn sessions_of(admin: &PgPool, role: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE usename = $1 AND datname = current_database()",
    )
    .bind(role)
    .fetch_one(admin)
    .await
    .expect("pg_stat_activity")
}

/// The role's sessions left inside a transaction.
async fn idle_in_transaction(admin: &PgPool, role: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE usename = $1 \
         AND datname = current_database() AND state LIKE 'idle in transaction%'",
    )
    .bind(role)
    .fetch_one(admin)
    .await
    .expect("pg_stat_activity")
}

/// The lockers of one run.
#[derive(Clone)]
struct Lockers {
    plain: PgLocker,
    fenced: PgLocker,
    /// Superuser connections (the limit does not apply) for the fence.
    admin: PgPool,
    /// The role's pool, for fresh lockers.
    pool: PgPool,
    multiplexed: bool,
}

impl Lockers {
    fn new(pool: &PgPool, admin: &PgPool, multiplex: usize) -> Self {
        let builder = |fencing| {
            PgLocker::builder(pool.clone())
                .heartbeat(Duration::from_millis(250))
                .heartbeat_timeout(HEARTBEAT)
                .multiplex(multiplex)
                .fencing(fencing)
                .build()
                .expect("valid settings")
        };
        Self {
            plain: builder(false),
            fenced: builder(true),
            admin: admin.clone(),
            pool: pool.clone(),
            multiplexed: multiplex > 0,
        }
    }
}

fn hot(key: usize) -> String {
    format!("hot:{key}")
}

/// Holds a session lock for a moment: records the hold, presents a fenced
/// lock's token to the fence, checks the lock is not lost, releases it.
async fn hold_session(lockers: &Lockers, history: &History, key: usize, lock: SessionLock) {
    let token = lock.fencing_token();
    let enter = history.enter(key);
    if let Some(token) = token {
        let mut conn = lockers.admin.acquire().await.expect("admin connection");
        if let Err(err) = distlock::fence::check(&mut conn, &hot(key), token).await {
            history.loss(format!("fence refused {key}: {err}"));
        }
    }
    tokio::time::sleep(Duration::from_millis(15)).await;
    if let Some(reason) = lock.loss() {
        history.loss(format!("{}: lost while held: {reason}", hot(key)));
    }
    history.exit(key, enter, token.map(|t| t.value()));
    match lock.release().await {
        Ok(()) => {}
        Err(Error::LockLost { reason, .. }) => {
            history.loss(format!("{}: release found it lost: {reason}", hot(key)));
        }
        Err(err) => history.loss(format!("{}: release failed: {err:?}", hot(key))),
    }
}

/// One call of kind `op` on `key`.
async fn one_call(lockers: &Lockers, history: &History, phase: &AtomicU8, op: usize, key: usize) {
    let at = phase.load(Ordering::SeqCst);
    let started = Instant::now();
    let (name, outcome) = match op {
        0 | 1 => {
            let (name, locker) = if op == 0 {
                ("try_lock", &lockers.plain)
            } else {
                ("try_lock fenced", &lockers.fenced)
            };
            match locker.try_lock(hot(key)).await {
                Ok(Some(lock)) => {
                    history.call(name, at, started, Outcome::Held);
                    return hold_session(lockers, history, key, lock).await;
                }
                Ok(None) => (name, Outcome::Busy),
                Err(err) => (name, classify(&err)),
            }
        }
        2 => {
            let name = "lock fenced";
            match lockers.fenced.lock(hot(key), WAIT).await {
                Ok(lock) => {
                    history.call(name, at, started, Outcome::Held);
                    return hold_session(lockers, history, key, lock).await;
                }
                Err(err) => (name, classify(&err)),
            }
        }
        3 => {
            let name = "with_advisory_lock";
            let result = lockers
                .plain
                .with_advisory_lock(hot(key), async |_conn| {
                    let enter = history.enter(key);
                    tokio::time::sleep(Duration::from_millis(15)).await;
                    history.exit(key, enter, None);
                    Ok::<_, Error>(())
                })
                .await;
            match result {
                Ok(Some(())) => (name, Outcome::Held),
                Ok(None) => (name, Outcome::Busy),
                Err(err) => (name, classify(&err)),
            }
        }
        _ => {
            let name = "with_advisory_lock_wait";
            let result = lockers
                .plain
                .with_advisory_lock_wait(hot(key), WAIT, async |_conn| {
                    let enter = history.enter(key);
                    tokio::time::sleep(Duration::from_millis(15)).await;
                    history.exit(key, enter, None);
                    Ok::<_, Error>(())
                })
                .await;
            match result {
                Ok(()) => (name, Outcome::Held),
                Err(err) => (name, classify(&err)),
            }
        }
    };
    history.call(name, at, started, outcome);
}

/// Runs the workers while the limit goes to the sessions in use, to 0, and
/// back to none; checks everything this file promises.
async fn contend_through_a_connection_limit(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
    multiplex: usize,
) {
    init_tracing();
    let admin = pool_opts
        .max_connections(8)
        .connect_with(connect_opts.clone())
        .await
        .expect("admin pool");
    distlock::migrate(&admin).await.expect("migrate");
    let tag = if multiplex > 0 { "mux" } else { "dflt" };
    let role = make_role(&admin, &format!("dlconn_{tag}")).await;
    grant_documented_rights(&admin, &role).await;
    let db: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(&admin)
        .await
        .expect("current_database");
    let role_opts = connect_opts.clone().username(&role);
    // Connections live briefly, so the pool keeps opening new ones and
    // runs into the limit.
    let pool = PgPoolOptions::new()
        .max_connections(POOL_SIZE)
        .min_connections(0)
        .acquire_timeout(ACQUIRE)
        .max_lifetime(Duration::from_millis(400))
        .idle_timeout(Duration::from_millis(200))
        .connect_with(role_opts.clone())
        .await
        .expect("role pool");
    let lockers = Lockers::new(&pool, &admin, multiplex);

    // Holders from before the limit: they must keep their locks.
    let held_fenced = lockers
        .fenced
        .try_lock("held:fenced")
        .await
        .expect("try")
        .expect("free");
    let held_plain = lockers
        .plain
        .try_lock("held:plain")
        .await
        .expect("try")
        .expect("free");
    let held_token = held_fenced.fencing_token().expect("fencing on");
    let mut admin_conn = admin.acquire().await.expect("admin connection");
    distlock::fence::check(&mut admin_conn, "held:fenced", held_token)
        .await
        .expect("first token");

    let history = Arc::new(History::default());
    let phase = Arc::new(AtomicU8::new(FREE));
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = tokio::task::JoinSet::new();
    for worker in 0..WORKERS {
        let (lockers, history, phase, stop) = (
            lockers.clone(),
            Arc::clone(&history),
            Arc::clone(&phase),
            Arc::clone(&stop),
        );
        workers.spawn(async move {
            let mut i = worker;
            while !stop.load(Ordering::SeqCst) {
                one_call(&lockers, &history, &phase, i % 5, (i / 5) % KEYS).await;
                i += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
    }
    // In multiplexed mode a fresh locker opens a shared connection of its
    // own for its first lock, which the limit refuses.
    if lockers.multiplexed {
        let (lockers, history, phase, stop) = (
            lockers.clone(),
            Arc::clone(&history),
            Arc::clone(&phase),
            Arc::clone(&stop),
        );
        workers.spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                let fresh = PgLocker::builder(lockers.pool.clone())
                    .multiplex(1)
                    .build()
                    .expect("valid settings");
                // Several first locks at once: they all queue for the one
                // connection the fresh locker opens.
                let at = phase.load(Ordering::SeqCst);
                let mut tries = tokio::task::JoinSet::new();
                for k in 0..4 {
                    let (fresh, history) = (fresh.clone(), Arc::clone(&history));
                    tries.spawn(async move {
                        let started = Instant::now();
                        let outcome = match fresh.try_lock(format!("fresh:{n}:{k}")).await {
                            Ok(Some(lock)) => {
                                if let Err(err) = lock.release().await {
                                    history.loss(format!("fresh:{n}: release failed: {err:?}"));
                                }
                                Outcome::Held
                            }
                            Ok(None) => Outcome::Busy,
                            Err(err) => classify(&err),
                        };
                        history.call("fresh multiplexed try_lock", at, started, outcome);
                    });
                }
                while let Some(joined) = tries.join_next().await {
                    joined.expect("fresh try");
                }
                n += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
    }

    tokio::time::sleep(Duration::from_millis(1500)).await;
    let in_use = sessions_of(&admin, &role).await;
    set_limit(&admin, &db, in_use).await;
    phase.store(AT_USE, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    set_limit(&admin, &db, 0).await;
    phase.store(ZERO, Ordering::SeqCst);
    // The limit is real: a new session of the role is refused.
    let refused = role_opts
        .connect()
        .await
        .expect_err("limit 0 refuses the role");
    let code = refused
        .as_database_error()
        .and_then(|e| e.code())
        .map(|c| c.into_owned());
    assert_eq!(code.as_deref(), Some("53300"), "{refused}");
    tokio::time::sleep(Duration::from_millis(3000)).await;
    set_limit(&admin, &db, -1).await;
    phase.store(LIFTED, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    stop.store(true, Ordering::SeqCst);
    bounded("workers stop", BOUND * 2, async {
        while let Some(joined) = workers.join_next().await {
            joined.expect("worker");
        }
    })
    .await;

    // Holders from before kept their locks, and their fence its token.
    assert_eq!(held_fenced.loss(), None);
    assert_eq!(held_plain.loss(), None);
    distlock::fence::check(&mut admin_conn, "held:fenced", held_token)
        .await
        .expect("the fence still takes the token of the holder from before");
    let fence_now = distlock::fence::current(&mut admin_conn, "held:fenced")
        .await
        .expect("fence");
    assert_eq!(fence_now, Some(held_token));
    assert!(
        lockers
            .plain
            .try_lock("held:fenced")
            .await
            .expect("try")
            .is_none(),
        "still held"
    );
    held_fenced.release().await.expect("release");
    held_plain.release().await.expect("release");

    let calls = history.calls.lock().expect("calls").clone();
    let holds = history.holds.lock().expect("holds").clone();
    let losses = history.losses.lock().expect("losses").clone();
    report(multiplex, &calls, &holds);

    let unexpected: Vec<&Call> = calls
        .iter()
        .filter(|c| matches!(c.outcome, Outcome::Unexpected(_)))
        .collect();
    assert!(unexpected.is_empty(), "untyped failures: {unexpected:#?}");
    let slow: Vec<&Call> = calls.iter().filter(|c| c.took > BOUND).collect();
    assert!(slow.is_empty(), "calls beyond {BOUND:?}: {slow:#?}");
    assert!(losses.is_empty(), "spurious losses: {losses:#?}");
    assert_eq!(history.overlaps.load(Ordering::SeqCst), 0);
    let overlaps = overlapping(&holds);
    assert!(overlaps.is_empty(), "overlapping holds: {overlaps:#?}");
    let regressions = token_regressions(&holds);
    assert!(
        regressions.is_empty(),
        "token regressions: {regressions:#?}"
    );
    // The limit did bite, and the run recovered from it.
    let failed_under_limit = calls
        .iter()
        .filter(|c| c.phase == ZERO && matches!(c.outcome, Outcome::Failed(_)))
        .count();
    assert!(failed_under_limit > 0, "no call failed at limit 0");
    let held_after = calls
        .iter()
        .filter(|c| c.phase == LIFTED && matches!(c.outcome, Outcome::Held))
        .count();
    assert!(
        held_after > 0,
        "nothing was held after the limit was lifted"
    );

    // Nothing leaked: no advisory lock, no session left in a transaction,
    // and every key can be taken again.
    let mut obs = observer_for(&admin).await;
    assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(10)).await;
    assert_eq!(idle_in_transaction(&admin, &role).await, 0);
    for key in 0..KEYS {
        let lock = lockers
            .fenced
            .try_lock(hot(key))
            .await
            .expect("try")
            .expect("free after the run");
        lock.release().await.expect("release");
        let done = lockers
            .plain
            .with_advisory_lock(hot(key), async |_conn| Ok::<_, Error>(()))
            .await
            .expect("with_advisory_lock");
        assert_eq!(done, Some(()));
    }
    assert!(advisory_locks(&mut obs).await.is_empty());

    close(obs).await;
    drop(admin_conn);
    drop(lockers);
    pool.close().await;
    eventually(
        "the role's sessions are gone",
        Duration::from_secs(10),
        async || sessions_of(&admin, &role).await == 0,
    )
    .await;
    drop_role(&admin, &role).await.expect("drop role");
    admin.close().await;
}

/// Prints calls by phase and outcome, and the slowest call per phase.
fn report(multiplex: usize, calls: &[Call], holds: &[Hold]) {
    println!(
        "connection limit, {}: {} calls, {} holds",
        if multiplex > 0 {
            "multiplexed"
        } else {
            "default mode"
        },
        calls.len(),
        holds.len()
    );
    for (phase, name) in PHASES.iter().enumerate() {
        let of_phase: Vec<&Call> = calls
            .iter()
            .filter(|c| usize::from(c.phase) == phase)
            .collect();
        let mut counts = std::collections::BTreeMap::<String, usize>::new();
        for call in &of_phase {
            let outcome = match &call.outcome {
                Outcome::Held => "held".to_owned(),
                Outcome::Busy => "busy".to_owned(),
                Outcome::Failed(variant) => format!("Err({variant})"),
                Outcome::Unexpected(err) => format!("UNEXPECTED {err}"),
            };
            *counts.entry(format!("{} {outcome}", call.op)).or_default() += 1;
        }
        let slowest = of_phase.iter().map(|c| c.took).max().unwrap_or_default();
        println!("  {name}: slowest call {slowest:?}");
        for (what, n) in counts {
            println!("    {what}: {n}");
        }
    }
}

#[sqlx::test(migrations = false)]
async fn default_mode_survives_a_connection_limit_under_contention(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    contend_through_a_connection_limit(pool_opts, connect_opts, 0).await;
}

#[sqlx::test(migrations = false)]
async fn multiplexed_mode_survives_a_connection_limit_under_contention(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    contend_through_a_connection_limit(pool_opts, connect_opts, 2).await;
}

/// The checkers catch what they are for: two holds of a key that overlap,
/// and a fencing token that does not grow.
#[test]
fn the_checkers_catch_an_overlap_and_a_token_regression() {
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let hold = |key, enter, exit, token| Hold {
        key,
        enter: at(enter),
        exit: at(exit),
        token,
    };
    let apart = [
        hold(0, 0, 10, Some(1)),
        hold(0, 10, 20, None),
        hold(0, 30, 40, Some(2)),
        hold(1, 5, 15, Some(1)),
    ];
    assert!(overlapping(&apart).is_empty());
    assert!(token_regressions(&apart).is_empty());

    let overlap = [
        hold(0, 0, 50, None),
        hold(0, 10, 20, None),
        hold(0, 30, 40, None),
    ];
    assert_eq!(overlapping(&overlap).len(), 2);
    let regressed = [hold(2, 0, 10, Some(5)), hold(2, 20, 30, Some(5))];
    assert_eq!(token_regressions(&regressed).len(), 1);
}

/// A multiplexed locker whose shared connection the limit refuses says so
/// with `Error::TooManyConnections`, to every try queued for that
/// connection at once (before, all but the first got
/// `MultiplexFailed`); in the default mode the same refusal is
/// `Database(PoolTimedOut)` after the pool's `acquire_timeout`, or
/// `NoConnection` for a wait. Lifting the limit makes both work again.
#[sqlx::test(migrations = false)]
async fn a_connection_limit_is_reported_as_a_typed_error(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    init_tracing();
    let admin = pool_opts
        .connect_with(connect_opts.clone())
        .await
        .expect("admin pool");
    distlock::migrate(&admin).await.expect("migrate");
    let role = make_role(&admin, "dlconn_typed").await;
    grant_documented_rights(&admin, &role).await;
    let db: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(&admin)
        .await
        .expect("current_database");
    // Lazy: no connection is open when the limit goes to 0.
    let pool = PgPoolOptions::new()
        .max_connections(POOL_SIZE)
        .acquire_timeout(ACQUIRE)
        .connect_lazy_with(connect_opts.clone().username(&role));
    set_limit(&admin, &db, 0).await;

    let mux = PgLocker::builder(pool.clone())
        .multiplex(1)
        .build()
        .expect("valid settings");
    let mut tries = tokio::task::JoinSet::new();
    for k in 0..4 {
        let mux = mux.clone();
        tries.spawn(async move {
            let started = Instant::now();
            let outcome = mux.try_lock(format!("typed:{k}")).await;
            (started.elapsed(), outcome.map(|lock| lock.is_some()))
        });
    }
    while let Some(joined) = tries.join_next().await {
        let (took, outcome) = joined.expect("try");
        match outcome {
            Err(Error::TooManyConnections { message }) => {
                assert!(message.contains("too many connections"), "{message}");
            }
            other => panic!("expected TooManyConnections, got {other:?}"),
        }
        assert!(took < BOUND, "{took:?}");
    }

    let plain = PgLocker::new(pool.clone());
    let started = Instant::now();
    let err = plain.try_lock("typed:plain").await.expect_err("limit 0");
    assert!(
        matches!(err, Error::Database(sqlx::Error::PoolTimedOut)),
        "{err:?}"
    );
    assert!(started.elapsed() < BOUND, "{:?}", started.elapsed());
    let started = Instant::now();
    let err = plain.lock("typed:plain", WAIT).await.expect_err("limit 0");
    assert!(matches!(err, Error::NoConnection { .. }), "{err:?}");
    assert!(started.elapsed() < BOUND, "{:?}", started.elapsed());

    set_limit(&admin, &db, -1).await;
    let lock = mux.try_lock("typed:0").await.expect("try").expect("free");
    lock.release().await.expect("release");
    let lock = plain
        .try_lock("typed:plain")
        .await
        .expect("try")
        .expect("free");
    lock.release().await.expect("release");
    drop((mux, plain));
    pool.close().await;
    eventually(
        "the role's sessions are gone",
        Duration::from_secs(10),
        async || sessions_of(&admin, &role).await == 0,
    )
    .await;
    drop_role(&admin, &role).await.expect("drop role");
    admin.close().await;
}
