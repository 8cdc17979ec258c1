//! Security: other roles of the database, colliding keys, and secrets.
//!
//! Every test here also shows the broken variant it catches: the attack
//! succeeding where the protection is missing (a squatted schema allowed,
//! the old broad grants, a planted function without `search_path`, a
//! colliding `hashtext`), so that its passing means something.

use crate::common;

use common::captured::Captured;
use common::roles::{drop_role, grant_documented_rights, make_role, pool_as};
use distlock::{Error, FencingToken, LockKey, Migrator, PgLocker};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Executor, PgPool};

fn token(value: i64) -> FencingToken {
    FencingToken::new(value)
}

// ---------------------------------------------------------------------------
// Schema squatting

#[sqlx::test(migrations = false)]
async fn migrate_refuses_a_schema_owned_by_another_role(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let pool = pool_opts.connect_with(connect_opts.clone()).await.unwrap();
    let squatter = make_role(&pool, "dlsec_squat").await;
    pool.execute(sqlx::AssertSqlSafe(format!(
        "CREATE SCHEMA distlock AUTHORIZATION {squatter}"
    )))
    .await
    .unwrap();

    let err = distlock::migrate(&pool).await.unwrap_err();
    assert!(
        matches!(&err, Error::UntrustedSchema { owner, .. } if *owner == squatter),
        "{err:?}"
    );
    let applied: Option<String> =
        sqlx::query_scalar("SELECT to_regclass('distlock._sqlx_migrations')::text")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(applied, None, "nothing was created in the squatted schema");

    // What the refusal prevents: once the squatter's schema is used, its
    // owner can replace the fence by one that accepts every token.
    let allowed = Migrator::new().allow_schema_owner(&squatter);
    allowed.run(&pool).await.unwrap();
    let squatter_pool = pool_as(&connect_opts, &squatter).await;
    squatter_pool
        .execute(
            "DROP FUNCTION distlock.fence_advance(text, bigint); \
             CREATE FUNCTION distlock.fence_advance(p_resource text, p_token bigint) \
             RETURNS bigint LANGUAGE sql AS 'SELECT p_token'",
        )
        .await
        .expect("the schema's owner may replace functions in it");
    squatter_pool.close().await;
    let mut conn = pool.acquire().await.unwrap();
    distlock::fence::check(&mut conn, "r", token(5))
        .await
        .unwrap();
    distlock::fence::check(&mut conn, "r", token(3))
        .await
        .expect("the planted fence accepts a stale token");
    drop(conn);
    pool.execute("DROP SCHEMA distlock CASCADE").await.unwrap();
    let _ = drop_role(&pool, &squatter).await;
}

#[sqlx::test(migrations = false)]
async fn migrate_trusts_its_own_schema_and_a_superusers(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let pool = pool_opts.connect_with(connect_opts.clone()).await.unwrap();
    // Created by the superuser: trusted by a role with the usage grants.
    distlock::migrate(&pool).await.unwrap();
    let app = make_role(&pool, "dlsec_user").await;
    grant_documented_rights(&pool, &app).await;
    let app_pool = pool_as(&connect_opts, &app).await;
    distlock::migrate(&app_pool)
        .await
        .expect("a superuser's schema is trusted");
    app_pool.close().await;
    pool.execute("DROP SCHEMA distlock CASCADE").await.unwrap();

    // Created and owned by the role itself.
    let owner = make_role(&pool, "dlsec_own").await;
    pool.execute(sqlx::AssertSqlSafe(format!(
        "CREATE SCHEMA distlock AUTHORIZATION {owner}"
    )))
    .await
    .unwrap();
    let owner_pool = pool_as(&connect_opts, &owner).await;
    distlock::migrate(&owner_pool)
        .await
        .expect("its own schema is trusted");
    owner_pool.close().await;
    pool.execute("DROP SCHEMA distlock CASCADE").await.unwrap();
    let _ = drop_role(&pool, &app).await;
    let _ = drop_role(&pool, &owner).await;
}

// ---------------------------------------------------------------------------
// Fixed search_path

