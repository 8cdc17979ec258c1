//! A hard network partition that the server really sees.
//!
//! The fault proxy (tests/common/proxy.rs) stalls a connection, but the
//! kernel under it still acknowledges every byte, so the server never
//! notices. Here PostgreSQL runs in a network namespace of its own, the lock
//! holders in another (this test binary run again there, `partition_worker`),
//! joined by a veth pair whose packets are then dropped on both ends
//! (tests/common/netns.rs). The test process watches the server through its
//! Unix-domain socket, which the partition does not touch.
//!
//! Under one cut it measures four things against the documented bound
//! (every lock statement sets `tcp_keepalives_idle` 10 s, `_interval` 5 s,
//! `_count` 3 and `tcp_user_timeout` 30 s, so the server frees the locks of a
//! cut-off client within about 25–30 s):
//!
//! 1. a session lock held through `PgLocker` (heartbeat 1 s, deadline 1 s):
//!    when the holder's `lost()` fires, and when the server frees the lock;
//! 2. a `lock()` call waiting behind a lock the observer holds: when the
//!    server abandons the wait, and what the call returns, and when;
//! 3. a transaction-scoped lock whose closure sleeps past the cut: when the
//!    server frees it, and what the caller gets (its `COMMIT` goes out into
//!    the partition and is answered once the link heals);
//! 4. a session lock on a connection whose application had set
//!    `tcp_user_timeout` itself (`-c tcp_user_timeout=30000`), which the
//!    lock statements once took for "keepalives already set";
//! 5. an idempotency key claimed by `idempotency::once` whose closure sleeps
//!    past the cut: when a second `once` on the key, made by the test over
//!    the Unix-domain socket, gets to run (the claim's row stays locked
//!    until the server ends the holder's transaction), and that exactly one
//!    of the two ran.
//!
//! Every claim is checked and the broken ones reported together. The run
//! takes about a minute: the waiter's timeout (43 s) must outlast the bound.
//!
//! Both sides take their timestamps from `CLOCK_MONOTONIC`, one clock for
//! every namespace on the machine.

use crate::common;

use std::path::PathBuf;
use std::time::Duration;

use common::cluster::Cluster;
use common::event_log::{Log, event, now_ns, secs};
use common::netns::{Partition, SERVER_ADDR};
use common::*;
use distlock::{Error, PgLocker};
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};

const SESSION_KEY: &str = "partition:session";
const WAITER_KEY: &str = "partition:waiter";
const XACT_KEY: &str = "partition:xact";
const PRESET_KEY: &str = "partition:preset";
/// The idempotency key `once` claims on both sides: `(ONCE_SCOPE, ONCE_KEY)`.
const ONCE_SCOPE: &str = "partition";
const ONCE_KEY: &str = "once";

/// The holder's heartbeat and its deadline: lost() within about 2 s.
const HEARTBEAT: Duration = Duration::from_secs(1);
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(1);
/// The waiter's timeout: longer than the server's bound plus slack, so that
/// the server ends the wait because it lost the client, not at its
/// `lock_timeout`.
const WAITER_TIMEOUT: Duration = Duration::from_secs(43);
/// How long the transaction's closure sleeps after it got the lock: well past
/// the moment the server frees it.
const XACT_SLEEP: Duration = Duration::from_secs(38);

/// The documented bound (about 25–30 s) plus slack for a loaded machine.
const SERVER_BOUND: Duration = Duration::from_secs(40);

const ENV_URL: &str = "DISTLOCK_PARTITION_URL";
const ENV_OUT: &str = "DISTLOCK_PARTITION_OUT";

// ---------------------------------------------------------------------------
// The worker: runs in the client namespace.
// ---------------------------------------------------------------------------

/// `ok <value>`, `timeout <error>` or `error <error>`.
fn outcome<T: std::fmt::Debug>(result: Result<T, &Error>) -> String {
    match result {
        Ok(value) => format!("ok {value:?}"),
        Err(err @ Error::Timeout { .. }) => format!("timeout {err}"),
        Err(err) => format!("error {err}"),
    }
}

/// The worker side: the database URL in `DISTLOCK_PARTITION_URL` (the
/// server's veth address), the event log in `DISTLOCK_PARTITION_OUT`.
#[test]
fn partition_worker() {
    let Ok(url) = std::env::var(ENV_URL) else {
        return; // an ordinary test run
    };
    let out = std::env::var(ENV_OUT).expect(ENV_OUT);
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(work(&url, &out));
}

