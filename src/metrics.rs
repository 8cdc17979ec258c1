//! Counters and histograms through the [`metrics`](https://docs.rs/metrics)
//! facade (cargo feature `metrics`).
//!
//! | name | kind | labels | when |
//! |---|---|---|---|
//! | `distlock_acquired_total` | counter | `backend`, `key` | a lock was taken |
//! | `distlock_busy_total` | counter | `backend`, `key` | a try found it held elsewhere |
//! | `distlock_timeout_total` | counter | `backend`, `key` | a wait passed its deadline |
//! | `distlock_lost_total` | counter | `backend`, `key` | a held lock stopped being trustworthy |
//! | `distlock_released_total` | counter | `backend`, `key` | a lock was released |
//! | `distlock_wait_seconds` | histogram | `backend`, `key` | time to take a lock (taken or timed out) |
//! | `distlock_hold_seconds` | histogram | `backend`, `key` | time a lock was held until released |
//! | `distlock_job_runs_total` | counter | `job`, `outcome` | a singleton job finished (`ran`, `skipped`, ...) |
//! | `distlock_job_seconds` | histogram | `job`, `outcome` | how long a job that ran took |
//!
//! Lock metrics come from the backends, job metrics from
//! [`SingletonJob`](crate::SingletonJob), so a job's lock is counted once.
//!
//! Lock names are often built from ids (`order:4711`); a label per id would
//! create a time series per id. `set_key_label` (feature `metrics`) chooses
//! what the `key` and `job` labels carry for the whole process; the default,
//! `KeyLabel::Prefix`, keeps the part before the first `:`.
//!
//! Without the feature every function here compiles to nothing.

use std::time::Duration;

use crate::LockKey;

/// What the `key` (and `job`) label of distlock's metrics carries.
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KeyLabel {
    /// The full key name (`order:4711`). Only for a small, fixed set of names.
    Full,
    /// The name up to its first `:` (`order`), or the whole name if it has
    /// none; numeric keys ([`LockKey::id`]) become `id`. The default.
    #[default]
    Prefix,
    /// No `key`/`job` label at all (the label is set to the empty string so
    /// every series has the same label names).
    None,
}

#[cfg(feature = "metrics")]
mod enabled {
    use std::sync::atomic::{AtomicU8, Ordering};
    use std::time::Duration;

    use ::metrics::{counter, histogram};

    use super::KeyLabel;
    use crate::LockKey;

    /// The process-wide [`KeyLabel`], stored as its discriminant.
    static KEY_LABEL: AtomicU8 = AtomicU8::new(1);

    /// Chooses what the `key` and `job` labels of distlock's metrics carry,
    /// for the whole process (default [`KeyLabel::Prefix`]).
    ///
    /// ```
    /// distlock::metrics::set_key_label(distlock::metrics::KeyLabel::Full);
    /// ```
    pub fn set_key_label(mode: KeyLabel) {
        let code = match mode {
            KeyLabel::Full => 0,
            KeyLabel::Prefix => 1,
            KeyLabel::None => 2,
        };
        KEY_LABEL.store(code, Ordering::Relaxed);
    }

    /// The process-wide [`KeyLabel`] set by [`set_key_label`].
    pub fn key_label() -> KeyLabel {
        match KEY_LABEL.load(Ordering::Relaxed) {
            0 => KeyLabel::Full,
            2 => KeyLabel::None,
            _ => KeyLabel::Prefix,
        }
    }

    /// The label value for `key` under the current setting.
    pub(crate) fn label(key: &LockKey) -> String {
        label_with(key_label(), key)
    }

    pub(crate) fn label_with(mode: KeyLabel, key: &LockKey) -> String {
        match (mode, key.name()) {
            (KeyLabel::None, _) => String::new(),
            (KeyLabel::Full, _) => key.to_string(),
            (KeyLabel::Prefix, Some(name)) => name
                .split_once(':')
                .map_or(name, |(prefix, _)| prefix)
                .to_owned(),
            (KeyLabel::Prefix, None) => "id".to_owned(),
        }
    }

    pub(crate) fn acquired(backend: &'static str, key: &LockKey, waited: Duration) {
        let key = label(key);
        counter!("distlock_acquired_total", "backend" => backend, "key" => key.clone())
            .increment(1);
        histogram!("distlock_wait_seconds", "backend" => backend, "key" => key)
            .record(waited.as_secs_f64());
    }

