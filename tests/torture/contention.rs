//! Multi-process contention without faults: 4 processes × 16 tasks on 16
//! keys, in each mode, every critical section a read-sleep-write of the
//! register.

use std::time::{Duration, Instant};

use super::db::{TestDb, admin_options};
use super::procs::{Fleet, RunDir};
use super::report::Outcome;
use super::worker::{Config, Mode};
use super::{scale, scenario};

const PROCESSES: i64 = 4;

async fn contention(name: &str, mode: Mode) {
    let db = TestDb::create(name).await;
    db.prepare(16).await;
    let dir = RunDir::new(name);
    // Per process: 4 × 25,000 = 100,000 acquisitions in the full run.
    let target = scale::pick(500, 25_000);
    let port = admin_options().get_port();
    let configs: Vec<Config> = (0..PROCESSES)
        .map(|p| Config {
            target,
            heartbeat_ms: 500,
            heartbeat_timeout_ms: 2_000,
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
        Mode::Session => &["try", "lock"],
        Mode::Xact | Mode::Unlocked => &["xact", "xwait"],
    };
    let acquired = outcome.acquisitions(methods);
    outcome.print(
        name,
        &[format!(
            "{acquired} acquisitions in {took:.1?} ({:.0}/s) by {PROCESSES} processes × 16 tasks on 16 keys",
            acquired as f64 / took.as_secs_f64()
        )],
    );
    outcome.assert_sound();
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
    scenario(contention("contention_session", Mode::Session));
}

#[test]
fn xact_mode_four_processes_sixteen_tasks() {
    scenario(contention("contention_xact", Mode::Xact));
}
