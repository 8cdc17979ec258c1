//! A loopback TCP proxy for network faults between clients and a server
//! (PostgreSQL, mostly).
//!
//! Modes (for all connections, current and new): **pass**, **delay** (each
//! chunk is held back for a while in each direction) and **stall** (nothing
//! is read, so bytes, FINs and all queue up in the kernel; nothing is
//! closed). Actions (on the connections open at that moment): **cut** (both
//! sockets closed, as a peer that closes would: FIN, or RST where the kernel
//! still holds bytes nobody read, as after a stall), **reset** (both sockets
//! reset with RST, as a crashed middlebox would), **half-close towards the
//! client** (FIN to the client, nothing more forwarded to it; its bytes
//! still reach the server) and **half-close towards the server** (the
//! mirror image). Any later action closes a half-closed connection; a reset
//! resets it.
//!
//! Its upstream can be switched (a failover): new connections go to the new
//! address, open ones stay where they are. New connections can also be
//! held (accepted, but not connected upstream, as a proxy retrying a node
//! that is down would), to go wherever the upstream points once released.
//!
//! It counts round trips ([`Proxy::round_trips`]): a client→server burst
//! that follows a server→client burst, or opens the connection. Bytes the
//! client sends before the server answered (a pipelined statement) count
//! with the burst they follow, as they cost once in latency. The pool's
//! pings (bare `Sync` messages) count like any statement. It can stall at a
//! given round trip ([`Proxy::stall_at_round_trip`]), holding back the
//! burst that starts it.
//!
//! It listens on `127.0.0.1:0` only. Dropping it stops it and cuts every
//! connection.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{broadcast, watch};
use tokio::task::AbortHandle;

/// Whether and how bytes flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward everything.
    Pass,
    /// Forward everything, each chunk held back this long (in each
    /// direction, so a statement's round trip takes at least two).
    Delay(Duration),
    /// Forward nothing (bytes stay queued); connections stay open; EOFs are
    /// not propagated either.
    Stall,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Cut,
    Reset,
    HalfCloseClient,
    HalfCloseServer,
    Freeze,
}

/// A running proxy; stops, and cuts every connection, when dropped.
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    mode: watch::Sender<Mode>,
    actions: broadcast::Sender<Action>,
    accepted: Arc<AtomicUsize>,
    round_trips: Arc<AtomicUsize>,
    /// The round trip to stall at (`usize::MAX`: none).
    stall_at: Arc<AtomicUsize>,
    upstream: Arc<Mutex<(String, u16)>>,
    /// While `true`, new connections wait before they connect upstream.
    hold_new: watch::Sender<bool>,
    listener: AbortHandle,
}

