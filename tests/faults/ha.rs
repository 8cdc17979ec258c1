//! High availability on private clusters: fencing tokens across a crash and
//! a failover, what holders, waiters and the pool see when the primary goes
//! away, and a split brain (the old primary still running after a
//! promotion).
//!
//! Each test starts its own clusters (see `common::cluster`) on free
//! loopback ports in a scratch directory. Only the split-brain test uses the
//! shared server: a database of its own (`#[sqlx::test]`) holds the fenced
//! register that lives on neither side of the split.

use crate::common;

use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::proxy::Proxy;
use distlock::{LockKey, PgLocker};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

async fn fenced(pool: &PgPool) -> PgLocker {
    distlock::migrate(pool).await.expect("migrate");
    PgLocker::builder(pool.clone())
        .fencing(true)
        .build()
        .expect("valid settings")
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

/// Primary P and two standbys S1 and S2 of P, both caught up with `issued`
/// tokens of P; then P dies, S1 is promoted and issues 50 tokens, S1 dies
/// and S2, which never followed S1, is promoted. Returns S1's highest token
/// and S2's first one. `standby_conf` is given to both standbys.
async fn two_failovers(name: &str, primary_conf: &[&str], standby_conf: &[&str]) -> (i64, i64) {
    common::init_tracing();
    let primary = Cluster::primary(&format!("{name}-p"), primary_conf).await;
    let pool = primary.pool().await;
    let locker = fenced(&pool).await;
    issue(&locker, "invoice", 40).await;
    let s1 = Cluster::standby_of(&primary, &format!("{name}_s1"), standby_conf).await;
    let s2 = Cluster::standby_of(&primary, &format!("{name}_s2"), standby_conf).await;
    issue(&locker, "invoice", 10).await;
    let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_flush_lsn()::text")
        .fetch_one(&pool)
        .await
        .expect("lsn");
    for standby in [&s1, &s2] {
        standby
            .wait_until(
                &format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn"),
                Duration::from_secs(30),
            )
            .await;
    }
    pool.close().await;
    primary.crash().await;

    s1.promote().await;
    let pool = s1.pool().await;
    let before = issue(&fenced(&pool).await, "invoice", 50).await;
    pool.close().await;
    // Long enough for S1's archiver (where there is one) to copy the new
    // timeline's history file.
    tokio::time::sleep(Duration::from_secs(2)).await;
    s1.crash().await;

    s2.promote().await;
    let after = one_token(&s2, "invoice").await;
    println!(
        "{name}: S1 (timeline {}) issued up to {before:#x}; S2's first token {after:#x} \
         (timeline {})",
        before >> 48,
        after >> 48
    );
    (before, after)
}

/// Two promotions to standbys that never followed each other both pick
/// timeline 2 when neither can see the other's history file: the second
/// promoted server issues tokens the first already issued. This is a limit
/// RELIABILITY.md states ("Where a guarantee cannot hold"); the test keeps
/// the statement true (it fails if that ever changes).
#[tokio::test]
async fn two_failovers_to_unrelated_standbys_share_a_timeline_and_can_repeat_tokens() {
    let (before, after) = two_failovers("twofo", LOSSY, &[]).await;
    assert_eq!(
        (before >> 48, after >> 48),
        (2, 2),
        "both promoted servers are on timeline 2"
    );
    assert!(
        after <= before,
        "the second promotion's token {after:#x} exceeds the first's {before:#x}: the \
         limit in RELIABILITY.md no longer holds as written"
    );
}

/// The remedy RELIABILITY.md names: a WAL archive both standbys restore
/// from. The first promoted server archives its timeline's history file; the
/// second finds it when it is promoted and moves to timeline 3, whose epochs
/// are above every epoch of timeline 2.
#[tokio::test]
async fn two_failovers_with_a_shared_archive_keep_tokens_increasing() {
    let archive = common::cluster::scratch("twofo-archive");
    let archive_command = format!("archive_command = 'cp %p {}/%f'", archive.display());
    let restore_command = format!("restore_command = 'cp {}/%f %p'", archive.display());
    let mut primary_conf = LOSSY.to_vec();
    primary_conf.extend(["archive_mode = on", archive_command.as_str()]);
    let standby_conf = ["archive_mode = on", &archive_command, &restore_command];
    let (before, after) = two_failovers("twofo-arch", &primary_conf, &standby_conf).await;
    let _ = std::fs::remove_dir_all(&archive);
    assert_eq!(
        after >> 48,
        3,
        "the second promotion moves past the first one's timeline: {after:#x}"
    );
    assert!(
        after > before,
        "token {after:#x} after the second failover, {before:#x} before it"
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
        .build()
        .expect("valid settings");
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

/// Set when the workers of a crash-under-load run are to stop.
type Stop = std::sync::Arc<std::sync::atomic::AtomicBool>;

async fn session_worker(id: i32, cluster_opts: PgConnectOptions, load: Shared, stop: Stop) {
    let pool = PgPoolOptions::new()
        .max_connections(3)
        .acquire_timeout(Duration::from_secs(1))
        .connect_lazy_with(cluster_opts);
    let locker = PgLocker::builder(pool.clone())
        .fencing(true)
        .heartbeat(Duration::from_millis(200))
        .heartbeat_timeout(Duration::from_millis(500))
        .build()
        .expect("valid settings");
    let bound = locker.heartbeat() + locker.heartbeat_timeout() + Duration::from_millis(500);
    let mut seq = 0;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
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

async fn xact_worker(id: i32, cluster_opts: PgConnectOptions, load: Shared, stop: Stop) {
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(1))
        .connect_lazy_with(cluster_opts);
    let locker = PgLocker::new(pool.clone());
    let mut seq = 0;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
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
    let stop = Stop::default();
    let mut workers = Vec::new();
    for id in 0..4 {
        workers.push(tokio::spawn(session_worker(
            id,
            cluster.options(),
            load.clone(),
            stop.clone(),
        )));
    }
    for id in 0..2 {
        workers.push(tokio::spawn(xact_worker(
            id,
            cluster.options(),
            load.clone(),
            stop.clone(),
        )));
    }
    let mut restarts = Vec::new();
    for i in 0..crashes {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let crashed = Instant::now();
        cluster.crash().await;
        cluster.start().await;
        restarts.push(Instant::now());
        println!(
            "crash {i}: the server was back after {:?}",
            crashed.elapsed()
        );
    }
    // Room after the last restart for every worker to be told of its lost
    // lock (up to 1.2 s) and take new ones, also when the fault tests run in
    // parallel on two cores (2 s was once not enough there). Counted from
    // the last restart, not from the start of the run: a crash and restart
    // took 0.8-5.5 s here (measured on 14, 15 and 18), and a fixed window of
    // the whole run left no grant after the last restart on 18 twice in a
    // row.
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
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
    let locker = distlock::postgres::TableLocker::builder(pool)
        .ttl(ttl)
        .listen(false)
        .build()
        .expect("valid settings");
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
    let other = distlock::postgres::TableLocker::builder(standby.pool().await)
        .listen(false)
        .build()
        .expect("valid settings");
    assert!(
        other.try_lock("lease").await.expect("try").is_none(),
        "someone else was granted a lease that is held"
    );
    lease.release().await.expect("release");
    let next = other.try_lock("lease").await.expect("try").expect("free");
    assert!(next.fencing_token().expect("token").value() > token);
    next.release().await.expect("release");
}

/// One critical section of a split-brain worker.
#[derive(Debug, Clone)]
struct Section {
    worker: usize,
    /// Connects to the old primary's address directly.
    stale: bool,
    seq: i32,
    key: usize,
    token: i64,
    acquired: Instant,
    /// When release was called; `clean`: the server confirmed the unlock on
    /// the backend that took the lock, so it held the lock from before
    /// `acquired` to after `releasing`.
    releasing: Instant,
    clean: bool,
    /// The write to the lock server itself: (seq, timeline of the server
    /// that acknowledged it, when the acknowledgement arrived).
    local: Option<(i32, i64, Instant)>,
    /// The fenced write in the third place: begun at, and its outcome with
    /// the time the outcome arrived.
    fence_began: Instant,
    fence: Fenced,
    fence_ended: Instant,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fenced {
    Accepted,
    Refused,
    Failed,
}

const SPLIT_KEYS: usize = 2;

/// The timeline a token was issued on (its top 16 bits, see the epoch
/// migration).
fn timeline_of(token: i64) -> i64 {
    token >> 48
}

/// Takes locks on `SPLIT_KEYS` keys through `pool`; in each critical
/// section writes a row to the lock server itself and a fenced row to the
/// register in `register` (a database neither side of the split lives in).
async fn split_worker(
    worker: usize,
    stale: bool,
    pool: PgPool,
    register: PgPool,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Vec<Section> {
    use std::sync::atomic::Ordering;
    let locker = PgLocker::builder(pool.clone())
        .fencing(true)
        .heartbeat(Duration::from_millis(300))
        .heartbeat_timeout(Duration::from_millis(700))
        .release_timeout(Duration::from_secs(2))
        .build()
        .expect("valid settings");
    let mut sections = Vec::new();
    let mut seq = 0i32;
    while !stop.load(Ordering::Relaxed) {
        seq += 1;
        let key = (worker + usize::try_from(seq).unwrap_or(0)) % SPLIT_KEYS;
        let Ok(lock) = locker
            .lock(format!("split:{key}"), Duration::from_secs(1))
            .await
        else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let acquired = Instant::now();
        let token = lock.fencing_token().expect("fenced");
        let local = tokio::time::timeout(
            Duration::from_secs(2),
            sqlx::query_scalar::<_, i64>(
                "INSERT INTO local_writes (worker, seq) VALUES ($1, $2) \
                 RETURNING distlock.current_timeline()",
            )
            .bind(i32::try_from(worker).expect("worker"))
            .bind(seq)
            .fetch_one(&pool),
        )
        .await;
        let local = match local {
            Ok(Ok(timeline)) => Some((seq, timeline, Instant::now())),
            _ => None,
        };
        tokio::time::sleep(Duration::from_millis(
            10 + u64::from(seq.unsigned_abs() % 5) * 10,
        ))
        .await;
        let fence_began = Instant::now();
        let write = async {
            let mut tx = register.begin().await?;
            distlock::fence::check(&mut tx, &format!("reg:{key}"), token).await?;
            sqlx::query(
                "INSERT INTO split_writes (key, worker, seq, token, stale) \
                 VALUES ($1, $2, $3, $4, $5)",
            )
            .bind(i32::try_from(key).expect("key"))
            .bind(i32::try_from(worker).expect("worker"))
            .bind(seq)
            .bind(token.value())
            .bind(stale)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            Ok::<_, distlock::Error>(())
        };
        let fence = match write.await {
            Ok(()) => Fenced::Accepted,
            Err(distlock::Error::StaleFencingToken { .. }) => Fenced::Refused,
            Err(_) => Fenced::Failed,
        };
        let fence_ended = Instant::now();
        let releasing = Instant::now();
        let clean = lock.release().await.is_ok();
        sections.push(Section {
            worker,
            stale,
            seq,
            key,
            token: token.value(),
            acquired,
            releasing,
            clean,
            local,
            fence_began,
            fence,
            fence_ended,
        });
    }
    pool.close().await;
    sections
}

/// Takes and releases locks on keys nobody else uses, as fast as it can
/// (with a pause of 2 ms); the number of tokens drawn.
async fn busy_client(pool: PgPool, stop: std::sync::Arc<std::sync::atomic::AtomicBool>) -> usize {
    let locker = PgLocker::builder(pool.clone())
        .fencing(true)
        .build()
        .expect("valid settings");
    let mut drawn = 0;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        if let Ok(Some(lock)) = locker.try_lock(format!("busy:{}", drawn % 4)).await {
            drawn += 1;
            let _ = lock.release().await;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    pool.close().await;
    drawn
}

/// Split brain: the standby is promoted while the old primary keeps
/// running (and is even restarted by its supervisor later). Workers behind
/// the proxy move to the new primary; stale workers keep using the old
/// primary's address. Advisory locks are per server, so the same key is
/// granted on both sides at once; what keeps the protected resource safe is
/// the fence: every token of the promoted server (timeline 2) exceeds every
/// token the old primary (timeline 1) ever issues, so once the register has
/// seen a new-side token it refuses every old-side write.
#[sqlx::test(migrations = false)]
async fn split_brain_double_grants_are_fenced_off_by_the_timeline(register: PgPool) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    common::init_tracing();
    distlock::migrate(&register)
        .await
        .expect("migrate register");
    sqlx::query(
        "CREATE TABLE split_writes (id bigserial PRIMARY KEY, key int NOT NULL, \
         worker int NOT NULL, seq int NOT NULL, token bigint NOT NULL, stale bool NOT NULL)",
    )
    .execute(&register)
    .await
    .expect("register table");

    let primary = Cluster::primary("split-primary", &[]).await;
    let admin = primary.pool().await;
    distlock::migrate(&admin).await.expect("migrate");
    sqlx::query("CREATE TABLE local_writes (worker int, seq int, PRIMARY KEY (worker, seq))")
        .execute(&admin)
        .await
        .expect("local table");
    admin.close().await;
    let standby = Cluster::standby_of(&primary, "split_standby", &[]).await;
    let proxy = Proxy::start("127.0.0.1", primary.port())
        .await
        .expect("proxy");

    let stop = Arc::new(AtomicBool::new(false));
    let pool_to = |port: u16| {
        PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(2))
            .connect_lazy_with(primary.options().port(port))
    };
    let mut workers = Vec::new();
    // Workers 0..3 behind the proxy, 3..5 on the old primary's address.
    for worker in 0..5 {
        let stale = worker >= 3;
        let port = if stale { primary.port() } else { proxy.port() };
        workers.push(tokio::spawn(split_worker(
            worker,
            stale,
            pool_to(port),
            register.clone(),
            stop.clone(),
        )));
    }
    // Other clients of the old primary keep taking locks on keys of their
    // own: its counter runs ahead of the new primary's.
    let busy = tokio::spawn(busy_client(pool_to(primary.port()), stop.clone()));
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Promotion with the old primary still up; the address behind the proxy
    // moves, and the connections it carried are cut.
    let promoting = Instant::now();
    standby.promote().await;
    proxy.set_upstream(standby.port());
    proxy.cut();
    let promoted = Instant::now();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    // The old primary's supervisor restarts it after a crash: it comes back
    // as a primary of timeline 1, in a new epoch.
    primary.crash().await;
    primary.start().await;
    let restarted = Instant::now();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    stop.store(true, Ordering::Relaxed);
    let mut sections = Vec::new();
    for worker in workers {
        sections.extend(worker.await.expect("worker"));
    }
    let busy = busy.await.expect("busy client");

    // Which server granted each section, from where its connection led: the
    // stale workers' always to the old primary, the proxied ones' to the old
    // primary until the switch and to the new one after it. A proxied grant
    // heard just after the switch may still be the old primary's answer
    // (read from the socket after the cut): those are left out.
    let ambiguous = promoted + Duration::from_millis(500);
    let side = |s: &Section| match (s.stale, s.acquired) {
        (true, _) => Some(false),
        (false, at) if at < promoted => Some(false),
        (false, at) if at < ambiguous => None,
        (false, _) => Some(true),
    };
    let old: Vec<&Section> = sections.iter().filter(|s| side(s) == Some(false)).collect();
    let new: Vec<&Section> = sections.iter().filter(|s| side(s) == Some(true)).collect();
    let unclassified = sections.len() - old.len() - new.len();

    // Token order: every token of the promoted server above every token the
    // old primary issued, before the promotion, after it, and after its own
    // restart.
    let old_max = old.iter().map(|s| s.token).max().expect("old-side tokens");
    let new_min = new.iter().map(|s| s.token).min().expect("new-side tokens");
    let old_after = old.iter().filter(|s| s.acquired > promoted).count();
    let old_after_restart = old.iter().filter(|s| s.acquired > restarted).count();
    assert!(
        old_after_restart > 0,
        "the old primary issued no token after its restart"
    );
    assert!(
        new_min > old_max,
        "new-side token {new_min:#x} not above old-side token {old_max:#x}"
    );
    // Because the timeline is in the high bits.
    assert!(old.iter().all(|s| timeline_of(s.token) == 1));
    assert!(new.iter().all(|s| timeline_of(s.token) == 2));

    // Failover time: promotion call to the first grant through the proxy
    // whose section wrote to the new primary.
    let first_new = sections
        .iter()
        .filter(|s| !s.stale && s.local.is_some_and(|l| l.1 == 2))
        .map(|s| s.acquired)
        .min()
        .expect("a grant through the proxy on the new primary");
    let failover = first_new - promoting;
    assert!(
        failover < Duration::from_secs(30),
        "failover took {failover:?}"
    );

    // Double grants: a key certainly held on both servers at once: two clean
    // sections whose [grant heard, release called] intervals overlap (on one
    // server that never happens, which checks the measure).
    let mut double = 0;
    let mut same_side = 0;
    let known: Vec<&Section> = sections
        .iter()
        .filter(|s| s.clean && side(s).is_some())
        .collect();
    for (i, a) in known.iter().enumerate() {
        for b in known[i + 1..].iter().filter(|s| s.key == a.key) {
            if a.acquired < b.releasing && b.acquired < a.releasing {
                if side(a) == side(b) {
                    same_side += 1;
                } else {
                    double += 1;
                }
            }
        }
    }
    assert_eq!(same_side, 0, "a key granted twice on one server");
    assert!(double > 0, "no key was held on both servers at once");

    // The fence: once a key's register accepted a new-side write, every
    // old-side write begun after that was refused.
    let mut old_refused_after = 0;
    let mut old_accepted_after = Vec::new();
    let mut old_accepted_before = 0;
    for key in 0..SPLIT_KEYS {
        let first = new
            .iter()
            .filter(|s| s.key == key && s.fence == Fenced::Accepted)
            .map(|s| s.fence_ended)
            .min()
            .expect("a new-side write on every key");
        for s in old.iter().filter(|s| s.key == key) {
            match (s.fence, s.fence_began > first) {
                (Fenced::Accepted, true) => old_accepted_after.push(s.token),
                (Fenced::Accepted, false) => old_accepted_before += 1,
                (Fenced::Refused, true) => old_refused_after += 1,
                _ => {}
            }
        }
    }
    assert!(
        old_accepted_after.is_empty(),
        "old-side writes accepted after a new-side write: {old_accepted_after:x?}"
    );
    assert!(
        old_refused_after > 0,
        "no old-side write was attempted after the first new-side write"
    );
    // The same from the register's own log (ids follow the fence row's lock
    // order): no old-side write after the first new-side write of its key.
    let log: Vec<(i32, i32, i32)> =
        sqlx::query_as("SELECT key, worker, seq FROM split_writes ORDER BY id")
            .fetch_all(&register)
            .await
            .expect("register log");
    let side_of = |worker: i32, seq: i32| {
        sections
            .iter()
            .find(|s| i32::try_from(s.worker).ok() == Some(worker) && s.seq == seq)
            .and_then(side)
    };
    let mut seen_new = [false; SPLIT_KEYS];
    let mut late = 0;
    for (key, worker, seq) in log {
        let key = usize::try_from(key).expect("key");
        match side_of(worker, seq) {
            Some(true) => seen_new[key] = true,
            Some(false) if seen_new[key] => late += 1,
            _ => {}
        }
    }
    assert_eq!(
        late, 0,
        "the register logged old-side writes after new-side ones"
    );

    // Acknowledged writes to the lock servers that the promoted server does
    // not have: lost once the old primary is discarded.
    let kept: Vec<(i32, i32)> = sqlx::query_as("SELECT worker, seq FROM local_writes")
        .fetch_all(&standby.pool().await)
        .await
        .expect("local writes");
    let acked: Vec<(usize, i32, i64, Instant)> = sections
        .iter()
        .filter_map(|s| s.local.map(|(seq, tl, at)| (s.worker, seq, tl, at)))
        .collect();
    let lost_of = |timeline: i64, until: Instant| {
        acked
            .iter()
            .filter(|(w, seq, tl, at)| {
                *tl == timeline
                    && *at < until
                    && !kept.contains(&(i32::try_from(*w).expect("w"), *seq))
            })
            .count()
    };
    let lost = |timeline: i64| lost_of(timeline, Instant::now());
    let acked_on = |timeline: i64| acked.iter().filter(|a| a.2 == timeline).count();
    let acked_before = acked.iter().filter(|a| a.3 < promoting).count();
    assert_eq!(
        lost(2),
        0,
        "the promoted server lost its own acknowledged writes"
    );
    let stale_writes = sections.iter().filter(|s| s.stale).count();
    println!(
        "split brain: failover {failover:?} (promote took {:?}); {busy} tokens drawn by a busy \
         client of the old primary; {} sections ({} stale, {} proxied just after the switch left out), \
         {} old-side ({old_after} after the promotion, {old_after_restart} after the old \
         primary's restart), {} new-side; double grants {double}; tokens old max {old_max:#x} \
         < new min {new_min:#x}; fence: {old_accepted_before} old-side writes accepted before \
         the first new-side write, {old_refused_after} refused after it, 0 accepted after it; \
         acknowledged local writes: {} on the old primary, {} of them lost ({} of the {} \
         acknowledged before the promotion call); {} on the new primary, 0 lost",
        promoted - promoting,
        sections.len(),
        stale_writes,
        unclassified,
        old.len(),
        new.len(),
        acked_on(1),
        lost(1),
        lost_of(1, promoting),
        acked_before,
        acked_on(2),
    );
}
