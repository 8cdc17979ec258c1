//! A pooled connection whose socket can be read while no statement runs, so
//! that a session lock learns of a server-ended session from the server's
//! goodbye, not at its next heartbeat.
//!
//! When PostgreSQL ends a session (`pg_terminate_backend`, a shutdown, a
//! crash, a switchover) it sends an ErrorResponse and closes the socket. sqlx
//! reads a connection only inside a statement, except in `PgListener`, which
//! also reads it between statements (for notifications) and runs statements
//! on it. A `PgListener` can only take its connection from a pool itself, so
//! a session lock's connection is taken as one from the start: the same
//! `pool.acquire()` (and a channel allocation), no statement more. A lock's
//! connection listens to no channel, so all that can arrive while no
//! statement runs is the goodbye; a semaphore's head `LISTEN`s (a statement
//! of its own) and reads its notifications with [`WatchedConn::notice`].
//!
//! Two habits of `PgListener` need care here:
//! - Dropped, it returns its connection to the pool in a task it spawns,
//!   after an `UNLISTEN *`. Right for a connection that holds no lock; one
//!   that may hold a lock must be closed instead ([`WatchedConn::close`]).
//! - After it found its connection closed, its next use would quietly take
//!   another one from the pool: a different session. It is told not to
//!   reconnect by itself, and once it has reported a closed connection it is
//!   dropped here, so it is never used again.

use std::future::Future;
use std::task::{Context, Poll, Waker};

use sqlx::postgres::{PgConnection, PgListener};
use sqlx::{Acquire, PgPool};

use crate::LossReason;

/// A pooled connection that can be read while idle. Dropped, it goes back
/// to the pool (in a background task, after an `UNLISTEN *`); a connection
/// that may hold a lock is [`close`](Self::close)d instead.
#[derive(Debug)]
pub(crate) struct WatchedConn {
    /// `None` once the server closed the connection: the listener then has
    /// none, and must not be asked for one (it would take another).
    listener: Option<PgListener>,
}

impl WatchedConn {
    /// A connection from `pool`: what `pool.acquire()` costs (a ping first,
    /// if the pool tests connections before handing them out).
    ///
    /// # Cancel safety
    ///
    /// As `pool.acquire()`: dropped before it completes, nothing is taken.
    pub(crate) async fn acquire(pool: &PgPool) -> Result<Self, sqlx::Error> {
        // Boxed: the pool's acquisition future is large (see
        // `pooled::acquire`), and a lock call that takes a warm connection
        // should not carry it.
        let mut listener = Box::pin(PgListener::connect_with(pool)).await?;
        // A held lock keeps its connection while the pool closes, as a plain
        // pooled connection would; the pool's closing is no loss.
        listener.ignore_pool_close_event(true);
        // A closed connection must never be replaced behind the lock's back.
        listener.eager_reconnect(false);
        Ok(Self {
            listener: Some(listener),
        })
    }

    /// The connection, for running statements; `None` once the server
    /// closed it.
    pub(crate) fn conn(&mut self) -> Option<&mut PgConnection> {
        let listener = self.listener.as_mut()?;
        // `PgListener` hands out its connection through a future, which is
        // ready at once while it has one: it loses it only when it reads a
        // closed socket, and `listener` is `None` from then on.
        let mut cx = Context::from_waker(Waker::noop());
        match listener.acquire().as_mut().poll(&mut cx) {
            Poll::Ready(Ok(conn)) => Some(conn),
            Poll::Ready(Err(_)) | Poll::Pending => None,
        }
    }

    /// Reads what the server sent while no statement ran, if anything:
    /// ready with why the session is over once the server has ended it
    /// (its goodbye, then the closed socket), pending otherwise, with `cx`'s
    /// task woken when more arrives. Must only be called while no statement
    /// is in flight on the connection.
    ///
    /// Each call reads afresh: nothing is kept between calls, so the caller
    /// may let go of the connection (to run a statement, or to release the
    /// lock) between any two calls. sqlx consumes a message only once it is
    /// read whole.
    pub(crate) fn poll_goodbye(&mut self, cx: &mut Context<'_>) -> Poll<LossReason> {
        loop {
            let Some(listener) = self.listener.as_mut() else {
                return Poll::Ready(closed());
            };
            let read = {
                let next = std::pin::pin!(listener.try_recv());
                next.poll(cx)
            };
            match read {
                Poll::Pending => return Poll::Pending,
                // A notification for a channel an earlier user of the pooled
                // connection listened to: nothing to do with the lock.
                Poll::Ready(Ok(Some(_))) => {}
                // The socket closed (after the goodbye, which the listener
                // reads past). The listener has closed and let go of the
                // connection; it must not be used again.
                Poll::Ready(Ok(None)) => {
                    self.listener = None;
                    return Poll::Ready(closed());
                }
                Poll::Ready(Err(err)) => {
                    return Poll::Ready(crate::postgres::pooler::loss_reason(&err));
                }
            }
        }
    }

    /// The payload of the next notification on a channel the connection
    /// `LISTEN`s to (whichever statement subscribed it), waiting for it while
    /// no statement runs; `Err` with why the session is over once the server
    /// has ended it. Reads nothing from the server that was not sent to it.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a notification is consumed only once it is read whole.
    pub(crate) async fn notice(&mut self) -> Result<String, LossReason> {
        let Some(listener) = self.listener.as_mut() else {
            return Err(closed());
        };
        // Boxed: the listener's receive future is about 9 KB, and a
        // waiting caller's future holds this one across its whole wait.
        match Box::pin(listener.try_recv()).await {
            Ok(Some(notification)) => Ok(notification.payload().to_owned()),
            Ok(None) => {
                self.listener = None;
                Err(closed())
            }
            Err(err) => Err(crate::postgres::pooler::loss_reason(&err)),
        }
    }

    /// Closes the connection by dropping its socket, never returning it to
    /// the pool: what a connection that may hold a lock needs. The server
    /// ends the session and frees its locks. Never blocks; needs no runtime.
    pub(crate) fn close(self) {
        if let Some(listener) = self.listener {
            close_listener(listener);
        }
    }
}

/// Closes a listener's connection by dropping its socket (see
/// [`WatchedConn::close`]). A listener merely dropped spawns a task that
/// sends `UNLISTEN *` and waits for the answer without a deadline: on a
/// network that stopped answering, that task and its socket would stay
/// until the process exits, and the session would keep its locks until the
/// server gives up on it.
pub(crate) fn close_listener(listener: PgListener) {
    // Dropped, the listener spawns a task that would unlisten and return
    // its connection to the pool. Spawned onto a runtime that is shut
    // down at once, that task is dropped unpolled, and with it the
    // connection: sqlx takes it out of the pool's accounting before the
    // task starts (for tasks spawned onto a dying runtime), so dropping
    // the task drops the socket and frees the pool's slot.
    match tokio::runtime::Builder::new_current_thread().build() {
        Ok(throwaway) => {
            {
                let _entered = throwaway.enter();
                drop(listener);
            }
            // Never waits (and so never panics inside a runtime).
            throwaway.shutdown_background();
        }
        // Building a runtime without drivers does not fail in practice.
        // If it did, forgetting the listener is the one way neither to
        // panic nor to pool a session that may hold a lock; its socket
        // then closes when the process exits.
        Err(_) => std::mem::forget(listener),
    }
}

fn closed() -> LossReason {
    LossReason::ConnectionFailed("the server ended the session (it closed the connection)".into())
}