impl Proxy {
    /// Starts a proxy on `127.0.0.1:0` forwarding to
    /// `upstream_host:upstream_port`.
    pub async fn start(upstream_host: &str, upstream_port: u16) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let (mode, _) = watch::channel(Mode::Pass);
        let (actions, _) = broadcast::channel(16);
        let accepted = Arc::new(AtomicUsize::new(0));
        let round_trips = Arc::new(AtomicUsize::new(0));
        let stall_at = Arc::new(AtomicUsize::new(usize::MAX));
        let upstream = Arc::new(Mutex::new((upstream_host.to_owned(), upstream_port)));
        let (hold_new, _) = watch::channel(false);
        let task = {
            let mode = mode.clone();
            let actions = actions.clone();
            let accepted = accepted.clone();
            let round_trips = round_trips.clone();
            let stall_at = stall_at.clone();
            let upstream = upstream.clone();
            let hold_new = hold_new.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        continue;
                    };
                    accepted.fetch_add(1, Ordering::SeqCst);
                    // Subscribe before spawning so no action is missed.
                    let rx = actions.subscribe();
                    let turns = Turns {
                        total: round_trips.clone(),
                        answered: Arc::new(AtomicBool::new(true)),
                        stall_at: stall_at.clone(),
                        stall: mode.clone(),
                    };
                    let mut held = hold_new.subscribe();
                    if !*held.borrow() {
                        let target = upstream.lock().expect("proxy mutex").clone();
                        tokio::spawn(serve(client, target, mode.subscribe(), rx, turns));
                        continue;
                    }
                    let (upstream, mode) = (upstream.clone(), mode.subscribe());
                    tokio::spawn(async move {
                        if held.wait_for(|held| !*held).await.is_err() {
                            return;
                        }
                        let target = upstream.lock().expect("proxy mutex").clone();
                        serve(client, target, mode, rx, turns).await;
                    });
                }
            })
        };
        Ok(Self {
            addr,
            mode,
            actions,
            accepted,
            round_trips,
            stall_at,
            upstream,
            hold_new,
            listener: task.abort_handle(),
        })
    }

    /// The port clients should connect to (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// `options` pointed at this proxy instead.
    pub fn options(&self, options: &PgConnectOptions) -> PgConnectOptions {
        options.clone().host("127.0.0.1").port(self.port())
    }

    /// How many client connections were accepted so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// Round trips forwarded so far, over all connections (see the module's
    /// opening comment).
    pub fn round_trips(&self) -> usize {
        self.round_trips.load(Ordering::SeqCst)
    }

    /// Sends new connections to `127.0.0.1:port` from now on (as a DNS name
    /// or a virtual IP moved to a promoted standby would); connections
    /// already open stay where they are.
    pub fn set_upstream(&self, port: u16) {
        *self.upstream.lock().expect("proxy mutex") = ("127.0.0.1".to_owned(), port);
    }

    /// While `hold` is `true`, new connections are accepted but not
    /// connected upstream (nothing is forwarded, nothing is closed); set
    /// back to `false`, each connects to the upstream of that moment (see
    /// [`set_upstream`](Self::set_upstream)). An action taken meanwhile
    /// (cut, reset) applies to them once they are connected.
    pub fn hold_new(&self, hold: bool) {
        self.hold_new.send_replace(hold);
    }

    /// Sets the mode of every connection, current and new.
    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    /// Forwards everything again.
    pub fn pass(&self) {
        self.set(Mode::Pass);
    }

    /// Stops forwarding in both directions; nothing is closed.
    pub fn stall(&self) {
        self.set(Mode::Stall);
    }

    /// Stalls (as [`stall`](Self::stall)) as a client's burst would start
    /// round trip `n` (as [`round_trips`](Self::round_trips) counts them):
    /// that burst is held back, and all traffic with it, until the next
    /// change of mode.
    pub fn stall_at_round_trip(&self, n: usize) {
        self.stall_at.store(n, Ordering::SeqCst);
    }

    /// Forwards every chunk after `delay` (both directions).
    pub fn delay(&self, delay: Duration) {
        self.set(Mode::Delay(delay));
    }

    /// Closes every open connection on both sides (new ones are still
    /// accepted).
    pub fn cut(&self) {
        let _ = self.actions.send(Action::Cut);
    }

    /// Resets every open connection with RST, on both sides (new ones are
    /// still accepted).
    pub fn reset(&self) {
        let _ = self.actions.send(Action::Reset);
    }

    /// Stops forwarding on every open connection for good, whatever the
    /// mode (as a node that stopped answering, or a proxy still waiting on
    /// it, would): nothing is closed until a cut, a reset or the proxy's
    /// drop. New connections are not affected.
    pub fn freeze_open(&self) {
        let _ = self.actions.send(Action::Freeze);
    }

    /// Sends FIN to every client and forwards nothing more to them.
    pub fn half_close_client(&self) {
        let _ = self.actions.send(Action::HalfCloseClient);
    }

    /// Sends FIN to the server on every connection and forwards nothing
    /// more to it.
    pub fn half_close_server(&self) {
        let _ = self.actions.send(Action::HalfCloseServer);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.listener.abort();
        self.cut();
    }
}

