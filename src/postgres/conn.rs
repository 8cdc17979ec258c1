//! A pooled connection that is closed, not returned, while it may hold a lock.

use std::sync::Arc;

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, Postgres};

use super::warm::Warm;

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
    conn: Option<PoolConnection<Postgres>>,
    armed: bool,
    /// Where a disarmed connection goes instead of the pool.
    home: Option<Arc<Warm>>,
}

impl HeldConn {
    /// Wraps `conn`; `armed` decides what dropping it does.
    pub(crate) fn new(conn: PoolConnection<Postgres>, armed: bool) -> Self {
        Self {
            conn: Some(conn),
            armed,
            home: None,
        }
    }

    /// Disarmed, the connection goes to `warm` (which may still hand it
    /// back to the pool) instead of straight to the pool.
    pub(crate) fn kept_by(mut self, warm: &Arc<Warm>) -> Self {
        self.home = Some(Arc::clone(warm));
        self
    }

    /// The connection, for running statements.
    pub(crate) fn conn(&mut self) -> &mut PgConnection {
        match self.conn.as_mut() {
            Some(conn) => conn,
            // `conn` is only taken by `Drop`, after which `self` is gone.
            None => unreachable!("HeldConn used after drop"),
        }
    }

    /// Returns the connection to the pool, or to its warm home (it must hold
    /// no lock).
    pub(crate) fn into_pool(mut self) {
        self.armed = false;
    }

    /// Closes the connection now, by dropping its socket; the wrapper must
    /// not be used for statements afterwards.
    pub(crate) fn close_now(&mut self) {
        if let Some(conn) = self.conn.take() {
            drop(conn.detach());
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
        if tokio::runtime::Handle::try_current().is_err() {
            // The runtime is gone (a guard dropped after shutdown). sqlx's
            // pooled connection spawns a task when it is dropped or detached
            // from a pool that keeps `min_connections`, which would panic
            // here; give it a throwaway runtime to spawn on (the task never
            // runs), and close the socket whatever `armed` says: the pool
            // cannot take it back without a runtime.
            if let Ok(rt) = tokio::runtime::Builder::new_current_thread().build() {
                let _entered = rt.enter();
                drop(conn.detach());
            } else {
                // Building a runtime without drivers does not fail in
                // practice. If it did, forgetting the connection is the one
                // way not to panic; its socket then closes when the process
                // exits, which at runtime shutdown is usually soon.
                std::mem::forget(conn);
            }
            return;
        }
        if self.armed {
            // Detach frees the pool slot; dropping the raw connection closes
            // the socket without a graceful Terminate, which is what we want
            // for a session that may still hold a lock.
            drop(conn.detach());
        } else if let Some(home) = self.home.take() {
            home.put(conn);
        }
    }
}
