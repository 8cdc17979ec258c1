//! The torture suite: distlock under contention and injected faults, judged
//! by an offline checker over the histories of every process involved.
//!
//! ```sh
//! cargo test --all-features --test torture                  # short run (CI)
//! DISTLOCK_TORTURE=full cargo test --all-features --test torture -- --nocapture
//! ```
//!
//! The full run produces the figures of RELIABILITY.md (about 26 minutes on
//! two cores); `--nocapture` shows each scenario's figures in either run.
//!
//! Scenarios run one at a time (they share two cores and a PostgreSQL),
//! each in a database of its own; the crash and failover scenario runs on
//! private clusters (`tests/common/cluster.rs`). Multi-process scenarios
//! start this test binary again as worker processes (`worker_entry`,
//! configured through `DISTLOCK_TORTURE_WORKER`); the test process injects
//! the faults and records them in a history of its own. See `checker.rs` for what is
//! judged, and RELIABILITY.md for the figures of a full run.

mod checker;
mod clock;
mod db;
mod history;
mod procs;
mod report;
mod scale;
mod worker;

#[allow(dead_code)]
#[path = "../common/cluster.rs"]
mod cluster;
#[allow(dead_code)]
#[path = "../common/pgbouncer.rs"]
mod pgbouncer;
#[allow(dead_code)]
#[path = "../common/proxy.rs"]
mod proxy;

mod cancel;
mod checker_tests;
mod contention;
mod failover;
mod idle;
mod kill9;
mod network;
mod pooler;
mod sigstop;
mod terminate;

use std::future::Future;

/// Scenarios take turns: each one measures latencies and throughput, which
/// another scenario running at the same time would distort.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs one scenario on a runtime of its own, after the previous one.
fn scenario(body: impl Future<Output = ()>) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let _turn = SERIAL.lock().await;
        body.await;
    });
}

/// A scenario's run name: `base`, or `base_broken` for its broken-locker
/// control.
fn run_name(base: &str, broken: worker::Broken) -> String {
    if broken == worker::Broken::No {
        base.to_owned()
    } else {
        format!("{base}_broken")
    }
}

/// What most scenarios start with: a database of their own on the server of
/// `DATABASE_URL`, with the fencing migrations and a register of `keys`
/// keys, and a run directory for the histories.
async fn setup(name: &str, keys: i64) -> (db::TestDb, procs::RunDir) {
    let db = db::TestDb::create(name).await;
    db.prepare(keys).await;
    (db, procs::RunDir::new(name))
}

/// The worker process's entry point (see `worker.rs`); returns at once in
/// the test run itself.
#[test]
fn worker_entry() {
    worker::main_from_env();
}
