//! Fencing tokens after one backend crashes: `kill -9` of a single backend
//! (as a segfault or the OOM killer would end it) makes the postmaster end
//! every other backend and run crash recovery without restarting, so its
//! start time stays the same. WAL that was not flushed is lost, a logged
//! token counter (PostgreSQL 14) falls back, and the token issued after the
//! recovery must still exceed every token issued before it.
//!
//! Runs on the machine's newest PostgreSQL, or on the binaries in
//! `$DISTLOCK_PG_BIN` (`.ci/pg-install 14` prints such a directory).

use crate::common;

use std::time::{Duration, Instant};

use common::cluster::Cluster;
use distlock::PgLocker;
use sqlx::{ConnectOptions, PgPool};

/// Commits are asynchronous and the WAL writer waits long, so the last
/// counter advance is still in shared memory when the backends die.
const LOSSY: &[&str] = &[
    "synchronous_commit = off",
    "wal_writer_delay = 10000ms",
    "wal_writer_flush_after = 0",
];

async fn fenced(pool: &PgPool) -> PgLocker {
    distlock::migrate(pool).await.expect("migrate");
    PgLocker::builder(pool.clone())
        .fencing(true)
        .build()
        .expect("valid settings")
}

/// Takes and releases `key` once; its token.
async fn one(locker: &PgLocker, key: &str) -> i64 {
    let lock = locker.try_lock(key).await.expect("try_lock").expect("free");
    let token = lock.fencing_token().expect("fenced").value();
    lock.release().await.expect("release");
    token
}

/// How often the server has reinitialised after a crashed backend so far.
fn recoveries(cluster: &Cluster) -> usize {
    cluster
        .log()
        .matches("all server processes terminated; reinitializing")
        .count()
}

/// Waits until the server has gone through its `n`th crash recovery and
/// accepts connections again; the postmaster's start time then.
async fn await_recovery(cluster: &Cluster, n: usize) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if recoveries(cluster) >= n
            && let Ok(mut conn) = cluster.options().connect().await
            && let Ok(started) =
                sqlx::query_scalar::<_, String>("SELECT pg_postmaster_start_time()::text")
                    .fetch_one(&mut conn)
                    .await
        {
            return started;
        }
        assert!(
            Instant::now() < deadline,
            "no crash recovery {n} within 60 s:\n{}",
            cluster.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn tokens_after_a_backend_crash_exceed_every_earlier_token() {
    common::init_tracing();
    let cluster = Cluster::primary("backend-crash", LOSSY).await;
    let pool = cluster.pool().await;
    let version: String = sqlx::query_scalar("SELECT version()")
        .fetch_one(&pool)
        .await
        .expect("version");
    pool.close().await;
    println!("{version}");
    for round in 1..=3 {
        let pool = cluster.pool().await;
        let locker = fenced(&pool).await;
        let mut before = 0;
        for i in 0..80 {
            let token = one(&locker, &format!("job:{}", i % 7)).await;
            assert!(token > before, "token {token:#x} after {before:#x}");
            before = token;
        }
        let started: String = sqlx::query_scalar("SELECT pg_postmaster_start_time()::text")
            .fetch_one(&pool)
            .await
            .expect("start time");
        // An idle backend of its own, killed as the OOM killer would.
        let mut idle = cluster.options().connect().await.expect("connect");
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut idle)
            .await
            .expect("pid");
        pool.close().await;
        cluster.kill_backend(pid);
        let restarted = Instant::now();
        let started_after = await_recovery(&cluster, round).await;
        drop(idle);
        // The case under test: recovery without a postmaster restart.
        assert_eq!(
            started_after, started,
            "the postmaster restarted; this test needs it to stay up"
        );

        let pool = cluster.pool().await;
        let locker = fenced(&pool).await;
        let after = one(&locker, "job:0").await;
        pool.close().await;
        println!(
            "round {round}: last token {before:#x} before the backend crash, first {after:#x} \
             after it (recovered in {:?})",
            restarted.elapsed()
        );
        assert!(
            after > before,
            "round {round}: token {after:#x} after a backend crash, {before:#x} before it"
        );
    }
}
