//! High availability on private clusters: fencing tokens across a crash and
//! a failover, and what holders, waiters and the pool see when the primary
//! goes away.
//!
//! Each test starts its own clusters (see `common::cluster`) on free
//! loopback ports in a scratch directory; the shared server is not touched.

use crate::common;

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

/// What the workers of a crash-under-load run saw.
#[derive(Default)]
struct Load {
    /// (received at, token) of every session grant.
    tokens: Vec<(Instant, i64)>,
    /// Session writes whose commit was acknowledged: (worker, seq, token).
    acked: Vec<(i32, i32, i64)>,
    /// Transaction-scoped writes whose commit was acknowledged: (worker, seq).
    acked_xact: Vec<(i32, i32)>,
    /// Holders whose critical section failed, and whether `lost()` told them
    /// within heartbeat + deadline.
    told: usize,
    not_told: usize,
}

type Shared = std::sync::Arc<std::sync::Mutex<Load>>;

async fn session_worker(id: i32, cluster_opts: PgConnectOptions, load: Shared, stop: Instant) {
    let pool = PgPoolOptions::new()
        .max_connections(3)
        .acquire_timeout(Duration::from_secs(1))
        .connect_lazy_with(cluster_opts);
    let locker = PgLocker::builder(pool.clone())
        .fencing(true)
        .heartbeat(Duration::from_millis(200))
        .heartbeat_timeout(Duration::from_millis(500))
        .build();
    let bound = locker.heartbeat() + locker.heartbeat_timeout() + Duration::from_millis(500);
    let mut seq = 0;
    while Instant::now() < stop {
        let Ok(lock) = locker.lock("register", Duration::from_secs(1)).await else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let token = lock.fencing_token().expect("fenced");
        load.lock()
            .unwrap()
            .tokens
            .push((Instant::now(), token.value()));
        seq += 1;
        let write = async {
            let mut tx = pool.begin().await?;
            distlock::fence::check(&mut tx, "register", token).await?;
            sqlx::query("INSERT INTO writes (worker, seq, token) VALUES ($1, $2, $3)")
                .bind(id)
                .bind(seq)
                .bind(token.value())
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok::<_, distlock::Error>(())
        };
        match write.await {
            Ok(()) => {
                load.lock().unwrap().acked.push((id, seq, token.value()));
                let _ = lock.release().await;
            }
            Err(_) => {
                let told = tokio::time::timeout(bound, lock.lost()).await.is_ok();
                let mut load = load.lock().unwrap();
                if told {
                    load.told += 1;
                } else {
                    load.not_told += 1;
                }
            }
        }
    }
    pool.close().await;
}

async fn xact_worker(id: i32, cluster_opts: PgConnectOptions, load: Shared, stop: Instant) {
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(1))
        .connect_lazy_with(cluster_opts);
    let locker = PgLocker::new(pool.clone());
    let mut seq = 0;
    while Instant::now() < stop {
        seq += 1;
        let done = locker
            .with_advisory_lock("register-xact", async |conn| {
                sqlx::query("INSERT INTO xact_writes (worker, seq) VALUES ($1, $2)")
                    .bind(id)
                    .bind(seq)
                    .execute(conn)
                    .await?;
                Ok::<_, distlock::Error>(())
            })
            .await;
        match done {
            Ok(Some(())) => load.lock().unwrap().acked_xact.push((id, seq)),
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    pool.close().await;
}

/// Fenced session workers and transaction-scoped workers run while the
/// server crashes `crashes` times. Returns the acknowledged writes that
/// were lost.
async fn crash_under_load(conf: &[&str], crashes: usize) -> usize {
    common::init_tracing();
    let cluster = Cluster::primary("load", conf).await;
    let admin = cluster.pool().await;
    distlock::migrate(&admin).await.expect("migrate");
    sqlx::raw_sql(
        "CREATE TABLE writes (worker int, seq int, token bigint, PRIMARY KEY (worker, seq));
         CREATE TABLE xact_writes (worker int, seq int, PRIMARY KEY (worker, seq));",
    )
    .execute(&admin)
    .await
    .expect("tables");
    admin.close().await;

    let load = Shared::default();
    let stop = Instant::now() + Duration::from_secs(3 * crashes as u64 + 2);
    let mut workers = Vec::new();
    for id in 0..4 {
        workers.push(tokio::spawn(session_worker(
            id,
            cluster.options(),
            load.clone(),
            stop,
        )));
    }
    for id in 0..2 {
        workers.push(tokio::spawn(xact_worker(
            id,
            cluster.options(),
            load.clone(),
            stop,
        )));
    }
    let mut restarts = Vec::new();
    for _ in 0..crashes {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        cluster.crash().await;
        cluster.start().await;
        restarts.push(Instant::now());
    }
    for worker in workers {
        worker.await.expect("worker");
    }

    let load = std::mem::take(&mut *load.lock().unwrap());
    // Tokens: every token received after a restart exceeds every token
    // received before it (the server was down in between, so those were all
    // issued before the crash).
    for (i, restart) in restarts.iter().enumerate() {
        let before = load
            .tokens
            .iter()
            .filter(|(at, _)| at < restart)
            .map(|t| t.1)
            .max();
        let after = load
            .tokens
            .iter()
            .filter(|(at, _)| at > restart)
            .map(|t| t.1)
            .min();
        if let (Some(before), Some(after)) = (before, after) {
            assert!(
                after > before,
                "crash {i}: token {after} after, {before} before"
            );
        } else {
            panic!("crash {i}: no tokens on one side ({before:?}, {after:?})");
        }
    }
    let mut tokens: Vec<i64> = load.tokens.iter().map(|t| t.1).collect();
    let issued = tokens.len();
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), issued, "a token was issued twice");
    assert_eq!(
        load.not_told, 0,
        "holders not told of their loss (told: {})",
        load.told
    );

    // The pool recovered: work was acknowledged after the last restart.
    let last = *restarts.last().expect("a crash");
    assert!(
        load.tokens.iter().any(|(at, _)| *at > last),
        "no session grant after the last restart"
    );

    let check = cluster.pool().await;
    let stored: Vec<(i32, i32)> = sqlx::query_as("SELECT worker, seq FROM writes")
        .fetch_all(&check)
        .await
        .expect("writes");
    let stored_x: Vec<(i32, i32)> = sqlx::query_as("SELECT worker, seq FROM xact_writes")
        .fetch_all(&check)
        .await
        .expect("xact writes");
    let lost = load
        .acked
        .iter()
        .filter(|(w, s, _)| !stored.contains(&(*w, *s)))
        .count()
        + load
            .acked_xact
            .iter()
            .filter(|k| !stored_x.contains(k))
            .count();
    println!(
        "{crashes} crashes: {issued} session grants, {} + {} acknowledged writes, {lost} lost, \
         {} holders told of their loss",
        load.acked.len(),
        load.acked_xact.len(),
        load.told
    );
    lost
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_under_load_keeps_tokens_increasing_and_acknowledged_writes() {
    let lost = crash_under_load(&[], 2).await;
    assert_eq!(
        lost, 0,
        "acknowledged writes lost with synchronous_commit on"
    );
}

