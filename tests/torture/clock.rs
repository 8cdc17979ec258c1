//! Timestamps every process on this machine agrees on.
//!
//! `std::time::Instant` cannot be compared across processes, so histories
//! carry `CLOCK_MONOTONIC` in nanoseconds: one clock for the whole machine,
//! never stepped by NTP, and still running while a process is stopped.

use nix::time::{ClockId, clock_gettime};

/// Nanoseconds of `CLOCK_MONOTONIC`.
pub fn now_ns() -> u64 {
    let ts = clock_gettime(ClockId::CLOCK_MONOTONIC).expect("CLOCK_MONOTONIC");
    let secs = u64::try_from(ts.tv_sec()).expect("monotonic seconds");
    let nanos = u64::try_from(ts.tv_nsec()).expect("monotonic nanoseconds");
    secs * 1_000_000_000 + nanos
}

/// Milliseconds between two timestamps, as a float for reports.
pub fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}
