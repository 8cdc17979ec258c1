//! A worker's event log: one line per event, `<event> <CLOCK_MONOTONIC ns>
//! <detail>`, written by a worker process (in another network namespace,
//! say) and read by the test that started it.
//!
//! `CLOCK_MONOTONIC` is one clock for every process and every namespace on
//! the machine, so the test can order the worker's events against its own.

use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};

use nix::time::{ClockId, clock_gettime};

/// Now, in `CLOCK_MONOTONIC` nanoseconds.
pub fn now_ns() -> u64 {
    let ts = clock_gettime(ClockId::CLOCK_MONOTONIC).expect("CLOCK_MONOTONIC");
    u64::try_from(ts.tv_sec()).expect("tv_sec") * 1_000_000_000
        + u64::try_from(ts.tv_nsec()).expect("tv_nsec")
}

/// Seconds from `from_ns` to `to_ns` (negative if `to_ns` comes first).
pub fn secs(from_ns: u64, to_ns: u64) -> f64 {
    (to_ns as f64 - from_ns as f64) / 1e9
}

/// The writing side, shared by a worker's tasks.
#[derive(Clone)]
pub struct Log(Arc<Mutex<std::fs::File>>);

impl Log {
    /// Creates (truncates) the log at `path`.
    pub fn create(path: impl AsRef<Path>) -> Log {
        Log(Arc::new(Mutex::new(
            std::fs::File::create(path).expect("event log"),
        )))
    }

    /// Appends `event` now, with `detail` on one line.
    pub fn line(&self, event: &str, detail: impl std::fmt::Display) {
        let detail = detail.to_string().replace('\n', " ");
        let mut file = self.0.lock().expect("log lock");
        writeln!(file, "{event} {} {detail}", now_ns()).expect("write log");
    }
}

/// The events logged at `path` so far: `(event, ns, detail)`.
pub fn events(path: &Path) -> Vec<(String, u64, String)> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ' ');
            let event = parts.next()?.to_owned();
            let at = parts.next()?.parse().ok()?;
            Some((event, at, parts.next().unwrap_or("").to_owned()))
        })
        .collect()
}

/// The first event `name` logged at `path`: `(ns, detail)`.
pub fn event(path: &Path, name: &str) -> Option<(u64, String)> {
    events(path)
        .into_iter()
        .find(|(e, _, _)| e == name)
        .map(|(_, at, detail)| (at, detail))
}
