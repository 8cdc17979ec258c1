//! Tracing spans of acquisitions, shared by every backend: key, backend,
//! mode, wait time and outcome (the `distlock.acquire` span at `DEBUG`).

use std::future::Future;
use std::time::Instant;
use tracing::Instrument;

use crate::{Error, LockKey, metrics};

/// The `distlock.acquire` span; `mode` is `try`, `wait`, `try_shared`, ….
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
fn finish<T>(
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

/// Runs one acquisition (`body`) inside its span and records how it ended;
/// `acquired` tells a granted result from a busy one.
pub(crate) async fn traced<T>(
    key: &LockKey,
    backend: &'static str,
    mode: &'static str,
    acquired: impl FnOnce(&T) -> bool,
    body: impl Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    let span = acquire(key, backend, mode);
    let started = Instant::now();
    let result = body.instrument(span.clone()).await;
    finish(&span, key, backend, started, &result, acquired);
    result
}

/// Records on the current span how long the acquisition has waited.
pub(crate) fn record_wait(started: Instant) {
    tracing::Span::current().record("wait_ms", started.elapsed().as_secs_f64() * 1e3);
}
