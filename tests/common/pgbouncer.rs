//! A private PgBouncer in transaction-pooling mode, in front of a
//! PostgreSQL on 127.0.0.1.
//!
//! It listens on a free loopback port, keeps its generated configuration and
//! its log in a directory of its own, and is stopped when dropped.
//! PgBouncer refuses to run as root: when the tests run as root it runs as
//! the `postgres` OS user (`pgbouncer -u postgres`). Debian's package
//! (`apt-get install pgbouncer`, 1.18 on bookworm); a missing binary is a
//! test failure, not a skip: `.ci/run` installs it.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::cluster::free_port;

use sqlx::postgres::PgConnectOptions;

/// Where Debian installs it (not on a non-root `PATH`), then `PATH`.
fn binary() -> PathBuf {
    let found = ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
        .iter()
        .map(PathBuf::from)
        .find(|path| path.exists())
        .or_else(|| {
            let out = Command::new("sh")
                .args(["-c", "command -v pgbouncer"])
                .output()
                .ok()?;
            let path = String::from_utf8(out.stdout).ok()?;
            let path = path.trim();
            (!path.is_empty()).then(|| PathBuf::from(path))
        });
    found.expect(
        "pgbouncer is not installed (apt-get install pgbouncer; .ci/run does it): \
         the PgBouncer tests cannot run without it",
    )
}

/// What to start: see [`PgBouncer::builder`].
#[derive(Debug, Clone)]
pub struct Builder {
    pg_port: u16,
    /// `(database, user)`; `None`: every database, as the client's user.
    database: Option<(String, String)>,
    overrides: Vec<(String, String)>,
    parent: Option<PathBuf>,
}

impl Builder {
    /// Serves only database `db`, under the same name, connecting to
    /// PostgreSQL as `user` (the default: every database, as the client's
    /// user, `postgres`).
    pub fn database(mut self, db: &str, user: &str) -> Self {
        self.database = Some((db.to_owned(), user.to_owned()));
        self
    }

    /// Replaces (or adds) one setting of the `[pgbouncer]` section.
    pub fn set(mut self, key: &str, value: &str) -> Self {
        self.overrides.push((key.to_owned(), value.to_owned()));
        self
    }

    /// Keeps the configuration and the log in a new directory under
    /// `parent`, left in place when the PgBouncer is dropped (the default:
    /// a scratch directory, removed then).
    pub fn dir_in(mut self, parent: &Path) -> Self {
        self.parent = Some(parent.to_owned());
        self
    }

    pub async fn start(self) -> PgBouncer {
        static STARTED: AtomicUsize = AtomicUsize::new(0);
        let binary = binary();
        let name = format!(
            "distlock-pgbouncer-{}-{}",
            std::process::id(),
            STARTED.fetch_add(1, Ordering::SeqCst)
        );
        let keep_dir = self.parent.is_some();
        let dir = self.parent.unwrap_or_else(std::env::temp_dir).join(name);
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("pgbouncer directory");
        // Writable by `postgres` (its log).
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).expect("chmod");
        let port = free_port();
        let path = |name: &str| dir.join(name).display().to_string();
        let pg_port = self.pg_port;
        let (entry, auth_user) = match &self.database {
            None => (format!("* = host=127.0.0.1 port={pg_port}"), "postgres"),
            Some((db, user)) => (
                format!("{db} = host=127.0.0.1 port={pg_port} dbname={db} user={user}"),
                user.as_str(),
            ),
        };
        fs::write(dir.join("users.txt"), format!("\"{auth_user}\" \"\"\n")).expect("auth file");
        let mut settings: Vec<(String, String)> = [
            ("listen_addr", "127.0.0.1".to_owned()),
            ("listen_port", port.to_string()),
            ("unix_socket_dir", String::new()),
            ("auth_type", "trust".to_owned()),
            ("auth_file", path("users.txt")),
            ("pool_mode", "transaction".to_owned()),
            ("server_round_robin", "1".to_owned()),
            ("default_pool_size", "4".to_owned()),
            ("max_client_conn", "200".to_owned()),
            ("ignore_startup_parameters", "extra_float_digits".to_owned()),
            ("logfile", path("pgbouncer.log")),
        ]
        .into_iter()
        .map(|(key, value)| (key.to_owned(), value))
        .collect();
        for (key, value) in self.overrides {
            settings.retain(|(k, _)| *k != key);
            settings.push((key, value));
        }
        let mut ini = format!("[databases]\n{entry}\n[pgbouncer]\n");
        for (key, value) in settings {
            ini.push_str(&format!("{key} = {value}\n"));
        }
        fs::write(dir.join("pgbouncer.ini"), ini).expect("ini");
        for file in ["users.txt", "pgbouncer.ini"] {
            fs::set_permissions(dir.join(file), fs::Permissions::from_mode(0o644)).expect("chmod");
        }
        let is_root = fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
        let mut cmd = Command::new(&binary);
        if is_root {
            cmd.args(["-u", "postgres"]);
        }
        let child = cmd
            .arg(dir.join("pgbouncer.ini"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(dir.join("stderr")).expect("stderr"))
            .spawn()
            .expect("spawn pgbouncer");
        let mut bouncer = PgBouncer {
            child,
            port,
            dir,
            keep_dir,
        };
        bouncer.wait_ready().await;
        bouncer
    }
}

/// A running PgBouncer; stopped when dropped.
#[derive(Debug)]
pub struct PgBouncer {
    child: Child,
    port: u16,
    dir: PathBuf,
    keep_dir: bool,
}

impl PgBouncer {
    /// Starts PgBouncer in transaction mode in front of every database of the
    /// PostgreSQL on 127.0.0.1:`pg_port` (trust authentication, four server
    /// connections per database and user, handed out round robin).
    pub async fn start(pg_port: u16) -> Self {
        Self::builder(pg_port).start().await
    }

    /// A PgBouncer like [`PgBouncer::start`]'s, to be changed before it
    /// starts.
    pub fn builder(pg_port: u16) -> Builder {
        Builder {
            pg_port,
            database: None,
            overrides: Vec::new(),
            parent: None,
        }
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `options` (a database of the PostgreSQL behind it) pointed at this
    /// PgBouncer instead, with sqlx's statement cache off (the README's
    /// recipe).
    pub fn options(&self, options: &PgConnectOptions) -> PgConnectOptions {
        options
            .clone()
            .host("127.0.0.1")
            .port(self.port)
            .statement_cache_capacity(0)
    }

    async fn wait_ready(&mut self) {
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("pgbouncer exited ({status}): {}", self.log());
            }
            if tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                .await
                .is_ok()
            {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "pgbouncer did not listen within 10 s: {}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Its log and standard error, for failure messages.
    pub fn log(&self) -> String {
        let log = fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default();
        let err = fs::read_to_string(self.dir.join("stderr")).unwrap_or_default();
        format!("{log}{err}")
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        // SIGTERM (shut down at once, closing every connection), then
        // SIGKILL if it is still there after two seconds.
        let pid = i32::try_from(self.child.id()).expect("pid fits");
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGTERM,
        );
        let gone = Instant::now();
        while !matches!(self.child.try_wait(), Ok(Some(_)))
            && gone.elapsed() < Duration::from_secs(2)
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !self.keep_dir {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}