/// Functions of schema `distlock` without a fixed `search_path`, or with
/// one naming a schema other than `pg_catalog`, `pg_temp` and `distlock`.
async fn functions_without_fixed_search_path(pool: &PgPool) -> Vec<String> {
    let rows: Vec<(String, Option<Vec<String>>)> = sqlx::query_as(
        "SELECT p.oid::regprocedure::text, p.proconfig::text[] FROM pg_proc p \
         WHERE p.pronamespace = 'distlock'::regnamespace ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(!rows.is_empty(), "no function in schema distlock");
    rows.into_iter()
        .filter(|(_, config)| {
            let path = config
                .iter()
                .flatten()
                .find_map(|c| c.strip_prefix("search_path="));
            !path.is_some_and(|p| {
                p.split(',')
                    .map(|s| s.trim().trim_matches('"'))
                    .all(|s| ["pg_catalog", "pg_temp", "distlock"].contains(&s))
            })
        })
        .map(|(name, _)| name)
        .collect()
}

#[sqlx::test(migrations = false)]
async fn every_function_in_schema_distlock_has_a_fixed_search_path(pool: PgPool) {
    distlock::migrate(&pool).await.unwrap();
    let loose = functions_without_fixed_search_path(&pool).await;
    assert!(loose.is_empty(), "without a fixed search_path: {loose:?}");

    // The check catches a function without one, and one whose path names
    // a schema other roles may write to.
    pool.execute(
        "CREATE FUNCTION distlock.planted() RETURNS int LANGUAGE sql AS 'SELECT 1'; \
         CREATE FUNCTION distlock.planted_public() RETURNS int LANGUAGE sql \
         SET search_path = public, pg_catalog AS 'SELECT 1'",
    )
    .await
    .unwrap();
    assert_eq!(
        functions_without_fixed_search_path(&pool).await,
        ["distlock.planted()", "distlock.planted_public()"]
    );
}

// ---------------------------------------------------------------------------
// Fencing state an application role cannot lower

/// Statements that would lower, reset or delete fencing state, or replace
/// the functions that guard it.
const ATTACKS: &[&str] = &[
    "UPDATE distlock.fencing_counters SET token = 0",
    "DELETE FROM distlock.fencing_counters",
    "TRUNCATE distlock.fencing_counters",
    "INSERT INTO distlock.fencing_counters (space, lock_id, token) VALUES (1, -1, 0)",
    "UPDATE distlock.fence_seen SET token = 0",
    "DELETE FROM distlock.fence_seen",
    "TRUNCATE distlock.fence_seen",
    "UPDATE distlock.fencing_floor SET token = 0",
    "DELETE FROM distlock.fencing_floor",
    "CREATE OR REPLACE FUNCTION distlock.fence_advance(p_resource text, p_token bigint) \
     RETURNS bigint LANGUAGE sql AS 'SELECT p_token'",
    "CREATE FUNCTION distlock.fence_advance(p_resource text, p_token numeric) \
     RETURNS bigint LANGUAGE sql AS 'SELECT 0::bigint'",
    "ALTER FUNCTION distlock.issue_token_in(smallint, bigint) SECURITY INVOKER",
    "UPDATE distlock.token_epoch SET epoch = 0",
    "UPDATE distlock.token_epoch SET counter_base = 0",
    "DELETE FROM distlock.token_epoch",
    "INSERT INTO distlock.token_epoch_live (epoch) VALUES (0) \
     ON CONFLICT (only_row) DO UPDATE SET epoch = 0",
    "DELETE FROM distlock.token_epoch_live",
    "TRUNCATE distlock.token_epoch_live",
    "SELECT setval('distlock.token_counter', 1)",
    "ALTER FUNCTION distlock.next_token() SECURITY INVOKER",
];

/// The attacks that succeed for `pool`'s role, each in a transaction that is
/// rolled back.
async fn successful_attacks(pool: &PgPool) -> Vec<&'static str> {
    let mut ok = Vec::new();
    for attack in ATTACKS {
        let mut tx = pool.begin().await.unwrap();
        if tx.execute(*attack).await.is_ok() {
            ok.push(*attack);
        }
        tx.rollback().await.unwrap();
    }
    ok
}

async fn fencing_state(pool: &PgPool) -> (Vec<(i16, i64, i64)>, Vec<(String, i64)>, i64) {
    let counters = sqlx::query_as("SELECT space, lock_id, token FROM distlock.fencing_counters")
        .fetch_all(pool)
        .await
        .unwrap();
    let seen = sqlx::query_as("SELECT resource, token FROM distlock.fence_seen")
        .fetch_all(pool)
        .await
        .unwrap();
    let floor = sqlx::query_scalar("SELECT token FROM distlock.fencing_floor")
        .fetch_one(pool)
        .await
        .unwrap();
    (counters, seen, floor)
}

