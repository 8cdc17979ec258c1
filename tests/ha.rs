//! High availability on private clusters: fencing tokens across a crash and
//! a failover, and what holders, waiters and the pool see when the primary
//! goes away.
//!
//! Each test starts its own clusters (see `common::cluster`) on free
//! loopback ports in a scratch directory; the shared server is not touched.

mod common;

use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::proxy::Proxy;
use distlock::{LockKey, PgLocker};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

async fn fenced(pool: &PgPool) -> PgLocker {
    distlock::migrate(pool).await.expect("migrate");
    PgLocker::builder(pool.clone()).fencing(true).build()
}

/// Takes and releases `key` `n` times; the highest token seen.
async fn issue(locker: &PgLocker, key: &str, n: usize) -> i64 {
    let mut last = 0;
    for _ in 0..n {
        let lock = locker.try_lock(key).await.expect("try_lock").expect("free");
        let token = lock.fencing_token().expect("fenced").value();
        assert!(token > last, "token {token} after {last}");
        last = token;
        lock.release().await.expect("release");
    }
    last
}

async fn one_token(cluster: &Cluster, key: &str) -> i64 {
    let pool = cluster.pool().await;
    let token = issue(&fenced(&pool).await, key, 1).await;
    pool.close().await;
    token
}

/// A server that loses unflushed WAL in a crash: commits are asynchronous
/// and the WAL writer waits long, so the last transactions are still in
/// shared memory when the postmaster dies.
const LOSSY: &[&str] = &[
    "synchronous_commit = off",
    "wal_writer_delay = 10000ms",
    "wal_writer_flush_after = 0",
];

#[tokio::test]
async fn tokens_after_a_crash_exceed_every_earlier_token() {
    common::init_tracing();
    let cluster = Cluster::primary("crash", LOSSY).await;
    let pool = cluster.pool().await;
    let locker = fenced(&pool).await;
    let mut before = 0;
    for i in 0..400 {
        before = before.max(issue(&locker, &format!("job:{}", i % 7), 1).await);
    }
    pool.close().await;
    cluster.crash().await;
    cluster.start().await;
    for i in 0..7 {
        let after = one_token(&cluster, &format!("job:{i}")).await;
        assert!(
            after > before,
            "token {after} after the crash, {before} before it"
        );
    }

    // The epoch that began with the first token after the restart was
    // durable: one more crash right after it does not bring it back.
    let first = one_token(&cluster, "job:0").await;
    cluster.crash().await;
    cluster.start().await;
    let next = one_token(&cluster, "job:0").await;
    assert!(
        next > first,
        "token {next} after a second crash, {first} before it"
    );
}

#[tokio::test]
async fn tokens_after_a_failover_to_a_lagging_standby_exceed_every_earlier_token() {
    common::init_tracing();
    let primary = Cluster::primary("failover-primary", LOSSY).await;
    let pool = primary.pool().await;
    let locker = fenced(&pool).await;
    issue(&locker, "invoice", 40).await;
    let standby = Cluster::standby_of(&primary, "failover_standby", &[]).await;
    // The standby has everything so far, then stops while the primary goes on.
    let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_flush_lsn()::text")
        .fetch_one(&pool)
        .await
        .expect("lsn");
    standby
        .wait_until(
            &format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn"),
            Duration::from_secs(30),
        )
        .await;
    standby.stop().await;
    let before = issue(&locker, "invoice", 50).await;
    pool.close().await;
    primary.crash().await;

    standby.start().await;
    standby.promote().await;
    let after = one_token(&standby, "invoice").await;
    assert!(
        after > before,
        "token {after} after the failover, {before} before it"
    );
    let timeline = after >> 48;
    assert_eq!(
        timeline, 2,
        "the promoted server's tokens carry its timeline: {after:#x}"
    );
}

/// A PgLocker whose connections go through `proxy`.
fn locker_via(proxy: &Proxy, cluster: &Cluster) -> (PgPool, PgLocker) {
    let opts: PgConnectOptions = cluster.options().port(proxy.port());
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy_with(opts);
    let locker = PgLocker::builder(pool.clone())
        .fencing(true)
        .heartbeat(Duration::from_millis(300))
        .heartbeat_timeout(Duration::from_millis(700))
        .build();
    (pool, locker)
}

#[tokio::test]
async fn holders_and_waiters_of_a_failed_primary_are_told_and_the_pool_recovers() {
    common::init_tracing();
    let primary = Cluster::primary("told-primary", &[]).await;
    distlock::migrate(&primary.pool().await)
        .await
        .expect("migrate");
    let standby = Cluster::standby_of(&primary, "told_standby", &[]).await;
    let proxy = Proxy::start("127.0.0.1", primary.port())
        .await
        .expect("proxy");
    let (_pool, locker) = locker_via(&proxy, &primary);

    let mut holders = Vec::new();
    for i in 0..4 {
        holders.push(
            locker
                .try_lock(format!("h{i}"))
                .await
                .expect("lock")
                .expect("free"),
        );
    }
    let before = holders
        .iter()
        .filter_map(|h| h.fencing_token())
        .map(|t| t.value())
        .max()
        .expect("tokens");
    let waiters: Vec<_> = (0..2)
        .map(|i| {
            let locker = locker.clone();
            tokio::spawn(async move {
                let r = locker.lock(format!("h{i}"), Duration::from_secs(600)).await;
                (Instant::now(), r.map(|l| l.fencing_token()))
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;

    let failed = Instant::now();
    primary.crash().await;
    let bound = locker.heartbeat() + locker.heartbeat_timeout() + Duration::from_millis(500);
    for holder in &holders {
        tokio::time::timeout(bound, holder.lost())
            .await
            .unwrap_or_else(|_| panic!("holder not told within {bound:?}"));
    }
    for waiter in waiters {
        let (ended, result) = tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .expect("a wait on the failed primary hung")
            .expect("join");
        assert!(
            result.is_err(),
            "a wait on a dead primary succeeded: {result:?}"
        );
        assert!(ended - failed < Duration::from_secs(10));
    }

    // The address now leads to the promoted standby: the same locker works.
    standby.promote().await;
    proxy.set_upstream(standby.port());
    let started = Instant::now();
    let lock = loop {
        if let Ok(Some(lock)) = locker.try_lock(LockKey::from("h0")).await {
            break lock;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the pool did not recover"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let after = lock.fencing_token().expect("fenced").value();
    assert!(
        after > before,
        "token {after} on the new primary, {before} before"
    );
    lock.release().await.expect("release");
}
