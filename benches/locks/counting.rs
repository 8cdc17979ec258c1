//! A loopback TCP proxy that counts round trips and can add latency.
//!
//! A round trip is a client→server burst that follows a server→client burst
//! (or opens the connection): the client sent something and, before it sent
//! more, the server answered. Messages the client pipelines (several
//! statements in one write, or a queued `ROLLBACK` that sqlx sends together
//! with the next query) count once, exactly as they cost once in latency.
//! Counting bursts rather than protocol messages needs no parsing and no
//! server extension (`pg_stat_statements` is not loaded on the test server,
//! and it would not see the pool's pings, which are bare `Sync` messages).
//!
//! With a delay, every burst is held back that long in each direction, which
//! turns loopback into a network with a round-trip time of twice the delay.
//! It runs on plain threads with blocking sockets, so the delay is as exact
//! as `thread::sleep` (tokio's timer has a 1 ms granularity).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// A running proxy on `127.0.0.1:<port>`; lives as long as the process.
#[derive(Debug, Clone)]
pub struct CountingProxy {
    port: u16,
    turns: Arc<AtomicU64>,
}

impl CountingProxy {
    /// Starts forwarding to `host:port`, each burst delayed by `delay`.
    pub fn start(host: &str, port: u16, delay: Duration) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0))?;
        let local = listener.local_addr()?.port();
        let turns = Arc::new(AtomicU64::new(0));
        let counter = turns.clone();
        let upstream = (host.to_owned(), port);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect((upstream.0.as_str(), upstream.1)) else {
                    continue;
                };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let (Ok(client2), Ok(server2)) = (client.try_clone(), server.try_clone()) else {
                    continue;
                };
                // `true` while the last bytes went server→client.
                let answered = Arc::new(AtomicBool::new(true));
                let (a, c) = (answered.clone(), counter.clone());
                std::thread::spawn(move || pump(client, server, &a, Some(&c), delay));
                std::thread::spawn(move || pump(server2, client2, &answered, None, delay));
            }
        });
        Ok(Self { port: local, turns })
    }

    /// The port to connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Round trips counted so far, over all connections.
    pub fn turns(&self) -> u64 {
        self.turns.load(Ordering::SeqCst)
    }
}

/// Copies one direction. The client→server pump (`count` is set) counts a
/// turn when it forwards bytes after the server last spoke.
fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    answered: &AtomicBool,
    count: Option<&AtomicU64>,
    delay: Duration,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => {
                let _ = to.shutdown(Shutdown::Write);
                return;
            }
            Ok(n) => n,
        };
        match count {
            Some(turns) => {
                if answered.swap(false, Ordering::SeqCst) {
                    turns.fetch_add(1, Ordering::SeqCst);
                }
            }
            None => answered.store(true, Ordering::SeqCst),
        }
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        if to.write_all(&buf[..n]).is_err() {
            return;
        }
    }
}
