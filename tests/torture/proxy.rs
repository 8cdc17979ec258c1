//! A loopback TCP proxy for network faults between workers and PostgreSQL.
//!
//! Modes (for all connections, current and new): **pass**, **delay** (each
//! chunk is held back for a while in each direction) and **stall** (nothing
//! is read, so bytes, FINs and all queue up in the kernel; nothing is
//! closed). Actions (on the connections open at that moment): **cut** (both
//! sockets reset with RST, as a crashed middlebox would), **half-close
//! towards the client** (FIN to the client, nothing more forwarded to it;
//! its bytes still reach the server) and **half-close towards the server**
//! (the mirror image).
//!
//! Its upstream can be switched (a failover): new connections go to the new
//! address, open ones stay where they are.
//!
//! It listens on `127.0.0.1:0` and only connects to 127.0.0.1.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{broadcast, watch};
use tokio::task::AbortHandle;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Pass,
    Delay(Duration),
    Stall,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Cut,
    HalfCloseClient,
    HalfCloseServer,
}

/// A running proxy; every connection is reset when it is dropped.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    mode: watch::Sender<Mode>,
    actions: broadcast::Sender<Action>,
    accepted: Arc<AtomicUsize>,
    upstream: Arc<AtomicU16>,
    listener: AbortHandle,
}

impl FaultProxy {
    /// Starts a proxy on `127.0.0.1:0` in front of `127.0.0.1:upstream`.
    pub async fn start(upstream: u16) -> Self {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let (mode, _) = watch::channel(Mode::Pass);
        let (actions, _) = broadcast::channel(16);
        let accepted = Arc::new(AtomicUsize::new(0));
        let upstream = Arc::new(AtomicU16::new(upstream));
        let task = {
            let mode = mode.clone();
            let actions = actions.clone();
            let accepted = accepted.clone();
            let upstream = upstream.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        continue;
                    };
                    accepted.fetch_add(1, Ordering::Relaxed);
                    // Subscribe before spawning so no action is missed.
                    let rx = actions.subscribe();
                    let target = upstream.load(Ordering::SeqCst);
                    tokio::spawn(serve(client, target, mode.subscribe(), rx));
                }
            })
        };
        Self {
            addr,
            mode,
            actions,
            accepted,
            upstream,
            listener: task.abort_handle(),
        }
    }

    /// Sends new connections to `127.0.0.1:port` from now on (as a moved
    /// DNS name or virtual IP would after a failover); connections already
    /// open stay where they are.
    pub fn set_upstream(&self, port: u16) {
        self.upstream.store(port, Ordering::SeqCst);
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::Relaxed)
    }

    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    /// Resets every open connection, on both sides.
    pub fn cut(&self) {
        let _ = self.actions.send(Action::Cut);
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

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.listener.abort();
        self.set(Mode::Pass);
        let _ = self.actions.send(Action::Cut);
    }
}

async fn serve(
    mut client: TcpStream,
    upstream: u16,
    mode: watch::Receiver<Mode>,
    mut actions: broadcast::Receiver<Action>,
) {
    let Ok(mut server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let action = {
        let (client_read, client_write) = client.split();
        let (server_read, server_write) = server.split();
        let both = async {
            tokio::join!(
                pump(client_read, server_write, mode.clone()),
                pump(server_read, client_write, mode.clone()),
            )
        };
        tokio::select! {
            _ = both => return,
            action = next_action(&mut actions) => action,
        }
    };
    match action {
        Action::Cut => reset(client, server),
        Action::HalfCloseClient => {
            let _ = client.shutdown().await;
            let cut = {
                let (client_read, _) = client.split();
                let (_, server_write) = server.split();
                tokio::select! {
                    _ = pump(client_read, server_write, mode) => false,
                    action = next_action(&mut actions) => action == Action::Cut,
                }
            };
            if cut {
                reset(client, server);
            }
        }
        Action::HalfCloseServer => {
            let _ = server.shutdown().await;
            let cut = {
                let (server_read, _) = server.split();
                let (_, client_write) = client.split();
                tokio::select! {
                    _ = pump(server_read, client_write, mode) => false,
                    action = next_action(&mut actions) => action == Action::Cut,
                }
            };
            if cut {
                reset(client, server);
            }
        }
    }
}

/// Closes both sockets with RST instead of FIN.
fn reset(client: TcpStream, server: TcpStream) {
    let _ = client.set_zero_linger();
    let _ = server.set_zero_linger();
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

/// Copies one direction while the mode lets it: a stall stops reading (a
/// chunk already read waits, and so does an EOF), a delay holds each chunk.
async fn pump(
    mut from: impl AsyncReadExt + Unpin,
    mut to: impl AsyncWriteExt + Unpin,
    mut mode: watch::Receiver<Mode>,
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
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
