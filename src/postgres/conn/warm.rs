//! Warm connections: the few connections a `PgLocker` keeps for a moment
//! after a lock statement, so that the next acquisition skips the pool.
//!
//! sqlx's pool pings a connection when it takes it back and again when it
//! hands it out (`test_before_acquire`), so a lock that borrows a pooled
//! connection per acquisition pays two round trips on top of its own
//! statements, and in a hot-key hand-off the returning holder's way back
//! into the queue goes through both. A locker therefore keeps up to
//! [`max`](Warm::max) connections that released their lock (or found the key
//! busy) for at most its idle time, and hands them to its next acquisitions
//! directly. Only connections that hold no lock are kept: a confirmed unlock,
//! or a try that took nothing.
//!
//! Holding connections takes them from the pool's other users, so a
//! connection is kept only while the pool has slack (an idle connection or
//! room to open one: nobody can be waiting for it then), and a sweeper task
//! returns every kept connection to the pool once it has been idle for the
//! idle time (default 20 ms: long enough for a loop that takes the next
//! lock at once, short enough that a pool user who starts waiting while a
//! connection is kept waits at most that long), or at once when the pool is
//! closed. The sweeper runs only while something is kept.
//!
//! A locker may serve several runtimes. A connection is kept for the
//! runtime it was kept on, handed out only there, and swept by that
//! runtime's own sweeper: its socket is usually registered with that
//! runtime's reactor, which another runtime does not drive (a statement on
//! it from elsewhere can wait for an answer nobody reads), and a runtime
//! that sits idle (a current-thread runtime outside `block_on`) must hold
//! up only its own connections, never another runtime's (as the keepers'
//! timer). Its connections are closed, not returned (no I/O), once they
//! are kept for twice the idle time, by the next checkout or keep on
//! another runtime ([`stranded`]), and when the pool closes.
//!
//! A kept connection is not pinged before use. If the server ended its
//! session meanwhile, the acquisition's first statement fails with a
//! connection error; the caller then closes it and runs the statement once
//! more on a connection from the pool ([`is_broken`]). The failed
//! connection is closed, so whatever its statement may have taken ends with
//! its session, as for any connection distlock closes.

use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use sqlx::PgPool;
use tokio::runtime::{Handle, Id};
use tokio::time::Instant;

use crate::Error;
use crate::postgres::conn::held::{HeldConn, Home};
use crate::postgres::conn::watched::WatchedConn;

/// Default: how many connections a locker keeps warm.
pub(crate) const DEFAULT_WARM: usize = 2;
/// Default: how long a kept connection may stay idle before it goes back to
/// the pool.
pub(crate) const DEFAULT_WARM_IDLE: Duration = Duration::from_millis(20);

/// A locker's kept connections.
#[derive(Debug)]
pub(crate) struct Warm {
    pool: PgPool,
    max: usize,
    idle: Duration,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Oldest first.
    conns: Vec<Kept>,
    /// The runtimes whose sweeper task is running.
    sweeping: Vec<Id>,
}

/// A kept connection, the runtime it was kept on, and when.
#[derive(Debug)]
struct Kept {
    conn: WatchedConn,
    runtime: Id,
    since: Instant,
}

impl Warm {
    pub(crate) fn new(pool: PgPool, max: usize, idle: Duration) -> Arc<Self> {
        Arc::new(Self {
            pool,
            max,
            idle,
            state: Mutex::default(),
        })
    }

    /// The connection most recently kept on the current runtime, if any,
    /// armed (see [`HeldConn`]) and coming back here when disarmed. Closes
    /// other runtimes' [`stranded`] connections first, so that an
    /// acquisition that goes to the pool finds their slots free. Never
    /// waits.
    pub(crate) fn checkout(self: &Arc<Self>) -> Option<HeldConn> {
        if self.pool.is_closed() {
            return None;
        }
        let runtime = Handle::try_current().ok()?.id();
        let mut state = self.lock();
        let stranded = stranded(&mut state, runtime, Instant::now(), self.idle);
        let ours = state
            .conns
            .iter()
            .rposition(|kept| kept.runtime == runtime)
            .map(|at| state.conns.remove(at));
        drop(state);
        for conn in stranded {
            conn.close();
        }
        Some(self.adopt(ours?.conn))
    }

