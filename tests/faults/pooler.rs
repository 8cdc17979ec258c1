//! Session locks behind a transaction pooler with ONE server connection that
//! hides prepared statements (PgBouncer 1.21+ with
//! `max_prepared_statements`, simulated by `common::txpool`).
//!
//! Every statement of every client reaches the same backend there, so the
//! backend pid never changes and no prepared-statement error (42P05, 26000)
//! reaches a client: neither of the signals distlock uses to spot a pooler
//! appears. Session-level advisory locks are re-entrant, so a second client's
//! `pg_try_advisory_lock` on a key that the backend already holds for the
//! first client returns `true`. Two `PgLocker`s must still never both hold
//! a session lock on one key.

use crate::common;

use std::time::Duration;

use common::txpool::TxPool;
use common::*;
use distlock::{Error, Lease, PgLocker, PgLockerBuilder, SessionLock};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::task::JoinSet;

const KEY: &str = "k";

/// Upper bound for anything that should be quick, so a wedged proxy fails
/// the test instead of hanging it.
const LIMIT: Duration = Duration::from_secs(10);

/// A transaction pooler in front of the test database `pool` points at.
async fn txpool(pool: &PgPool) -> TxPool {
    let opts = pool.connect_options();
    TxPool::start(
        opts.get_host(),
        opts.get_port(),
        opts.get_username(),
        opts.get_database().expect("the test database's name"),
    )
    .await
    .expect("transaction pooler")
}

/// A client pool (two connections, sqlx's default statement cache, so
/// queries use named prepared statements) connected through `proxy`.
async fn through(proxy: &TxPool, pool: &PgPool, app: &str) -> PgPool {
    let opts = (*pool.connect_options())
        .clone()
        .host("127.0.0.1")
        .port(proxy.port())
        .application_name(app);
    PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(opts)
        .await
        .expect("pool through the transaction pooler")
}

/// The proxy and two clients' pools through it.
async fn two_clients(pool: &PgPool) -> (TxPool, PgPool, PgPool) {
    let proxy = txpool(pool).await;
    let a = through(&proxy, pool, "client-a").await;
    let b = through(&proxy, pool, "client-b").await;
    (proxy, a, b)
}

async fn pid_of(pool: &PgPool) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(pool)
        .await
        .expect("pg_backend_pid")
}

