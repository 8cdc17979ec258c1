//! A pooled connection that is closed, not returned, while it may hold a lock.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll};

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, Postgres};

use crate::LossReason;
use crate::postgres::conn::watched::WatchedConn;

/// Where a disarmed connection goes instead of the pool: the locker's warm
/// connections (`warm.rs`). A trait, so that this file, which every lock
/// path uses, depends on nothing of the warm connections' own.
pub(crate) trait Home: fmt::Debug + Send + Sync {
    /// Takes back `conn`, which holds no lock. Must never block: it runs
    /// in `Drop`.
    fn put(self: Arc<Self>, conn: WatchedConn);
}

/// Wraps a pooled connection. While *armed* (it may hold a session lock or be
/// blocked in a lock wait), dropping it detaches the connection from the pool
/// and drops the socket, so PostgreSQL ends the session and frees its locks.
/// Disarmed, it returns to the pool as usual, or to the locker's warm
/// connections when it has a [`home`](Self::kept_by) there.
///
/// Closing by dropping the socket needs no runtime and never blocks, which is
/// what makes every future of this crate safe to drop at any `.await`.
#[derive(Debug)]
pub(crate) struct HeldConn {
    conn: Option<Link>,
    armed: bool,
    /// Where a disarmed connection goes instead of the pool.
    home: Option<Arc<dyn Home>>,
}

/// How the connection is held.
#[derive(Debug)]
enum Link {
    /// As the pool hands it out: read only inside statements.
    Plain(PoolConnection<Postgres>),
    /// Readable while idle: what a session lock's keeper watches.
    Watched(WatchedConn),
}

impl HeldConn {
    /// Wraps `conn`; `armed` decides what dropping it does.
    pub(crate) fn new(conn: PoolConnection<Postgres>, armed: bool) -> Self {
        Self::with(Link::Plain(conn), armed)
    }

    /// Wraps `conn`, which can be read while idle (see
    /// [`poll_goodbye`](Self::poll_goodbye)); `armed` decides what dropping
    /// it does.
    pub(crate) fn watched(conn: WatchedConn, armed: bool) -> Self {
        Self::with(Link::Watched(conn), armed)
    }

    fn with(conn: Link, armed: bool) -> Self {
        Self {
            conn: Some(conn),
            armed,
            home: None,
        }
    }

    /// Disarmed, the connection goes to `home` (which may still hand it
    /// back to the pool) instead of straight to the pool.
    pub(crate) fn kept_by(mut self, home: Arc<dyn Home>) -> Self {
        self.home = Some(home);
        self
    }

    /// The connection, for running statements.
    pub(crate) fn conn(&mut self) -> &mut PgConnection {
        let conn = match self.conn.as_mut() {
            Some(Link::Plain(conn)) => Some(&mut **conn),
            Some(Link::Watched(conn)) => conn.conn(),
            None => None,
        };
        match conn {
            Some(conn) => conn,
            // `conn` is only taken by `Drop` and `close_now`, and a watched
            // connection lost only after `poll_goodbye` reported it; in every
            // case the wrapper is not used for statements any more.
            None => unreachable!("HeldConn used after it was closed"),
        }
    }

    /// What the server sent while no statement ran: ready with why the
    /// session is over once the server has ended it, pending otherwise
    /// (with `cx`'s task woken when more arrives). Only a
    /// [`watched`](Self::watched) connection is read; any other stays
    /// pending. Must not be called while a statement is in flight; once it
    /// is ready, the wrapper must only be closed.
    pub(crate) fn poll_goodbye(&mut self, cx: &mut Context<'_>) -> Poll<LossReason> {
        match self.conn.as_mut() {
            Some(Link::Watched(conn)) => conn.poll_goodbye(cx),
            Some(Link::Plain(_)) | None => Poll::Pending,
        }
    }