    /// Wraps a connection from the pool: armed, and coming back here when
    /// disarmed.
    pub(crate) fn adopt(self: &Arc<Self>, conn: WatchedConn) -> HeldConn {
        let home: Arc<Self> = Arc::clone(self);
        HeldConn::watched(conn, true).kept_by(home)
    }

    /// Keeps `conn`, which must hold no lock, or returns it to the pool when
    /// the locker keeps enough already, the pool has no slack, or there is
    /// no runtime to sweep on. Never blocks (a short mutex). Connections
    /// are dropped only after the mutex is let go.
    pub(crate) fn keep(self: &Arc<Self>, conn: WatchedConn) {
        if self.max == 0 || self.pool.is_closed() || !self.pool_has_slack() {
            return;
        }
        let Ok(handle) = Handle::try_current() else {
            return;
        };
        let runtime = handle.id();
        let (not_kept, start, stranded) = self.store(conn, runtime);
        for conn in stranded {
            conn.close();
        }
        drop(not_kept);
        // Spawned with the mutex let go: a runtime shutting down drops the
        // new task inside `spawn`, and the sweeper's drop takes the mutex
        // (this thread would wait for itself for ever).
        if start {
            let sweeper = Sweeper {
                warm: Arc::downgrade(self),
                runtime,
                finished: false,
            };
            handle.spawn(sweeper.run(self.pool.clone()));
        }
    }

    /// Under the mutex: takes out other runtimes' stranded connections
    /// ([`stranded`]), then keeps `conn` for `runtime` unless the locker
    /// keeps enough (handing it back). Says whether `runtime` needs a
    /// sweeper started.
    fn store(
        &self,
        conn: WatchedConn,
        runtime: Id,
    ) -> (Option<WatchedConn>, bool, Vec<WatchedConn>) {
        let now = Instant::now();
        let mut state = self.lock();
        let stranded = stranded(&mut state, runtime, now, self.idle);
        if state.conns.len() >= self.max {
            return (Some(conn), false, stranded);
        }
        let start = !state.sweeping.contains(&runtime);
        if start {
            state.sweeping.push(runtime);
        }
        state.conns.push(Kept {
            conn,
            runtime,
            since: now,
        });
        (None, start, stranded)
    }

    /// An idle connection in the pool, or room to open one: no one can be
    /// waiting for a connection, so keeping one takes nothing from anyone
    /// (for now; the idle time bounds the rest).
    fn pool_has_slack(&self) -> bool {
        self.pool.num_idle() > 0 || self.pool.size() < self.pool.options().get_max_connections()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes out the connections kept on `runtime` idle for the idle time
    /// or longer; returns when its sweeper next has something to do (and
    /// marks it gone when nothing of `runtime`'s is left).
    fn expire(&self, runtime: Id, now: Instant) -> (Vec<WatchedConn>, Next) {
        let mut state = self.lock();
        let idle = self.idle;
        let expired = state
            .conns
            .extract_if(.., |kept| {
                kept.runtime == runtime && now.saturating_duration_since(kept.since) >= idle
            })
            .map(|kept| kept.conn)
            .collect();
        // Oldest first: the first left is the next to expire.
        let next = match state.conns.iter().find(|kept| kept.runtime == runtime) {
            None => {
                state.sweeping.retain(|id| *id != runtime);
                Next::Done
            }
            // An idle time too long for the clock never expires: the
            // connection stays until the pool closes.
            Some(kept) => kept.since.checked_add(idle).map_or(Next::Close, Next::At),
        };
        (expired, next)
    }

    /// Takes out the connections kept on `runtime` (every runtime's with
    /// `None`: the pool closed, and `PgPool::close` waits for them all) and
    /// marks its sweeper gone.
    fn drain(&self, runtime: Option<Id>) -> Vec<Kept> {
        let mut state = self.lock();
        let ours = |id: &Id| runtime.is_none_or(|runtime| *id == runtime);
        state.sweeping.retain(|id| !ours(id));
        state
            .conns
            .extract_if(.., |kept| ours(&kept.runtime))
            .collect()
    }
}

impl Home for Warm {
    fn put(self: Arc<Self>, conn: WatchedConn) {
        self.keep(conn);
    }
}

/// Returns the connections kept on its runtime to the pool once idle for
/// the idle time, and every kept connection when the pool closes
/// (`PgPool::close` waits for every connection to come back). Ends when
/// none of its runtime's is kept or the locker is gone (its kept
/// connections then go back as it drops). Returned connections are dropped
/// outside the mutex: their return to the pool (an `UNLISTEN *`, see
/// [`WatchedConn`], then sqlx's ping) runs in a task they spawn.
struct Sweeper {
    warm: Weak<Warm>,
    /// The runtime whose connections it sweeps, which it runs on.
    runtime: Id,
    /// Set where the sweeper marks itself gone, under the mutex.
    finished: bool,
}

impl Sweeper {
    /// Sweeps until nothing of its runtime's is kept, the locker is gone or
    /// `pool` closes.
    async fn run(mut self, pool: PgPool) {
        sweep(&self.warm, self.runtime, pool).await;
        self.finished = true;
    }
}

impl Drop for Sweeper {
    /// Dropped unfinished, by the runtime it ran on shutting down (a
    /// locker may serve several runtimes): marked gone, so that a
    /// connection kept later starts another sweeper, and the connections
    /// kept on this runtime go back with it (dropped after the mutex is let
    /// go: their return to the pool is a task on this runtime, which,
    /// shutting down, drops it, and with it the connection). Nothing else
    /// returned them, and `PgPool::close` waits for every connection.
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        if let Some(warm) = self.warm.upgrade() {
            drop(warm.drain(Some(self.runtime)));
        }
    }
}

