//! Deadlines that saturate: a timeout too large to add to the clock means
//! "as long as possible", never an overflow panic.

use std::time::Duration;

use tokio::time::Instant;

/// About 30 years: later than any deadline that can pass in practice, and
/// early enough to be added to any `Instant` a running process has.
const FAR_FUTURE: Duration = Duration::from_secs(86_400 * 365 * 30);

/// `start + timeout`, or a point about 30 years after `start` when that
/// would not fit (`Duration::MAX` and the like).
pub(crate) fn after(start: Instant, timeout: Duration) -> Instant {
    start
        .checked_add(timeout)
        .unwrap_or_else(|| start + FAR_FUTURE)
}

/// `timeout` from now, saturating like [`after`].
pub(crate) fn from_now(timeout: Duration) -> Instant {
    after(Instant::now(), timeout)
}

/// `timeout` from a `std` instant, saturating like [`after`].
pub(crate) fn after_std(start: std::time::Instant, timeout: Duration) -> Instant {
    after(Instant::from_std(start), timeout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_timeouts_saturate() {
        let now = Instant::now();
        assert!(after(now, Duration::MAX) > now + Duration::from_secs(86_400 * 365));
        assert_eq!(
            after(now, Duration::from_secs(1)),
            now + Duration::from_secs(1)
        );
        assert!(from_now(Duration::MAX) > now);
    }
}
