//! A transaction-pooling PgBouncer between the locker and PostgreSQL: the
//! session API must refuse (or report the lock lost as soon as another
//! backend answers), the transaction-scoped API must keep working.
//!
//! PgBouncer 1.18 (Debian bookworm) does not support prepared statements in
//! transaction mode, and sqlx prepares named statements (`sqlx_s_<n>`,
//! numbered per client connection, cached). Through such a PgBouncer, two
//! clients' `sqlx_s_1` meet on one server connection ("prepared statement
//! already exists", 42P05) and a cached statement is missing on the next
//! server ("does not exist", 26000). `statement_cache_capacity(0)` alone does
//! not help: sqlx 0.9 still *names* every statement, only never reuses or
//! closes it. What works for `with_advisory_lock` (everything runs inside
//! one transaction, on one server connection): the client's
//! `statement_cache_capacity(0)` *and* PgBouncer's
//! `server_reset_query = DEALLOCATE ALL` with `server_reset_query_always = 1`,
//! so each transaction starts with no statements on its server connection.
//! PgBouncer 1.21+ with `max_prepared_statements > 0` needs neither.

use std::time::Duration;

use distlock::{Error, LossReason, PgLocker};
use sqlx::Executor;
use sqlx::postgres::{PgPool, PgPoolOptions};

use super::db::{TestDb, admin_options};
use super::pgbouncer::PgBouncer;
use super::procs::{Fleet, RunDir};
use super::report::Outcome;
use super::worker::{Broken, Config, Mode};
use super::{run_name, scale, scenario, setup};

/// The PgBouncer settings of the recipe above.
const RECIPE: &[(&str, &str)] = &[
    ("server_reset_query", "DEALLOCATE ALL"),
    ("server_reset_query_always", "1"),
];

async fn pool_through(bouncer: &PgBouncer, db: &TestDb, cache: Option<usize>) -> PgPool {
    let mut opts = db
        .options()
        .port(bouncer.port())
        .application_name("torture-pgbouncer");
    if let Some(capacity) = cache {
        opts = opts.statement_cache_capacity(capacity);
    }
    PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(opts)
        .await
        .expect("pool through pgbouncer")
}

/// Makes PgBouncer open `n` server connections (it opens them lazily), so
/// that consecutive statements can land on different backends.
async fn open_server_connections(pool: &PgPool, n: usize) {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move {
                sqlx::raw_sql("BEGIN; SELECT pg_sleep(0.2); COMMIT")
                    .execute(&pool)
                    .await
                    .expect("warm-up");
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("warm-up task");
    }
}

/// A PgBouncer for `db` alone, its configuration and log kept in the run
/// directory; two server connections opened at once. A scenario that
/// cannot run must not pass: a missing binary fails it.
async fn start(dir: &RunDir, db: &TestDb, overrides: &[(&str, &str)]) -> PgBouncer {
    let admin = admin_options();
    let mut bouncer = PgBouncer::builder(admin.get_port())
        .database(&db.name, admin.get_username())
        .dir_in(&dir.path)
        .set("min_pool_size", "2")
        .set("max_client_conn", "100");
    for (key, value) in overrides {
        bouncer = bouncer.set(key, value);
    }
    bouncer.start().await
}

#[test]
fn pgbouncer_transaction_pooling_refuses_session_locks() {
    scenario(async {
        let db = TestDb::create("pgbouncer_session").await;
        let dir = RunDir::new("pgbouncer_session");
        // sqlx's own startup parameter; nothing of distlock's (the
        // multiplexed mode sets its keepalives by statement).
        let ignore = [("ignore_startup_parameters", "extra_float_digits")];
        let bouncer = start(&dir, &db, &ignore).await;
        let pool = pool_through(&bouncer, &db, None).await;
        open_server_connections(&pool, 3).await;
        let attempts = scale::pick(12, 60);
        let (mut refused, mut lost) = (0, 0);
        for i in 0..attempts {
            // A fresh locker each time: the probe runs once per locker.
            let (mode, locker) = match i % 3 {
                0 => ("try_lock", PgLocker::new(pool.clone())),
                1 => ("lock", PgLocker::new(pool.clone())),
                _ => (
                    "multiplexed try_lock",
                    PgLocker::builder(pool.clone())
                        .multiplex(1)
                        .build()
                        .expect("valid settings"),
                ),
            };
            let attempt = match i % 3 {
                1 => locker
                    .lock("torture:pooled", Duration::from_secs(1))
                    .await
                    .map(Some),
                _ => locker.try_lock("torture:pooled").await,
            };
            match attempt {
                Err(Error::PoolerDetected { .. }) => refused += 1,
                Ok(Some(lock)) => {
                    let reason = tokio::time::timeout(Duration::from_secs(5), lock.lost())
                        .await
                        .unwrap_or_else(|_| {
                            panic!("{mode}: granted through PgBouncer, never lost")
                        });
                    // A changed pid, or a prepared statement that appeared
                    // or vanished on the session: both say "pooler".
                    assert!(
                        matches!(
                            reason,
                            LossReason::BackendChanged { .. } | LossReason::SessionShared(_)
                        ),
                        "{mode}: lost for another reason: {reason}"
                    );
                    lost += 1;
                }
                other => panic!("{mode} through PgBouncer: {other:?}"),
            }
        }
        pool.close().await;
        drop(bouncer);
        let left = db.advisory_locks().await;
        println!("=== torture: PgBouncer (transaction pooling), session API ===");
        println!(
            "  {attempts} attempts with fresh lockers (try_lock, lock, multiplexed): {refused} refused with PoolerDetected, {lost} granted then lost with BackendChanged or SessionShared; advisory locks left: {left}"
        );
        assert_eq!(refused + lost, attempts);
        assert_eq!(
            left, 0,
            "a session lock stayed behind on a server connection"
        );
    });
}

