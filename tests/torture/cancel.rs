//! Cancellation sweeps: each call is dropped after its first Pending, then
//! after its second, and so on until it completes, so every `.await` it
//! passes is a cancellation point at least once. After each drop, nothing
//! may be left behind: no advisory lock (granted or awaited), no session
//! idle in a transaction, and the locker keeps working.

use std::time::{Duration, Instant};

use distlock::{Error, PgLocker};
use sqlx::Connection;
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions};

use super::db::TestDb;
use super::{scale, scenario};

const APP: &str = "torture-cancel";
const KEY: &str = "torture:cancel";
/// No call here passes anywhere near this many Pendings.
const MAX_PENDINGS: usize = 500;
/// How long the server may take to free what a dropped call held (it
/// notices a closed socket within `client_connection_check_interval`).
const SETTLE: Duration = Duration::from_secs(5);

#[path = "../common/drop_after.rs"]
mod drop_after;
use drop_after::drop_after;

struct Bench {
    db: TestDb,
    pool: PgPool,
    observer: PgConnection,
    observer_pid: i32,
    /// Longest wait for the server to free what a dropped call held.
    worst_settle: Duration,
    cancelled: usize,
    /// Times the key was found busy although nothing held it when the
    /// previous step settled: a dropped call's statement, already on its
    /// way, took the lock on the server just after the drop, on a session
    /// that is closing (the lock dies with it a moment later).
    transient: usize,
}

