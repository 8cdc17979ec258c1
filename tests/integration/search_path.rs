//! A `search_path` that puts another schema before `pg_catalog` cannot
//! replace the functions, types, operators or settings the lock statements
//! use: every statement names them by their `pg_catalog` names.

use crate::common::*;

use std::time::Duration;

use distlock::{Error, PgLocker};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// Look-alikes in schema `evil` that grant every lock and hash every name
/// to 0: a statement that resolves an unqualified name through the
/// `search_path` takes no real lock at all.
const EVIL: &str = r#"
CREATE SCHEMA evil;
CREATE FUNCTION evil.hashtext(text) RETURNS int4 LANGUAGE sql AS 'SELECT 0';
CREATE FUNCTION evil.pg_try_advisory_lock(int8) RETURNS bool LANGUAGE sql AS 'SELECT true';
CREATE FUNCTION evil.pg_try_advisory_lock(int4, int4) RETURNS bool LANGUAGE sql AS 'SELECT true';
CREATE FUNCTION evil.pg_advisory_lock(int8) RETURNS void LANGUAGE sql AS '';
CREATE FUNCTION evil.pg_advisory_lock(int4, int4) RETURNS void LANGUAGE sql AS '';
CREATE FUNCTION evil.pg_try_advisory_xact_lock(int8) RETURNS bool LANGUAGE sql AS 'SELECT true';
CREATE FUNCTION evil.pg_advisory_xact_lock(int8) RETURNS void LANGUAGE sql AS '';
CREATE FUNCTION evil.pg_try_advisory_lock_shared(int8) RETURNS bool LANGUAGE sql AS 'SELECT true';
CREATE FUNCTION evil.pg_advisory_unlock(int8) RETURNS bool LANGUAGE sql AS 'SELECT true';
CREATE FUNCTION evil.pg_advisory_unlock(int4, int4) RETURNS bool LANGUAGE sql AS 'SELECT true';
CREATE FUNCTION evil.pg_advisory_lock_shared(int8) RETURNS void LANGUAGE sql AS '';
CREATE FUNCTION evil.pg_advisory_unlock_shared(int8) RETURNS bool LANGUAGE sql AS 'SELECT true';
CREATE FUNCTION evil.pg_advisory_unlock_all() RETURNS void LANGUAGE sql AS '';
CREATE FUNCTION evil.pg_try_advisory_xact_lock_shared(int8) RETURNS bool LANGUAGE sql AS 'SELECT true';
CREATE FUNCTION evil.pg_advisory_xact_lock_shared(int8) RETURNS void LANGUAGE sql AS '';
CREATE FUNCTION evil.pg_backend_pid() RETURNS int4 LANGUAGE sql AS 'SELECT 0';
CREATE FUNCTION evil.pg_current_wal_lsn() RETURNS pg_lsn LANGUAGE sql AS 'SELECT NULL::pg_lsn';
CREATE FUNCTION evil.current_setting(text) RETURNS text LANGUAGE sql AS $$SELECT ''$$;
CREATE FUNCTION evil.current_setting(text, bool) RETURNS text LANGUAGE sql AS $$SELECT ''$$;
CREATE FUNCTION evil.set_config(text, text, bool) RETURNS text LANGUAGE sql AS $$SELECT ''$$;
CREATE FUNCTION evil.make_interval(years int4 DEFAULT 0, months int4 DEFAULT 0,
  weeks int4 DEFAULT 0, days int4 DEFAULT 0, hours int4 DEFAULT 0, mins int4 DEFAULT 0,
  secs float8 DEFAULT 0) RETURNS interval LANGUAGE sql AS $$SELECT interval '0'$$;
"#;

