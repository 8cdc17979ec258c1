//! A database of its own for each scenario (advisory locks are per
//! database, and some scenarios change database-level settings), dropped at
//! the end even if the test panics.

use std::collections::HashMap;
use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, Row};

use super::checker::LoggedWrite;

/// `DATABASE_URL` (set by `.cargo/config.toml` for cargo runs), always
/// reached on 127.0.0.1.
pub fn admin_options() -> PgConnectOptions {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    PgConnectOptions::from_str(&url)
        .expect("DATABASE_URL")
        .host("127.0.0.1")
        .application_name("distlock-torture-admin")
}

/// A scenario's database; dropped (sessions and all) when this is dropped.
#[derive(Debug)]
pub struct TestDb {
    pub name: String,
    /// How the server is reached (its `postgres` database).
    server: PgConnectOptions,
}

impl TestDb {
    /// Creates `distlock_torture_<scenario>_<pid>` afresh.
    pub async fn create(scenario: &str) -> Self {
        Self::create_on(scenario, admin_options()).await
    }

    /// The same, on the server `server` leads to (a private cluster, or a
    /// proxy in front of one).
    pub async fn create_on(scenario: &str, server: PgConnectOptions) -> Self {
        let name = format!("distlock_torture_{scenario}_{}", std::process::id());
        let mut admin = server.connect().await.expect("admin connection");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
        )))
        .execute(&mut admin)
        .await
        .expect("drop stale database");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut admin)
            .await
            .expect("create database");
        let _ = admin.close().await;
        Self { name, server }
    }

    /// Direct connection options to this database.
    pub fn options(&self) -> PgConnectOptions {
        self.server.clone().database(&self.name)
    }

    /// A control connection, exempt from the idle timeouts a scenario sets.
    pub async fn connect(&self, application: &str) -> PgConnection {
        self.options()
            .application_name(application)
            .options([
                ("idle_session_timeout", "0"),
                ("idle_in_transaction_session_timeout", "0"),
            ])
            .connect()
            .await
            .expect("connect to the scenario database")
    }

    pub async fn pool(&self, max: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(self.options().application_name("distlock-torture-control"))
            .await
            .expect("pool")
    }

    /// `ALTER DATABASE <this> SET <name> = <value>` (new sessions only).
    pub async fn set(&self, name: &str, value: &str) {
        let mut admin = self.server.connect().await.expect("admin connection");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE {} SET {name} = '{value}'",
            self.name
        )))
        .execute(&mut admin)
        .await
        .expect("alter database");
        let _ = admin.close().await;
    }

    /// Migrations for fencing, and the register with `keys` keys at 0.
    pub async fn prepare(&self, keys: i64) {
        let pool = self.pool(2).await;
        distlock::migrate(&pool).await.expect("migrate");
        for sql in [
            "CREATE TABLE torture_register (k int PRIMARY KEY, value bigint NOT NULL)",
            "CREATE TABLE torture_register_log (k int NOT NULL, value bigint NOT NULL, \
             token bigint, proc int NOT NULL, task int NOT NULL, seq bigint NOT NULL, \
             at timestamptz NOT NULL DEFAULT clock_timestamp())",
        ] {
            sqlx::query(sql)
                .execute(&pool)
                .await
                .expect("register table");
        }
        sqlx::query("INSERT INTO torture_register SELECT g, 0 FROM generate_series(0, $1 - 1) g")
            .bind(keys)
            .execute(&pool)
            .await
            .expect("register rows");
        pool.close().await;
    }

    /// The register's log and final values.
    pub async fn register(&self) -> (Vec<LoggedWrite>, Vec<(i64, i64)>) {
        let mut conn = self.connect("distlock-torture-check").await;
        let log = sqlx::query("SELECT k, value, token, proc, task, seq FROM torture_register_log")
            .fetch_all(&mut conn)
            .await
            .expect("register log")
            .iter()
            .map(|r| LoggedWrite {
                key: i64::from(r.get::<i32, _>(0)),
                value: r.get(1),
                token: r.get(2),
                op: (
                    i64::from(r.get::<i32, _>(3)),
                    i64::from(r.get::<i32, _>(4)),
                    r.get(5),
                ),
            })
            .collect();
        let finals = sqlx::query("SELECT k, value FROM torture_register ORDER BY k")
            .fetch_all(&mut conn)
            .await
            .expect("register values")
            .iter()
            .map(|r| (i64::from(r.get::<i32, _>(0)), r.get(1)))
            .collect();
        let _ = conn.close().await;
        (log, finals)
    }

    /// Advisory locks (granted or awaited) in this database right now.
    pub async fn advisory_locks(&self) -> i64 {
        let mut conn = self.connect("distlock-torture-check").await;
        let n = count_advisory_locks(&mut conn).await;
        let _ = conn.close().await;
        n
    }
}

/// Advisory locks (granted or awaited) in the connection's database.
pub async fn count_advisory_locks(conn: &mut PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_one(conn)
    .await
    .expect("pg_locks")
}

/// A granted advisory lock of this database and who holds it.
#[derive(Debug, Clone)]
pub struct HeldLock {
    pub pid: i32,
    pub application: String,
    /// `(classid, objid, objsubid)` as `pg_locks` shows the key.
    pub triple: (i64, i64, i32),
}

/// Granted advisory locks in this database, with their holders.
pub async fn advisory_holders(conn: &mut PgConnection) -> Vec<HeldLock> {
    sqlx::query(
        "SELECT l.pid, coalesce(a.application_name, ''), l.classid::int8, l.objid::int8, \
         l.objsubid::int4 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND l.granted \
         AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_all(conn)
    .await
    .expect("advisory holders")
    .iter()
    .map(|r| HeldLock {
        pid: r.get(0),
        application: r.get(1),
        triple: (r.get(2), r.get(3), r.get(4)),
    })
    .collect()
}

/// Maps `pg_locks` triples back to the workers' key indexes `keys`.
pub async fn key_triples(
    conn: &mut PgConnection,
    keys: std::ops::Range<i64>,
) -> HashMap<(i64, i64, i32), i64> {
    let mut map = HashMap::new();
    for k in keys {
        let hash: i32 = sqlx::query_scalar("SELECT hashtext($1)")
            .bind(format!("torture:{k}"))
            .fetch_one(&mut *conn)
            .await
            .expect("hashtext");
        let low = |v: i32| i64::from(u32::from_ne_bytes(v.to_ne_bytes()));
        let bigint = |v: i64| {
            let bits = u64::from_ne_bytes(v.to_ne_bytes());
            (
                i64::try_from(bits >> 32).expect("high"),
                i64::try_from(bits & 0xFFFF_FFFF).expect("low"),
                1,
            )
        };
        let triple = match k.rem_euclid(3) {
            0 => bigint(i64::from(hash)),
            1 => bigint(0x7f00_0000 + k),
            _ => (77, low(hash), 2),
        };
        map.insert(triple, k);
    }
    map
}

impl Drop for TestDb {
    fn drop(&mut self) {
        // Drop may run inside a runtime or during a panic: do the async
        // clean-up on a thread of its own.
        let name = self.name.clone();
        let server = self.server.clone();
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                if let Ok(mut admin) = server.connect().await {
                    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                    )))
                    .execute(&mut admin)
                    .await;
                    let _ = admin.close().await;
                }
            });
        });
        let _ = done.join();
    }
}
