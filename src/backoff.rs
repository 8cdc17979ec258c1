//! Jittered delays between acquisition attempts.
//!
//! Random delays keep contenders that failed together from retrying in
//! lockstep (for Redlock, from splitting the vote again; for singleton
//! jobs' replicas, from polling together).

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use rand::Rng;

/// Exponential backoff with "equal jitter" from `backon`: the n-th delay is
/// uniform in `[d/2, d)`, where `d` doubles from `first` up to `max`; it
/// never runs out.
pub(crate) fn exponential(first: Duration, max: Duration) -> ExponentialBackoff {
    // backon adds a random part of up to the current delay to it, so half
    // the bounds give delays between d/2 and d.
    ExponentialBuilder::new()
        .with_min_delay(first / 2)
        .with_max_delay(max / 2)
        .with_jitter()
        .without_max_times()
        .build()
}

/// `base` plus a uniformly random part of `jitter`, saturating at
/// `Duration::MAX`. Redlock's retry delay is a fixed part plus an
/// independent random part (its builder sets both), which backon's
/// jitter, a random part of the delay itself, cannot express.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn jittered(base: Duration, jitter: Duration) -> Duration {
    let nanos = u64::try_from(jitter.as_nanos()).unwrap_or(u64::MAX);
    base.saturating_add(Duration::from_nanos(rand::rng().random_range(0..=nanos)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_delays_saturate() {
        assert_eq!(jittered(Duration::MAX, Duration::MAX), Duration::MAX);
        let mut backoff = exponential(Duration::MAX, Duration::MAX);
        for _ in 0..3 {
            assert!(backoff.next().is_some_and(|d| d >= Duration::MAX / 4));
        }
    }

    #[test]
    fn delays_stay_within_their_bounds_and_grow_to_the_cap() {
        let mut backoff = exponential(Duration::from_millis(8), Duration::from_millis(32));
        let ceilings = [8, 16, 32, 32, 32, 32].map(Duration::from_millis);
        for ceiling in ceilings {
            let delay = backoff.next().unwrap_or_default();
            assert!(
                delay >= ceiling / 2 && delay <= ceiling,
                "{delay:?} vs {ceiling:?}"
            );
        }
    }
}
