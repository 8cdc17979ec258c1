//! Tracing spans of acquisitions, shared by every backend: key, backend,
//! mode, wait time and outcome (the `distlock.acquire` span at `DEBUG`), and
//! the `distlock.wait` span around the statements that wait on the server.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
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

/// How an acquisition ended.
#[derive(Debug, Clone, Copy)]
enum Outcome {
    Acquired,
    Busy,
    Timeout,
    Error,
}

impl Outcome {
    fn of<T>(result: &Result<T, Error>, acquired: impl FnOnce(&T) -> bool) -> Self {
        match result {
            Ok(value) if acquired(value) => Outcome::Acquired,
            Ok(_) => Outcome::Busy,
            Err(err) => Outcome::of_error(err),
        }
    }

    fn of_error(err: &Error) -> Self {
        match err {
            Error::Timeout { .. } => Outcome::Timeout,
            _ => Outcome::Error,
        }
    }
}

/// Records on `span` and in the metrics how long the acquisition took and
/// how it ended (`acquired`, `busy`, `timeout` or `error`).
fn record(
    span: &tracing::Span,
    key: &LockKey,
    backend: &'static str,
    started: Instant,
    outcome: Outcome,
) {
    let waited = started.elapsed();
    let name = match outcome {
        Outcome::Acquired => {
            metrics::acquired(backend, key, waited);
            "acquired"
        }
        Outcome::Busy => {
            metrics::busy(backend, key);
            "busy"
        }
        Outcome::Timeout => {
            metrics::timeout(backend, key, waited);
            "timeout"
        }
        Outcome::Error => "error",
    };
    span.record("outcome", name);
    span.record("wait_ms", waited.as_secs_f64() * 1e3);
}

/// Records, on the current span, an acquisition that ended without an
/// error (`acquired` or busy), for a path whose span outlives the
/// acquisition (a transaction-scoped lock's covers the caller's work).
pub(crate) fn ended(key: &LockKey, backend: &'static str, started: Instant, acquired: bool) {
    let outcome = if acquired {
        Outcome::Acquired
    } else {
        Outcome::Busy
    };
    record(&tracing::Span::current(), key, backend, started, outcome);
}

/// As [`ended`], for an acquisition that failed with `err`; returns it.
pub(crate) fn failed(key: &LockKey, backend: &'static str, started: Instant, err: Error) -> Error {
    record(
        &tracing::Span::current(),
        key,
        backend,
        started,
        Outcome::of_error(&err),
    );
    err
}

/// Runs one acquisition (`body`) inside its span and records how it ended;
/// `acquired` tells a granted result from a busy one.
///
/// Not an `async fn`: the returned [`Traced`] future adds only the span and
/// the record to `body`'s future, where an `async fn` would hold `body`
/// twice (a lock's future is large, and every wrapper layer adds to it).
/// Dropped before it is done, it records nothing, as the acquisition it
/// wraps leaves nothing held.
pub(crate) fn traced<'a, T: 'a>(
    key: &'a LockKey,
    backend: &'static str,
    mode: &'static str,
    acquired: impl FnOnce(&T) -> bool + 'a,
    body: impl Future<Output = Result<T, Error>> + 'a,
) -> impl Future<Output = Result<T, Error>> + 'a {
    traced_in(acquire(key, backend, mode), key, backend, acquired, body)
}

/// As [`traced`], in `span`, a span of the caller's with the fields
/// `outcome` and `wait_ms` (a multi-key acquisition's, whose metrics carry
/// its first key).
pub(crate) fn traced_in<'a, T: 'a, A: FnOnce(&T) -> bool + 'a>(
    span: tracing::Span,
    key: &'a LockKey,
    backend: &'static str,
    acquired: A,
    body: impl Future<Output = Result<T, Error>> + 'a,
) -> impl Future<Output = Result<T, Error>> + 'a {
    Traced {
        body: body.instrument(span.clone()),
        record: Some(Record {
            span,
            key,
            backend,
            started: Instant::now(),
            acquired,
        }),
    }
}

/// What [`Traced`] records once its body is done.
struct Record<'a, A> {
    span: tracing::Span,
    key: &'a LockKey,
    backend: &'static str,
    started: Instant,
    acquired: A,
}

pin_project_lite::pin_project! {
    /// An acquisition's future and what to record when it is done. Written
    /// out rather than built from combinators: its `poll` is a small frame,
    /// where a general `map`'s debug-build frame held the output several
    /// times over (a waiting call's stack is deep: tests run on 2 MiB
    /// threads).
    struct Traced<'a, F, A> {
        #[pin]
        body: tracing::instrument::Instrumented<F>,
        record: Option<Record<'a, A>>,
    }
}

impl<T, F, A> Future for Traced<'_, F, A>
where
    F: Future<Output = Result<T, Error>>,
    A: FnOnce(&T) -> bool,
{
    type Output = Result<T, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let result = std::task::ready!(this.body.poll(cx));
        if let Some(r) = this.record.take() {
            let outcome = Outcome::of(&result, r.acquired);
            record(&r.span, r.key, r.backend, r.started, outcome);
        }
        Poll::Ready(result)
    }
}

/// Runs `body`, the part of an acquisition that may wait on the server (and
/// never the caller's own work), in the `distlock.wait` span.
///
/// A lock wait is a statement that runs as long as the wait, so sqlx logs
/// one longer than its threshold as a slow statement (`WARN`, target
/// `sqlx::query`); the span is what tells that line from a slow query of
/// the caller's, and lets a filter drop it (README, "Observability"). It is
/// at `WARN` so that it exists wherever that warning is shown.
pub(crate) fn waiting<F: Future>(
    key: &impl std::fmt::Display,
    body: F,
) -> tracing::instrument::Instrumented<F> {
    body.instrument(tracing::warn_span!("distlock.wait", key = %key))
}
