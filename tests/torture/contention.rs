//! Multi-process contention without faults: 4 processes × 16 tasks on 16
//! keys, in each mode, every critical section a read-sleep-write of the
//! register. In transaction mode processes 1 and 3 send the try with the
//! `BEGIN` (`try_with_begin`), 0 and 2 do not.
//!
//! In session mode, processes 2 and 3 write the register without the fence
//! (their tokens are only logged): on their writes only the lock keeps two
//! holders apart, so the register judges the lock itself. The control
//! `broken_locker_fails_under_contention` shows it: with every write
//! unfenced, a locker that releases early loses updates.

use std::time::{Duration, Instant};

use super::db::{TestDb, admin_options};
use super::procs::{Fleet, RunDir};
use super::report::{Outcome, SESSION, XACT};
use super::worker::{Broken, Config, Mode};
use super::{scale, scenario};

const PROCESSES: i64 = 4;

async fn contention(name: &str, mode: Mode, broken: Broken) {
    let db = TestDb::create(name).await;
    db.prepare(16).await;
    let dir = RunDir::new(name);
    // Per process: 4 × 25,000 = 100,000 acquisitions in the full run.
    let target = if broken == Broken::No {
        scale::pick(500, 25_000)
    } else {
        500
    };
    let port = admin_options().get_port();
    let configs: Vec<Config> = (0..PROCESSES)
        .map(|p| Config {
            target,
            heartbeat_ms: 500,
            heartbeat_timeout_ms: 2_000,
            // Without the fence, only the lock protects the register.
            fence_register: broken == Broken::No && p < 2,
            // Transaction mode: two of the four send the try with the
            // `BEGIN`, on the same keys as the two that do not.
            try_with_begin: mode == Mode::Xact && p % 2 == 1,
            broken,
            ..Config::new(p, &dir.path, &db.name, port, mode)
        })
        .collect();
    let started = Instant::now();
    let mut fleet = Fleet::spawn(&dir.path, &configs);
    fleet
        .wait(scale::pick(
            Duration::from_secs(300),
            Duration::from_secs(3 * 3600),
        ))
        .await;
    let took = started.elapsed();
    let outcome = Outcome::analyse(&db, &dir.path, configs.len()).await;
    let methods: &[&str] = match mode {
        Mode::Session => SESSION,
        Mode::Xact | Mode::Unlocked => XACT,
    };
    let acquired = outcome.acquisitions(methods);
    outcome.print(
        name,
        &[format!(
            "{acquired} acquisitions in {took:.1?} ({:.0}/s) by {PROCESSES} processes × 16 tasks on 16 keys{}",
            acquired as f64 / took.as_secs_f64(),
            if mode == Mode::Xact {
                " (processes 1 and 3 with try_with_begin)"
            } else {
                ""
            }
        )],
    );
    if broken != Broken::No {
        outcome.assert_caught("contention");
        assert!(
            outcome.register.lost_updates > 0,
            "unfenced writes of a broken locker lost no update: the register cannot judge the lock"
        );
        return;
    }
    outcome.assert_sound();
    outcome.assert_attributed();
    // RELIABILITY.md: with nothing injected, no wait timed out and no call
    // failed before the grant.
    let timeouts = outcome.history.acqs.iter().filter(|a| a.timeout).count();
    let failed: Vec<_> = outcome
        .history
        .acqs
        .iter()
        .filter(|a| a.failed.is_some() || (!a.held() && !a.busy && !a.timeout))
        .map(|a| (a.op, a.failed.clone()))
        .take(5)
        .collect();
    assert_eq!(timeouts, 0, "waits timed out with nothing injected");
    assert!(
        failed.is_empty(),
        "calls failed with nothing injected: {failed:?}"
    );
    let expected = usize::try_from(target * PROCESSES as u64).expect("target");
    assert!(
        acquired >= expected,
        "{acquired} acquisitions, expected at least {expected}"
    );
    assert_eq!(
        outcome.exclusion.lost, 0,
        "no fault was injected, yet leases were lost"
    );
    assert_eq!(
        db.advisory_locks().await,
        0,
        "advisory locks left after the run"
    );
}

#[test]
fn session_mode_four_processes_sixteen_tasks() {
    scenario(contention("contention_session", Mode::Session, Broken::No));
}

#[test]
fn xact_mode_four_processes_sixteen_tasks() {
    scenario(contention("contention_xact", Mode::Xact, Broken::No));
}

/// The control for the unfenced register: a locker that releases early,
/// every write unfenced, must lose updates.
#[test]
fn broken_locker_fails_under_contention() {
    scenario(contention(
        "contention_broken",
        Mode::Session,
        Broken::ReleaseEarly(0.1),
    ));
}
