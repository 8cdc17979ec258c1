//! Tracing spans of acquisitions: key, backend, wait time and outcome.

use tokio::time::Instant;

use crate::{Error, LockKey, metrics};

/// The `distlock.acquire` span (at `DEBUG`), as the PostgreSQL backend
/// names it; `mode` is `try` or `wait`.
pub(crate) fn acquire(key: &LockKey, backend: &'static str, mode: &'static str) -> tracing::Span {
    tracing::debug_span!(
        "distlock.acquire",
        key = %key,
        backend,
        mode,
        outcome = tracing::field::Empty,
        wait_ms = tracing::field::Empty,
    )
}

/// Records on the span and in the metrics how long the acquisition took and
/// how it ended (`acquired`, `busy`, `timeout` or `error`).
pub(crate) fn finish<T>(
    span: &tracing::Span,
    key: &LockKey,
    backend: &'static str,
    started: Instant,
    result: &Result<T, Error>,
    acquired: impl FnOnce(&T) -> bool,
) {
    let waited = started.elapsed();
    let outcome = match result {
        Ok(value) if acquired(value) => {
            metrics::acquired(backend, key, waited);
            "acquired"
        }
        Ok(_) => {
            metrics::busy(backend, key);
            "busy"
        }
        Err(Error::Timeout { .. }) => {
            metrics::timeout(backend, key, waited);
            "timeout"
        }
        Err(_) => "error",
    };
    span.record("outcome", outcome);
    span.record("wait_ms", waited.as_secs_f64() * 1e3);
}
