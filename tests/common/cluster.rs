//! Private PostgreSQL clusters for crash and failover tests.
//!
//! Each cluster lives in a scratch directory of its own, listens on a free
//! loopback port and is stopped and removed when dropped; the shared server
//! on 5432 is never touched. `initdb` refuses to run as root, so when the
//! tests run as root every server binary runs as the `postgres` OS user
//! through `runuser`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use sqlx::ConnectOptions;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use tokio::process::Command;

/// One private cluster: a data directory, a port, a running postmaster.
#[derive(Debug)]
pub struct Cluster {
    root: PathBuf,
    data: PathBuf,
    port: u16,
    name: String,
    /// The network namespace the postmaster runs in (None: the test's own).
    netns: Option<String>,
    /// Its `listen_addresses`.
    listen: String,
    /// Where the postmaster finds locales beyond the system's (`LOCPATH`).
    locpath: Option<PathBuf>,
}

/// The directory of the server binaries: `$DISTLOCK_PG_BIN` where set (for
/// example a directory `.ci/pg-install` printed, to run these tests on
/// another major version), else the newest installed under
/// /usr/lib/postgresql.
pub fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("DISTLOCK_PG_BIN").filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        assert!(
            dir.join("initdb").exists(),
            "DISTLOCK_PG_BIN={} has no initdb",
            dir.display()
        );
        return dir;
    }
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL server binaries under /usr/lib/postgresql")
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|p| p.join("initdb").exists())
        .collect();
    dirs.sort_by_key(|p| {
        p.parent()
            .and_then(|v| v.file_name())
            .and_then(|v| v.to_str())
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0)
    });
    dirs.pop()
        .expect("an initdb under /usr/lib/postgresql/*/bin")
}

/// The libraries the binaries of [`bin_dir`] need, where they ship their
/// own (`../lib`, as the npm-packaged servers do; Debian's binaries find
/// theirs without help).
fn lib_dir() -> Option<PathBuf> {
    std::env::var_os("DISTLOCK_PG_BIN")
        .filter(|d| !d.is_empty())
        .map(|d| PathBuf::from(d).join("../lib"))
        .filter(|l| l.is_dir())
}

fn running_as_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// A command for one of the server binaries, as `postgres` when we are root,
/// with `LD_LIBRARY_PATH` set where the binaries ship their libraries. Run
/// through `env` so the variable reaches the binary whatever `runuser`
/// keeps of the environment; `prefix` (e.g. `ip netns exec NS`) goes first.
fn std_server_command(prefix: &[&str], binary: &str) -> std::process::Command {
    let path = bin_dir().join(binary);
    let mut argv: Vec<std::ffi::OsString> = prefix.iter().map(Into::into).collect();
    if running_as_root() {
        argv.extend(["runuser", "-u", "postgres", "--"].map(Into::into));
    }
    if let Some(lib) = lib_dir() {
        argv.push("env".into());
        let mut var = std::ffi::OsString::from("LD_LIBRARY_PATH=");
        var.push(lib);
        argv.push(var);
    }
    argv.push(path.into());
    let mut cmd = std::process::Command::new(&argv[0]);
    cmd.args(&argv[1..]);
    cmd
}

/// [`std_server_command`] for tokio, without a prefix.
fn server_command(binary: &str) -> Command {
    Command::from(std_server_command(&[], binary))
}

/// The setting that makes a cluster built with [`build_german_locale`]
/// answer in German.
const GERMAN: &str = "lc_messages = 'de_DE.UTF-8'";

/// Builds the locale `de_DE.UTF-8` into `dir` (as `LOCPATH` reads it),
/// readable by the `postgres` user.
async fn build_german_locale(dir: &std::path::Path) {
    std::fs::create_dir_all(dir).expect("locale dir");
    let mut localedef = Command::new("localedef");
    localedef
        .args(["-i", "de_DE", "-f", "UTF-8"])
        .arg(dir.join("de_DE.UTF-8"));
    run(localedef, "localedef de_DE.UTF-8").await;
    let mut readable = Command::new("chmod");
    readable.args(["-R", "a+rX"]).arg(dir);
    run(readable, "chmod the locale").await;
}