/// Regression (finding of this suite): through a PgBouncer with a *single*
/// server connection, every statement is answered by the same backend, so
/// the pid probe passes, and the lock statement failed with a raw driver
/// error ("prepared statement sqlx_s_1 already exists", another client's)
/// instead of the pooler error. Reproduced without PgBouncer: the session
/// already holds a statement of that name, as a shared one would.
#[test]
fn foreign_prepared_statement_on_the_session_is_reported_as_pooler() {
    scenario(async {
        let db = TestDb::create("pooler_foreign_statement").await;
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    // Simple protocol: does not advance sqlx's own numbering.
                    conn.execute(sqlx::raw_sql(
                        "PREPARE sqlx_s_1 AS SELECT 1; PREPARE sqlx_s_2 AS SELECT 2",
                    ))
                    .await?;
                    Ok(())
                })
            })
            .connect_with(db.options().application_name("torture-pooler"))
            .await
            .expect("pool");
        let locker = PgLocker::new(pool.clone());
        let attempt = locker.try_lock("torture:shared-session").await;
        assert!(
            matches!(attempt, Err(Error::PoolerDetected { .. })),
            "try_lock: {attempt:?}"
        );
        let attempt = locker
            .lock("torture:shared-session", Duration::from_secs(1))
            .await;
        assert!(
            matches!(attempt, Err(Error::PoolerDetected { .. })),
            "lock: {attempt:?}"
        );
        pool.close().await;
        assert_eq!(db.advisory_locks().await, 0, "nothing may stay locked");
    });
}

#[test]
fn pgbouncer_transaction_pooling_keeps_with_advisory_lock_working() {
    scenario(pgbouncer_xact(Broken::No));
}

/// The control: the same run with a locker that skips the lock now and then
/// must fail.
#[test]
fn broken_locker_fails_behind_pgbouncer() {
    scenario(pgbouncer_xact(Broken::SkipLock(0.1)));
}

async fn pgbouncer_xact(broken: Broken) {
    let name = &run_name("pgbouncer_xact", broken);
    let (db, dir) = setup(name, 16).await;
    let bouncer = start(&dir, &db, RECIPE).await;
    // Without the recipe's client half, sqlx's cached statements break.
    let plain = pool_through(&bouncer, &db, None).await;
    let locker = PgLocker::new(plain.clone());
    let mut failing = 0;
    for _ in 0..5 {
        let r = locker
            .with_advisory_lock("torture:plain", async |conn| {
                sqlx::query("SELECT $1::int")
                    .bind(1)
                    .execute(&mut *conn)
                    .await?;
                Ok::<_, Error>(())
            })
            .await;
        failing += usize::from(r.is_err());
    }
    plain.close().await;

    let pg = admin_options().get_port();
    let configs: Vec<Config> = (0..3)
        .map(|p| {
            // 0 and 1 through PgBouncer, 2 directly, on the same keys.
            let port = if p < 2 { bouncer.port() } else { pg };
            Config {
                tasks: 8,
                hold_us: (0, 5_000),
                lock_pool: 4,
                statement_cache: (p < 2).then_some(0),
                // One through PgBouncer and the direct one send the try
                // with the `BEGIN`: through the recipe's `DEALLOCATE ALL`,
                // every call of process 1 prepares it again.
                try_with_begin: p >= 1,
                duration_ms: if broken == Broken::No {
                    scale::pick(5_000, 60_000)
                } else {
                    5_000
                },
                broken,
                ..Config::new(p, &dir.path, &db.name, port, Mode::Xact)
            }
        })
        .collect();
    let mut fleet = Fleet::spawn(&dir.path, &configs);
    fleet.wait(Duration::from_secs(300)).await;
    let outcome = Outcome::analyse(&db, &dir.path, configs.len()).await;
    let h = &outcome.history;
    let through = |p: i64| h.held().filter(|a| a.op.0 == p).count();
    let failed: Vec<_> = h
        .acqs
        .iter()
        .filter(|a| a.op.0 < 2 && a.failed.is_some())
        .map(|a| a.failed.clone())
        .take(3)
        .collect();
    outcome.print(
        "PgBouncer (transaction pooling), with_advisory_lock",
        &[
            format!(
                "through PgBouncer: {} + {} acquisitions (the second with try_with_begin); directly, with try_with_begin: {}",
                through(0),
                through(1),
                through(2)
            ),
            format!(
                "with sqlx's default statement cache, {failing} of 5 calls failed (prepared statements)"
            ),
        ],
    );
    if broken != Broken::No {
        outcome.assert_caught("PgBouncer");
        return;
    }
    outcome.assert_sound();
    outcome.assert_attributed();
    assert!(
        through(0) > 0 && through(1) > 0,
        "nothing went through PgBouncer"
    );
    assert!(
        failed.is_empty(),
        "calls through PgBouncer failed: {failed:?}"
    );
    assert_eq!(db.advisory_locks().await, 0);
}