#[sqlx::test(migrations = false)]
async fn the_transaction_pooler_shares_one_backend_and_hides_prepared_statements(pool: PgPool) {
    let (proxy, a, b) = two_clients(&pool).await;
    assert!(proxy.clients() >= 2, "both pools connect through the proxy");

    // One backend answers both clients, and it is not the direct one.
    let (pid_a, pid_b) = (pid_of(&a).await, pid_of(&b).await);
    assert_eq!(pid_a, pid_b, "both clients reach the same backend");
    assert_eq!(pid_a, proxy.backend_pid());
    assert_ne!(
        pid_of(&pool).await,
        pid_a,
        "the direct pool has its own backend"
    );

    // Prepared statements from four client connections at once: each of
    // them names its statements sqlx_s_1, sqlx_s_2, ..., so without renaming
    // they would collide (42P05) or miss (26000) on the shared backend.
    let mut tasks = JoinSet::new();
    for round in 0..25_i32 {
        for (client, p) in [("a", a.clone()), ("b", b.clone())] {
            tasks.spawn(async move {
                let n: i32 = sqlx::query_scalar("SELECT $1::int4 + 1")
                    .bind(round)
                    .fetch_one(&p)
                    .await?;
                let s: String = sqlx::query_scalar("SELECT $1::text || '!'")
                    .bind(client)
                    .fetch_one(&p)
                    .await?;
                let t: i64 = sqlx::query_scalar("SELECT $1::int8 * 2")
                    .bind(i64::from(round))
                    .fetch_one(&p)
                    .await?;
                Ok::<_, sqlx::Error>((round, client, n, s, t))
            });
        }
    }
    let results = bounded("prepared statements", LIMIT, tasks.join_all()).await;
    for result in results {
        let (round, client, n, s, t) =
            result.unwrap_or_else(|err| panic!("prepared statement through the pooler: {err}"));
        assert_eq!(n, round + 1);
        assert_eq!(s, format!("{client}!"));
        assert_eq!(t, i64::from(round) * 2);
    }
    // The server session holds several clients' sqlx_s_1, under their tags.
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM pg_prepared_statements WHERE name LIKE '%sqlx_s_1' ORDER BY name",
    )
    .persistent(false)
    .fetch_all(&a)
    .await
    .expect("pg_prepared_statements");
    assert!(
        names.len() >= 2 && names.iter().all(|n| n.starts_with('c')),
        "renamed statements of several clients on the one backend: {names:?}"
    );

    // A client whose statement cache holds one statement closes the one it
    // evicts (Close of a named statement), under its own name.
    let small = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(
            (*pool.connect_options())
                .clone()
                .host("127.0.0.1")
                .port(proxy.port())
                .statement_cache_capacity(1),
        )
        .await
        .expect("pool with a one-statement cache");
    for round in 0..3_i32 {
        for sql in [
            "SELECT $1::int4",
            "SELECT $1::int4 + 0",
            "SELECT $1::int4 * 1",
        ] {
            let n: i32 = sqlx::query_scalar(sql)
                .bind(round)
                .fetch_one(&small)
                .await
                .unwrap_or_else(|err| panic!("{sql} with an evicting cache: {err}"));
            assert_eq!(n, round);
        }
    }
    small.close().await;

    // A transaction from each client, at the same time.
    sqlx::query("CREATE TABLE visits (client text NOT NULL, n int NOT NULL)")
        .execute(&pool)
        .await
        .expect("create table");
    let mut txs = JoinSet::new();
    for (client, p) in [("a", a.clone()), ("b", b.clone())] {
        txs.spawn(async move {
            let mut tx = p.begin().await?;
            for n in 1..=2 {
                sqlx::query("INSERT INTO visits VALUES ($1, $2)")
                    .bind(client)
                    .bind(n)
                    .execute(&mut *tx)
                    .await?;
            }
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok::<_, sqlx::Error>(pid)
        });
    }
    for pid in bounded("transactions", LIMIT, txs.join_all()).await {
        assert_eq!(pid.expect("transaction through the pooler"), pid_a);
    }
    let count = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM visits")
            .fetch_one(&pool)
            .await
            .expect("count")
    };
    assert_eq!(count().await, 4, "both transactions committed");

    // A rolled-back transaction leaves nothing.
    let mut tx = a.begin().await.expect("begin");
    sqlx::query("INSERT INTO visits VALUES ('a', 3)")
        .execute(&mut *tx)
        .await
        .expect("insert");
    tx.rollback().await.expect("rollback");
    assert_eq!(count().await, 4, "the rollback undid the insert");

    // While A is inside a transaction it owns the server connection: B's
    // statement waits until A commits (transaction pooling).
    let mut tx = a.begin().await.expect("begin");
    sqlx::query("INSERT INTO visits VALUES ('a', 4)")
        .execute(&mut *tx)
        .await
        .expect("insert");
    let waiting = {
        let b = b.clone();
        tokio::spawn(async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM visits")
                .fetch_one(&b)
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "B ran a statement while A's transaction held the server connection"
    );
    tx.commit().await.expect("commit");
    let seen = bounded("B after A's commit", LIMIT, waiting)
        .await
        .expect("task")
        .expect("B's statement");
    assert_eq!(seen, 5, "B runs after A's commit and sees it");

    // A client that vanishes inside a transaction does not wedge the server
    // connection: the proxy rolls its transaction back for it.
    let mut conn = a.acquire().await.expect("connection of A");
    sqlx::query("BEGIN")
        .execute(&mut *conn)
        .await
        .expect("begin");
    sqlx::query("INSERT INTO visits VALUES ('a', 5)")
        .execute(&mut *conn)
        .await
        .expect("insert");
    drop(conn.detach());
    let seen: i64 = bounded(
        "B after A vanished inside a transaction",
        LIMIT,
        sqlx::query_scalar("SELECT count(*) FROM visits").fetch_one(&b),
    )
    .await
    .expect("B's statement");
    assert_eq!(seen, 5, "the vanished client's transaction was rolled back");

    a.close().await;
    b.close().await;
}

