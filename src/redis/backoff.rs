//! Jittered delays between acquisition attempts.
//!
//! Redis cannot queue waiters as PostgreSQL does, so waiting means trying
//! again. Random delays keep contenders that failed together from retrying in
//! lockstep (and, for Redlock, from splitting the vote again).

use std::time::Duration;

use rand::Rng;

/// Exponential backoff with "equal jitter": each delay is uniform in
/// `[d/2, d]`, and `d` doubles from `first` up to `max`.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    pub(crate) fn new(first: Duration, max: Duration) -> Self {
        Self { next: first, max }
    }

    pub(crate) fn next_delay(&mut self) -> Duration {
        let ceiling = self.next;
        self.next = ceiling.saturating_mul(2).min(self.max);
        jittered(ceiling / 2, ceiling / 2)
    }
}

/// `base` plus a uniformly random part of `jitter`, saturating at
/// `Duration::MAX`.
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
        let mut backoff = Backoff::new(Duration::MAX, Duration::MAX);
        assert!(backoff.next_delay() >= Duration::MAX / 2);
        assert!(backoff.next_delay() >= Duration::MAX / 2);
    }

    #[test]
    fn delays_stay_within_their_bounds_and_grow_to_the_cap() {
        let mut backoff = Backoff::new(Duration::from_millis(8), Duration::from_millis(32));
        let delays: Vec<_> = (0..5).map(|_| backoff.next_delay()).collect();
        let ceilings = [8, 16, 32, 32, 32].map(Duration::from_millis);
        for (delay, ceiling) in delays.into_iter().zip(ceilings) {
            assert!(
                delay >= ceiling / 2 && delay <= ceiling,
                "{delay:?} vs {ceiling:?}"
            );
        }
    }
}
