//! A `search_path` that puts another schema before `pg_catalog` cannot
//! replace the functions, types or settings the lock statements use: every
//! statement names them by their `pg_catalog` names.

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

/// A pool whose sessions resolve names through `evil` first.
async fn evil_pool(pool: &PgPool) -> PgPool {
    sqlx::raw_sql(EVIL)
        .execute(pool)
        .await
        .expect("plant the look-alikes");
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
    sqlx::raw_sql(EVIL_VIEWS)
        .execute(&pool)
        .await
        .expect("plant the look-alike views");
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
