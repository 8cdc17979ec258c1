//! One subscriber connection to one server: it subscribes to the channels
//! the locker's waiters listen on, hands each message to the key's
//! waiters, and reconnects (and subscribes again) when the connection
//! breaks. It runs as a task of its own, started by the first waiter.

use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use redis::Client;
use redis::aio::{PubSub, PubSubSink};
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio::time::{sleep, timeout};
use tokio_util::sync::CancellationToken;

use super::node::{self, Node};
use super::signals::Shared;
use crate::backoff;

/// How long opening the connection, or one `SUBSCRIBE`/`UNSUBSCRIBE`, may
/// take before the connection counts as broken.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(2);
/// First and largest pause between two failed connection attempts.
const FIRST_RECONNECT: Duration = Duration::from_millis(50);
const MAX_RECONNECT: Duration = Duration::from_secs(2);

/// The subscriber of one server.
pub(super) struct Subscriber {
    parts: Arc<Parts>,
    task: Mutex<Option<JoinHandle<()>>>,
}

/// What the subscriber task and the waiters share.
struct Parts {
    client: Client,
    label: Arc<str>,
    link: watch::Sender<Link>,
    /// The registry changed: subscribe or unsubscribe.
    changed: Notify,
    /// Whether a refused `SUBSCRIBE` was logged already.
    warned: AtomicBool,
}

/// The subscriber's state, as waiters see it.
#[derive(Debug, Clone, Copy, Default)]
struct Link {
    /// The connection is open.
    up: bool,
    /// The registry `seq` whose channels are all subscribed on it.
    through: u64,
    /// The latest registry `seq` the subscriber failed to apply.
    failed: u64,
}

impl Subscriber {
    pub(super) fn new(node: &Node) -> Self {
        Self {
            parts: Arc::new(Parts {
                client: node.client().clone(),
                label: Arc::from(node.label()),
                link: watch::Sender::new(Link::default()),
                changed: Notify::new(),
                warned: AtomicBool::new(false),
            }),
            task: Mutex::new(None),
        }
    }

    /// Starts the task unless it runs: on the first listener, or after
    /// the runtime that ran it shut down.
    pub(super) fn ensure_running(&self, shared: &Arc<Shared>) {
        let mut task = self.task.lock().unwrap_or_else(PoisonError::into_inner);
        if task.as_ref().is_some_and(|task| !task.is_finished()) {
            return;
        }
        // A task that died with its runtime left its last state behind.
        self.parts.link.send_replace(Link::default());
        let run = run(
            Arc::clone(&self.parts),
            Arc::downgrade(shared),
            shared.stop().clone(),
        );
        *task = Some(tokio::spawn(run));
    }

    /// The registry changed.
    pub(super) fn changed(&self) {
        self.parts.changed.notify_one();
    }

    /// Whether the connection is up and subscribed to every channel wanted
    /// at `seq`.
    pub(super) fn listens_since(&self, seq: u64) -> bool {
        let link = *self.parts.link.borrow();
        link.up && link.through >= seq
    }

    /// Completes once the subscriber has applied `seq` or failed to.
    pub(super) async fn settled(&self, seq: u64) {
        let mut link = self.parts.link.subscribe();
        let _ = link
            .wait_for(|link| link.through >= seq || link.failed >= seq)
            .await;
    }
}

impl fmt::Debug for Subscriber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscriber")
            .field("node", &self.parts.label)
            .field("link", &*self.parts.link.borrow())
            .finish()
    }
}

/// Why the subscriber stopped serving a connection.
enum Broken {
    /// The connection failed or did not answer in time: reconnect.
    Connection(String),
    /// The locker is gone.
    Stopped,
}

/// The task: connect while some waiter listens, serve, reconnect.
async fn run(parts: Arc<Parts>, shared: Weak<Shared>, stop: CancellationToken) {
    let mut pause = backoff::exponential(FIRST_RECONNECT, MAX_RECONNECT);
    loop {
        if !wanted(&parts, &shared, &stop).await {
            return;
        }
        match connect(&parts.client).await {
            Ok(pubsub) => {
                let mut came_up = false;
                let broken = serve(pubsub, &parts, &shared, &stop, &mut came_up).await;
                if came_up {
                    parts.link.send_modify(|link| {
                        link.up = false;
                        link.through = 0;
                    });
                    if let Some(shared) = shared.upgrade() {
                        shared.links_changed();
                    }
                    // It served: the next attempt starts the backoff over
                    // (a short pause, not none, so that a server that
                    // drops every connection at once is not hammered).
                    pause = backoff::exponential(FIRST_RECONNECT, MAX_RECONNECT);
                }
                let Broken::Connection(error) = broken else {
                    return;
                };
                tracing::debug!(
                    node = %parts.label,
                    %error,
                    "distlock: Redis subscriber connection lost; reconnecting"
                );
            }
            Err(error) => {
                tracing::debug!(node = %parts.label, %error, "distlock: Redis subscriber cannot connect");
            }
        }
        let Some(delay) = pause.next() else { return };
        if !down_for(delay, &parts, &shared, &stop).await {
            return;
        }
    }
}

/// Waits until some waiter listens; `false` once the locker is gone.
async fn wanted(parts: &Parts, shared: &Weak<Shared>, stop: &CancellationToken) -> bool {
    loop {
        match shared.upgrade() {
            None => return false,
            Some(shared) if !shared.registry().channels.is_empty() => return true,
            Some(_) => {}
        }
        tokio::select! {
            () = stop.cancelled() => return false,
            () = parts.changed.notified() => {}
        }
    }
}

