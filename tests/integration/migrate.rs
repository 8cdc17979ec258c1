//! `distlock::migrate`: idempotent, concurrent-safe, works without superuser.

use crate::common::roles::{drop_role, grant_documented_rights, make_role, pool_as};
use distlock::{FencingToken, PgLocker};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

async fn applied(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM distlock._sqlx_migrations WHERE success")
        .fetch_one(pool)
        .await
        .unwrap()
}

fn migration_count() -> i64 {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
    let n = std::fs::read_dir(dir).unwrap().filter(|e| {
        e.as_ref()
            .unwrap()
            .path()
            .extension()
            .is_some_and(|x| x == "sql")
    });
    i64::try_from(n.count()).unwrap()
}

#[sqlx::test(migrations = false)]
async fn migrate_is_idempotent_and_keeps_its_own_table(pool: PgPool) {
    distlock::migrate(&pool).await.unwrap();
    distlock::migrate(&pool).await.unwrap();
    assert_eq!(applied(&pool).await, migration_count());
    let public: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_tables WHERE tablename = '_sqlx_migrations' AND schemaname = 'public')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(!public, "the application's migrations table is untouched");
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT tablename::text FROM pg_tables WHERE schemaname = 'distlock' ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        tables,
        [
            "_sqlx_migrations",
            "fence_seen",
            "fencing_counters",
            "fencing_floor",
            "fencing_tokens",
            "idempotency_keys",
            "job_runs",
            "leaders",
            "leases",
            "token_epoch",
            "token_epoch_live",
        ]
    );
}

#[sqlx::test(migrations = false)]
async fn concurrent_migrate_calls_all_succeed(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let pool = pool_opts
            .clone()
            .max_connections(2)
            .connect_with(connect_opts.clone())
            .await
            .unwrap();
        tasks.push(tokio::spawn(async move { distlock::migrate(&pool).await }));
    }
    for task in tasks {
        task.await
            .unwrap()
            .expect("every concurrent migrate succeeds");
    }
    let pool = pool_opts.connect_with(connect_opts).await.unwrap();
    assert_eq!(applied(&pool).await, migration_count());
}

async fn exercise_as(connect_opts: &PgConnectOptions, role: &str) {
    let pool = pool_as(connect_opts, role).await;
    let is_super: bool =
        sqlx::query_scalar("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(!is_super);
    distlock::migrate(&pool)
        .await
        .expect("migrate as a non-superuser");
    distlock::migrate(&pool).await.expect("and again");
    let locker = PgLocker::builder(pool.clone())
        .fencing(true)
        .build()
        .expect("valid settings");
    let lock = locker.try_lock("as-role").await.unwrap().unwrap();
    // The first token of the first epoch of timeline 1 (or whatever
    // timeline the server is on).
    let token = lock.fencing_token().map(FencingToken::value).unwrap();
    assert_eq!(token & 0xffff_ffff, 1, "{token:#x}");
    let mut conn = pool.acquire().await.unwrap();
    distlock::fence::check(&mut conn, "r", lock.fencing_token().unwrap())
        .await
        .unwrap();
    assert!(
        distlock::idempotency::claim(&mut conn, "s", "k")
            .await
            .unwrap()
    );
    lock.release().await.unwrap();
    drop(conn);
    pool.close().await;
}

#[sqlx::test(migrations = false)]
async fn role_owning_the_schema_can_migrate(pool: PgPool) {
    let role = make_role(&pool, "dl_own").await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE SCHEMA distlock AUTHORIZATION {role}"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let opts = pool.connect_options().as_ref().clone();
    exercise_as(&opts, &role).await;
    let _ = drop_role(&pool, &role).await;
}

#[sqlx::test(migrations = false)]
async fn role_allowed_to_create_the_schema_can_migrate(pool: PgPool) {
    let role = make_role(&pool, "dl_crt").await;
    let db: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&pool)
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "GRANT CREATE ON DATABASE \"{db}\" TO {role}"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let opts = pool.connect_options().as_ref().clone();
    exercise_as(&opts, &role).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "REVOKE CREATE ON DATABASE \"{db}\" FROM {role}"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let _ = drop_role(&pool, &role).await;
}