/// Control: the same two-client scenario with hand-written SQL. Both
/// clients' `pg_try_advisory_lock` return `true`, because the proxy really
/// hands both to one backend; a locker that does not notice this hands out
/// two locks, which is what the regression tests below catch.
#[sqlx::test(migrations = false)]
async fn control_raw_session_locks_of_two_clients_through_the_pooler_are_both_granted(
    pool: PgPool,
) {
    let (proxy, a, b) = two_clients(&pool).await;
    let mut conn_a = a.acquire().await.expect("connection of A");
    let mut conn_b = b.acquire().await.expect("connection of B");
    let key = Raw::text(KEY);
    let got_a = raw_try_lock(&mut conn_a, &key).await;
    let got_b = raw_try_lock(&mut conn_b, &key).await;
    assert!(got_a, "A takes the free key");
    assert!(
        got_b,
        "B is granted the key A holds: one backend, re-entrant locks"
    );

    // The server sees one session holding it (twice over), and nobody
    // outside the pooler can take it.
    let mut obs = observer_for(&pool).await;
    let rows = advisory_locks(&mut obs).await;
    assert_eq!(rows.len(), 1, "one granted row: {rows:?}");
    assert_eq!(rows[0].pid, proxy.backend_pid());
    assert!(rows[0].granted);
    assert!(!raw_can_take(&mut obs, &key).await);

    // Closing the client connections does not end the server session, so
    // the locks stay (unlike on a direct connection).
    drop(conn_a.detach());
    drop(conn_b.detach());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !raw_can_take(&mut obs, &key).await,
        "behind the pooler, closing a client connection frees none of its session locks"
    );

    // Only the end of the pooler's server session frees them.
    a.close().await;
    b.close().await;
    drop(proxy);
    assert_no_advisory_locks_eventually(&mut obs, LIMIT).await;
    close(obs).await;
}

/// Heartbeat of the lockers in these tests: a few beats pass before a
/// second lock is reported, to show whether either lock noticed anything.
const BEAT: Duration = Duration::from_millis(100);

fn builder(pool: PgPool) -> PgLockerBuilder {
    PgLocker::builder(pool).heartbeat(BEAT)
}

/// The failure message for a second lock on the key A holds, after a few
/// heartbeats of both.
async fn second_lock(what: &str, a: &SessionLock, b: &SessionLock, proxy: &TxPool) -> String {
    tokio::time::sleep(BEAT * 4).await;
    format!(
        "{what}: client B got a second session lock on {KEY:?} while client A holds it \
         (A: backend {}, token {:?}; B: backend {}, token {:?}; the pooler's one backend: {}; \
         after four heartbeats, A lost: {:?}, B lost: {:?})",
        a.backend_pid(),
        a.fencing_token(),
        b.backend_pid(),
        b.fencing_token(),
        proxy.backend_pid(),
        a.loss(),
        b.loss(),
    )
}

/// After B's attempt: A's lock still keeps outsiders off the key, A can
/// release it, and nothing is left locked on the shared backend (closing a
/// client connection does not end the server session behind a pooler, so a
/// lock given up that way would stay held there).
async fn a_still_holds_then_releases(pool: &PgPool, held: SessionLock) {
    let mut obs = observer_for(pool).await;
    assert!(
        !raw_can_take(&mut obs, &Raw::text(KEY)).await,
        "A's lock still keeps other sessions off the key"
    );
    bounded("A's release", LIMIT, held.release())
        .await
        .expect("A releases its lock");
    assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(3)).await;
    close(obs).await;
}

/// Client A takes the key with `try_lock`; client B tries with `try_lock`.
async fn try_lock_scenario(pool: &PgPool, build: impl Fn(PgPool) -> PgLocker, what: &str) {
    let (proxy, a, b) = two_clients(pool).await;
    let (locker_a, locker_b) = (build(a.clone()), build(b.clone()));
    let held = bounded("A's try_lock", LIMIT, locker_a.try_lock(KEY))
        .await
        .expect("A's try_lock")
        .expect("A takes the free key");
    assert_eq!(held.backend_pid(), proxy.backend_pid());

    match bounded("B's try_lock", LIMIT, locker_b.try_lock(KEY)).await {
        Ok(None) | Err(Error::PoolerDetected { .. }) => {}
        Ok(Some(second)) => panic!("{}", second_lock(what, &held, &second, &proxy).await),
        Err(other) => {
            panic!("{what}: B's try_lock: expected Ok(None) or PoolerDetected, got {other:?}")
        }
    }
    a_still_holds_then_releases(pool, held).await;
    a.close().await;
    b.close().await;
}

