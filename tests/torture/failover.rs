//! Crashes and failovers under load. Two processes take fenced session
//! locks and two take transaction-scoped locks on a private cluster (see
//! `tests/common/cluster.rs`), all through a proxy; the cluster has a
//! synchronous streaming standby, so no acknowledged register write may be
//! lost. The control process crashes the primary (`pg_ctl stop -m
//! immediate`) and starts it again, twice, then fails over: crashes the
//! primary, promotes the standby and points the proxy at it (the full run
//! repeats this with a fresh standby each time).
//!
//! Each fault is recorded from the moment the crash began to the moment the
//! server (or its successor) answered again. It is aimed at every holder: a
//! crash frees every lock. Besides the checker's rules: fencing tokens heard
//! after a fault exceed every token heard before it, and every holder whose
//! section spanned a fault learnt that its lock was gone.

use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use sqlx::{ConnectOptions, Connection};

use super::checker::{Acq, Status};
use super::clock::now_ns;
use super::cluster::Cluster;
use super::db::{TestDb, advisory_holders};
use super::history::{CONTROL, Recorder};
use super::procs::{Fleet, RunDir};
use super::proxy::Proxy;
use super::report::{Outcome, SESSION, XACT};
use super::worker::{Broken, Config, Mode};
use super::{run_name, scale, scenario};

/// `application_name` of the session processes' lock connections.
const SESSION_APPS: &[&str] = &["torture-w0", "torture-w1"];

#[test]
fn crash_restart_and_failover_to_a_synchronous_standby() {
    scenario(failover(Broken::No));
}

/// The control: the same schedule with a locker that releases early (skips
/// the lock in transaction mode) must fail.
#[test]
fn broken_locker_fails_under_crashes_and_failover() {
    scenario(failover(Broken::ReleaseEarly(0.1)));
}

/// A streaming standby of `primary` that every commit of `primary` waits
/// for (`synchronous_commit = on`: flushed on the standby).
async fn synchronous_standby(primary: &Cluster, n: usize) -> Cluster {
    let name = format!("torture_standby_{n}");
    // Back quickly after a crash of the primary: commits wait for it.
    let standby =
        Cluster::standby_of(primary, &name, &["wal_retrieve_retry_interval = 100ms"]).await;
    primary
        .reconfigure(&[
            &format!("synchronous_standby_names = '{name}'"),
            "synchronous_commit = on",
        ])
        .await;
    primary
        .wait_until(
            &format!(
                "SELECT sync_state = 'sync' FROM pg_stat_replication \
                 WHERE application_name = '{name}'"
            ),
            Duration::from_secs(60),
        )
        .await;
    standby
}