async fn work(url: &str, out: &str) {
    let log = Log::create(out);
    let options: PgConnectOptions = url.parse().expect("database URL");
    let locker_on = async |options: PgConnectOptions| {
        let pool = PgPoolOptions::new()
            .max_connections(6)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await
            .expect("pool across the veth pair");
        PgLocker::builder(pool)
            .heartbeat(HEARTBEAT)
            .heartbeat_timeout(HEARTBEAT_TIMEOUT)
            .build()
            .expect("valid settings")
    };
    let locker = locker_on(options.clone()).await;
    // An application that set tcp_user_timeout itself (to the value the
    // lock statements use), but not the keepalives.
    let preset_locker = locker_on(options.clone().options([("tcp_user_timeout", "30000")])).await;

    // 1. A session lock.
    let session = locker
        .try_lock(SESSION_KEY)
        .await
        .expect("try_lock")
        .expect("the session key is free");
    log.line("session_held", session.backend_pid());
    // 4. A session lock on a connection that has tcp_user_timeout already.
    let preset = preset_locker
        .try_lock(PRESET_KEY)
        .await
        .expect("try_lock")
        .expect("the preset key is free");
    log.line("preset_held", preset.backend_pid());

    // 3. A transaction-scoped lock whose closure sleeps past the cut.
    let xact = tokio::spawn({
        let (locker, log) = (locker.clone(), log.clone());
        async move {
            let result = locker
                .with_advisory_lock(XACT_KEY, async |conn| {
                    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                        .fetch_one(&mut *conn)
                        .await?;
                    log.line("xact_entered", pid);
                    tokio::time::sleep(XACT_SLEEP).await;
                    log.line("xact_woke", "");
                    Ok::<_, Error>(pid)
                })
                .await;
            log.line("xact_returned", outcome(result.as_ref()));
        }
    });

    // 5. An idempotency claim whose closure sleeps past the cut.
    let once = tokio::spawn({
        let log = log.clone();
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options.clone())
            .await
            .expect("pool across the veth pair");
        async move {
            let result = distlock::idempotency::once(&pool, ONCE_SCOPE, ONCE_KEY, async |conn| {
                let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                    .fetch_one(&mut *conn)
                    .await
                    .map_err(Error::from)?;
                log.line("once_entered", pid);
                tokio::time::sleep(XACT_SLEEP).await;
                Ok::<_, Error>("worker".to_owned())
            })
            .await;
            log.line("once_returned", outcome(result.as_ref()));
        }
    });

    // 2. A waiter behind the observer's lock.
    let waiter = tokio::spawn({
        let (locker, log) = (locker.clone(), log.clone());
        async move {
            log.line("waiter_start", "");
            let result = locker.lock(WAITER_KEY, WAITER_TIMEOUT).await;
            log.line(
                "waiter_returned",
                outcome(result.as_ref().map(|l| l.backend_pid())),
            );
        }
    });

    tokio::join!(
        async { log.line("session_lost", session.lost().await) },
        async { log.line("preset_lost", preset.lost().await) },
    );
    drop((session, preset));
    waiter.await.expect("waiter task");
    xact.await.expect("xact task");
    once.await.expect("once task");
    log.line("done", "");
}

// ---------------------------------------------------------------------------
// The test: runs in the test's own namespace.
// ---------------------------------------------------------------------------

/// `(pid, granted)` of every advisory-lock row for the text key `name`.
pub(crate) async fn rows(obs: &mut PgConnection, name: &str) -> Vec<(i32, bool)> {
    sqlx::query_as(
        "SELECT pid, granted FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 \
         AND ((classid::int8 << 32) | objid::int8) = hashtext($1)::int8",
    )
    .bind(name)
    .fetch_all(obs)
    .await
    .expect("pg_locks")
}

async fn backend_alive(obs: &mut PgConnection, pid: i32) -> bool {
    sqlx::query_scalar("SELECT count(*) > 0 FROM pg_stat_activity WHERE pid = $1")
        .bind(pid)
        .fetch_one(obs)
        .await
        .expect("pg_stat_activity")
}