/// The sweeper's loop, until it marks itself gone (see [`Sweeper`]).
async fn sweep(warm: &Weak<Warm>, runtime: Id, pool: PgPool) {
    let closed = pool.close_event();
    tokio::pin!(closed);
    loop {
        let Some(kept) = warm.upgrade() else { return };
        let (expired, next) = kept.expire(runtime, Instant::now());
        drop(expired);
        let next = match next {
            Next::Done => return,
            Next::At(at) => Some(at),
            Next::Close => None,
        };
        drop(kept);
        tokio::select! {
            () = sleep_until_some(next) => {}
            () = &mut closed => {
                if let Some(kept) = warm.upgrade() {
                    close_kept(kept.drain(None), runtime);
                }
                return;
            }
        }
    }
}

/// Connections of runtimes other than `runtime` kept for twice the idle
/// time or longer: their own sweeper would have returned them, so their
/// runtime is not running it (a current-thread runtime outside
/// `block_on`). Left there, they would hold pool slots and the locker's
/// limit for as long as it sits idle. Closed by dropping their sockets
/// ([`WatchedConn::close`]): a return to the pool is I/O on their socket,
/// which only their runtime's reactor completes; they hold no lock.
fn stranded(state: &mut State, runtime: Id, now: Instant, idle: Duration) -> Vec<WatchedConn> {
    let overdue = |kept: &mut Kept| {
        kept.runtime != runtime
            && kept
                .since
                .checked_add(idle.saturating_mul(2))
                .is_some_and(|due| now >= due)
    };
    state
        .conns
        .extract_if(.., overdue)
        .map(|kept| kept.conn)
        .collect()
}

/// Gives back the connections of a closing pool, as the sweeper of
/// `runtime`: its own through the pool (which closes them), other
/// runtimes' by dropping their sockets, since their runtime may sit idle
/// and the pool's closing waits for every connection.
fn close_kept(kept: Vec<Kept>, runtime: Id) {
    for kept in kept {
        if kept.runtime == runtime {
            drop(kept.conn);
        } else {
            kept.conn.close();
        }
    }
}

/// When the sweeper next has something to do.
#[derive(Debug)]
enum Next {
    /// Nothing is kept: the sweeper ends.
    Done,
    /// The oldest kept connection's idle time ends then.
    At(Instant),
    /// Only when the pool closes (the idle time never ends).
    Close,
}

/// Sleeps until `at`, or for ever.
async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// What an acquisition's first statement hands back: its connection, and
/// its outcome.
pub(crate) type Ran<T> = (HeldConn, Result<T, Error>);

impl Warm {
    /// An acquisition's connection, with its first statement's outcome:
    /// [`connection`](Self::connection), then
    /// [`first_statement`](Self::first_statement). On an error the
    /// connection is dropped (closed: it is armed).
    pub(crate) async fn acquire<T, P, S>(
        self: &Arc<Self>,
        pooled: impl Fn() -> P,
        statement: impl FnMut(HeldConn) -> S,
    ) -> Result<(HeldConn, T), Error>
    where
        P: Future<Output = Result<WatchedConn, Error>>,
        S: Future<Output = Ran<T>>,
    {
        let (conn, kept) = self.connection(pooled()).await?;
        self.first_statement((conn, kept), pooled, statement).await
    }