/// Waits (up to five seconds) until a session worker holds a lock, so the
/// fault lands on a holder.
async fn until_a_session_lock_is_held(db: &TestDb) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if let Ok(Ok(mut conn)) = tokio::time::timeout(
            Duration::from_secs(2),
            db.options()
                .application_name("distlock-torture-control")
                .connect(),
        )
        .await
        {
            let held = advisory_holders(&mut conn)
                .await
                .iter()
                .any(|l| SESSION_APPS.contains(&l.application.as_str()));
            let _ = conn.close().await;
            if held {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A recorded fault: `(kind, began, answered again)`.
type Window = (&'static str, u64, u64);

async fn failover(broken: Broken) {
    let name = &run_name("failover", broken);
    // A base backup waits for a checkpoint spread over this share of the
    // interval: keep a fresh standby's clone to a few seconds under load.
    let conf = [
        "checkpoint_timeout = 30s",
        "checkpoint_completion_target = 0.1",
    ];
    let mut primary = Cluster::primary(&format!("torture-{name}"), &conf).await;
    let mut standby = Some(synchronous_standby(&primary, 0).await);
    let proxy = Proxy::start("127.0.0.1", primary.port())
        .await
        .expect("proxy");
    let db = TestDb::create_on(name, primary.options().port(proxy.port())).await;
    db.prepare(32).await;
    let dir = RunDir::new(name);
    let heartbeat = Duration::from_millis(200);
    let heartbeat_timeout = Duration::from_millis(500);
    let configs: Vec<Config> = (0..4)
        .map(|p| {
            let mode = if p < 2 { Mode::Session } else { Mode::Xact };
            Config {
                check_port: Some(proxy.port()),
                key_base: if p < 2 { 0 } else { 16 },
                hold_us: if p < 2 {
                    (5_000, 400_000)
                } else {
                    (2_000, 50_000)
                },
                heartbeat_ms: 200,
                heartbeat_timeout_ms: 500,
                broken,
                ..Config::new(p, &dir.path, &db.name, proxy.port(), mode)
            }
        })
        .collect();
    let cycles = if broken == Broken::No {
        scale::pick(1, 4)
    } else {
        1
    };
    let mut fleet = Fleet::spawn(&dir.path, &configs);
    let control = Recorder::create(&dir.path, CONTROL);
    let mut rng = StdRng::seed_from_u64(scale::seed_for(name));
    let mut pause = move || Duration::from_millis(rng.random_range(1_500..2_500));
    let mut windows: Vec<Window> = Vec::new();
    let mut failover_took = Vec::new();
    tokio::time::sleep(Duration::from_millis(1_500)).await; // workers start
    for cycle in 0..cycles {
        for _ in 0..2 {
            tokio::time::sleep(pause()).await;
            until_a_session_lock_is_held(&db).await;
            let start = now_ns();
            primary.crash().await;
            primary.start().await;
            let end = control.emit("fault", json!({"kind": "crash", "start": start}));
            windows.push(("crash", start, end));
        }
        tokio::time::sleep(pause()).await;
        until_a_session_lock_is_held(&db).await;
        let started = Instant::now();
        let start = now_ns();
        let next = standby.take().expect("a standby for every failover");
        primary.crash().await;
        next.promote().await;
        proxy.set_upstream(next.port());
        let end = control.emit("fault", json!({"kind": "failover", "start": start}));
        windows.push(("failover", start, end));
        failover_took.push(started.elapsed());
        // The old primary is gone for good.
        primary = next;
        if cycle + 1 < cycles {
            standby = Some(synchronous_standby(&primary, cycle + 1).await);
        }
    }
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let last_fault = windows.last().map_or(0, |w| w.2);
    control.flush();
    fleet.stop();
    fleet.wait(Duration::from_secs(120)).await;
    let outcome = Outcome::analyse(&db, &dir.path, configs.len()).await;
    let (session, by_watch) = outcome.latency_for(SESSION);
    let h = &outcome.history;

    // Tokens heard after a fault (the server answered again) exceed every
    // token heard before it began.
    let mut token_steps = Vec::new();
    for &(kind, start, end) in &windows {
        let tokens = |keep: &dyn Fn(u64) -> bool| {
            h.acqs
                .iter()
                .filter(|a| a.acquired.is_some_and(keep))
                .filter_map(|a| a.token)
                .collect::<Vec<i64>>()
        };
        let before = tokens(&|t| t < start).into_iter().max();
        let after = tokens(&|t| t > end).into_iter().min();
        token_steps.push((kind, before, after));
    }
    // Holders whose section spanned a fault: granted before it began, not
    // released before the server answered again.
    let spanned = |a: &&Acq| {
        windows.iter().any(|&(_, start, end)| {
            a.acquired.is_some_and(|t| t < start) && a.released.is_none_or(|t| t > end)
        })
    };
    let across: Vec<&Acq> = h.held().filter(spanned).collect();
    let not_told: Vec<_> = across
        .iter()
        .filter(|a| a.status() != Status::Lost)
        .map(|a| (a.op, a.status()))
        .collect();
    let after_last = h
        .held()
        .filter(|a| a.acquired.is_some_and(|t| t > last_fault))
        .count();
    outcome.print(
        "failover (private cluster behind a proxy: crash and restart, crash and failover to a synchronous standby)",
        &[
            format!(
                "{} crashes, {} failovers (crash to proxy switched: {failover_took:?})",
                windows.iter().filter(|w| w.0 == "crash").count(),
                windows.iter().filter(|w| w.0 == "failover").count()
            ),
            format!(
                "session: {} acquisitions, {} lost; detection latency {session}; by lost() {by_watch} (heartbeat {heartbeat:?}, deadline {heartbeat_timeout:?})",
                outcome.acquisitions(SESSION),
                outcome.lost_for(SESSION)
            ),
            format!(
                "xact: {} acquisitions, {} transactions failed by a fault",
                outcome.acquisitions(XACT),
                outcome.lost_for(XACT)
            ),
            format!(
                "sections across a fault: {} ({} session), told of the loss: {}",
                across.len(),
                across
                    .iter()
                    .filter(|a| SESSION.contains(&a.method.as_str()))
                    .count(),
                across.len() - not_told.len()
            ),
            format!("tokens across each fault (highest before, lowest after): {token_steps:x?}"),
            format!("sections after the last fault: {after_last}"),
        ],
    );
    if broken != Broken::No {
        outcome.assert_caught("crashes and failover");
        return;
    }
    outcome.assert_sound();
    outcome.assert_attributed();
    for (kind, before, after) in &token_steps {
        let (Some(before), Some(after)) = (before, after) else {
            panic!("{kind}: no tokens on one side ({before:?}, {after:?})");
        };
        assert!(
            after > before,
            "{kind}: token {after:#x} after the fault, {before:#x} before it"
        );
    }
    assert!(
        across.iter().any(|a| SESSION.contains(&a.method.as_str())),
        "no session holder held across a fault"
    );
    assert!(
        not_told.is_empty(),
        "holders across a fault not told of the loss: {not_told:?}"
    );
    assert!(outcome.lost_for(XACT) > 0, "no transaction was hit");
    // Generous for a loaded two-core machine: the crash itself (pg_ctl stop)
    // is inside the measured time.
    let bound = heartbeat + heartbeat_timeout + Duration::from_secs(4);
    assert!(
        session.max <= bound.as_secs_f64() * 1e3,
        "lost() took up to {:.0} ms, bound {bound:?}",
        session.max
    );
    assert!(after_last > 0, "no acquisition after the last fault");
    assert_eq!(
        db.advisory_locks().await,
        0,
        "advisory locks left after the run"
    );
}