/// Look-alike operators in schema `evil`: every comparison of the types
/// the statements compare answers its opposite (`=` is `<>`, `<` is `>=`,
/// and so on, taken from PostgreSQL's own negators), `||` drops its right
/// side, and the arithmetic and bit operators do something else. An
/// operator written without `OPERATOR(pg_catalog.…)` resolves to these
/// under `search_path=evil,pg_catalog`: a marker check would refuse, a key
/// would resolve to another lock, a deadline would be in the past.
const EVIL_OPERATORS: &str = r#"
DO $$
DECLARE o record;
BEGIN
  FOR o IN SELECT op.oprname, op.oprleft::pg_catalog.regtype AS l,
      op.oprright::pg_catalog.regtype AS r, neg.oprcode AS f
    FROM pg_catalog.pg_operator op
    JOIN pg_catalog.pg_operator neg ON neg.oid OPERATOR(pg_catalog.=) op.oprnegate
    WHERE op.oprnamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace
      AND op.oprname OPERATOR(pg_catalog.=) ANY ('{=,<>,<,<=,>,>=}')
      AND ((op.oprleft OPERATOR(pg_catalog.=) ANY (ARRAY['text', 'int2', 'int4', 'int8',
          'oid', 'bool', 'timestamptz', 'interval', 'numeric', 'float8']::pg_catalog.regtype[])
        AND op.oprright OPERATOR(pg_catalog.=) op.oprleft)
      OR (op.oprleft OPERATOR(pg_catalog.=) ANY (ARRAY['int2', 'int4', 'int8']::pg_catalog.regtype[])
        AND op.oprright OPERATOR(pg_catalog.=) ANY (ARRAY['int2', 'int4', 'int8']::pg_catalog.regtype[])))
  LOOP
    EXECUTE pg_catalog.format('CREATE OPERATOR evil.%s (LEFTARG = %s, RIGHTARG = %s, FUNCTION = %s)',
      o.oprname, o.l, o.r, o.f);
  END LOOP;
END $$;
CREATE FUNCTION evil.left_only(text, text) RETURNS text LANGUAGE sql AS 'SELECT $1';
CREATE OPERATOR evil.|| (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.left_only);
CREATE OPERATOR evil.+ (LEFTARG = timestamptz, RIGHTARG = interval,
  FUNCTION = pg_catalog.timestamptz_mi_interval);
CREATE OPERATOR evil.+ (LEFTARG = int4, RIGHTARG = int4, FUNCTION = pg_catalog.int4mi);
CREATE OPERATOR evil.- (LEFTARG = int4, RIGHTARG = int4, FUNCTION = pg_catalog.int4pl);
CREATE OPERATOR evil.+ (LEFTARG = int8, RIGHTARG = int8, FUNCTION = pg_catalog.int8mi);
CREATE OPERATOR evil.- (LEFTARG = int8, RIGHTARG = int8, FUNCTION = pg_catalog.int8pl);
CREATE OPERATOR evil.* (LEFTARG = numeric, RIGHTARG = numeric, FUNCTION = pg_catalog.numeric_add);
CREATE OPERATOR evil./ (LEFTARG = float8, RIGHTARG = float8, FUNCTION = pg_catalog.float8mul);
CREATE OPERATOR evil.& (LEFTARG = int8, RIGHTARG = int8, FUNCTION = pg_catalog.int8or);
CREATE OPERATOR evil.| (LEFTARG = int8, RIGHTARG = int8, FUNCTION = pg_catalog.int8and);
CREATE OPERATOR evil.>> (LEFTARG = int8, RIGHTARG = int4, FUNCTION = pg_catalog.int8shl);
CREATE OPERATOR evil.<< (LEFTARG = int8, RIGHTARG = int4, FUNCTION = pg_catalog.int8shr);
"#;

/// A pool whose sessions resolve names through `evil` first.
async fn evil_pool(pool: &PgPool) -> PgPool {
    for plant in [EVIL, EVIL_OPERATORS] {
        sqlx::raw_sql(plant)
            .execute(pool)
            .await
            .expect("plant the look-alikes");
    }
    let options = (*pool.connect_options())
        .clone()
        .options([("search_path", "evil,pg_catalog")]);
    PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .expect("pool with the hostile search_path")
}

/// Whether an ordinary session can take `key` now.
async fn free(pool: &PgPool, key: &str) -> bool {
    let mut obs = observer_for(pool).await;
    let free = raw_can_take(&mut obs, &Raw::text(key)).await;
    close(obs).await;
    free
}

