//! How big a run is: `DISTLOCK_TORTURE=full` for the figures in
//! RELIABILITY.md, anything else (or unset) for the short run CI does.

/// Whether this is the full run.
pub fn full() -> bool {
    std::env::var("DISTLOCK_TORTURE").is_ok_and(|v| v == "full")
}

/// `ci` in the short run, `full` in the full one.
pub fn pick<T>(ci: T, full: T) -> T {
    if self::full() { full } else { ci }
}

/// The name of the current size, for reports.
pub fn name() -> &'static str {
    pick("short", "full")
}