/// The grants `migrate`'s documentation and the README give another role
/// (no write privilege on fencing state: `security.rs` shows the broad
/// grants it once gave let that role lower it).
#[sqlx::test(migrations = false)]
async fn other_roles_work_with_the_documented_grants(pool: PgPool) {
    distlock::migrate(&pool).await.unwrap();
    let role = make_role(&pool, "dl_use").await;
    grant_documented_rights(&pool, &role).await;
    let opts = pool.connect_options().as_ref().clone();
    exercise_as(&opts, &role).await;
    let _ = drop_role(&pool, &role).await;
}

/// `(version, checksum, installed_on)` of every applied migration.
async fn applied_rows(pool: &PgPool) -> Vec<(i64, Vec<u8>, String)> {
    sqlx::query_as(
        "SELECT version, checksum, installed_on::text FROM distlock._sqlx_migrations ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Databases migrated by earlier builds, which embedded the migrations with
/// `sqlx::migrate!` over the same directory and table, are up to date for
/// `migrate`: same versions and checksums, nothing run again, nothing
/// refused as changed.
#[sqlx::test(migrations = false)]
async fn a_database_migrated_by_sqlx_migrate_is_accepted(pool: PgPool) {
    let mut old = sqlx::migrate!("./migrations");
    old.dangerous_set_table_name("distlock._sqlx_migrations");
    old.create_schema("distlock");
    old.run(&pool)
        .await
        .expect("the sqlx::migrate! migrator runs");
    let before = applied_rows(&pool).await;
    assert_eq!(i64::try_from(before.len()).unwrap(), migration_count());
    distlock::migrate(&pool)
        .await
        .expect("migrate accepts what sqlx::migrate! applied");
    assert_eq!(applied_rows(&pool).await, before, "nothing ran again");
    // A migration sqlx::migrate! did not apply (the newest; it only
    // replaces a function, so it can run twice) is applied by `migrate` with
    // the checksum sqlx::migrate! gives it.
    let newest = old.iter().map(|m| m.version).max().unwrap();
    sqlx::query("DELETE FROM distlock._sqlx_migrations WHERE version = $1")
        .bind(newest)
        .execute(&pool)
        .await
        .unwrap();
    distlock::migrate(&pool)
        .await
        .expect("migrate applies the missing one");
    let checksums = |rows: Vec<(i64, Vec<u8>, String)>| {
        rows.into_iter()
            .map(|(version, checksum, _)| (version, checksum))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        checksums(applied_rows(&pool).await),
        checksums(before),
        "same versions and checksums as sqlx::migrate!"
    );
}

/// `migrate`'s connection holds the migrations' lock while it applies them,
/// so its lock statement sets the TCP keepalives every lock statement sets:
/// a migrator cut off by a partition lets the server free the lock within
/// about 30 s, not keep every other process's `migrate` waiting for the
/// operating system's hours. Read on the pool's one connection, which ran
/// the migrations.
#[sqlx::test(migrations = false)]
async fn migrate_sets_keepalives_on_the_connection_that_holds_its_lock(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(connect_opts)
        .await
        .unwrap();
    distlock::migrate(&pool).await.unwrap();
    let settings: (String, String, String, String) = sqlx::query_as(
        "SELECT current_setting('tcp_keepalives_idle'), current_setting('tcp_keepalives_interval'), \
         current_setting('tcp_keepalives_count'), current_setting('tcp_user_timeout')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        settings,
        ("10".into(), "5".into(), "3".into(), "30000".into()),
        "the migrating connection's keepalives"
    );
    pool.close().await;
}