#[sqlx::test(migrations = false)]
async fn a_hostile_search_path_does_not_replace_the_lock_functions(pool: PgPool) {
    let evil = evil_pool(&pool).await;
    // Sanity: the look-alikes are what an unqualified call finds there.
    let found: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtext('x'))")
        .fetch_one(&evil)
        .await
        .expect("unqualified call");
    assert!(
        found && free(&pool, "x").await,
        "the look-alike granted without a lock"
    );

    for locker in [
        PgLocker::new(evil.clone()),
        PgLocker::builder(evil.clone())
            .multiplex(1)
            .build()
            .expect("valid settings"),
    ] {
        let held = locker.try_lock("k").await.expect("try_lock").expect("free");
        assert!(!free(&pool, "k").await, "try_lock took the real lock");
        assert!(locker.try_lock("k").await.expect("second try").is_none());
        held.release().await.expect("release");
        assert!(free(&pool, "k").await, "release gave the real lock back");

        let waited = locker
            .lock("k", Duration::from_secs(1))
            .await
            .expect("lock");
        assert!(!free(&pool, "k").await, "lock took the real lock");
        waited.release().await.expect("release");
    }
    let locker = PgLocker::new(evil.clone());
    let both = locker
        .try_lock_all(["a", "b"])
        .await
        .expect("try_lock_all")
        .expect("free");
    assert!(
        !free(&pool, "a").await && !free(&pool, "b").await,
        "try_lock_all took them"
    );
    both.release().await.expect("release");
    let shared = locker
        .try_lock_shared("s")
        .await
        .expect("try_lock_shared")
        .expect("free");
    assert!(
        !free(&pool, "s").await,
        "try_lock_shared took the real lock"
    );
    shared.release().await.expect("release");

    let inside = locker
        .with_advisory_lock("t", async |_| Ok::<_, Error>(free(&pool, "t").await))
        .await
        .expect("with_advisory_lock");
    assert_eq!(
        inside,
        Some(false),
        "with_advisory_lock held the real lock inside"
    );
    let mut tx = evil.begin().await.expect("begin");
    assert!(
        distlock::try_lock_xact(&mut tx, "u")
            .await
            .expect("try_lock_xact")
    );
    assert!(!free(&pool, "u").await, "try_lock_xact took the real lock");
    tx.rollback().await.expect("rollback");
    evil.close().await;
}

/// The waiting paths, the shared and transaction-scoped ones, and the
/// schema's own statements under the same look-alikes (which also fake the
/// settings, the backend pid, the standby check and intervals: a statement
/// that called them unqualified would refuse, lose its lock, or purge what
/// it must keep).
#[sqlx::test(migrations = false)]
async fn a_hostile_search_path_does_not_replace_the_waits_or_the_schema_functions(pool: PgPool) {
    distlock::migrate(&pool).await.expect("migrate");
    let evil = evil_pool(&pool).await;
    let locker = PgLocker::new(evil.clone());
    let wait = Duration::from_secs(1);

    let all = locker.lock_all(["wa", "wb"], wait).await.expect("lock_all");
    assert!(
        !free(&pool, "wa").await && !free(&pool, "wb").await,
        "lock_all took them"
    );
    all.release().await.expect("release");
    assert!(free(&pool, "wa").await, "release gave them back");

    let shared = locker.lock_shared("ws", wait).await.expect("lock_shared");
    assert!(!free(&pool, "ws").await, "lock_shared took the real lock");
    shared.release().await.expect("release");
    assert!(free(&pool, "ws").await, "the shared unlock gave it back");

    let inside = locker
        .with_shared_advisory_lock_wait("wt", wait, async |_| {
            Ok::<_, Error>(free(&pool, "wt").await)
        })
        .await
        .expect("with_shared_advisory_lock_wait");
    assert!(!inside, "the shared transaction lock was held inside");

    let mut tx = evil.begin().await.expect("begin");
    distlock::lock_xact(&mut tx, "wu", wait)
        .await
        .expect("lock_xact");
    assert!(!free(&pool, "wu").await, "lock_xact took the real lock");
    tx.rollback().await.expect("rollback");

    let mut conn = evil.acquire().await.expect("connection");
    assert!(
        distlock::idempotency::claim(&mut conn, "scope", "fresh")
            .await
            .expect("claim")
    );
    drop(conn);
    let purged = distlock::idempotency::purge(&evil, Duration::from_secs(3600))
        .await
        .expect("purge");
    assert_eq!(purged, 0, "a claim a moment old is younger than an hour");
}