/// A scratch directory, removed when dropped.
pub(crate) struct Scratch(pub(crate) PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_the_server_sees_frees_every_lock_within_the_keepalive_bound() {
    init_tracing();
    // Dropped in reverse: the worker is killed, then the cluster stopped,
    // then the namespaces deleted, also when an assertion fails.
    let mut net = Partition::new();
    let cluster = Cluster::primary_in_netns("partition", &[], net.server_ns(), SERVER_ADDR).await;
    let scratch =
        Scratch(std::env::temp_dir().join(format!("distlock-partition-{}", std::process::id())));
    std::fs::create_dir_all(&scratch.0).expect("scratch dir");
    let log = scratch.0.join("events.log");

    // Set up from this namespace, over the Unix-domain socket.
    let local = cluster.socket_options();
    let setup = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(local.clone())
        .await
        .expect("pool over the Unix socket");
    distlock::migrate(&setup).await.expect("migrate");
    setup.close().await;
    let mut obs = observer(&local).await;
    assert!(
        raw_try_lock(&mut obs, &Raw::text(WAITER_KEY)).await,
        "the observer holds the waiter's key"
    );
    let obs_pid = backend_pid(&mut obs).await;

    // The worker, in the client namespace, reaches the server over the veth.
    let url = format!(
        "postgres://postgres@{SERVER_ADDR}:{}/postgres",
        cluster.port()
    );
    let mut worker = net.in_client(std::env::current_exe().expect("current_exe"));
    worker
        .args(["partition::partition_worker", "--exact", "--nocapture"])
        .env(ENV_URL, &url)
        .env(ENV_OUT, &log);
    let mut worker = tokio::process::Command::from(worker)
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the worker in the client namespace");

    // Ready: the session and transaction locks granted, the waiter queued.
    let mut pids = [0_i32; 4];
    eventually(
        "the worker's locks in pg_locks",
        Duration::from_secs(60),
        async || {
            if let Ok(Some(status)) = worker.try_wait() {
                panic!("the worker exited early: {status}");
            }
            let granted = |r: Vec<(i32, bool)>| r.iter().find(|(_, g)| *g).map(|(p, _)| *p);
            let found = [
                granted(rows(&mut obs, SESSION_KEY).await),
                granted(rows(&mut obs, PRESET_KEY).await),
                granted(rows(&mut obs, XACT_KEY).await),
                rows(&mut obs, WAITER_KEY)
                    .await
                    .iter()
                    .find(|(_, g)| !*g)
                    .map(|(p, _)| *p),
            ];
            if found.iter().all(Option::is_some) {
                pids = found.map(|p| p.unwrap_or_default());
            }
            found.iter().all(Option::is_some) && event(&log, "once_entered").is_some()
        },
    )
    .await;
    let [session_pid, preset_pid, xact_pid, waiter_pid] = pids;
    assert!(
        !pids.contains(&obs_pid),
        "the worker's backends are not the observer's"
    );
    // A heartbeat or so across the link before it breaks.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(
        worker.try_wait().expect("try_wait").is_none(),
        "the worker is still running"
    );

    let cut_at = now_ns();
    net.cut();

    // 5. A second `once` on the key, from this side: it waits on the
    // holder's uncommitted claim until the server ends that transaction.
    let second_once = tokio::spawn({
        let local = local.clone();
        async move {
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .connect_with(local)
                .await
                .expect("pool over the Unix socket");
            let ran = tokio::time::timeout(
                SERVER_BOUND + Duration::from_secs(20),
                distlock::idempotency::once(&pool, ONCE_SCOPE, ONCE_KEY, async |_| {
                    Ok::<_, Error>("observer".to_owned())
                }),
            )
            .await;
            let at = now_ns();
            pool.close().await;
            (at, format!("{ran:?}"))
        }
    });

    // Watch the server free each lock (or stop watching at 45 s).
    let watched: [(&str, i32, bool); 4] = [
        (SESSION_KEY, session_pid, true),
        (PRESET_KEY, preset_pid, true),
        (XACT_KEY, xact_pid, true),
        (WAITER_KEY, waiter_pid, false),
    ];
    let mut freed: [Option<u64>; 4] = [None; 4];
    let mut session_gone = None;
    let watch_until = cut_at + 45_000_000_000;
    while now_ns() < watch_until && freed.iter().any(Option::is_none) {
        let at = now_ns();
        for (i, (key, pid, granted)) in watched.iter().enumerate() {
            if freed[i].is_none() && !rows(&mut obs, key).await.contains(&(*pid, *granted)) {
                freed[i] = Some(at);
            }
        }
        if session_gone.is_none() && !backend_alive(&mut obs, session_pid).await {
            session_gone = Some(at);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let [session_freed, preset_freed, xact_freed, waiter_abandoned] = freed;
    let since_cut = |t: Option<u64>| t.map(|t| format!("{:.3}", secs(cut_at, t)));
    println!(
        "server side, seconds after the cut: session lock freed {:?} (backend gone {:?}), \
         session lock with tcp_user_timeout preset freed {:?}, wait abandoned {:?}, \
         transaction lock freed {:?}",
        since_cut(session_freed),
        since_cut(session_gone),
        since_cut(preset_freed),
        since_cut(waiter_abandoned),
        since_cut(xact_freed)
    );

    let (second_once_at, second_once) = second_once.await.expect("the second once");
    println!(
        "idempotency: the second once returned {:.3} s after the cut: {second_once}",
        secs(cut_at, second_once_at)
    );

    // The waiter returns at its own deadline, inside the partition.
    let (waiter_start, _) = event(&log, "waiter_start").expect("the waiter started");
    let waiter_limit = WAITER_TIMEOUT + HEARTBEAT_TIMEOUT + Duration::from_secs(30);
    eventually("the waiter's call returns", waiter_limit, async || {
        event(&log, "waiter_returned").is_some()
    })
    .await;

    let heal_at = now_ns();
    net.heal();
    bounded(
        "the worker finishes after the heal",
        Duration::from_secs(120),
        worker.wait(),
    )
    .await
    .expect("wait for the worker");
    let done = now_ns();

    let lost = |name: &str| event(&log, name).unwrap_or_else(|| panic!("{name} fired"));
    let (lost_at, lost_reason) = lost("session_lost");
    let (preset_lost_at, preset_reason) = lost("preset_lost");
    let (waiter_at, waiter_outcome) = lost("waiter_returned");
    let (xact_entered, _) = lost("xact_entered");
    let (xact_at, xact_outcome) = lost("xact_returned");
    let (_, once_outcome) = lost("once_returned");
    println!(
        "holders: lost() {:.3} s after the cut ({lost_reason}); with tcp_user_timeout \
         preset {:.3} s ({preset_reason})",
        secs(cut_at, lost_at),
        secs(cut_at, preset_lost_at)
    );
    println!(
        "waiter: started {:.3} s before the cut, returned {:.3} s after it \
         ({:.3} s after it started, timeout {WAITER_TIMEOUT:?}): {waiter_outcome}",
        secs(waiter_start, cut_at),
        secs(cut_at, waiter_at),
        secs(waiter_start, waiter_at)
    );
    println!(
        "transaction: entered {:.3} s before the cut; healed {:.3} s after the cut; \
         returned {:.3} s after the heal: {xact_outcome}",
        secs(xact_entered, cut_at),
        secs(cut_at, heal_at),
        secs(heal_at, xact_at)
    );
    println!("idempotency: the worker's once returned {once_outcome}");
    println!("worker exited {:.3} s after the heal", secs(heal_at, done));

    // Every claim is checked, and every broken one reported together.
    let mut broken: Vec<String> = Vec::new();
    let mut check = |ok: bool, what: String| {
        if !ok {
            broken.push(what);
        }
    };
    let bound = SERVER_BOUND.as_secs_f64();
    let after_cut = |at: Option<u64>| at.map_or(f64::INFINITY, |at| secs(cut_at, at));
    // 1. Session locks: freed by the server within the bound, after their
    // holder stopped trusting them, within heartbeat + deadline of the cut
    // (plus slack). Also where the application had set tcp_user_timeout
    // itself.
    for (what, lost_at, freed) in [
        ("session lock", lost_at, session_freed),
        (
            "session lock, tcp_user_timeout preset",
            preset_lost_at,
            preset_freed,
        ),
    ] {
        check(
            after_cut(freed) <= bound,
            format!(
                "{what}: the server freed it {:.3} s after the cut",
                after_cut(freed)
            ),
        );
        check(
            lost_at > cut_at,
            format!("{what}: lost() fired before the cut"),
        );
        check(
            lost_at < freed.unwrap_or(u64::MAX),
            format!(
                "{what}: the server freed it ({:.3} s) before the holder knew ({:.3} s)",
                after_cut(freed),
                secs(cut_at, lost_at)
            ),
        );
        check(
            secs(cut_at, lost_at) <= (HEARTBEAT + HEARTBEAT_TIMEOUT).as_secs_f64() + 8.0,
            format!(
                "{what}: lost() {:.3} s after the cut",
                secs(cut_at, lost_at)
            ),
        );
    }
    check(
        after_cut(session_gone) <= bound,
        format!(
            "the holder's backend ended {:.3} s after the cut",
            after_cut(session_gone)
        ),
    );
    // 2. The waiter: the server abandoned the wait within the bound, before
    // its lock_timeout could end it, and the call returned an error, not a
    // lock, within its timeout plus the heartbeat deadline (plus the holder
    // lookup's and a loaded machine's slack).
    check(
        after_cut(waiter_abandoned) <= bound
            && waiter_abandoned.unwrap_or(u64::MAX)
                < waiter_start + u64::try_from(WAITER_TIMEOUT.as_nanos()).expect("ns"),
        format!(
            "the server abandoned the wait {:.3} s after the cut",
            after_cut(waiter_abandoned)
        ),
    );
    check(
        waiter_outcome.starts_with("timeout "),
        format!("the waiter got {waiter_outcome}"),
    );
    check(
        secs(waiter_start, waiter_at) <= (WAITER_TIMEOUT + HEARTBEAT_TIMEOUT).as_secs_f64() + 10.0,
        format!(
            "the waiter returned {:.3} s after it started",
            secs(waiter_start, waiter_at)
        ),
    );
    // 3. The transaction: freed by the server within the bound; the caller
    // got an error, never Ok(Some).
    check(
        after_cut(xact_freed) <= bound,
        format!(
            "transaction lock: the server freed it {:.3} s after the cut",
            after_cut(xact_freed)
        ),
    );
    check(
        xact_outcome.starts_with("error ") || xact_outcome.starts_with("timeout "),
        format!("the transaction's caller got {xact_outcome}"),
    );
    // 5. The idempotency claim: the server ended the holder's transaction
    // within the bound, so the second `once` ran; the worker's did not.
    check(
        second_once.starts_with("Ok(Ok(Ran(\"observer\"") && secs(cut_at, second_once_at) <= bound,
        format!(
            "the second once returned {:.3} s after the cut: {second_once}",
            secs(cut_at, second_once_at)
        ),
    );
    check(
        !once_outcome.starts_with("ok "),
        format!("the worker's once, cut off, got {once_outcome}"),
    );
    for key in [SESSION_KEY, PRESET_KEY, XACT_KEY] {
        let held = rows(&mut obs, key).await.iter().any(|(_, g)| *g);
        check(!held, format!("{key} is still held after the heal"));
    }
    assert!(
        broken.is_empty(),
        "bound {bound} s after the cut:\n  {}",
        broken.join("\n  ")
    );
    close(obs).await;
}

/// The lock statements set the keepalives also on a connection whose
/// application had set `tcp_user_timeout` itself (to the very value they
/// use): they used to look at that one setting only, and then left the
/// keepalive idle time at the operating system's two hours (the partition
/// test's fourth scenario shows what that costs).
#[sqlx::test(migrations = false)]
async fn keepalives_are_set_where_the_application_preset_tcp_user_timeout(
    _opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    // One connection, so the pool hands back the lock's connection.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(connect.options([("tcp_user_timeout", "30000")]))
        .await
        .expect("pool");
    const SETTINGS: &str = "SELECT current_setting('tcp_keepalives_idle'), \
         current_setting('tcp_keepalives_interval'), \
         current_setting('tcp_keepalives_count'), current_setting('tcp_user_timeout')";
    type Settings = (String, String, String, String);
    let settings = async |pool: &sqlx::PgPool| -> Settings {
        sqlx::query_as(SETTINGS)
            .fetch_one(pool)
            .await
            .expect("settings")
    };
    let expected: Settings = ("10".into(), "5".into(), "3".into(), "30000".into());
    let preset: Settings = settings(&pool).await;
    assert_eq!(preset.3, "30000", "the application's own setting");
    assert_ne!(preset, expected, "the keepalives are not set yet");
    let locker = PgLocker::builder(pool.clone())
        .heartbeat(Duration::from_secs(10))
        .build()
        .expect("valid settings");
    let reset = async || {
        sqlx::raw_sql(
            "RESET tcp_keepalives_idle; RESET tcp_keepalives_interval; RESET tcp_keepalives_count",
        )
        .execute(&pool)
        .await
        .expect("reset");
        assert_eq!(
            settings(&pool).await,
            preset,
            "back to the application's settings"
        );
    };

    let lock = locker
        .try_lock("preset:a")
        .await
        .expect("try_lock")
        .expect("free");
    lock.release().await.expect("release");
    assert_eq!(settings(&pool).await, expected, "after try_lock");
    reset().await;
    let lock = locker
        .lock("preset:a", Duration::from_secs(1))
        .await
        .expect("lock");
    lock.release().await.expect("release");
    assert_eq!(settings(&pool).await, expected, "after lock");
    reset().await;
    let all = locker
        .lock_all(["preset:a", "preset:b"], Duration::from_secs(1))
        .await
        .expect("lock_all");
    all.release().await.expect("release");
    assert_eq!(settings(&pool).await, expected, "after lock_all");
    reset().await;
    let inside = locker
        .with_advisory_lock("preset:a", async |conn| {
            let row: Settings = sqlx::query_as(SETTINGS).fetch_one(&mut *conn).await?;
            Ok::<_, Error>(row)
        })
        .await
        .expect("with_advisory_lock");
    assert_eq!(inside, Some(expected), "inside with_advisory_lock");
}
