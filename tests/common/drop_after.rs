//! Dropping a future after it has returned `Pending` a given number of
//! times: a cancellation at a chosen `.await`.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// Polls the inner future until it has returned Pending `budget` more
/// times, then gives up (`None`) and drops it.
pub struct DropAfter<F: Future> {
    fut: Pin<Box<F>>,
    budget: usize,
}

impl<F: Future> Future for DropAfter<F> {
    type Output = Option<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.fut.as_mut().poll(cx) {
            Poll::Ready(out) => Poll::Ready(Some(out)),
            Poll::Pending if self.budget == 0 => Poll::Ready(None),
            Poll::Pending => {
                self.budget -= 1;
                Poll::Pending
            }
        }
    }
}

/// `fut`, dropped after `budget` Pendings.
pub fn drop_after<F: Future>(budget: usize, fut: F) -> DropAfter<F> {
    DropAfter {
        fut: Box::pin(fut),
        budget,
    }
}