#[sqlx::test(migrations = false)]
async fn an_application_role_cannot_lower_or_delete_fencing_state(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let pool = pool_opts.connect_with(connect_opts.clone()).await.unwrap();
    distlock::migrate(&pool).await.unwrap();
    let app = make_role(&pool, "dlsec_fence").await;
    grant_documented_rights(&pool, &app).await;
    let app_pool = pool_as(&connect_opts, &app).await;

    // The documented rights are enough to lock, fence, claim and migrate.
    distlock::migrate(&app_pool).await.expect("up to date");
    let locker = PgLocker::builder(app_pool.clone())
        .fencing(true)
        .build()
        .expect("valid settings");
    let first = locker.try_lock("fenced").await.unwrap().unwrap();
    let issued = first.fencing_token().expect("fencing");
    first.release().await.unwrap();
    let second = locker.try_lock("fenced").await.unwrap().unwrap();
    assert!(second.fencing_token().unwrap() > issued);
    let mut conn = app_pool.acquire().await.unwrap();
    distlock::fence::check(&mut conn, "res", second.fencing_token().unwrap())
        .await
        .unwrap();
    let stale = distlock::fence::check(&mut conn, "res", issued).await;
    assert!(matches!(stale, Err(Error::StaleFencingToken { .. })));
    assert!(
        distlock::idempotency::claim(&mut conn, "scope", "k")
            .await
            .unwrap()
    );
    drop(conn);
    second.release().await.unwrap();
    // And the lease table.
    let table = distlock::postgres::TableLocker::new(app_pool.clone());
    let lease = table.try_lock("leased").await.unwrap().expect("free");
    assert!(lease.fencing_token().unwrap() > issued);
    lease.release().await.unwrap();

    let before = fencing_state(&pool).await;
    let ok = successful_attacks(&app_pool).await;
    assert!(ok.is_empty(), "the application role could: {ok:?}");
    // Nor through the functions: presenting a low token lowers nothing.
    sqlx::query("SELECT distlock.fence_advance('res', -1), distlock.fence_advance('res', 0)")
        .execute(&app_pool)
        .await
        .unwrap();
    assert_eq!(fencing_state(&pool).await, before);

    // The broken variant: the broad grants of earlier versions let the
    // application role reset the counters and the fence ...
    pool.execute(sqlx::AssertSqlSafe(format!(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA distlock TO {app}"
    )))
    .await
    .unwrap();
    let ok = successful_attacks(&app_pool).await;
    assert!(
        ok.contains(&"UPDATE distlock.fencing_counters SET token = 0")
            && ok.contains(&"DELETE FROM distlock.fence_seen")
            && ok.contains(&"UPDATE distlock.token_epoch SET epoch = 0")
            && ok.contains(&"DELETE FROM distlock.token_epoch_live"),
        "{ok:?}"
    );
    // ... and the hardening migrations revoke them where they were given
    // before they ran (an upgrade).
    pool.execute(
        "DELETE FROM distlock._sqlx_migrations WHERE version IN (20261201000009, 20261201000011)",
    )
    .await
    .unwrap();
    distlock::migrate(&pool).await.unwrap();
    let ok = successful_attacks(&app_pool).await;
    assert!(ok.is_empty(), "after the upgrade the role could: {ok:?}");

    app_pool.close().await;
    pool.execute("DROP SCHEMA distlock CASCADE").await.unwrap();
    let _ = drop_role(&pool, &app).await;
}

// ---------------------------------------------------------------------------
// Key collisions

/// Two names with one `hashtext` (found by a search over `collide:<n>`).
const COLLIDING: (&str, &str) = ("collide:27929", "collide:122276");