/// With `synchronous_commit = off` acknowledged writes may be lost (that is
/// what the setting trades), but tokens still never repeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_under_load_with_asynchronous_commit_keeps_tokens_increasing() {
    crash_under_load(LOSSY, 2).await;
}

/// With a synchronous standby, a `TableLocker` lease survives a failover:
/// the holder's next renewal reaches the promoted server and succeeds, the
/// lease is never lost, and nobody else is granted it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_lease_survives_a_synchronous_failover() {
    common::init_tracing();
    let primary = Cluster::primary("lease-primary", &[]).await;
    distlock::migrate(&primary.pool().await)
        .await
        .expect("migrate");
    let standby = Cluster::standby_of(&primary, "lease_standby", &[]).await;
    // Synchronous from now on: every commit waits until the standby applied it.
    primary
        .reconfigure(&[
            "synchronous_standby_names = 'lease_standby'",
            "synchronous_commit = remote_apply",
        ])
        .await;
    primary
        .wait_until(
            "SELECT sync_state = 'sync' FROM pg_stat_replication \
             WHERE application_name = 'lease_standby'",
            Duration::from_secs(30),
        )
        .await;
    let proxy = Proxy::start("127.0.0.1", primary.port())
        .await
        .expect("proxy");
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy_with(primary.options().port(proxy.port()));
    let ttl = Duration::from_secs(6);
    let locker = distlock::TableLocker::builder(pool)
        .ttl(ttl)
        .listen(false)
        .build();
    let lease = locker.try_lock("lease").await.expect("try").expect("free");
    let token = lease.fencing_token().expect("token").value();

    let failover = Instant::now();
    primary.crash().await;
    standby.promote().await;
    proxy.set_upstream(standby.port());
    println!("failover took {:?}", failover.elapsed());

    // Past the deadline the holder would have given up at without a
    // renewal, and past the TTL itself.
    tokio::time::sleep(ttl + ttl / 2).await;
    assert!(!lease.is_lost(), "the lease was lost across the failover");
    let renewed_after: bool =
        sqlx::query_scalar("SELECT renewed_at > now() - interval '5 seconds' FROM distlock.leases")
            .fetch_one(&standby.pool().await)
            .await
            .expect("lease row on the new primary");
    assert!(
        renewed_after,
        "the lease was not renewed on the promoted server"
    );
    let other = distlock::TableLocker::builder(standby.pool().await)
        .listen(false)
        .build();
    assert!(
        other.try_lock("lease").await.expect("try").is_none(),
        "someone else was granted a lease that is held"
    );
    lease.release().await.expect("release");
    let next = other.try_lock("lease").await.expect("try").expect("free");
    assert!(next.fencing_token().expect("token").value() > token);
    next.release().await.expect("release");
}
