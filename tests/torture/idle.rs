//! `idle_session_timeout` and `idle_in_transaction_session_timeout` set low
//! on the test database: a heartbeat shorter than the idle timeout keeps a
//! session lock alive however long it is held; one longer than it lets the
//! server end the session (and free the lock) between two beats; a
//! transaction that idles past its timeout is aborted, lock and all.

use std::time::Duration;

use super::checker::{Percentiles, Status};
use super::db::admin_options;
use super::procs::Fleet;
use super::report::Outcome;
use super::worker::{Broken, Config, Mode};
use super::{run_name, scale, scenario, setup};

const IDLE_SESSION: Duration = Duration::from_millis(1_000);
const IDLE_IN_TRANSACTION: Duration = Duration::from_millis(500);
/// How much longer than a timeout a section must last to have surely
/// crossed it on a loaded machine.
const SLACK: Duration = Duration::from_millis(500);

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).expect("ns")
}

#[test]
fn idle_session_and_idle_in_transaction_timeouts() {
    scenario(idle(Broken::No));
}

/// The control: the same timeouts with a locker that releases early (skips
/// the lock in transaction mode) must fail, although the checker forgives
/// every overlap of an idled-out holder as unattributed.
#[test]
fn broken_locker_fails_under_idle_timeouts() {
    scenario(idle(Broken::ReleaseEarly(0.1)));
}

async fn idle(broken: Broken) {
    let name = &run_name("idle", broken);
    let (db, dir) = setup(name, 32).await;
    db.set("idle_session_timeout", "1s").await;
    db.set("idle_in_transaction_session_timeout", "500ms").await;
    let port = admin_options().get_port();
    let base = |p, mode| Config {
        broken,
        ..Config::new(p, &dir.path, &db.name, port, mode)
    };
    let configs = vec![
        // 0, 1: heartbeat 100 ms, holds up to 2.5 s: kept alive.
        Config {
            heartbeat_ms: 100,
            hold_us: (0, 2_500_000),
            ..base(0, Mode::Session)
        },
        Config {
            heartbeat_ms: 100,
            hold_us: (0, 2_500_000),
            ..base(1, Mode::Session)
        },
        // 2: heartbeat 3 s, holds 1.2-2.5 s: the server ends the idle
        // session under the holder.
        Config {
            heartbeat_ms: 3_000,
            hold_us: (1_200_000, 2_500_000),
            tasks: 4,
            ..base(2, Mode::Session)
        },
        // 3: transactions that idle up to 1.5 s inside the lock.
        Config {
            key_base: 16,
            hold_us: (0, 1_500_000),
            ..base(3, Mode::Xact)
        },
        // 4: multiplexed session locks (heartbeat 100 ms) on the keys of
        // 0 and 1: its shared connections idle out whenever they hold
        // nothing.
        Config {
            heartbeat_ms: 100,
            hold_us: (0, 2_500_000),
            multiplex: 2,
            tasks: 8,
            ..base(4, Mode::Session)
        },
    ];
    let duration = if broken == Broken::No {
        scale::pick(Duration::from_secs(10), Duration::from_secs(150))
    } else {
        Duration::from_secs(10)
    };
    let mut fleet = Fleet::spawn(&dir.path, &configs);
    tokio::time::sleep(duration).await;
    fleet.stop();
    fleet.wait(Duration::from_secs(120)).await;
    let outcome = Outcome::analyse(&db, &dir.path, configs.len()).await;

    let h = &outcome.history;
    let of = |p: i64| h.held().filter(move |a| a.op.0 == p);
    let lost = |p: i64| of(p).filter(|a| a.status() == Status::Lost).count();
    let longer = |p: i64, d: Duration| {
        of(p)
            .filter(move |a| match (a.entered, a.exited) {
                (Some(i), Some(o)) => o - i > ns(d + SLACK),
                _ => false,
            })
            .collect::<Vec<_>>()
    };
    // Sections of 0, 1 and 4 that outlived the idle timeout, alive.
    let kept: usize = [0, 1, 4]
        .iter()
        .map(|&p| longer(p, IDLE_SESSION).len())
        .sum();
    let long_2 = longer(2, IDLE_SESSION);
    let long_3 = longer(3, IDLE_IN_TRANSACTION);
    let missed_2: Vec<_> = long_2
        .iter()
        .filter(|a| a.status() != Status::Lost)
        .map(|a| a.op)
        .collect();
    let missed_3: Vec<_> = long_3
        .iter()
        .filter(|a| a.status() != Status::Lost)
        .map(|a| a.op)
        .collect();
    // Process 2 learns of the server's decision at release (or at its
    // next beat): latency after the session's idle timeout ran out.
    let after_timeout = Percentiles::of(
        of(2)
            .filter(|a| a.status() == Status::Lost)
            .filter_map(|a| {
                let killed = a.acquired? + ns(IDLE_SESSION);
                Some(a.detected()?.saturating_sub(killed))
            })
            .collect(),
    );
    let committed_3 = of(3).filter(|a| a.status() == Status::Clean).count();
    outcome.print(
        "idle timeouts (idle_session_timeout 1 s, idle_in_transaction_session_timeout 500 ms)",
        &[
            format!(
                "heartbeat 100 ms (processes 0, 1, 4 multiplexed): {} sections, {kept} of them longer than the idle timeout, {} lost",
                of(0).count() + of(1).count() + of(4).count(),
                lost(0) + lost(1) + lost(4)
            ),
            format!(
                "heartbeat 3 s (process 2): {} sections, {} longer than the idle timeout, {} lost; detected {after_timeout} after the timeout",
                of(2).count(),
                long_2.len(),
                lost(2)
            ),
            format!(
                "transactions (process 3): {} sections, {} idled past the timeout, {} aborted, {committed_3} committed",
                of(3).count(),
                long_3.len(),
                lost(3)
            ),
        ],
    );
    if broken != Broken::No {
        outcome.assert_caught("idle timeouts");
        return;
    }
    outcome.assert_sound();
    assert_eq!(
        lost(0) + lost(1) + lost(4),
        0,
        "a heartbeat shorter than idle_session_timeout must keep the lock"
    );
    assert!(kept > 0, "no section outlived the idle timeout");
    assert!(!long_2.is_empty() && !long_3.is_empty(), "no long holds");
    assert!(
        missed_2.is_empty(),
        "idled out, never reported lost: {missed_2:?}"
    );
    assert!(
        missed_3.is_empty(),
        "idled out, yet committed: {missed_3:?}"
    );
    assert!(committed_3 > 0, "no transaction committed");
    assert_eq!(
        db.advisory_locks().await,
        0,
        "advisory locks left after the run"
    );
}