#[sqlx::test(migrations = false)]
async fn names_with_one_hashtext_are_one_lock_and_hashed64_keeps_them_apart(pool: PgPool) {
    let (a, b) = COLLIDING;
    let mut conn = pool.acquire().await.unwrap();
    let (ha, hb) = (
        common::hashtext(&mut conn, a).await,
        common::hashtext(&mut conn, b).await,
    );
    assert_eq!(
        ha, hb,
        "the pair must collide for this test to mean anything"
    );
    drop(conn);

    let locker = PgLocker::new(pool.clone());
    // Documented: the default key is hashtext(name), so these are one lock.
    let held = locker.try_lock(a).await.unwrap().expect("free");
    assert!(
        locker.try_lock(b).await.unwrap().is_none(),
        "two names with one hashtext are one lock"
    );
    held.release().await.unwrap();

    // hashed64 keeps them apart.
    let first = locker
        .try_lock(LockKey::hashed64(a))
        .await
        .unwrap()
        .expect("free");
    let second = locker
        .try_lock(LockKey::hashed64(b))
        .await
        .unwrap()
        .expect("hashed64 tells the two names apart");
    first.release().await.unwrap();
    second.release().await.unwrap();
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn a_redis_lock_named_like_a_counter_is_not_the_counter() {
    use distlock::redis::RedisLocker;
    let server = common::redis::RedisServer::start().await;
    let locker = RedisLocker::connect(&server.url()).await.unwrap();
    // Earlier versions counted the tokens of `x` in `distlock:fencing:x`:
    // a lock of that name would find the counter's key taken (busy forever)
    // and taking it would reset `x`'s tokens.
    let x = locker.try_lock("x").await.unwrap().expect("free");
    let t1 = x.fencing_token().unwrap();
    x.release().await.unwrap();
    let named_like_counter = locker
        .try_lock("distlock:fencing:x")
        .await
        .unwrap()
        .expect("a lock named like the old counter key is free");
    let x = locker.try_lock("x").await.unwrap().expect("free");
    assert!(x.fencing_token().unwrap() > t1, "x's tokens keep growing");
    x.release().await.unwrap();
    named_like_counter.release().await.unwrap();
    // The counter's own key cannot be named by a lock: names cannot hold NUL.
    assert!(matches!(
        locker.try_lock("distlock:fencing\0x").await,
        Err(Error::InvalidKey { .. })
    ));
}

// ---------------------------------------------------------------------------
// Secrets

const SECRET: &str = "Pw-s3cr3t-4711";

#[sqlx::test(migrations = false)]
async fn passwords_stay_out_of_debug_errors_and_tracing(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    // The test server trusts local connections, so any password connects.
    let with_password = connect_opts.clone().password(SECRET);
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::FULL)
        .with_writer(writer)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(with_password.clone())
        .await
        .unwrap();
    distlock::migrate(&pool).await.unwrap();
    let mut seen = Vec::new();
    for multiplex in [0, 1] {
        let builder = PgLocker::builder(pool.clone())
            .fencing(true)
            .multiplex(multiplex);
        seen.push(format!("{builder:?}"));
        let locker = builder.build().expect("valid settings");
        seen.push(format!("{locker:?}"));
        let lock = locker.try_lock("secret-test").await.unwrap().unwrap();
        seen.push(format!("{lock:?}"));
        lock.release().await.unwrap();
        let timeout = {
            let held = locker.try_lock("secret-test").await.unwrap().unwrap();
            let other = PgLocker::new(pool.clone());
            let err = other
                .lock("secret-test", std::time::Duration::from_millis(50))
                .await
                .unwrap_err();
            held.release().await.unwrap();
            err
        };
        seen.push(format!("{timeout:?} {timeout}"));
    }
    // A failing connection's error.
    let refused = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(std::time::Duration::from_secs(2))
        .connect_lazy_with(with_password.clone().port(1));
    let err = PgLocker::new(refused).try_lock("x").await.unwrap_err();
    seen.push(format!("{err:?} {err}"));
    pool.close().await;
    seen.push(captured.text());
    let all = seen.join("\n");
    assert!(all.contains("secret-test"), "captured nothing: {all}");
    assert!(!all.contains(SECRET), "a password leaked:\n{all}");

    // The check catches a leak: sqlx's own options print it.
    assert!(format!("{with_password:?}").contains(SECRET));
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_passwords_stay_out_of_debug_and_errors() {
    use distlock::redis::{RedisLocker, Redlock};
    let port = common::cluster::free_port();
    let mut child = std::process::Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no", "--requirepass", SECRET])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("redis-server is installed (.ci/run installs it)");
    let url = format!("redis://:{SECRET}@127.0.0.1:{port}");
    let mut locker = None;
    for _ in 0..200 {
        if let Ok(l) = RedisLocker::connect(&url).await {
            locker = Some(l);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    let locker = locker.expect("redis-server with a password came up");
    let mut seen = vec![format!("{locker:?}")];
    let lease = locker.try_lock("secret-test").await.unwrap().unwrap();
    seen.push(format!("{lease:?}"));
    lease.release().await.unwrap();
    let redlock = Redlock::connect(&[url.as_str(), url.as_str(), url.as_str()]).await;
    seen.push(format!("{redlock:?}"));
    seen.push(format!("{:?}", RedisLocker::builder(url.as_str())));
    seen.push(format!("{:?}", Redlock::builder([url.as_str()])));
    let built = RedisLocker::builder(url.as_str()).build().await.unwrap();
    seen.push(format!("{built:?}"));
    let wrong = format!("redis://:{SECRET}-wrong@127.0.0.1:{port}");
    match RedisLocker::connect(&wrong).await {
        Ok(l) => seen.push(format!("{:?}", l.try_lock("x").await)),
        Err(err) => seen.push(format!("{err:?} {err}")),
    }
    let _ = child.kill();
    let _ = child.wait();
    let all = seen.join("\n");
    assert!(all.contains("127.0.0.1"), "{all}");
    assert!(!all.contains(SECRET), "a password leaked:\n{all}");
}
