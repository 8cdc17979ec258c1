//! Runs a future so that a panic inside it becomes a value.

use std::any::Any;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::task::{Context, Poll};

/// Polls the inner future inside `catch_unwind`: a panicking job must not
/// unwind through the runner, which still holds the job's lease and has to
/// release it.
///
/// The future is boxed so this wrapper is `Unpin` and needs no pin projection.
pub(crate) struct CatchUnwind<F> {
    inner: Pin<Box<F>>,
}

impl<F: Future> CatchUnwind<F> {
    pub(crate) fn new(inner: F) -> Self {
        Self {
            inner: Box::pin(inner),
        }
    }
}

impl<F: Future> Future for CatchUnwind<F> {
    type Output = Result<F::Output, String>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = self.inner.as_mut();
        // AssertUnwindSafe: after a panic the future is never polled again
        // (the runner drops it), so no broken invariant can be observed.
        match catch_unwind(AssertUnwindSafe(move || inner.poll(cx))) {
            Ok(Poll::Ready(value)) => Poll::Ready(Ok(value)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(payload) => Poll::Ready(Err(panic_message(payload.as_ref()))),
        }
    }
}

/// The text of a panic payload (`panic!("..")` yields `&str` or `String`).
fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "a panic with a non-string payload".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::CatchUnwind;

    #[tokio::test]
    async fn a_panic_becomes_its_message() {
        let answer = 42;
        let caught = CatchUnwind::new(async move {
            if answer == 42 {
                panic!("boom {answer}");
            }
        })
        .await;
        assert_eq!(caught, Err("boom 42".to_owned()));
        let fine = CatchUnwind::new(async { 7 }).await;
        assert_eq!(fine, Ok(7));
    }
}
