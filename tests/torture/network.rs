//! Network faults from the fault proxy: two processes reach PostgreSQL
//! through it, two directly, on the same keys; the proxy cycles through
//! pass, delay, stall, cut (RST), and both half-closes.

use std::time::Duration;

use serde_json::json;

use super::checker::{Percentiles, Status};
use super::db::admin_options;
use super::history::{CONTROL, Recorder};
use super::procs::Fleet;
use super::proxy::{Mode as Net, Proxy};
use super::report::{Outcome, SESSION, XACT};
use super::worker::{Broken, Config, Mode};
use super::{run_name, scale, scenario, setup};

/// Workers behind the proxy.
const PROXIED: [i64; 2] = [0, 2];

#[test]
fn proxy_pass_delay_stall_cut_and_half_close() {
    scenario(network(Broken::No));
}

/// The control: the same schedule with a locker that releases early (skips
/// the lock in transaction mode) must fail.
#[test]
fn broken_locker_fails_under_network_faults() {
    scenario(network(Broken::ReleaseEarly(0.1)));
}

async fn network(broken: Broken) {
    let name = &run_name("network", broken);
    let (db, dir) = setup(name, 32).await;
    let pg = admin_options().get_port();
    let proxy = Proxy::start("127.0.0.1", pg).await.expect("proxy");
    let heartbeat = Duration::from_millis(200);
    let heartbeat_timeout = Duration::from_millis(500);
    // 0: session via proxy, 1: session direct, 2: xact via proxy,
    // 3: xact direct; session and xact workers use separate keys.
    let configs: Vec<Config> = (0..4)
        .map(|p| {
            let mode = if p < 2 { Mode::Session } else { Mode::Xact };
            let port = if PROXIED.contains(&p) {
                proxy.port()
            } else {
                pg
            };
            Config {
                key_base: if p < 2 { 0 } else { 16 },
                // Session holders hold long enough for heartbeats to
                // be the first to notice, now and then.
                hold_us: if p < 2 {
                    (5_000, 400_000)
                } else {
                    (2_000, 100_000)
                },
                heartbeat_ms: 200,
                heartbeat_timeout_ms: 500,
                release_timeout_ms: 1_000,
                broken,
                ..Config::new(p, &dir.path, &db.name, port, mode)
            }
        })
        .collect();
    let mut fleet = Fleet::spawn(&dir.path, &configs);
    let control = Recorder::create(&dir.path, CONTROL);
    let fault = |kind: &str| {
        for target in PROXIED {
            control.emit("fault", json!({"kind": kind, "target": target}));
        }
    };
    let phase = |kind: &str| {
        control.emit("phase", json!({"kind": kind}));
    };
    let sleep = |ms: u64| tokio::time::sleep(Duration::from_millis(ms));
    let mut stalls = Vec::new();
    let cycles = if broken == Broken::No {
        scale::pick(1, 12)
    } else {
        1
    };
    sleep(1_500).await; // workers start
    for _ in 0..cycles {
        phase("pass");
        sleep(1_000).await;
        phase("delay");
        proxy.set(Net::Delay(Duration::from_millis(20)));
        sleep(1_500).await;
        phase("pass");
        proxy.set(Net::Pass);
        sleep(500).await;
        stalls.push(super::clock::now_ns());
        fault("stall");
        proxy.set(Net::Stall);
        sleep(1_500).await;
        phase("pass");
        proxy.set(Net::Pass);
        sleep(1_000).await;
        fault("cut");
        proxy.reset();
        sleep(1_000).await;
        fault("half-close-client");
        proxy.half_close_client();
        sleep(1_000).await;
        fault("half-close-server");
        proxy.half_close_server();
        sleep(1_000).await;
    }
    phase("pass");
    proxy.set(Net::Pass);
    control.flush();
    fleet.stop();
    fleet.wait(Duration::from_secs(120)).await;
    let outcome = Outcome::analyse(&db, &dir.path, configs.len()).await;
    let (session, by_watch) = outcome.latency_for(SESSION);

    // A holder that cannot reach the database must stop trusting its
    // lock: every proxied session holder that held through a whole
    // stall (longer than heartbeat + deadline, plus slack) was lost.
    let blind = heartbeat + heartbeat_timeout + Duration::from_millis(700);
    let blind_ns = u64::try_from(blind.as_nanos()).expect("ns");
    let through_stall: Vec<_> = outcome
        .history
        .held()
        .filter(|a| a.op.0 == 0)
        .filter(|a| {
            stalls.iter().any(|&s| {
                a.acquired.is_some_and(|t| t < s) && a.exited.is_some_and(|t| t > s + blind_ns)
            })
        })
        .collect();
    let by_kind: Vec<String> = ["stall", "cut", "half-close-client", "half-close-server"]
        .iter()
        .map(|kind| {
            let session: std::collections::HashSet<_> = outcome
                .history
                .acqs
                .iter()
                .filter(|a| SESSION.contains(&a.method.as_str()))
                .map(|a| a.op)
                .collect();
            let of = |watch_only: bool| {
                Percentiles::of(
                    outcome
                        .latencies
                        .iter()
                        .filter(|l| l.kind == *kind && session.contains(&l.op))
                        .filter(|l| l.by_watch || !watch_only)
                        .map(|l| l.ns)
                        .collect(),
                )
            };
            format!(
                "session, {kind}: detection {}; by lost() {}",
                of(false),
                of(true)
            )
        })
        .collect();
    let trusted: Vec<_> = through_stall
        .iter()
        .filter(|a| a.status() != Status::Lost)
        .map(|a| a.op)
        .collect();
    outcome.print(
        "network (fault proxy: pass, delay 20 ms, stall 1.5 s, cut, half-close either way)",
        &[
            format!(
                "{cycles} fault cycles, {} proxied connections",
                proxy.accepted()
            ),
            format!(
                "session: {} acquisitions, {} lost; detection latency {session}; by lost() {by_watch} (heartbeat {heartbeat:?}, deadline {heartbeat_timeout:?})",
                outcome.acquisitions(SESSION),
                outcome.lost_for(SESSION)
            ),
            by_kind.join("\n  "),
            format!(
                "session holders through a whole stall: {}, still trusting their lock: {}",
                through_stall.len(),
                trusted.len()
            ),
            format!(
                "xact: {} acquisitions, {} transactions failed by a fault",
                outcome.acquisitions(XACT),
                outcome.lost_for(XACT)
            ),
        ],
    );
    if broken != Broken::No {
        outcome.assert_caught("network faults");
        return;
    }
    outcome.assert_sound();
    outcome.assert_attributed();
    assert!(
        trusted.is_empty(),
        "held through a stall, never lost: {trusted:?}"
    );
    assert!(outcome.lost_for(SESSION) > 0, "no session holder was hit");
    let bound = heartbeat + heartbeat_timeout + Duration::from_millis(1_500);
    assert!(
        session.max <= bound.as_secs_f64() * 1e3,
        "lost() took up to {:.0} ms, bound {bound:?}",
        session.max
    );
    assert_eq!(
        db.advisory_locks().await,
        0,
        "advisory locks left after the run"
    );
}
