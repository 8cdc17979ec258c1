//! Redis for the tests: `redis-server` processes of their own, on
//! free loopback ports, killed when dropped.
#![allow(dead_code)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::cluster::free_port;

use redis::aio::MultiplexedConnection;

/// A `redis-server` child process on 127.0.0.1, without persistence.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    args: Vec<String>,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts a server on a free port.
    pub async fn start() -> Self {
        Self::start_with(&[]).await
    }

    /// Starts a server on a free port with extra arguments.
    pub async fn start_with(args: &[&str]) -> Self {
        let mut server = Self::reserve(args);
        server.spawn().await;
        server
    }

    /// Picks a free port for a server that is not running yet.
    pub fn reserve(args: &[&str]) -> Self {
        Self {
            port: free_port(),
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            child: None,
        }
    }

    /// Starts (or restarts) the server on its port and waits until it
    /// answers `PING`.
    pub async fn spawn(&mut self) {
        assert!(self.child.is_none(), "server already running");
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .args(["--dir", &std::env::temp_dir().to_string_lossy()])
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server (is it installed?)");
        self.child = Some(child);
        self.wait_ready().await;
    }

    async fn wait_ready(&self) {
        let started = Instant::now();
        loop {
            if let Ok(mut conn) = try_connect(&self.url()).await {
                let pong: redis::RedisResult<String> =
                    redis::cmd("PING").query_async(&mut conn).await;
                if pong.is_ok() {
                    return;
                }
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "redis-server on port {} did not come up",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Kills the server (SIGKILL, like a crash) and waits for it to exit.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills the server (SIGKILL, like a crash) without waiting: its
    /// connections are refused a moment later; the process is reaped on
    /// drop.
    pub fn crash(&self) {
        self.signal(nix::sys::signal::Signal::SIGKILL);
    }

    /// Stops the server's process (SIGSTOP): connections stay open and
    /// nothing answers, as on a stalled host, until [`resume`](Self::resume).
    pub fn pause(&self) {
        self.signal(nix::sys::signal::Signal::SIGSTOP);
    }

    /// Lets a [`pause`](Self::pause)d server run again (SIGCONT).
    pub fn resume(&self) {
        self.signal(nix::sys::signal::Signal::SIGCONT);
    }

    fn signal(&self, signal: nix::sys::signal::Signal) {
        let child = self.child.as_ref().expect("server running");
        let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
        nix::sys::signal::kill(pid, signal).expect("signal redis-server");
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A plain connection for looking at and tampering with keys.
    pub async fn conn(&self) -> MultiplexedConnection {
        try_connect(&self.url())
            .await
            .expect("connect to test redis-server")
    }

    /// `GET key`.
    pub async fn get(&self, key: &str) -> Option<String> {
        redis::cmd("GET")
            .arg(key)
            .query_async(&mut self.conn().await)
            .await
            .expect("GET")
    }

    /// Runs a command and returns its reply.
    pub async fn run<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        let mut cmd = redis::cmd(args[0]);
        for arg in &args[1..] {
            cmd.arg(*arg);
        }
        cmd.query_async(&mut self.conn().await)
            .await
            .unwrap_or_else(|err| panic!("{args:?}: {err}"))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn try_connect(url: &str) -> redis::RedisResult<MultiplexedConnection> {
    redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await
}

/// `n` independent servers.
pub async fn servers(n: usize) -> Vec<RedisServer> {
    let mut servers = Vec::with_capacity(n);
    for _ in 0..n {
        servers.push(RedisServer::start().await);
    }
    servers
}

/// The URLs of `servers`.
pub fn urls(servers: &[RedisServer]) -> Vec<String> {
    servers.iter().map(RedisServer::url).collect()
}
