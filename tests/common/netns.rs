//! A network partition both ends really see: two network namespaces of the
//! test's own, joined by a veth pair, whose packets can be dropped.
//!
//! The server side gets `SERVER_ADDR`, the client side `CLIENT_ADDR` (both in
//! 127.0.0.0/8, which works on a veth only with `route_localnet`, set inside
//! the two namespaces and nowhere else). [`Partition::cut`] puts a
//! `blackhole` qdisc on both ends of the pair: every packet either side sends
//! is dropped silently, while the sending kernel believes it went out, as on
//! a broken link. Unlike a stalled proxy, nothing acknowledges the data, so
//! the server's TCP keepalives and `tcp_user_timeout` run out for real.
//! [`Partition::heal`] removes the qdiscs.
//!
//! The namespaces are named after the test's pid (and a counter) and deleted
//! when the `Partition` is dropped, also on panic. Creating them needs root
//! (CAP_NET_ADMIN): without it `Partition::new` panics, so a test built on
//! it fails rather than passing without a partition.

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

/// The server side's address (on the veth in the server namespace).
pub const SERVER_ADDR: &str = "127.10.0.1";
/// The client side's address (on the veth in the client namespace).
pub const CLIENT_ADDR: &str = "127.10.0.2";

const SERVER_IF: &str = "dlsrv";
const CLIENT_IF: &str = "dlcli";

/// Two namespaces and the veth pair between them.
#[derive(Debug)]
pub struct Partition {
    server: String,
    client: String,
    cut: bool,
}

fn ip(args: &[&str]) -> Result<(), String> {
    tool("ip", args)
}

fn tool(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{program} {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {} failed: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

impl Partition {
    /// Creates the namespaces and the veth pair, addresses it and brings it
    /// up. Panics (the test fails) if any step fails.
    pub fn new() -> Partition {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let partition = Partition {
            server: format!("distlock-{pid}-{n}-srv"),
            client: format!("distlock-{pid}-{n}-cli"),
            cut: false,
        };
        // From here on, Drop deletes whatever was created.
        if let Err(e) = partition.set_up() {
            panic!(
                "cannot build a network partition (network namespaces and a veth pair need \
                 root and CAP_NET_ADMIN): {e}"
            );
        }
        partition
    }

    fn set_up(&self) -> Result<(), String> {
        let (s, c) = (self.server.as_str(), self.client.as_str());
        ip(&["netns", "add", s])?;
        ip(&["netns", "add", c])?;
        ip(&[
            "link", "add", SERVER_IF, "netns", s, "type", "veth", "peer", "name", CLIENT_IF,
            "netns", c,
        ])?;
        for (ns, dev, addr) in [(s, SERVER_IF, SERVER_ADDR), (c, CLIENT_IF, CLIENT_ADDR)] {
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
            // 127/8 off the loopback device is dropped as martian unless
            // route_localnet is on; only inside these namespaces.
            tool(
                "ip",
                &[
                    "netns",
                    "exec",
                    ns,
                    "sysctl",
                    "-q",
                    "-w",
                    "net.ipv4.conf.all.route_localnet=1",
                    &format!("net.ipv4.conf.{dev}.route_localnet=1"),
                ],
            )?;
            ip(&["-n", ns, "addr", "add", &format!("{addr}/30"), "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
        }
        Ok(())
    }

    /// The namespace the server runs in.
    pub fn server_ns(&self) -> &str {
        &self.server
    }

    /// The namespace the client runs in.
    pub fn client_ns(&self) -> &str {
        &self.client
    }

    /// `ip netns exec <server namespace>` followed by `program`.
    pub fn in_server(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        in_ns(&self.server, program)
    }

    /// `ip netns exec <client namespace>` followed by `program`.
    pub fn in_client(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        in_ns(&self.client, program)
    }

    /// Drops every packet either end sends from now on.
    pub fn cut(&mut self) {
        for (ns, dev) in [(&self.server, SERVER_IF), (&self.client, CLIENT_IF)] {
            tool(
                "tc",
                &["-n", ns, "qdisc", "add", "dev", dev, "root", "blackhole"],
            )
            .unwrap_or_else(|e| panic!("cut the link: {e}"));
        }
        self.cut = true;
    }

    /// Lets packets through again.
    pub fn heal(&mut self) {
        for (ns, dev) in [(&self.server, SERVER_IF), (&self.client, CLIENT_IF)] {
            tool("tc", &["-n", ns, "qdisc", "del", "dev", dev, "root"])
                .unwrap_or_else(|e| panic!("heal the link: {e}"));
        }
        self.cut = false;
    }

    /// Whether the link is cut right now.
    pub fn is_cut(&self) -> bool {
        self.cut
    }
}

fn in_ns(ns: &str, program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns]).arg(program);
    cmd
}

impl Drop for Partition {
    fn drop(&mut self) {
        // Deleting a namespace's name removes the namespace once no process
        // is left in it, and with it its end of the veth pair (which takes
        // the other end along).
        let _ = ip(&["netns", "del", &self.server]);
        let _ = ip(&["netns", "del", &self.client]);
    }
}
