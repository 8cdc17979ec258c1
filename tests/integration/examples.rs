//! The examples, run in their short versions against a test database: each
//! invoice gets one reminder, each order one charge, the migrations are
//! applied once.
//!
//! The example sources are compiled into this test as modules, so the test
//! always runs the current code (no stale example binary) and can call each
//! example's `run` function and check its summary.

use std::process::{Command, Stdio};

use sqlx::PgPool;

use crate::common::url_of;

#[allow(dead_code)]
#[path = "../../examples/cron_worker.rs"]
mod cron_worker;
#[allow(dead_code)]
#[path = "../../examples/leader.rs"]
mod leader;
#[allow(dead_code)]
#[path = "../../examples/migration_runner.rs"]
mod migration_runner;
#[allow(dead_code)]
#[path = "../../examples/wait_chain.rs"]
mod wait_chain;
#[allow(dead_code)]
#[path = "../../examples/web_handler.rs"]
mod web_handler;

#[sqlx::test(migrations = false)]
async fn cron_worker_sends_each_reminder_once_and_the_others_skip(pool: PgPool) {
    // Three ticks do the work (two invoices per run); a fourth leaves slack
    // for a loaded machine.
    let summary = cron_worker::run(&url_of(&pool), 4).await.expect("example");
    assert!(summary.exactly_once(), "{summary:?}");
    assert_eq!(summary.runs + summary.skips, 12, "{summary:?}");
    assert!(summary.runs >= 3, "{summary:?}");
    assert!(summary.skips >= 4, "the other workers skip: {summary:?}");
}

#[sqlx::test(migrations = false)]
async fn leader_example_schedules_under_one_leader_and_takes_over(pool: PgPool) {
    let summary = leader::run(&url_of(&pool)).await.expect("example");
    assert!(summary.one_leader_at_a_time(), "{summary:?}");
    assert!(summary.rounds.len() >= 5, "{summary:?}");
    // The observer saw the first leader and its successor, a higher term.
    let terms: Vec<u64> = summary.observed.iter().map(|(_, term)| *term).collect();
    assert!(terms.len() >= 2 && terms.is_sorted(), "{summary:?}");
}

#[sqlx::test(migrations = false)]
async fn wait_chain_example_times_out_with_the_chain_to_the_root(pool: PgPool) {
    let summary = wait_chain::run(&url_of(&pool)).await.expect("example");
    assert_eq!(summary.timeout_chain, ["ledger-close", "nightly-export"]);
    assert_eq!(summary.holders_chain, ["ledger-close", "nightly-export"]);
}

#[sqlx::test(migrations = false)]
async fn web_handler_charges_each_order_once(pool: PgPool) {
    let summary = web_handler::run(&url_of(&pool)).await.expect("example");
    assert!(summary.charged_once(), "{summary:?}");
    assert_eq!(summary.charges.len(), 2, "{summary:?}");
    assert!(
        summary.duplicates.iter().all(|s| *s == 200 || *s == 409),
        "duplicates get the charge, its stored result, or 409: {summary:?}"
    );
    assert!(summary.duplicates.contains(&200), "{summary:?}");
    assert!(summary.retry_replayed, "{summary:?}");
    assert_eq!(summary.new_key_for_paid_order, 409, "{summary:?}");
}

/// Set for the child processes of the migration-runner test.
const CHILD_ENV: &str = "DISTLOCK_EXAMPLE_MIGRATION_RUNNER_CHILD";

#[sqlx::test(migrations = false)]
async fn migration_runner_applies_the_migrations_once(pool: PgPool) {
    let exe = std::env::current_exe().expect("test binary");
    // The runners are this test binary again, running only the test below.
    let summary = migration_runner::run_parent(&url_of(&pool), |id| {
        let mut child = Command::new(&exe);
        child
            .args(["--exact", "examples::migration_runner_child", "--nocapture"])
            .env(CHILD_ENV, id.to_string())
            .stdout(Stdio::null());
        child
    })
    .await
    .expect("example");
    assert_eq!(summary.exits.len(), migration_runner::RUNNERS);
    assert!(summary.applied_once(), "{summary:?}");
}

/// One migration runner, when started as a child by the test above; does
/// nothing in a normal test run.
#[tokio::test]
async fn migration_runner_child() {
    let Ok(id) = std::env::var(CHILD_ENV) else {
        return;
    };
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL from the parent");
    migration_runner::run_child(&url, id.parse().expect("runner id"))
        .await
        .expect("runner");
}