/// Look-alike catalog views in schema `evil`: `pg_locks` that shows no
/// lock, `pg_stat_activity` that names every session `forged`, and
/// `pg_database` that hides every database. A lookup that reads an
/// unqualified view through the `search_path` sees nobody holding anything.
const EVIL_VIEWS: &str = r#"
CREATE SCHEMA evil;
CREATE VIEW evil.pg_locks AS SELECT * FROM pg_catalog.pg_locks WHERE false;
CREATE VIEW evil.pg_stat_activity AS
  SELECT pid, 'forged'::text AS application_name, client_addr, xact_start, backend_start
  FROM pg_catalog.pg_stat_activity;
CREATE VIEW evil.pg_database AS SELECT * FROM pg_catalog.pg_database WHERE false;
"#;

/// The application name of the pool that reads through `evil` first.
const SEES: &str = "distlock-search-path";

#[sqlx::test(migrations = false)]
async fn a_hostile_search_path_does_not_change_who_holds_what(pool: PgPool) {
    for plant in [EVIL_VIEWS, EVIL_OPERATORS] {
        sqlx::raw_sql(plant)
            .execute(&pool)
            .await
            .expect("plant the look-alike views and operators");
    }
    let options = (*pool.connect_options())
        .clone()
        .application_name(SEES)
        .options([("search_path", "evil,pg_catalog")]);
    let evil = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .expect("pool with the hostile search_path");
    let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_locks")
        .fetch_one(&evil)
        .await
        .expect("unqualified read");
    assert_eq!(
        seen, 0,
        "the look-alike view is what an unqualified read finds"
    );

    let locker = PgLocker::new(evil.clone());
    let held = locker.try_lock("k").await.expect("try_lock").expect("free");
    let holders = locker.holders().await.expect("holders");
    assert_eq!(holders.len(), 1, "the real lock is listed: {holders:?}");
    assert_eq!(holders[0].pid, held.backend_pid());
    assert_eq!(holders[0].application_name.as_deref(), Some(SEES));
    let of = locker.holders_of("k").await.expect("holders_of");
    assert_eq!(of.len(), 1, "holders_of lists the real lock: {of:?}");

    // A timeout names the real holder, and its chain starts there.
    match locker.lock("k", Duration::from_millis(200)).await {
        Err(Error::Timeout {
            holder_pid,
            holder_application,
            chain,
            ..
        }) => {
            assert_eq!(holder_pid, Some(held.backend_pid()));
            assert_eq!(holder_application.as_deref(), Some(SEES));
            assert_eq!(chain.pids(), [held.backend_pid()]);
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    held.release().await.expect("release");
    evil.close().await;
}

/// The other kinds under the look-alike functions and operators: fencing
/// tokens, heartbeats, upgrades, the semaphore, the lease table and
/// leadership each take the real lock (or row), keep it, and give it back.
#[sqlx::test(migrations = false)]
async fn a_hostile_search_path_does_not_replace_the_operators_of_any_kind(pool: PgPool) {
    distlock::migrate(&pool).await.expect("migrate");
    let evil = evil_pool(&pool).await;
    let wait = Duration::from_secs(2);
    let locker = PgLocker::builder(evil.clone())
        .fencing(true)
        .heartbeat(Duration::from_millis(100))
        .heartbeat_timeout(PATIENT)
        .build()
        .expect("valid settings");

    let first = locker.try_lock("f").await.expect("try_lock").expect("free");
    let first_token = first.fencing_token().expect("a token");
    // Heartbeats run meanwhile: they must find the lock still held.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!first.is_lost(), "a heartbeat reported the lock lost");
    assert!(!free(&pool, "f").await, "the fenced lock is real");
    first.release().await.expect("release");
    let second = locker.lock("f", wait).await.expect("lock");
    assert!(
        second.fencing_token().expect("a token") > first_token,
        "tokens grow"
    );
    // Fencing checks compare the right resource's row (`=` inverted would
    // read or advance the other one).
    let mut conn = evil.acquire().await.expect("connection");
    distlock::fence::check(&mut conn, "other", first_token)
        .await
        .expect("check other");
    let token = second.fencing_token().expect("a token");
    distlock::fence::check(&mut conn, "res", token)
        .await
        .expect("check res");
    assert_eq!(
        distlock::fence::current(&mut conn, "res")
            .await
            .expect("current"),
        Some(token)
    );
    drop(conn);
    second.release().await.expect("release");

    // A window's run record: written once, found on the second run, and
    // finished with its outcome.
    let job = || {
        let locker: std::sync::Arc<dyn distlock::Locker> =
            std::sync::Arc::new(PgLocker::new(evil.clone()));
        distlock::SingletonJob::builder(locker, "job:daily")
            .once_per_window(evil.clone(), Duration::from_secs(86_400))
            .build()
            .expect("valid settings")
    };
    let first_run = job().run(async |_| Ok::<_, Error>(())).await.expect("run");
    assert!(first_run.is_ran(), "{first_run:?}");
    let again = job()
        .run(async |_| Ok::<_, Error>(()))
        .await
        .expect("again");
    assert!(!again.is_ran(), "ran twice in one window: {again:?}");
    let finished: Vec<(String, Option<String>, bool)> =
        sqlx::query_as("SELECT job, outcome, finished_at IS NOT NULL FROM distlock.job_runs")
            .fetch_all(&pool)
            .await
            .expect("job_runs");
    assert_eq!(
        finished,
        [("job:daily".to_owned(), Some("ran".to_owned()), true)]
    );

    let mut read = locker
        .try_lock_upgradeable("u")
        .await
        .expect("try_lock_upgradeable")
        .expect("free");
    assert!(read.try_upgrade().await.expect("try_upgrade"), "upgraded");
    assert!(!free(&pool, "u").await, "the upgraded lock is real");
    read.release().await.expect("release");
    assert!(
        free(&pool, "u").await,
        "the upgradeable lock was given back"
    );

    let semaphore = locker.semaphore("sem", 1).expect("a valid semaphore");
    let permit = semaphore
        .try_acquire()
        .await
        .expect("try_acquire")
        .expect("free");
    assert!(
        semaphore.try_acquire().await.expect("second try").is_none(),
        "one permit"
    );
    permit.release().await.expect("release");
    let permit = semaphore.acquire(wait).await.expect("acquire");
    permit.release().await.expect("release");

    let table = distlock::postgres::TableLocker::builder(evil.clone())
        .ttl(Duration::from_secs(2))
        .build()
        .expect("valid settings");
    let lease = table.try_lock("t").await.expect("try_lock").expect("free");
    assert!(table.try_lock("t").await.expect("second").is_none(), "held");
    // Renewals run meanwhile (every third of the TTL).
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(!lease.is_lost(), "a renewal reported the lease lost");
    lease.release().await.expect("release");
    table
        .lock("t", wait)
        .await
        .expect("lock after release")
        .release()
        .await
        .expect("release");

    let locker: std::sync::Arc<dyn distlock::Locker> = std::sync::Arc::new(locker);
    let election = distlock::LeaderElection::builder(locker, "leader")
        .identity("node-a")
        .poll(Duration::from_millis(50))
        .build()
        .expect("valid settings");
    let campaign = election.campaign();
    bounded("leads", Duration::from_secs(5), campaign.elected())
        .await
        .expect("a term");
    let seen = election
        .leader()
        .await
        .expect("leader()")
        .expect("a leader");
    assert_eq!(seen.identity, "node-a");
    campaign.resign().await.expect("resign");
    assert_eq!(election.leader().await.expect("leader()"), None);
    evil.close().await;
}