    /// A connection for an acquisition, armed and coming back here when
    /// disarmed: the most recently kept one (`true`; not pinged, see
    /// [`first_statement`](Self::first_statement)), or else the one
    /// `pooled` takes from the pool (not awaited when one is kept).
    pub(crate) async fn connection(
        self: &Arc<Self>,
        pooled: impl Future<Output = Result<WatchedConn, Error>>,
    ) -> Result<(HeldConn, bool), Error> {
        match self.checkout() {
            Some(conn) => Ok((conn, true)),
            None => Ok((self.adopt(pooled.await?), false)),
        }
    }

    /// Runs an acquisition's first statement on `conn`, which the statement
    /// hands back with its outcome (a statement dropped before its end
    /// drops the connection: closed, as it is armed). If `conn` was a kept
    /// one (`kept`) found broken ([`retry_on_pool`]), it is closed and the
    /// statement runs once more on a connection from `pooled`. On an error
    /// the connection is dropped (closed).
    pub(crate) async fn first_statement<T, P, S>(
        self: &Arc<Self>,
        (conn, kept): (HeldConn, bool),
        pooled: impl Fn() -> P,
        mut statement: impl FnMut(HeldConn) -> S,
    ) -> Result<(HeldConn, T), Error>
    where
        P: Future<Output = Result<WatchedConn, Error>>,
        S: Future<Output = Ran<T>>,
    {
        let (conn, outcome) = statement(conn).await;
        if !retry_on_pool(kept, &outcome) {
            return outcome.map(|value| (conn, value));
        }
        drop(conn);
        let (conn, outcome) = statement(self.adopt(pooled().await?)).await;
        outcome.map(|value| (conn, value))
    }
}

/// Whether an acquisition's first statement, run on a kept connection
/// (`kept`), failed because the connection is broken ([`is_broken`]): the
/// caller then closes it and runs the statement once more on a connection
/// from the pool.
pub(crate) fn retry_on_pool<T>(kept: bool, outcome: &Result<T, Error>) -> bool {
    let broken = kept && matches!(outcome, Err(Error::Database(err)) if is_broken(err));
    if broken {
        tracing::debug!("distlock: a kept connection was closed; retrying on the pool's");
    }
    broken
}

/// Whether a statement failed because its connection is no longer usable:
/// the socket failed, or the server ended the session (SQLSTATE class 08,
/// 57P01–57P05 such as `pg_terminate_backend`, or 25P03, the idle-in-
/// transaction timeout). Only then is a kept connection's statement run
/// again on a pooled one.
pub(crate) fn is_broken(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            code.starts_with("08") || code.starts_with("57P0") || code == "25P03"
        }),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection kept on a runtime that shuts down (its task list
    /// closed): the sweeper's new task is dropped inside `spawn`, and its
    /// drop takes the state's mutex, which `keep` must not hold then (this
    /// thread waited for itself for ever). The connection goes back with
    /// the sweeper.
    #[sqlx::test(migrations = false)]
    async fn keeping_a_connection_on_a_runtime_shutting_down_returns(pool: PgPool) {
        let conn = WatchedConn::acquire(&pool).await.expect("a connection");
        let warm = Warm::new(pool.clone(), 2, Duration::from_secs(60));
        let dead = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime");
        let handle = dead.handle().clone();
        dead.shutdown_background();
        let (done, returned) = std::sync::mpsc::channel();
        let kept = Arc::clone(&warm);
        std::thread::spawn(move || {
            let _entered = handle.enter();
            kept.keep(conn);
            let _ = done.send(());
        });
        returned
            .recv_timeout(Duration::from_secs(5))
            .expect("keep() returned");
        assert!(warm.lock().conns.is_empty(), "kept past its sweeper");
        assert!(
            warm.lock().sweeping.is_empty(),
            "a sweeper believed running"
        );
    }

    #[test]
    fn only_connection_failures_count_as_broken() {
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
        assert!(is_broken(&io));
        assert!(!is_broken(&sqlx::Error::RowNotFound));
        assert!(!is_broken(&sqlx::Error::PoolTimedOut));
    }
}