/// The regression: behind a single-connection transaction pooler, B's
/// `try_lock` must come back busy or refused, although the shared backend,
/// which already holds A's lock, would grant it again.
#[sqlx::test(migrations = false)]
async fn two_clients_behind_a_single_connection_transaction_pooler_never_both_hold_a_session_lock(
    pool: PgPool,
) {
    try_lock_scenario(
        &pool,
        |p| builder(p).build().expect("valid settings"),
        "try_lock",
    )
    .await;
}

/// The same with `lock(key, 500 ms)` for B: the try, and the wait on the
/// server after it, are both re-entrant on the shared backend.
#[sqlx::test(migrations = false)]
async fn two_clients_behind_a_single_connection_transaction_pooler_never_both_hold_a_waited_session_lock(
    pool: PgPool,
) {
    let (proxy, a, b) = two_clients(&pool).await;
    let (locker_a, locker_b) = (
        builder(a.clone()).build().expect("valid settings"),
        builder(b.clone()).build().expect("valid settings"),
    );
    let held = bounded(
        "A's lock",
        LIMIT,
        locker_a.lock(KEY, Duration::from_millis(500)),
    )
    .await
    .expect("A takes the free key");
    assert_eq!(held.backend_pid(), proxy.backend_pid());

    let attempt = locker_b.lock(KEY, Duration::from_millis(500));
    match bounded("B's lock", LIMIT, attempt).await {
        Err(Error::Timeout { .. } | Error::PoolerDetected { .. }) => {}
        Ok(second) => panic!("{}", second_lock("lock", &held, &second, &proxy).await),
        Err(other) => panic!("lock: B's lock: expected Timeout or PoolerDetected, got {other:?}"),
    }
    a_still_holds_then_releases(&pool, held).await;
    a.close().await;
    b.close().await;
}

/// The same with fencing tokens: a second lock would come with a second,
/// higher token, which a fenced resource would accept.
#[sqlx::test(migrations = false)]
async fn two_clients_behind_a_single_connection_transaction_pooler_never_both_hold_a_fenced_session_lock(
    pool: PgPool,
) {
    distlock::migrate(&pool).await.expect("migrate");
    let fenced = |p: PgPool| builder(p).fencing(true).build().expect("valid settings");
    try_lock_scenario(&pool, fenced, "fenced try_lock").await;
}

/// The same in multiplexed mode; its shared connections are opened from the
/// pool's connect options, so they go through the pooler too.
#[sqlx::test(migrations = false)]
async fn two_clients_behind_a_single_connection_transaction_pooler_never_both_hold_a_multiplexed_session_lock(
    pool: PgPool,
) {
    let mux = |p: PgPool| builder(p).multiplex(1).build().expect("valid settings");
    try_lock_scenario(&pool, mux, "multiplexed try_lock").await;
}

/// Sequential use through the pooler stays possible: once A released the
/// key, B's `try_lock` must not report it busy (nobody holds it) nor hang.
///
/// Which answer is right? Getting the lock is sound here: the one backend
/// then holds the key for B alone, sessions outside the pooler cannot take
/// it, the heartbeat sees the same backend, and B's release frees it; what
/// the pooler breaks is exclusion between its clients, which the tests
/// above check. Refusing with `PoolerDetected` is within the contract too
/// (session locks through a transaction pooler are refused rather than
/// handed out unheld), and arguably safer: behind a pooler the server
/// session outlives the client, so a holder that dies without releasing
/// leaves the key locked until the pooler drops its server connection.
/// Both are accepted; a refusal must leave nothing locked.
#[sqlx::test(migrations = false)]
async fn after_the_first_client_releases_the_second_can_lock_through_the_pooler(pool: PgPool) {
    let (proxy, a, b) = two_clients(&pool).await;
    let (held, locker_b) = a_holds_the_key(&a, &b).await;
    bounded("A's release", LIMIT, held.release())
        .await
        .expect("A releases");

    let mut obs = observer_for(&pool).await;
    match bounded("B's try_lock", LIMIT, locker_b.try_lock(KEY)).await {
        Ok(Some(lock)) => {
            assert_eq!(lock.backend_pid(), proxy.backend_pid());
            assert!(
                !raw_can_take(&mut obs, &Raw::text(KEY)).await,
                "B's lock keeps other sessions off the key"
            );
            bounded("B's release", LIMIT, lock.release())
                .await
                .expect("B releases");
        }
        Err(Error::PoolerDetected { .. }) => {}
        Ok(None) => panic!("B was told the key is busy, but nobody holds it"),
        Err(other) => panic!("B's try_lock after A's release: {other:?}"),
    }
    assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(3)).await;
    close(obs).await;
    a.close().await;
    b.close().await;
}