    /// The [`watched`](Self::watched) connection, for what only it can do
    /// (`LISTEN`, notifications); `None` for any other.
    pub(crate) fn watched_mut(&mut self) -> Option<&mut WatchedConn> {
        match self.conn.as_mut() {
            Some(Link::Watched(conn)) => Some(conn),
            Some(Link::Plain(_)) | None => None,
        }
    }

    /// Sends what sqlx has queued on the connection without waiting for its
    /// answer: the `ROLLBACK` that a dropped `Transaction` queues. Left
    /// queued, it goes out with the connection's next statement, which waits
    /// for its answer first: a round trip more for the next lock on a kept
    /// connection, however long after. Sent now, the answer is usually there
    /// by then and is read without waiting. Never waits. If the socket fails
    /// here, the connection's next statement fails too, and is run again on
    /// a pooled connection as for any kept connection found broken
    /// ([`retry_on_pool`](crate::postgres::conn::warm::retry_on_pool)).
    pub(crate) fn send_queued(&mut self) {
        use sqlx::Connection;
        // `flush` writes out what is queued, then reads until it is
        // answered. Polled once it writes (a few bytes into an idle socket
        // go at once) and stops at the read, which the next statement on
        // the connection finishes. Dropping it there loses nothing: sqlx
        // takes bytes from its buffer only once written, and a message only
        // once read whole.
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let sent = std::pin::pin!(self.conn().flush()).poll(&mut cx);
        if let Poll::Ready(Err(err)) = sent {
            tracing::debug!(%err, "distlock: sending a queued statement failed");
        }
    }

    /// Returns the connection to the pool, or to its warm home (it must hold
    /// no lock).
    pub(crate) fn into_pool(mut self) {
        self.armed = false;
    }

    /// Disarms the connection in place (it holds no lock): dropped, it
    /// goes back to the pool, or to its warm home.
    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }

    /// Closes the connection now, by dropping its socket; the wrapper must
    /// not be used for statements afterwards. Safe to call without a runtime
    /// (a keeper dropped while its runtime shuts down).
    pub(crate) fn close_now(&mut self) {
        if let Some(conn) = self.conn.take() {
            conn.close();
        }
    }

    /// Closes the connection by dropping its socket.
    pub(crate) fn close(mut self) {
        self.armed = true;
    }
}

impl Drop for HeldConn {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        // Without a runtime (a guard dropped after shutdown) the pool cannot
        // take the connection back: close it whatever `armed` says.
        if self.armed || tokio::runtime::Handle::try_current().is_err() {
            return conn.close();
        }
        match (conn, self.home.take()) {
            (Link::Watched(conn), Some(home)) => home.put(conn),
            // Dropped, either goes back to the pool.
            (conn, _) => drop(conn),
        }
    }
}

impl Link {
    /// Closes the connection by dropping its socket, without a graceful
    /// Terminate: what a session that may still hold a lock needs. Never
    /// blocks, and needs no runtime.
    fn close(self) {
        match self {
            Self::Plain(conn) => close_socket(conn),
            Self::Watched(conn) => conn.close(),
        }
    }
}

/// Closes a pooled connection by dropping its socket. Detaching frees the
/// pool slot.
fn close_socket(conn: PoolConnection<Postgres>) {
    if tokio::runtime::Handle::try_current().is_ok() {
        drop(conn.detach());
        return;
    }
    // sqlx's pooled connection spawns a task when it is dropped or detached
    // from a pool that keeps `min_connections`, which would panic without a
    // runtime; give it a throwaway runtime to spawn on (the task never runs).
    if let Ok(rt) = tokio::runtime::Builder::new_current_thread().build() {
        let _entered = rt.enter();
        drop(conn.detach());
    } else {
        // Building a runtime without drivers does not fail in practice. If it
        // did, forgetting the connection is the one way not to panic; its
        // socket then closes when the process exits, which at runtime
        // shutdown is usually soon.
        std::mem::forget(conn);
    }
}
