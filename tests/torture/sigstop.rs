//! A holder process stopped with SIGSTOP for longer than its heartbeat (and
//! than the database's `idle_session_timeout`, which ends the stopped
//! holder's session and frees its lock), then continued: its leases must be
//! reported lost, and the writes it attempts on waking must be refused by
//! the fence.
//!
//! This is the case a lock alone cannot handle: the paused process does not
//! run, so nothing can tell it in time; when it wakes, it is still inside
//! its critical section while another holder is in its own. Only the fence
//! keeps that from becoming a lost update.

use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::json;
use sqlx::Connection;

use super::checker::{Percentiles, Status};
use super::db::{admin_options, advisory_holders};
use super::history::{CONTROL, Recorder};
use super::procs::Fleet;
use super::report::Outcome;
use super::worker::{Broken, Config, Mode};
use super::{run_name, scale, scenario, setup};

const HEARTBEAT: Duration = Duration::from_millis(200);
const HEARTBEAT_TIMEOUT: Duration = Duration::from_millis(500);
const STOPPED: Duration = Duration::from_millis(2_500);

#[test]
fn sigstopped_holder_is_reported_lost_and_fenced() {
    scenario(sigstop(Broken::No));
}

/// The control: the same schedule with a locker that releases early must
/// fail.
#[test]
fn broken_locker_fails_under_sigstop() {
    scenario(sigstop(Broken::ReleaseEarly(0.1)));
}

async fn sigstop(broken: Broken) {
    let name = &run_name("sigstop", broken);
    let (db, dir) = setup(name, 16).await;
    db.set("idle_session_timeout", "1s").await;
    let port = admin_options().get_port();
    let configs: Vec<Config> = (0..4)
        .map(|p| Config {
            heartbeat_ms: 200,
            heartbeat_timeout_ms: 500,
            // Mostly asleep between read and write, so a stop usually
            // catches holders there.
            hold_us: (50_000, 150_000),
            tasks: 8,
            broken,
            ..Config::new(p, &dir.path, &db.name, port, Mode::Session)
        })
        .collect();
    let mut fleet = Fleet::spawn(&dir.path, &configs);
    let control = Recorder::create(&dir.path, CONTROL);
    let mut conn = db.connect("distlock-torture-control").await;
    let stops = if broken == Broken::No {
        scale::pick(3, 30)
    } else {
        3
    };
    let mut pauses = Vec::new();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    for i in 0..stops {
        let victim = i % 4;
        let app = Config::lock_app(victim);
        // Stop it while it holds something (bounded wait).
        for _ in 0..200 {
            let holding = advisory_holders(&mut conn)
                .await
                .iter()
                .any(|l| l.application == app);
            if holding {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let stopped = control.emit("fault", json!({"kind": "sigstop", "target": victim}));
        fleet.signal(victim, Signal::SIGSTOP);
        tokio::time::sleep(STOPPED).await;
        fleet.signal(victim, Signal::SIGCONT);
        let resumed = control.emit("phase", json!({"kind": "sigcont", "target": victim}));
        pauses.push((victim, stopped, resumed));
        tokio::time::sleep(Duration::from_millis(1_500)).await;
    }
    control.flush();
    fleet.stop();
    fleet.wait(Duration::from_secs(120)).await;
    let outcome = Outcome::analyse(&db, &dir.path, configs.len()).await;
    let h = &outcome.history;

    // Holders caught by a stop inside their critical section: granted
    // before it, not out of the section before it. A holder stopped after
    // leaving its section, while its release was on the wire, is not one:
    // the server ran the unlock before the session could idle out, and the
    // release reports success when the process wakes (seen in a full run).
    let mut caught = Vec::new();
    for &(victim, stopped, resumed) in &pauses {
        for a in h.held().filter(|a| a.op.0 == victim) {
            let granted_before = a.acquired.is_some_and(|t| t < stopped);
            let still_held =
                a.exited.is_none_or(|t| t > stopped) && a.detected().is_none_or(|t| t > stopped);
            // `stopped` is taken just before the signal is sent: a release
            // recorded before the resume shows that the process still ran
            // after it (a stopped process records nothing), so the stop
            // landed after the release (seen in CI: released 1.4 ms after
            // `stopped`).
            let released_first = a.released.is_some_and(|t| t < resumed);
            if granted_before && still_held && !released_first {
                caught.push((a, resumed));
            }
        }
    }
    let trusted: Vec<_> = caught
        .iter()
        .filter(|(a, _)| a.status() != Status::Lost)
        .map(|(a, _)| a.op)
        .collect();
    let after_resume = Percentiles::of(
        caught
            .iter()
            .filter_map(|(a, resumed)| Some(a.detected()?.saturating_sub(*resumed)))
            .collect(),
    );
    // Refusals of the victims' operations after they woke up.
    let refused_after_resume = h
        .write_rejected
        .iter()
        .filter(|(t, op)| pauses.iter().any(|&(v, _, r)| op.0 == v && *t >= r))
        .count();
    let overlapped = outcome.exclusion.excused.len();
    outcome.print(
        "SIGSTOP (holder stopped 2.5 s; heartbeat 200 ms; idle_session_timeout 1 s)",
        &[
            format!(
                "{stops} stops, {} holders caught inside their critical section, {} of them still trusting their lock afterwards",
                caught.len(),
                trusted.len()
            ),
            format!("loss detected after SIGCONT: {after_resume}"),
            format!(
                "overlaps of a woken holder with its successor: {overlapped}; its writes refused by the fence after waking: {refused_after_resume}"
            ),
        ],
    );
    if broken != Broken::No {
        outcome.assert_caught("SIGSTOP");
        return;
    }
    outcome.assert_sound();
    outcome.assert_attributed();
    assert!(!caught.is_empty(), "no stop caught a holder");
    assert!(
        trusted.is_empty(),
        "paused past its loss, never told: {trusted:?}"
    );
    // Documented: at most about one heartbeat interval plus its deadline
    // once the holder runs again; slack for a loaded machine.
    let bound = HEARTBEAT + HEARTBEAT_TIMEOUT + Duration::from_millis(1_500);
    assert!(
        after_resume.max <= bound.as_secs_f64() * 1e3,
        "loss reported up to {:.0} ms after SIGCONT, bound {bound:?}",
        after_resume.max
    );
    assert!(
        refused_after_resume > 0,
        "no woken holder's write was refused by the fence"
    );
    assert_eq!(
        db.advisory_locks().await,
        0,
        "advisory locks left after the run"
    );
    let _ = conn.close().await;
}
