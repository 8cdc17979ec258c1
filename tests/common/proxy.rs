//! A tiny loopback TCP proxy for fault injection: it forwards bytes between
//! clients and an upstream server and can *stall* (stop forwarding in both
//! directions, as a partitioned network would, without closing anything) or
//! *cut* (close every proxied connection on both sides).
//!
//! It listens on `127.0.0.1:0` only.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::AbortHandle;

/// Whether bytes flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward everything.
    Pass,
    /// Forward nothing (bytes stay queued); connections stay open; EOFs are
    /// not propagated either.
    Stall,
    /// Forward everything, each chunk held back this many microseconds.
    Delay(u64),
}

/// A running proxy; stops (and cuts every connection) when dropped.
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    mode: watch::Sender<Mode>,
    conns: Arc<Mutex<Vec<AbortHandle>>>,
    accepted: Arc<AtomicUsize>,
    listener: AbortHandle,
    upstream: Arc<Mutex<(String, u16)>>,
}

impl Proxy {
    /// Starts a proxy on `127.0.0.1:0` forwarding to `upstream_host:upstream_port`.
    pub async fn start(upstream_host: &str, upstream_port: u16) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let (mode, _) = watch::channel(Mode::Pass);
        let conns: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let accepted = Arc::new(AtomicUsize::new(0));
        let upstream = Arc::new(Mutex::new((upstream_host.to_owned(), upstream_port)));
        let task = {
            let upstream = upstream.clone();
            let mode = mode.clone();
            let conns = conns.clone();
            let accepted = accepted.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        continue;
                    };
                    accepted.fetch_add(1, Ordering::SeqCst);
                    let target = upstream.lock().expect("proxy mutex").clone();
                    let handle = tokio::spawn(serve(client, target, mode.subscribe()));
                    let mut conns = conns.lock().expect("proxy mutex");
                    conns.retain(|h| !h.is_finished());
                    conns.push(handle.abort_handle());
                }
            })
        };
        Ok(Self {
            addr,
            mode,
            conns,
            accepted,
            listener: task.abort_handle(),
            upstream,
        })
    }

    /// The port clients should connect to (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Stops forwarding in both directions; nothing is closed.
    pub fn stall(&self) {
        self.mode.send_replace(Mode::Stall);
    }

    /// Forwards every chunk after `micros` µs (both directions), so every
    /// statement takes at least two such delays.
    pub fn delay(&self, micros: u64) {
        self.mode.send_replace(Mode::Delay(micros));
    }

    /// Resumes forwarding.
    pub fn pass(&self) {
        self.mode.send_replace(Mode::Pass);
    }

    /// Closes every current proxied connection on both sides (new ones are
    /// still accepted).
    pub fn cut(&self) {
        for handle in self.conns.lock().expect("proxy mutex").drain(..) {
            handle.abort();
        }
    }

    /// Sends new connections to `127.0.0.1:port` from now on (as a DNS name
    /// or a virtual IP moved to a promoted standby would); current
    /// connections stay where they are.
    pub fn set_upstream(&self, port: u16) {
        *self.upstream.lock().expect("proxy mutex") = ("127.0.0.1".to_owned(), port);
    }

    /// How many client connections were accepted so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.listener.abort();
        self.cut();
    }
}

async fn serve(client: TcpStream, upstream: (String, u16), mode: watch::Receiver<Mode>) {
    let Ok(server) = TcpStream::connect((upstream.0.as_str(), upstream.1)).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::join!(
        pump(client_read, server_write, mode.clone()),
        pump(server_read, client_write, mode),
    );
}

/// Copies `from` to `to` while the mode is `Pass`. A read that completes
/// during a stall is held back until forwarding resumes, and so is an EOF.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut mode: watch::Receiver<Mode>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if mode.wait_for(|m| *m != Mode::Stall).await.is_err() {
            return;
        }
        let n = from.read(&mut buf).await.unwrap_or(0);
        if mode.wait_for(|m| *m != Mode::Stall).await.is_err() {
            return;
        }
        let delay = match *mode.borrow() {
            Mode::Delay(micros) => micros,
            _ => 0,
        };
        if delay > 0 {
            tokio::time::sleep(std::time::Duration::from_micros(delay)).await;
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