async fn run(mut cmd: Command, what: &str) {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A port nobody holds right now, for a server (a cluster, PgBouncer,
/// Redis) the test starts later: taken below the kernel's ephemeral range,
/// because a port from `bind(0)` lies in it and any client socket opened
/// meanwhile (the suites open thousands) can take it, and then the server's
/// bind fails ("could not create any TCP/IP sockets"). Candidates come from
/// one counter per process, so two tests of one binary never get the same
/// port; a bind proves the candidate free of listeners and client sockets.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const SPAN: u32 = 12_000;
    let below = ephemeral_low().max(SPAN + 1024);
    let start = (std::process::id() % 97) * 120;
    for _ in 0..SPAN {
        let port = below - SPAN + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % SPAN;
        let port = u16::try_from(port).expect("a port number");
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in [{}, {below})", below - SPAN);
}

/// The first port of the kernel's ephemeral range (32768 where unreadable).
fn ephemeral_low() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// A scratch directory the `postgres` user may write (the caller removes
/// it; a cluster removes its own).
pub fn scratch(name: &str) -> PathBuf {
    let root = std::env::temp_dir().join(format!(
        "distlock-{name}-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&root).expect("scratch dir");
    if running_as_root() {
        let status = std::process::Command::new("chown")
            .args(["postgres:postgres"])
            .arg(&root)
            .status()
            .expect("chown");
        assert!(status.success(), "chown scratch dir");
    }
    root
}

impl Cluster {
    /// `initdb` a new cluster, append `conf` lines to its configuration and
    /// start it.
    pub async fn primary(name: &str, conf: &[&str]) -> Cluster {
        let cluster = Self::initdb(name, None, "127.0.0.1").await;
        cluster.configure(conf);
        cluster.start().await;
        cluster
    }

    /// Like [`primary`](Self::primary), with its server messages in German
    /// (see [`german_standby_of`](Self::german_standby_of)).
    pub async fn german_primary(name: &str) -> Cluster {
        let mut cluster = Self::initdb(name, None, "127.0.0.1").await;
        let dir = cluster.root.join("locale");
        build_german_locale(&dir).await;
        cluster.locpath = Some(dir);
        cluster.configure(&[GERMAN]);
        cluster.start().await;
        cluster
    }

    /// A new cluster (`initdb`, configured for streaming replication), not
    /// started.
    async fn initdb(name: &str, netns: Option<&str>, listen: &str) -> Cluster {
        let root = scratch(name);
        let data = root.join("data");
        let mut initdb = server_command("initdb");
        initdb.arg("-D").arg(&data).args([
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
        ]);
        run(initdb, "initdb").await;
        let cluster = Cluster {
            root,
            data,
            port: free_port(),
            name: name.to_owned(),
            netns: netns.map(str::to_owned),
            listen: listen.to_owned(),
            locpath: None,
        };
        cluster.configure(&[
            "wal_level = replica",
            "max_wal_senders = 5",
            "hot_standby = on",
        ]);
        cluster
    }

    /// Like [`primary`](Self::primary), but the postmaster runs in the
    /// network namespace `netns` and listens on `listen` (an address of that
    /// namespace) and on its Unix-domain socket, which the test reaches from
    /// any namespace ([`socket_options`](Self::socket_options)).
    pub async fn primary_in_netns(name: &str, conf: &[&str], netns: &str, listen: &str) -> Cluster {
        let cluster = Self::initdb(name, Some(netns), listen).await;
        // initdb trusts 127.0.0.1 only; the clients come from the other
        // end of a veth pair, still inside 127.0.0.0/8.
        {
            use std::io::Write;
            let mut hba = std::fs::OpenOptions::new()
                .append(true)
                .open(cluster.data.join("pg_hba.conf"))
                .expect("pg_hba.conf");
            writeln!(hba, "host all all 127.0.0.0/8 trust").expect("write pg_hba.conf");
        }
        cluster.configure(conf);
        cluster.start().await;
        cluster
    }

    /// A streaming standby of `primary` (`pg_basebackup -R`), started.
    pub async fn standby_of(primary: &Cluster, name: &str, conf: &[&str]) -> Cluster {
        Self::standby(primary, name, conf, false).await
    }

    /// A streaming standby of `primary` whose server messages are German
    /// (`lc_messages = 'de_DE.UTF-8'`): the locale is built with `localedef`
    /// into the cluster's scratch directory, where the postmaster finds it
    /// through `LOCPATH`. Needs `localedef` and the `locales` package's
    /// sources (`.ci/run` installs them).
    pub async fn german_standby_of(primary: &Cluster, name: &str) -> Cluster {
        Self::standby(primary, name, &[GERMAN], true).await
    }

    async fn standby(primary: &Cluster, name: &str, conf: &[&str], german: bool) -> Cluster {
        let root = scratch(name);
        let locpath = german.then(|| root.join("locale"));
        let data = root.join("data");
        if bin_dir().join("pg_basebackup").exists() {
            let mut backup = server_command("pg_basebackup");
            backup
                .arg("-D")
                .arg(&data)
                .args(["-h", "127.0.0.1", "-U", "postgres", "-R", "-X", "stream"])
                .args(["-p", &primary.port.to_string()]);
            run(backup, "pg_basebackup").await;
        } else {
            copy_backup(primary, &data).await;
        }
        let cluster = Cluster {
            root,
            data,
            port: free_port(),
            name: name.to_owned(),
            netns: None,
            listen: "127.0.0.1".to_owned(),
            locpath,
        };
        if let Some(dir) = &cluster.locpath {
            build_german_locale(dir).await;
        }
        // The standby names itself, so a primary can list it in
        // synchronous_standby_names.
        cluster.configure(&[&format!(
            "primary_conninfo = 'host=127.0.0.1 port={} user=postgres application_name={name}'",
            primary.port
        )]);
        cluster.configure(conf);
        cluster.start().await;
        cluster
    }

    fn configure(&self, lines: &[&str]) {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(self.data.join("postgresql.auto.conf"))
            .expect("postgresql.auto.conf");
        for line in lines {
            writeln!(file, "{line}").expect("write conf");
        }
    }

    /// Appends configuration and reloads it.
    pub async fn reconfigure(&self, lines: &[&str]) {
        self.configure(lines);
        self.pg_ctl(&["reload"]).await;
    }

    async fn pg_ctl(&self, args: &[&str]) {
        let mut cmd = server_command("pg_ctl");
        cmd.arg("-D").arg(&self.data).args(args);
        if let Some(dir) = &self.locpath {
            cmd.env("LOCPATH", dir);
        }
        run(cmd, &format!("pg_ctl {args:?} ({})", self.name)).await;
    }

    /// Starts the postmaster and waits until it accepts connections.
    pub async fn start(&self) {
        let options = format!(
            "-p {} -c listen_addresses={} -c unix_socket_directories={}",
            self.port,
            self.listen,
            self.root.display()
        );
        let log = self.root.join("log");
        let args = ["start", "-w", "-t", "60", "-o", &options, "-l", path(&log)];
        match &self.netns {
            None => self.pg_ctl(&args).await,
            Some(ns) => {
                // The postmaster (and every backend) inherits the namespace.
                let mut cmd =
                    Command::from(std_server_command(&["ip", "netns", "exec", ns], "pg_ctl"));
                cmd.arg("-D").arg(&self.data).args(args);
                run(cmd, &format!("pg_ctl start in {ns} ({})", self.name)).await;
            }
        }
    }

    /// `pg_ctl stop -m immediate`: a crash, WAL that was not flushed is lost.
    pub async fn crash(&self) {
        self.pg_ctl(&["stop", "-m", "immediate", "-w"]).await;
    }

    /// A clean shutdown.
    pub async fn stop(&self) {
        self.pg_ctl(&["stop", "-m", "fast", "-w"]).await;
    }

    /// Promotes a standby and waits until it accepts writes.
    pub async fn promote(&self) {
        self.pg_ctl(&["promote", "-w", "-t", "60"]).await;
    }

    /// `kill -9` of one server process (a backend): the postmaster ends
    /// every other backend and runs crash recovery, without restarting
    /// (its start time stays).
    pub fn kill_backend(&self, pid: i32) {
        let status = std::process::Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill -9 {pid} ({})", self.name);
    }

    /// What the server has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.root.join("log")).unwrap_or_default()
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Connect options for its `postgres` database (over TCP, on the
    /// address it listens on).
    pub fn options(&self) -> PgConnectOptions {
        PgConnectOptions::new()
            .host(&self.listen)
            .port(self.port)
            .username("postgres")
            .database("postgres")
            .disable_statement_logging()
    }

    /// Connect options for its `postgres` database over its Unix-domain
    /// socket (in its scratch directory), which works across network
    /// namespaces.
    pub fn socket_options(&self) -> PgConnectOptions {
        PgConnectOptions::new()
            .socket(&self.root)
            .port(self.port)
            .username("postgres")
            .database("postgres")
            .disable_statement_logging()
    }

    /// A small pool on its `postgres` database.
    pub async fn pool(&self) -> PgPool {
        PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(self.options())
            .await
            .expect("pool on private cluster")
    }

    /// Waits until `sql` returns true on a fresh connection.
    pub async fn wait_until(&self, sql: &str, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            if self.holds(sql).await {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{}: `{sql}` not true within {within:?}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Cluster {
    async fn holds(&self, sql: &str) -> bool {
        let Ok(mut conn) = self.options().connect().await else {
            return false;
        };
        sqlx::query_scalar::<_, bool>(sqlx::AssertSqlSafe(sql.to_owned()))
            .fetch_one(&mut conn)
            .await
            .unwrap_or(false)
    }
}

/// A base backup of the running `primary` into `data` without
/// `pg_basebackup` (the npm-packaged servers ship only initdb, pg_ctl and
/// postgres): the low-level backup API around a file copy, then the
/// `backup_label` it returns and a `standby.signal`, which is what
/// `pg_basebackup -R` leaves (its `primary_conninfo` is written by the
/// caller). WAL written during the copy is streamed from the primary.
async fn copy_backup(primary: &Cluster, data: &Path) {
    let mut conn = primary
        .options()
        .connect()
        .await
        .expect("connect for the backup");
    let version: i32 = sqlx::query_scalar("SELECT current_setting('server_version_num')::int")
        .fetch_one(&mut conn)
        .await
        .expect("server_version_num");
    // Renamed in 15; the non-exclusive form needs this session kept open.
    let (start, stop) = if version >= 150000 {
        (
            "SELECT pg_backup_start('distlock-test', true)::text",
            "SELECT labelfile FROM pg_backup_stop(false)",
        )
    } else {
        (
            "SELECT pg_start_backup('distlock-test', true, false)::text",
            "SELECT labelfile FROM pg_stop_backup(false, false)",
        )
    };
    sqlx::query_scalar::<_, String>(start)
        .fetch_one(&mut conn)
        .await
        .expect("start backup");
    let mut copy = if running_as_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--", "cp"]);
        c
    } else {
        Command::new("cp")
    };
    copy.arg("-a").arg(&primary.data).arg(data);
    let out = copy
        .stdin(Stdio::null())
        .output()
        .await
        .expect("copy the data directory");
    // Files the running server removes meanwhile (statistics, recycled WAL)
    // may vanish under cp; the backup does not need them.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success()
            || stderr
                .lines()
                .all(|l| l.contains("No such file or directory")),
        "copy the data directory: {stderr}"
    );
    let label: String = sqlx::query_scalar(stop)
        .fetch_one(&mut conn)
        .await
        .expect("stop backup");
    for stale in ["postmaster.pid", "postmaster.opts", "backup_label.old"] {
        let _ = std::fs::remove_file(data.join(stale));
    }
    std::fs::write(data.join("backup_label"), label).expect("write backup_label");
    std::fs::write(data.join("standby.signal"), "").expect("write standby.signal");
    if running_as_root() {
        let status = std::process::Command::new("chown")
            .arg("postgres:postgres")
            .arg(data.join("backup_label"))
            .arg(data.join("standby.signal"))
            .status()
            .expect("chown");
        assert!(status.success(), "chown backup_label");
    }
}

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 scratch path")
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Blocking on purpose: the cluster must be gone before the test
        // process exits, whatever the runtime is doing.
        let _ = std_server_command(&[], "pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .args(["stop", "-m", "immediate", "-w"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}