/// Client A takes [`KEY`] with `try_lock`; returns its lock and client B's
/// locker.
async fn a_holds_the_key(a: &PgPool, b: &PgPool) -> (SessionLock, PgLocker) {
    let locker_a = builder(a.clone()).build().expect("valid settings");
    let held = bounded("A's try_lock", LIMIT, locker_a.try_lock(KEY))
        .await
        .expect("A's try_lock")
        .expect("A takes the free key");
    (held, builder(b.clone()).build().expect("valid settings"))
}

/// The same with a shared lock for B: the shared try is re-entrant on the
/// shared backend too (and a shared hold beside A's exclusive one is a
/// second holder as much as an exclusive one).
#[sqlx::test(migrations = false)]
async fn two_clients_behind_a_single_connection_transaction_pooler_never_share_an_exclusive_lock(
    pool: PgPool,
) {
    let (proxy, a, b) = two_clients(&pool).await;
    let (held, locker_b) = a_holds_the_key(&a, &b).await;
    for (what, attempt) in [
        ("try_lock_shared", locker_b.try_lock_shared(KEY).await),
        (
            "lock_shared",
            locker_b
                .lock_shared(KEY, Duration::from_millis(300))
                .await
                .map(Some),
        ),
    ] {
        match attempt {
            Ok(None) | Err(Error::PoolerDetected { .. } | Error::Timeout { .. }) => {}
            Ok(Some(second)) => panic!("{}", second_lock(what, &held, &second, &proxy).await),
            Err(other) => panic!("{what}: expected busy or PoolerDetected, got {other:?}"),
        }
    }
    a_still_holds_then_releases(&pool, held).await;
    a.close().await;
    b.close().await;
}

/// `try_lock_all` for B while A holds one of its keys: refused or busy.
#[sqlx::test(migrations = false)]
async fn two_clients_behind_a_single_connection_transaction_pooler_never_both_hold_a_multi_key_lock(
    pool: PgPool,
) {
    let (proxy, a, b) = two_clients(&pool).await;
    let (held, locker_b) = a_holds_the_key(&a, &b).await;
    match bounded(
        "B's try_lock_all",
        LIMIT,
        locker_b.try_lock_all([KEY, "other"]),
    )
    .await
    {
        Ok(None) | Err(Error::PoolerDetected { .. }) => {}
        Ok(Some(both)) => panic!(
            "try_lock_all: B got {:?} while A holds {KEY:?} (A lost: {:?}, B lost: {:?}, \
             backend {})",
            both.keys(),
            held.loss(),
            both.is_lost(),
            proxy.backend_pid()
        ),
        Err(other) => panic!("try_lock_all: expected busy or PoolerDetected, got {other:?}"),
    }
    a_still_holds_then_releases(&pool, held).await;
    a.close().await;
    b.close().await;
}

/// How many rounds of the `lock_all` race below to run: each round lets A
/// take `x` between B's try (which takes `x`, finds `y` busy and gives `x`
/// back) and B's wait about half the time (the pooler serves its clients
/// in turn), so a defect shows within a few rounds.
const MULTI_WAIT_ROUNDS: usize = 12;
/// Extra keys in B's `lock_all`, to lengthen its try on the server.
const MULTI_WAIT_KEYS: usize = 3000;

/// `lock_all([x, y])` for B while `y` is held outside the pooler and A keeps
/// trying `x`. Where A's try lands between B's try and B's wait, the shared
/// backend takes `x` for A; B's wait must then not be granted `x` again
/// (re-entrantly) without either of them being told.
#[sqlx::test(migrations = false)]
async fn a_waiting_multi_key_lock_behind_a_single_connection_transaction_pooler_never_shares_a_key(
    pool: PgPool,
) {
    let (mut reached, mut interleaved) = (0, 0);
    for round in 0..MULTI_WAIT_ROUNDS {
        // A task of its own: polled from the runtime's loop rather than under
        // this test's frames, it has the thread's stack to itself (the race
        // nests large futures, and a debug build's frames are large).
        let (a_took_x, b_waited) = tokio::spawn(lock_all_race_round(pool.clone(), round))
            .await
            .expect("the race round");
        reached += usize::from(a_took_x);
        interleaved += usize::from(a_took_x && b_waited);
    }
    // Before the wait checked the session marker, B was granted x beside A
    // in most rounds (9 of 12 in one run); a refused wait returns at once,
    // so the second count only shows rounds that B won by waiting.
    println!(
        "lock_all race: A took x after B's try in {reached} of {MULTI_WAIT_ROUNDS} rounds; \
         B waited while A held x in {interleaved}"
    );
    // A round where A took x is one where B's try had given x back, and
    // B's wait came (or would come) with x held on the shared backend: the
    // state the check exists for. Without one, the test showed nothing.
    assert!(
        reached > 0,
        "no round reached the race: A never took x between B's try and B's wait"
    );
}