/// Stays disconnected for `delay`, telling new waiters at once that nobody
/// listens for them; `false` once the locker is gone.
async fn down_for(
    delay: Duration,
    parts: &Parts,
    shared: &Weak<Shared>,
    stop: &CancellationToken,
) -> bool {
    let pause = sleep(delay);
    tokio::pin!(pause);
    loop {
        fail_current(parts, shared);
        tokio::select! {
            () = stop.cancelled() => return false,
            () = &mut pause => return true,
            () = parts.changed.notified() => {}
        }
    }
}

/// Records that the registry as it is now is not applied.
fn fail_current(parts: &Parts, shared: &Weak<Shared>) {
    if let Some(shared) = shared.upgrade() {
        let seq = shared.registry().seq;
        parts.link.send_modify(|link| link.failed = seq);
    }
}

async fn connect(client: &Client) -> Result<PubSub, String> {
    match timeout(COMMAND_TIMEOUT, client.get_async_pubsub()).await {
        Ok(Ok(pubsub)) => Ok(pubsub),
        Ok(Err(err)) => Err(err.to_string()),
        Err(_) => Err(format!("no connection within {COMMAND_TIMEOUT:?}")),
    }
}

/// Subscribes to what the waiters want and says so (`came_up`, and the
/// link), then hands messages to them until the connection breaks or the
/// locker is gone.
async fn serve(
    pubsub: PubSub,
    parts: &Parts,
    shared: &Weak<Shared>,
    stop: &CancellationToken,
    came_up: &mut bool,
) -> Broken {
    let (mut sink, mut stream) = pubsub.split();
    let mut subscribed = HashSet::new();
    if let Some(broken) = apply(&mut sink, &mut subscribed, parts, shared).await {
        return broken;
    }
    parts.link.send_modify(|link| link.up = true);
    *came_up = true;
    // Waiters that polled while it was down, or whose release came while it
    // was, look again.
    match shared.upgrade() {
        Some(shared) => shared.links_changed(),
        None => return Broken::Stopped,
    }
    loop {
        tokio::select! {
            () = stop.cancelled() => return Broken::Stopped,
            () = parts.changed.notified() => {
                if let Some(broken) = apply(&mut sink, &mut subscribed, parts, shared).await {
                    return broken;
                }
            }
            message = stream.next() => match message {
                Some(message) => deliver(shared, &message),
                None => return Broken::Connection("the server closed the connection".into()),
            },
        }
    }
}

/// Hands a message to the waiters of its channel.
fn deliver(shared: &Weak<Shared>, message: &redis::Msg) {
    if let (Some(shared), Ok(channel)) = (shared.upgrade(), message.get_channel::<String>()) {
        shared.deliver(&channel);
    }
}

/// Subscribes to the channels wanted now and unsubscribes from the others;
/// `None` when done, which the link then says.
async fn apply(
    sink: &mut PubSubSink,
    subscribed: &mut HashSet<String>,
    parts: &Parts,
    shared: &Weak<Shared>,
) -> Option<Broken> {
    let Some(shared) = shared.upgrade() else {
        return Some(Broken::Stopped);
    };
    let (seq, wanted): (u64, HashSet<String>) = {
        let registry = shared.registry();
        (registry.seq, registry.channels.keys().cloned().collect())
    };
    drop(shared);
    let add: Vec<String> = wanted.difference(subscribed).cloned().collect();
    let remove: Vec<String> = subscribed.difference(&wanted).cloned().collect();
    // Never an empty list: `UNSUBSCRIBE` without channels drops them all.
    let outcome = async {
        if !add.is_empty() {
            timeout(COMMAND_TIMEOUT, sink.subscribe(&add)).await??;
        }
        if !remove.is_empty() {
            timeout(COMMAND_TIMEOUT, sink.unsubscribe(&remove)).await??;
        }
        Ok::<_, Applied>(())
    }
    .await;
    match outcome {
        Ok(()) => {
            subscribed.extend(add);
            for channel in &remove {
                subscribed.remove(channel);
            }
            parts.link.send_modify(|link| link.through = seq);
            None
        }
        Err(Applied::Redis(err)) if !node::is_transient(&err) => {
            parts.link.send_modify(|link| link.failed = seq);
            if !parts.warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    node = %parts.label,
                    error = %err,
                    "distlock: cannot subscribe to release signals; waiting locks poll instead \
                     (grant the user the channels distlock:released*)"
                );
            }
            // Not a broken connection: stay, and let waiters poll.
            None
        }
        Err(Applied::Redis(err)) => Some(Broken::Connection(err.to_string())),
        Err(Applied::TimedOut) => Some(Broken::Connection(format!(
            "no reply within {COMMAND_TIMEOUT:?}"
        ))),
    }
}

/// Why applying the registry failed.
enum Applied {
    Redis(redis::RedisError),
    TimedOut,
}

impl From<redis::RedisError> for Applied {
    fn from(err: redis::RedisError) -> Self {
        Self::Redis(err)
    }
}

impl From<tokio::time::error::Elapsed> for Applied {
    fn from(_: tokio::time::error::Elapsed) -> Self {
        Self::TimedOut
    }
}