impl Bench {
    async fn new(name: &str) -> Self {
        let db = TestDb::create(name).await;
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(db.options().application_name(APP))
            .await
            .expect("pool");
        let mut observer = db.connect("distlock-torture-observer").await;
        let observer_pid = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut observer)
            .await
            .expect("pid");
        Self {
            db,
            pool,
            observer,
            observer_pid,
            worst_settle: Duration::ZERO,
            cancelled: 0,
            transient: 0,
        }
    }

    fn lockers(&self) -> [(&'static str, PgLocker); 2] {
        [
            ("dedicated", PgLocker::new(self.pool.clone())),
            (
                "multiplexed",
                PgLocker::builder(self.pool.clone())
                    .multiplex(2)
                    .build()
                    .expect("valid settings"),
            ),
        ]
    }

    /// Waits until nothing the calls under test took is left, and checks
    /// that the locker still works; panics after [`SETTLE`].
    async fn settle(&mut self, locker: &PgLocker, what: &str) {
        let started = Instant::now();
        loop {
            let (locks, idle_in_tx): (i64, i64) = sqlx::query_as(
                "SELECT (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid <> $1 \
                   AND database = (SELECT oid FROM pg_database WHERE datname = current_database())), \
                 (SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                   AND application_name = $2 AND state LIKE 'idle in transaction%')",
            )
            .bind(self.observer_pid)
            .bind(APP)
            .fetch_one(&mut self.observer)
            .await
            .expect("leak check");
            if locks == 0 && idle_in_tx == 0 {
                break;
            }
            assert!(
                started.elapsed() < SETTLE,
                "{what}: {locks} advisory locks and {idle_in_tx} sessions idle in a transaction left after {SETTLE:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.worst_settle = self.worst_settle.max(started.elapsed());
        // The pool hands out healthy connections, and the key is free (after
        // a transient hold, see `transient`).
        let deadline = Instant::now() + SETTLE;
        loop {
            let probe = locker.with_advisory_lock(KEY, async |conn| {
                sqlx::query("SELECT 1").execute(conn).await?;
                Ok::<_, Error>(())
            });
            match tokio::time::timeout(SETTLE, probe).await {
                Ok(Ok(Some(()))) => break,
                Ok(Ok(None)) if Instant::now() < deadline => {
                    self.transient += 1;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                other => panic!("{what}: locker unusable afterwards: {other:?}"),
            }
        }
    }

    /// A session lock on `KEY`, which must be free (after a transient hold).
    async fn take(&mut self, locker: &PgLocker) -> distlock::SessionLock {
        let deadline = Instant::now() + SETTLE;
        loop {
            match locker.try_lock(KEY).await {
                Ok(Some(lock)) => return lock,
                Ok(None) if Instant::now() < deadline => {
                    self.transient += 1;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                other => panic!("try_lock on a free key: {other:?}"),
            }
        }
    }

    /// Takes `KEY` on a connection of its own and lets go after `hold`.
    async fn hold_then_release(&mut self, hold: Duration) -> tokio::task::JoinHandle<()> {
        let mut conn = self.db.connect("distlock-torture-holder").await;
        let deadline = Instant::now() + SETTLE;
        loop {
            let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtext($1))")
                .bind(KEY)
                .fetch_one(&mut conn)
                .await
                .expect("holder lock");
            if locked {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the key must be free before a step"
            );
            self.transient += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::spawn(async move {
            tokio::time::sleep(hold).await;
            let _ = conn.close().await;
        })
    }
}

/// Runs `step(k)` for k = 0, 1, ... until it reports completion; returns
/// how many Pendings the call passed.
async fn sweep(what: &str, mut step: impl AsyncFnMut(usize) -> bool) -> usize {
    for k in 0..MAX_PENDINGS {
        if step(k).await {
            return k;
        }
    }
    panic!("{what}: still pending after {MAX_PENDINGS} polls");
}

fn report(op: &str, rounds: usize, points: &[(&str, usize)], bench: &Bench) {
    let mut by_locker: std::collections::BTreeMap<&str, (usize, usize)> = Default::default();
    for &(locker, n) in points {
        let range = by_locker.entry(locker).or_insert((usize::MAX, 0));
        *range = (range.0.min(n), range.1.max(n));
    }
    let ranges: Vec<String> = by_locker
        .iter()
        .map(|(locker, (lo, hi))| format!("{locker} {lo}-{hi}"))
        .collect();
    println!(
        "  {op}: {rounds} sweep(s) per locker; Pendings before completion: {}; so far {} drops, 0 leaks, worst settle {:?}, {} transient holds",
        ranges.join(", "),
        bench.cancelled,
        bench.worst_settle,
        bench.transient
    );
}

#[test]
fn cancellation_sweep_try_lock_and_release() {
    scenario(async {
        let mut bench = Bench::new("cancel_try").await;
        let rounds = scale::pick(2, 25);
        println!("=== torture: cancellation sweep, try_lock and release ===");
        let mut try_points = Vec::new();
        let mut release_points = Vec::new();
        for (name, locker) in bench.lockers() {
            for _ in 0..rounds {
                let n = sweep("try_lock", async |k| {
                    let done = match drop_after(k, locker.try_lock(KEY)).await {
                        Some(Ok(Some(lock))) => {
                            lock.release().await.expect("release");
                            true
                        }
                        Some(Ok(None)) => {
                            bench.transient += 1;
                            false
                        }
                        Some(Err(err)) => panic!("try_lock: {err}"),
                        None => {
                            bench.cancelled += 1;
                            false
                        }
                    };
                    bench
                        .settle(&locker, &format!("{name} try_lock dropped after {k}"))
                        .await;
                    done
                })
                .await;
                try_points.push((name, n));

                // A release future dropped before its first poll.
                let lock = bench.take(&locker).await;
                drop(lock.release());
                bench.cancelled += 1;
                bench
                    .settle(&locker, &format!("{name} release never polled"))
                    .await;

                let n = sweep("release", async |k| {
                    let lock = bench.take(&locker).await;
                    let done = match drop_after(k, lock.release()).await {
                        Some(result) => {
                            result.expect("release");
                            true
                        }
                        None => {
                            bench.cancelled += 1;
                            false
                        }
                    };
                    bench
                        .settle(&locker, &format!("{name} release dropped after {k}"))
                        .await;
                    done
                })
                .await;
                release_points.push((name, n));
            }
        }
        report("try_lock", rounds, &try_points, &bench);
        report("release", rounds, &release_points, &bench);
        assert!(bench.cancelled > 0);
    });
}

#[test]
fn cancellation_sweep_lock_while_waiting() {
    scenario(async {
        let mut bench = Bench::new("cancel_lock").await;
        let rounds = scale::pick(1, 10);
        println!("=== torture: cancellation sweep, lock (waiting) ===");
        let mut points = Vec::new();
        for (name, locker) in bench.lockers() {
            for _ in 0..rounds {
                let n = sweep("lock", async |k| {
                    let holder = bench.hold_then_release(Duration::from_millis(100)).await;
                    let call = locker.lock(KEY, Duration::from_secs(5));
                    let done = match drop_after(k, call).await {
                        Some(Ok(lock)) => {
                            lock.release().await.expect("release");
                            true
                        }
                        Some(Err(err)) => panic!("lock: {err}"),
                        None => {
                            bench.cancelled += 1;
                            false
                        }
                    };
                    holder.await.expect("holder");
                    bench
                        .settle(&locker, &format!("{name} lock dropped after {k}"))
                        .await;
                    done
                })
                .await;
                points.push((name, n));
            }
        }
        report("lock", rounds, &points, &bench);
        assert!(bench.cancelled > 0);
    });
}

#[test]
fn cancellation_sweep_with_advisory_lock() {
    scenario(async {
        let mut bench = Bench::new("cancel_xact").await;
        sqlx::query("CREATE TABLE effects (k int)")
            .execute(&bench.pool)
            .await
            .expect("table");
        let rounds = scale::pick(2, 25);
        println!("=== torture: cancellation sweep, with_advisory_lock (try and wait) ===");
        let locker = PgLocker::new(bench.pool.clone());
        let mut try_points = Vec::new();
        let mut wait_points = Vec::new();
        let work = async |conn: &mut PgConnection, k: usize| {
            sqlx::query("SELECT pg_sleep(0.005)")
                .execute(&mut *conn)
                .await?;
            tokio::time::sleep(Duration::from_millis(5)).await;
            sqlx::query("INSERT INTO effects VALUES ($1)")
                .bind(i32::try_from(k).expect("k"))
                .execute(&mut *conn)
                .await?;
            Ok::<_, Error>(())
        };
        for _ in 0..rounds {
            let n = sweep("with_advisory_lock", async |k| {
                let call = locker.with_advisory_lock(KEY, async |c| work(c, k).await);
                let done = match drop_after(k, call).await {
                    Some(Ok(Some(()))) => true,
                    Some(Ok(None)) => {
                        bench.transient += 1;
                        false
                    }
                    Some(Err(err)) => panic!("with_advisory_lock: {err}"),
                    None => {
                        bench.cancelled += 1;
                        false
                    }
                };
                bench
                    .settle(&locker, &format!("with_advisory_lock dropped after {k}"))
                    .await;
                done
            })
            .await;
            try_points.push(("try", n));
            let n = sweep("with_advisory_lock_wait", async |k| {
                let holder = bench.hold_then_release(Duration::from_millis(100)).await;
                let call = locker.with_advisory_lock_wait(KEY, Duration::from_secs(5), async |c| {
                    work(c, k).await
                });
                let done = match drop_after(k, call).await {
                    Some(Ok(())) => true,
                    Some(Err(err)) => panic!("with_advisory_lock_wait: {err}"),
                    None => {
                        bench.cancelled += 1;
                        false
                    }
                };
                holder.await.expect("holder");
                bench
                    .settle(
                        &locker,
                        &format!("with_advisory_lock_wait dropped after {k}"),
                    )
                    .await;
                done
            })
            .await;
            wait_points.push(("wait", n));
        }
        report("with_advisory_lock", rounds, &try_points, &bench);
        report("with_advisory_lock_wait", rounds, &wait_points, &bench);
        assert!(bench.cancelled > 0);
    });
}