/// One round of the race: whether A took `x` while B's `lock_all` was under
/// way (the interleaving that reaches B's wait with `x` taken), and whether
/// B's call then waited (returned after `y` was freed).
async fn lock_all_race_round(pool: PgPool, round: usize) -> (bool, bool) {
    let pool = &pool;
    let (proxy, a, b) = two_clients(pool).await;
    // A slow heartbeat: B's wait holds up the pooler's one server
    // connection, and a heartbeat that times out meanwhile would tell A by
    // accident, not because anything noticed the second holder.
    let slow = |p: PgPool| {
        PgLocker::builder(p)
            .heartbeat(Duration::from_secs(2))
            .build()
            .expect("valid settings")
    };
    let (locker_a, locker_b) = (slow(a.clone()), slow(b.clone()));
    // Both lockers probe for a pooler once; do it now, out of the race.
    drop(locker_a.try_lock("warm-up-a").await);
    drop(locker_b.try_lock("warm-up-b").await);
    let mut outside = observer_for(pool).await;
    assert!(raw_try_lock(&mut outside, &Raw::text("y")).await);

    // Many keys make B's try slow enough on the server for A's try, sent
    // a moment after it, to queue behind it at the pooler and run before
    // B's wait.
    let mut keys: Vec<String> = (0..MULTI_WAIT_KEYS)
        .map(|i| format!("filler-{i}"))
        .collect();
    keys.extend(["x".to_owned(), "y".to_owned()]);
    let started = std::time::Instant::now();
    let b_wait = async {
        let got = locker_b.lock_all(keys, Duration::from_secs(3)).await;
        (got, started.elapsed())
    };
    let a_tries = async {
        tokio::time::sleep(Duration::from_millis(1 + (round % 4) as u64)).await;
        match locker_a.try_lock("x").await {
            Ok(Some(held)) => Some((held, started.elapsed())),
            Ok(None) | Err(Error::PoolerDetected { .. }) => None,
            Err(other) => panic!("round {round}: A's try_lock: {other:?}"),
        }
    };
    let release_y = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(raw_unlock(&mut outside, &Raw::text("y")).await);
    };
    let ((b_got, b_took), a_held, ()) = bounded("the lock_all race", LIMIT, async {
        tokio::join!(b_wait, a_tries, release_y)
    })
    .await;
    let a_held = a_held.map(|(held, at)| {
        println!("round {round}: A took x at {at:?}");
        held
    });
    // B waited (its try had given x back) if it returned after y was freed.
    let reached = a_held.is_some();
    let waited = b_took >= Duration::from_millis(300);
    println!(
        "round {round}: B's lock_all after {b_took:?}: {:?}",
        b_got.as_ref().map(|m| m.keys().len()),
    );
    if let (Ok(multi), Some(held)) = (&b_got, &a_held) {
        assert!(
            multi.is_lost() || held.is_lost(),
            "round {round}: B's lock_all holds its {} keys, \"x\" among them, and A's try_lock \
             holds \"x\" on the one backend {} behind the pooler; when B's lock_all returned, \
             neither was told (A lost: {:?}, B lost: {})",
            multi.keys().len(),
            proxy.backend_pid(),
            held.loss(),
            multi.is_lost()
        );
    }
    if let Ok(multi) = b_got {
        drop(multi.release().await);
    }
    if let Some(held) = a_held {
        drop(held.release().await);
    }
    close(outside).await;
    a.close().await;
    b.close().await;
    (reached, waited)
}

