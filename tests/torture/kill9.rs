//! `kill -9` of worker processes inside their critical sections: the
//! kernel closes their sockets, PostgreSQL frees their locks, and a
//! successor may enter only after the kill. The checker ends a killed
//! process's open section at the moment its kill returned, so any overlap
//! before that is a violation; a fresh worker replaces each killed one.

use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use serde_json::json;
use sqlx::Connection;

use super::checker::Status;
use super::clock::now_ns;
use super::db::{admin_options, advisory_holders};
use super::history::{CONTROL, Recorder};
use super::procs::Fleet;
use super::report::Outcome;
use super::worker::{Broken, Config, Mode};
use super::{run_name, scale, scenario, setup};

const PROCESSES: i64 = 4;

#[test]
fn kill9_holders_inside_their_critical_sections() {
    scenario(kill9(Broken::No));
}

/// The control: the same kills with a locker that releases early must
/// fail.
#[test]
fn broken_locker_fails_under_kill9() {
    scenario(kill9(Broken::ReleaseEarly(0.1)));
}

async fn kill9(broken: Broken) {
    let name = &run_name("kill9", broken);
    let (db, dir) = setup(name, 16).await;
    let port = admin_options().get_port();
    let config = |p: i64| Config {
        tasks: 8,
        // Long enough that a kill usually lands inside a section.
        hold_us: (5_000, 200_000),
        broken,
        ..Config::new(p, &dir.path, &db.name, port, Mode::Session)
    };
    let mut fleet = Fleet::spawn(&dir.path, &(0..PROCESSES).map(config).collect::<Vec<_>>());
    let control = Recorder::create(&dir.path, CONTROL);
    let mut conn = db.connect("distlock-torture-control").await;
    let mut rng = StdRng::seed_from_u64(scale::seed_for(name));
    let duration = if broken == Broken::No {
        scale::pick(Duration::from_secs(10), Duration::from_secs(120))
    } else {
        Duration::from_secs(10)
    };
    let mut live: Vec<i64> = (0..PROCESSES).collect();
    let mut next = PROCESSES;
    let mut kills = 0;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let started = Instant::now();
    while started.elapsed() < duration {
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..600))).await;
        // A process that holds a lock right now.
        let holding: Vec<i64> = advisory_holders(&mut conn)
            .await
            .iter()
            .filter_map(|l| l.application.strip_prefix("torture-w")?.parse().ok())
            .filter(|p| live.contains(p))
            .collect();
        let Some(&victim) = holding.choose(&mut rng) else {
            continue;
        };
        if !fleet.running(victim) {
            continue;
        }
        let start = now_ns();
        let sent = fleet.kill9(victim);
        // Its open sections end at `start`, when `kill` was called: its
        // locks are freed only after it died, later than that. `dead` is
        // when the call returned, as read afterwards (for the record).
        control.emit(
            "fault",
            json!({"kind": "kill", "target": victim, "start": start, "dead": sent}),
        );
        kills += 1;
        live.retain(|&p| p != victim);
        live.push(next);
        fleet.add(&config(next));
        next += 1;
    }
    control.flush();
    fleet.stop();
    fleet.wait(Duration::from_secs(120)).await;
    let outcome = Outcome::analyse(&db, &dir.path, fleet.survivors()).await;
    let killed = outcome
        .history
        .held()
        .filter(|a| a.status() == Status::Killed)
        .count();
    outcome.print(
        "kill -9 of holder processes",
        &[format!(
            "{kills} processes killed, {killed} critical sections cut short by a kill, {} processes in all",
            next
        )],
    );
    if broken != Broken::No {
        outcome.assert_caught("kill -9");
        return;
    }
    outcome.assert_sound();
    outcome.assert_attributed();
    assert!(kills > 0, "no process was killed");
    assert!(killed > 0, "no kill landed inside a critical section");
    assert_eq!(
        db.advisory_locks().await,
        0,
        "advisory locks left after the run"
    );
    let _ = conn.close().await;
}
