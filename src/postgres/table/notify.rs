//! Waking waiters when a key is released: one `LISTEN distlock_lease`
//! connection per [`TableLocker`](super::TableLocker), opened at its first
//! wait, whose notifications fan out to every waiting `lock()`.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tokio::sync::{broadcast, watch};
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::sql::{CHANNEL, parse_payload};

/// How long a first wait gives the listening connection to come up before
/// it starts without it (it then polls until the listener is up).
const LISTEN_SETUP: Duration = Duration::from_secs(2);

/// What a waiter is woken for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    /// `(space, lock_id)` was released.
    Key(i16, i64),
    /// Releases may have been missed (the listener (re)started listening):
    /// every waiter looks again.
    All,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Not listening yet: no task runs (none was started, or the last
    /// ended, see [`Ended`]), or one is connecting and has never failed.
    Starting,
    Listening,
    /// The connection failed; retrying with backoff.
    Failed,
}

/// The listening side of one locker.
pub(super) struct Listener {
    options: PgConnectOptions,
    wakes: broadcast::Sender<Wake>,
    state: watch::Sender<State>,
    /// Whether a listening task runs (it clears this as it ends).
    started: Arc<AtomicBool>,
    stop: CancellationToken,
    /// Stops the listening task when the locker goes away.
    _stop_on_drop: DropGuard,
}

impl fmt::Debug for Listener {
    // By hand: `PgConnectOptions`' derived Debug would print the password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Listener")
            .field("state", &*self.state.borrow())
            .finish_non_exhaustive()
    }
}

impl Listener {
    pub(super) fn new(options: PgConnectOptions) -> Self {
        let stop = CancellationToken::new();
        Self {
            options,
            wakes: broadcast::channel(1024).0,
            state: watch::channel(State::Starting).0,
            started: Arc::new(AtomicBool::new(false)),
            _stop_on_drop: stop.clone().drop_guard(),
            stop,
        }
    }

    /// A waiter's subscription, taken before its first attempt. The first
    /// one starts the listening task (as does the first after that task
    /// ended with the runtime it ran on). Each waits, while the listener
    /// has not come up yet (until `deadline`, at most [`LISTEN_SETUP`]), for
    /// it to listen, so a release right after its attempt is heard.
    pub(super) async fn subscribe(&self, deadline: Instant) -> Wakes {
        let wakes = Wakes {
            rx: self.wakes.subscribe(),
            state: self.state.subscribe(),
        };
        if !self.started.swap(true, Ordering::SeqCst) {
            let ended = Ended {
                started: Arc::clone(&self.started),
                state: self.state.clone(),
                wakes: self.wakes.clone(),
            };
            let run = run(
                self.options.clone(),
                self.wakes.clone(),
                self.state.clone(),
                self.stop.clone(),
            );
            tokio::spawn(async move {
                let _ended = ended;
                run.await;
            });
        }
        let mut state = self.state.subscribe();
        let setup = crate::deadline::from_now(LISTEN_SETUP).min(deadline);
        let _ = tokio::time::timeout_at(setup, state.wait_for(|s| *s != State::Starting)).await;
        wakes
    }
}

/// Dropped as the listening task ends, also when the runtime it runs on
/// shuts down and drops it (the locker may serve several runtimes): its
/// waiters stop counting on notifications and look again, and the next
/// subscription starts another task, on its own runtime. Without it the
/// state stayed `Listening` with no one listening, and every waiter slept
/// its whole poll interval.
struct Ended {
    started: Arc<AtomicBool>,
    state: watch::Sender<State>,
    wakes: broadcast::Sender<Wake>,
}

impl Drop for Ended {
    fn drop(&mut self) {
        self.state.send_replace(State::Starting);
        let _ = self.wakes.send(Wake::All);
        self.started.store(false, Ordering::SeqCst);
    }
}

/// One waiter's end.
#[derive(Debug)]
pub(super) struct Wakes {
    rx: broadcast::Receiver<Wake>,
    state: watch::Receiver<State>,
}

impl Wakes {
    /// Forgets wake-ups from before the next attempt.
    pub(super) fn clear(&mut self) {
        loop {
            match self.rx.try_recv() {
                Ok(_) | Err(broadcast::error::TryRecvError::Lagged(_)) => {}
                Err(_) => return,
            }
        }
    }

    /// Whether releases are heard right now.
    pub(super) fn listening(&self) -> bool {
        *self.state.borrow() == State::Listening
    }

    /// Waits until `key` may have been released, or until `next`.
    pub(super) async fn until(&mut self, next: Instant, (space, lock_id): (i16, i64)) {
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(next) => return,
                wake = self.rx.recv() => match wake {
                    Ok(Wake::Key(s, id)) if (s, id) != (space, lock_id) => {}
                    // Ours, everyone's, or some were dropped: look again.
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => return,
                    Err(broadcast::error::RecvError::Closed) => {
                        tokio::time::sleep_until(next).await;
                        return;
                    }
                },
            }
        }
    }
}

/// The listening task: listens, fans notifications out, and reconnects
/// with backoff (from 100 ms up to 10 s) after a failure.
async fn run(
    options: PgConnectOptions,
    wakes: broadcast::Sender<Wake>,
    state: watch::Sender<State>,
    stop: CancellationToken,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let Some(err) = stop
            .run_until_cancelled(listen(&options, &wakes, &state))
            .await
        else {
            return;
        };
        tracing::warn!(error = %err, "distlock: the lease listener failed; waiters poll until it is back");
        state.send_replace(State::Failed);
        let _ = wakes.send(Wake::All);
        if stop
            .run_until_cancelled(tokio::time::sleep(backoff))
            .await
            .is_none()
        {
            return;
        }
        backoff = (backoff * 2).min(Duration::from_secs(10));
    }
}

/// Listens until the connection fails; returns the error.
async fn listen(
    options: &PgConnectOptions,
    wakes: &broadcast::Sender<Wake>,
    state: &watch::Sender<State>,
) -> sqlx::Error {
    // A pool of one, outside the locker's pool: PgListener reconnects
    // through it.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .max_lifetime(None)
        .idle_timeout(None)
        .acquire_timeout(Duration::from_secs(10))
        .connect_lazy_with(options.clone());
    let mut listener = match PgListener::connect_with(&pool).await {
        Ok(listener) => listener,
        Err(err) => return err,
    };
    listener.ignore_pool_close_event(true);
    if let Err(err) = listener.listen(CHANNEL).await {
        return err;
    }
    state.send_replace(State::Listening);
    // Whatever was released before this point was not heard.
    let _ = wakes.send(Wake::All);
    loop {
        match listener.try_recv().await {
            Ok(Some(notification)) => {
                if let Some((space, lock_id)) = parse_payload(notification.payload()) {
                    let _ = wakes.send(Wake::Key(space, lock_id));
                }
            }
            // The connection was lost and is back (listening again): what
            // was released in between was not heard.
            Ok(None) => {
                let _ = wakes.send(Wake::All);
            }
            Err(err) => return err,
        }
    }
}