/// A lock taken through `proxy` (heartbeat 9 s, so the release is the
/// first to look), the pooler's server connection replaced, then
/// `release()`: it must say `LockLost(BackendChanged)` with both pids.
async fn release_on_another_backend(
    pool: &PgPool,
    app: &str,
    builder: fn(PgPool) -> PgLockerBuilder,
) {
    let proxy = txpool(pool).await;
    let client = through(&proxy, pool, app).await;
    let locker = builder(client.clone())
        .heartbeat(Duration::from_secs(9))
        .build()
        .expect("valid settings");
    let held = locker.try_lock(KEY).await.expect("try").expect("free");
    let before = proxy.backend_pid();
    let after = proxy
        .replace_server()
        .await
        .expect("a new server connection");
    let released = bounded("release", LIMIT, held.release()).await;
    match released {
        Err(Error::LockLost {
            reason:
                distlock::LossReason::BackendChanged {
                    expected_pid,
                    actual_pid,
                },
            ..
        }) => assert_eq!((expected_pid, actual_pid), (before, after)),
        other => panic!("expected LockLost(BackendChanged), got {other:?}"),
    }
    drop(locker);
    client.close().await;
}

/// The regression: `release()` of a lock whose client connection the
/// pooler had moved to another server backend (the lock went with the old
/// one) said `PoolerDetected`, against its documented `LockLost`; the
/// heartbeat reports the same finding as `LossReason::BackendChanged`.
#[sqlx::test(migrations = false)]
async fn a_release_on_another_backend_reports_the_lock_lost(pool: PgPool) {
    release_on_another_backend(&pool, "moved", PgLocker::builder).await;
}

/// The same with the unlock statement already prepared on the connection
/// (by an earlier release): on the new backend it is missing (26000), which
/// `release()` reported as a raw `Error::Database`; now `LockLost` with
/// `LossReason::SessionShared`, the heartbeat's reason for that error.
#[sqlx::test(migrations = false)]
async fn a_release_whose_statement_is_missing_on_the_backend_reports_the_lock_lost(pool: PgPool) {
    let proxy = txpool(&pool).await;
    let opts = (*pool.connect_options())
        .clone()
        .host("127.0.0.1")
        .port(proxy.port());
    // One connection, so the second lock runs where the first was released.
    let client = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(opts)
        .await
        .expect("pool through the transaction pooler");
    let locker = PgLocker::builder(client.clone())
        .heartbeat(Duration::from_secs(9))
        .build()
        .expect("valid settings");
    let first = locker.try_lock(KEY).await.expect("try").expect("free");
    first.release().await.expect("the first release");
    let held = locker.try_lock(KEY).await.expect("try").expect("free");
    proxy
        .replace_server()
        .await
        .expect("a new server connection");
    let released = bounded("release", LIMIT, held.release()).await;
    match released {
        Err(Error::LockLost {
            reason: distlock::LossReason::SessionShared(why),
            ..
        }) => assert!(
            why.contains("26000") || why.contains("does not exist"),
            "{why}"
        ),
        other => panic!("expected LockLost(SessionShared), got {other:?}"),
    }
    client.close().await;
}

/// The same for a multiplexed lock: its driver reported a backend change at
/// release as `PoolerDetected`.
#[sqlx::test(migrations = false)]
async fn a_multiplexed_release_on_another_backend_reports_the_lock_lost(pool: PgPool) {
    release_on_another_backend(&pool, "moved-mux", |client| {
        PgLocker::builder(client).multiplex(1)
    })
    .await;
}

/// Transaction-scoped locks check the session marker too: while client A
/// holds a session lock on the pooler's one backend, client B's
/// transaction-scoped lock on the same key (its own transaction, or the
/// caller's) would be granted re-entrantly by that backend. Each of B's
/// forms must come back busy, timed out or refused.
#[sqlx::test(migrations = false)]
async fn transaction_scoped_locks_behind_a_single_connection_transaction_pooler_never_join_a_session_lock(
    pool: PgPool,
) {
    let (proxy, a, b) = two_clients(&pool).await;
    let (held, locker_b) = a_holds_the_key(&a, &b).await;
    let wait = Duration::from_millis(300);
    let inside = async |_: &mut sqlx::PgConnection| Ok::<_, Error>(());
    let mut outcomes = vec![
        (
            "with_advisory_lock",
            locker_b
                .with_advisory_lock(KEY, inside)
                .await
                .map(|ran| ran.is_some()),
        ),
        (
            "with_shared_advisory_lock",
            locker_b
                .with_shared_advisory_lock(KEY, inside)
                .await
                .map(|ran| ran.is_some()),
        ),
        (
            "with_advisory_lock_wait",
            locker_b
                .with_advisory_lock_wait(KEY, wait, inside)
                .await
                .map(|()| true),
        ),
    ];
    let mut tx = b.begin().await.expect("B's transaction");
    outcomes.push(("try_lock_xact", distlock::try_lock_xact(&mut tx, KEY).await));
    drop(tx);
    let mut tx = b.begin().await.expect("B's transaction");
    outcomes.push((
        "lock_xact",
        distlock::lock_xact(&mut tx, KEY, wait).await.map(|()| true),
    ));
    drop(tx);
    for (what, outcome) in outcomes {
        match outcome {
            Ok(false) | Err(Error::PoolerDetected { .. } | Error::Timeout { .. }) => {}
            Ok(true) => panic!(
                "{what}: client B took {KEY:?} in a transaction on the pooler's one backend ({}) \
                 while client A holds it there (backend {})",
                proxy.backend_pid(),
                held.backend_pid()
            ),
            Err(other) => panic!("{what}: expected busy or PoolerDetected, got {other:?}"),
        }
    }
    a_still_holds_then_releases(&pool, held).await;
    a.close().await;
    b.close().await;
}