async fn serve(
    mut client: TcpStream,
    upstream: (String, u16),
    mode: watch::Receiver<Mode>,
    mut actions: broadcast::Receiver<Action>,
    turns: Turns,
) {
    let Ok(mut server) = TcpStream::connect((upstream.0.as_str(), upstream.1)).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let action = {
        let (client_read, client_write) = client.split();
        let (server_read, server_write) = server.split();
        let both = async {
            tokio::join!(
                pump(client_read, server_write, mode.clone(), turns.to_server()),
                pump(server_read, client_write, mode.clone(), turns.to_client()),
            )
        };
        tokio::select! {
            _ = both => return,
            action = next_action(&mut actions) => action,
        }
    };
    let reset_later = match action {
        Action::Cut => false,
        Action::Reset => true,
        // Nothing is read or written any more; only the next action (or
        // the proxy's drop) closes the sockets.
        Action::Freeze => next_action(&mut actions).await == Action::Reset,
        Action::HalfCloseClient => {
            let _ = client.shutdown().await;
            let (client_read, _) = client.split();
            let (_, server_write) = server.split();
            tokio::select! {
                _ = pump(client_read, server_write, mode, turns.to_server()) => false,
                action = next_action(&mut actions) => action == Action::Reset,
            }
        }
        Action::HalfCloseServer => {
            let _ = server.shutdown().await;
            let (server_read, _) = server.split();
            let (_, client_write) = client.split();
            tokio::select! {
                _ = pump(server_read, client_write, mode, turns.to_client()) => false,
                action = next_action(&mut actions) => action == Action::Reset,
            }
        }
    };
    if reset_later {
        // RST instead of FIN.
        let _ = client.set_zero_linger();
        let _ = server.set_zero_linger();
    }
    drop((client, server));
}

async fn next_action(actions: &mut broadcast::Receiver<Action>) -> Action {
    loop {
        match actions.recv().await {
            Ok(action) => return action,
            Err(broadcast::error::RecvError::Lagged(_)) => continue,
            Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
        }
    }
}

/// One connection's round-trip counting: whether the server spoke last.
#[derive(Debug, Clone)]
struct Turns {
    total: Arc<AtomicUsize>,
    answered: Arc<AtomicBool>,
    /// The proxy's round trip to stall at, and its mode, to stall it.
    stall_at: Arc<AtomicUsize>,
    stall: watch::Sender<Mode>,
}

/// Which way a pump copies, for counting.
enum Direction {
    ToServer(Turns),
    ToClient(Turns),
}

impl Turns {
    fn to_server(&self) -> Direction {
        Direction::ToServer(self.clone())
    }

    fn to_client(&self) -> Direction {
        Direction::ToClient(self.clone())
    }
}

impl Direction {
    /// Whether the chunk about to be forwarded starts the round trip to
    /// stall at; if so, the proxy is stalled (once).
    fn stalls(&self) -> bool {
        let Direction::ToServer(turns) = self else {
            return false;
        };
        let next = turns.total.load(Ordering::SeqCst) + 1;
        let starts = turns.answered.load(Ordering::SeqCst);
        let due = starts
            && turns
                .stall_at
                .compare_exchange(next, usize::MAX, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok();
        if due {
            turns.stall.send_replace(Mode::Stall);
        }
        due
    }

    /// A chunk is being forwarded: a client chunk after the server spoke
    /// starts a round trip.
    fn forwarded(&self) {
        match self {
            Direction::ToServer(turns) => {
                if turns.answered.swap(false, Ordering::SeqCst) {
                    turns.total.fetch_add(1, Ordering::SeqCst);
                }
            }
            Direction::ToClient(turns) => turns.answered.store(true, Ordering::SeqCst),
        }
    }
}

/// Copies one direction while the mode lets it: a stall stops reading (a
/// chunk already read waits, and so does an EOF), a delay holds each chunk.
async fn pump(
    mut from: impl AsyncReadExt + Unpin,
    mut to: impl AsyncWriteExt + Unpin,
    mut mode: watch::Receiver<Mode>,
    direction: Direction,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if mode.wait_for(|m| *m != Mode::Stall).await.is_err() {
            return;
        }
        let n = from.read(&mut buf).await.unwrap_or(0);
        let current = match mode.wait_for(|m| *m != Mode::Stall).await {
            Ok(current) => *current,
            Err(_) => return,
        };
        if let Mode::Delay(delay) = current {
            tokio::time::sleep(delay).await;
        }
        if n == 0 {
            let _ = to.shutdown().await;
            return;
        }
        if direction.stalls() && mode.wait_for(|m| *m != Mode::Stall).await.is_err() {
            return;
        }
        direction.forwarded();
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