    pub(crate) fn busy(backend: &'static str, key: &LockKey) {
        counter!("distlock_busy_total", "backend" => backend, "key" => label(key)).increment(1);
    }

    pub(crate) fn timeout(backend: &'static str, key: &LockKey, waited: Duration) {
        let key = label(key);
        counter!("distlock_timeout_total", "backend" => backend, "key" => key.clone()).increment(1);
        histogram!("distlock_wait_seconds", "backend" => backend, "key" => key)
            .record(waited.as_secs_f64());
    }

    pub(crate) fn lost(backend: &'static str, key: &LockKey) {
        counter!("distlock_lost_total", "backend" => backend, "key" => label(key)).increment(1);
    }

    pub(crate) fn released(backend: &'static str, key: &LockKey, held: Duration) {
        let key = label(key);
        counter!("distlock_released_total", "backend" => backend, "key" => key.clone())
            .increment(1);
        histogram!("distlock_hold_seconds", "backend" => backend, "key" => key)
            .record(held.as_secs_f64());
    }

    pub(crate) fn job_finished(job: &LockKey, outcome: &'static str, took: Option<Duration>) {
        let job = label(job);
        counter!("distlock_job_runs_total", "job" => job.clone(), "outcome" => outcome)
            .increment(1);
        if let Some(took) = took {
            histogram!("distlock_job_seconds", "job" => job, "outcome" => outcome)
                .record(took.as_secs_f64());
        }
    }
}

#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub use enabled::{key_label, set_key_label};

// The crate-internal entry points. They take plain values so a call site is
// one line whatever the feature; without the feature they do nothing.

/// A lock was taken after waiting `waited`.
#[inline]
pub(crate) fn acquired(backend: &'static str, key: &LockKey, waited: Duration) {
    #[cfg(feature = "metrics")]
    enabled::acquired(backend, key, waited);
    #[cfg(not(feature = "metrics"))]
    let _ = (backend, key, waited);
}

/// A try found the lock held elsewhere.
#[inline]
pub(crate) fn busy(backend: &'static str, key: &LockKey) {
    #[cfg(feature = "metrics")]
    enabled::busy(backend, key);
    #[cfg(not(feature = "metrics"))]
    let _ = (backend, key);
}

/// A wait for the lock passed its deadline after `waited`.
#[inline]
pub(crate) fn timeout(backend: &'static str, key: &LockKey, waited: Duration) {
    #[cfg(feature = "metrics")]
    enabled::timeout(backend, key, waited);
    #[cfg(not(feature = "metrics"))]
    let _ = (backend, key, waited);
}

/// A held lock was declared lost.
#[inline]
pub(crate) fn lost(backend: &'static str, key: &LockKey) {
    #[cfg(feature = "metrics")]
    enabled::lost(backend, key);
    #[cfg(not(feature = "metrics"))]
    let _ = (backend, key);
}

/// A lock was released after being held for `held`.
#[inline]
pub(crate) fn released(backend: &'static str, key: &LockKey, held: Duration) {
    #[cfg(feature = "metrics")]
    enabled::released(backend, key, held);
    #[cfg(not(feature = "metrics"))]
    let _ = (backend, key, held);
}

/// A singleton job finished with `outcome`; `took` is set when it ran.
#[inline]
pub(crate) fn job_finished(job: &LockKey, outcome: &'static str, took: Option<Duration>) {
    #[cfg(feature = "metrics")]
    enabled::job_finished(job, outcome, took);
    #[cfg(not(feature = "metrics"))]
    let _ = (job, outcome, took);
}

#[cfg(all(test, feature = "metrics"))]
mod tests {
    use super::KeyLabel;
    use super::enabled::label_with;
    use crate::LockKey;

    #[test]
    fn prefix_label_keeps_the_part_before_the_first_colon() {
        let key = LockKey::from("order:4711:charge");
        assert_eq!(label_with(KeyLabel::Prefix, &key), "order");
        assert_eq!(label_with(KeyLabel::Full, &key), "order:4711:charge");
        assert_eq!(label_with(KeyLabel::None, &key), "");
        assert_eq!(
            label_with(KeyLabel::Prefix, &LockKey::from("nightly")),
            "nightly"
        );
        assert_eq!(label_with(KeyLabel::Prefix, &LockKey::id(42)), "id");
        assert_eq!(label_with(KeyLabel::Full, &LockKey::id(42)), "42");
    }
}