/// A's lock, taken on the pooler's first server connection, then the
/// pooler on a second one where B holds "b": A's `release()` runs there.
/// It must give back nothing of B's and leave the session marker B's lock
/// set, so that a third client's try on "b" there is still refused.
async fn release_beside_another_clients_lock(pool: &PgPool, a_kind: AKind) {
    let proxy = txpool(pool).await;
    let locker = |app: &'static str, multiplexed: bool| {
        let proxy = &proxy;
        async move {
            let client = through(proxy, pool, app).await;
            let builder = PgLocker::builder(client).heartbeat(Duration::from_secs(9));
            let builder = if multiplexed {
                builder.multiplex(1)
            } else {
                builder
            };
            builder.build().expect("valid settings")
        }
    };
    let a = locker("a", a_kind == AKind::Multiplexed).await;
    let (b, c) = (locker("b", false).await, locker("c", false).await);
    let a_held: Box<dyn Lease> = match a_kind {
        AKind::MultiKey => Box::new(
            a.try_lock_all(["a1", "a2"])
                .await
                .expect("try")
                .expect("free"),
        ),
        AKind::Single | AKind::Multiplexed => {
            Box::new(a.try_lock("a").await.expect("try").expect("free"))
        }
    };
    proxy
        .replace_server()
        .await
        .expect("a new server connection");
    let b_held = b.try_lock("b").await.expect("try").expect("free");
    let released = bounded("A's release", LIMIT, a_held.release()).await;
    assert!(
        matches!(released, Err(Error::LockLost { .. })),
        "A's lock went with the first backend: {released:?}"
    );
    let mut obs = observer_for(pool).await;
    assert!(
        !raw_can_take(&mut obs, &Raw::text("b")).await,
        "B's lock still keeps other sessions off \"b\""
    );
    let third = c.try_lock("b").await;
    assert!(
        matches!(third, Err(Error::PoolerDetected { .. }) | Ok(None)),
        "a third client got \"b\" while B holds it: {:?}",
        third.map(|l| l.map(|l| l.backend_pid()))
    );
    b_held.release().await.expect("B releases");
    close(obs).await;
}

/// What client A holds in [`release_beside_another_clients_lock`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AKind {
    Single,
    MultiKey,
    Multiplexed,
}

/// The regression: the unlock ran on whatever backend answered and looked
/// at the pid only afterwards, resetting the marker of B's lock there.
#[sqlx::test(migrations = false)]
async fn a_release_on_another_backend_leaves_that_backends_lock_and_marker_alone(pool: PgPool) {
    release_beside_another_clients_lock(&pool, AKind::Single).await;
}

/// The same for a multi-key lock, whose release is `pg_advisory_unlock_all()`:
/// on B's backend it freed B's lock outright.
#[sqlx::test(migrations = false)]
async fn a_multi_key_release_on_another_backend_frees_nothing_there(pool: PgPool) {
    release_beside_another_clients_lock(&pool, AKind::MultiKey).await;
}

/// The same for a multiplexed lock, whose driver set the session's marker
/// to its own count of locks on whatever backend answered its unlock.
#[sqlx::test(migrations = false)]
async fn a_multiplexed_release_on_another_backend_leaves_that_backends_marker_alone(pool: PgPool) {
    release_beside_another_clients_lock(&pool, AKind::Multiplexed).await;
}
