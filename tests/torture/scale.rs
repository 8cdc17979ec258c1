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

/// The seed of this run: `DISTLOCK_TORTURE_SEED` if set, else one drawn from
/// the clock once per test process. Every scenario prints it; workers and
/// fault schedules derive their random choices from it, so a run's choices
/// can be repeated (timing on a shared machine cannot).
pub fn seed() -> u64 {
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SEED.get_or_init(|| match std::env::var("DISTLOCK_TORTURE_SEED") {
        Ok(text) => text
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("DISTLOCK_TORTURE_SEED={text:?} is not a u64")),
        Err(_) => super::clock::now_ns() ^ u64::from(std::process::id()) << 40,
    })
}

/// A seed for one scenario's own choices (fault schedule), derived from
/// [`seed`] and the scenario's name.
pub fn seed_for(scenario: &str) -> u64 {
    scenario
        .bytes()
        .fold(seed(), |h, b| h.rotate_left(5) ^ u64::from(b))
}
