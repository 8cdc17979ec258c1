//! A private PostgreSQL cluster for the scale rows: its own lock table, so
//! filling it to 100,000 advisory locks (and past its limit) cannot make
//! another user of the shared server fail with `out of shared memory`.
//! `initdb` into a scratch directory, a free loopback port, run as the
//! `postgres` OS user when we are root; stopped and removed on drop.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};
use sqlx::postgres::PgConnectOptions;

/// A running private cluster.
pub struct Server {
    root: PathBuf,
    data: PathBuf,
    port: u16,
    running: bool,
}

/// The newest server binaries under /usr/lib/postgresql (or
/// `$DISTLOCK_PG_BIN`, as the tests use).
fn bin_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("DISTLOCK_PG_BIN").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    let mut dirs: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .context("no PostgreSQL server binaries under /usr/lib/postgresql")?
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    dirs.sort();
    dirs.pop()
        .map(|(_, bin)| bin)
        .context("no initdb under /usr/lib/postgresql/*/bin")
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn command(binary: &str) -> anyhow::Result<Command> {
    let path = bin_dir()?.join(binary);
    Ok(if running_as_root() {
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", "postgres", "--"]).arg(path);
        cmd
    } else {
        Command::new(path)
    })
}

fn run(mut cmd: Command, what: &str) -> anyhow::Result<()> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("{what}: could not start"))?;
    if !out.status.success() {
        bail!(
            "{what} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind(("127.0.0.1", 0))?
        .local_addr()?
        .port())
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap_or_default()
}

impl Server {
    /// `initdb`, append `conf` lines to postgresql.conf, start. Blocking
    /// (a few seconds); call it before the measurements.
    pub fn start(conf: &[&str]) -> anyhow::Result<Self> {
        let root = std::env::temp_dir().join(format!(
            "distlock-bench-scale-{}-{}",
            std::process::id(),
            free_port()?
        ));
        std::fs::create_dir_all(&root)?;
        if running_as_root() {
            let mut chown = Command::new("chown");
            chown.arg("postgres:postgres").arg(&root);
            run(chown, "chown")?;
        }
        let data = root.join("data");
        let mut server = Self {
            root,
            data,
            port: free_port()?,
            running: false,
        };
        let mut initdb = command("initdb")?;
        initdb.arg("-D").arg(&server.data).args([
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
        ]);
        run(initdb, "initdb")?;
        let mut text = String::from("\n");
        for line in conf {
            text.push_str(line);
            text.push('\n');
        }
        let config = server.data.join("postgresql.conf");
        let mut current = std::fs::read_to_string(&config)?;
        current.push_str(&text);
        std::fs::write(&config, current)?;
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories={}",
            server.port,
            path(&server.root)
        );
        let log = server.root.join("log");
        let mut start = command("pg_ctl")?;
        start.arg("-D").arg(&server.data).args([
            "start",
            "-w",
            "-t",
            "60",
            "-o",
            &options,
            "-l",
            path(&log),
        ]);
        server.running = true; // from here on, drop stops it
        run(start, "pg_ctl start")?;
        Ok(server)
    }

    pub fn options(&self) -> PgConnectOptions {
        PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username("postgres")
            .database("postgres")
            .application_name("distlock-bench")
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.running
            && let Ok(mut stop) = command("pg_ctl")
        {
            stop.arg("-D")
                .arg(&self.data)
                .args(["stop", "-m", "immediate", "-w"]);
            let _ = run(stop, "pg_ctl stop");
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}
