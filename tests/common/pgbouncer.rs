//! A private PgBouncer in transaction-pooling mode, in front of the shared
//! PostgreSQL on 127.0.0.1:5432.
//!
//! It runs as the `postgres` OS user (`runuser -u postgres -- pgbouncer`,
//! since PgBouncer refuses to run as root), listens on a free loopback port,
//! keeps its configuration and log in a scratch directory of its own, and is
//! stopped (by the pid it writes) when dropped. A missing binary is a test
//! failure, not a skip: `.ci/run` installs Debian's package.

use std::fs;
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

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

/// A running PgBouncer; stopped when dropped.
#[derive(Debug)]
pub struct PgBouncer {
    runuser: Child,
    port: u16,
    dir: PathBuf,
}

impl PgBouncer {
    /// Starts PgBouncer in transaction mode in front of every database of the
    /// PostgreSQL on 127.0.0.1:`pg_port` (trust authentication, four server
    /// connections per database and user, handed out round robin).
    pub async fn start(pg_port: u16) -> Self {
        static STARTED: AtomicUsize = AtomicUsize::new(0);
        let binary = binary();
        let dir = std::env::temp_dir().join(format!(
            "distlock-pgbouncer-{}-{}",
            std::process::id(),
            STARTED.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("pgbouncer directory");
        // Readable and writable by `postgres` (log, pid file).
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).expect("chmod");
        let port = free_port();
        let path = |name: &str| dir.join(name).display().to_string();
        fs::write(dir.join("users.txt"), "\"postgres\" \"\"\n").expect("auth file");
        let ini = format!(
            "[databases]\n\
             * = host=127.0.0.1 port={pg_port}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {auth}\n\
             pool_mode = transaction\n\
             server_round_robin = 1\n\
             default_pool_size = 4\n\
             max_client_conn = 200\n\
             ignore_startup_parameters = extra_float_digits\n\
             logfile = {log}\n\
             pidfile = {pid}\n",
            auth = path("users.txt"),
            log = path("pgbouncer.log"),
            pid = path("pgbouncer.pid"),
        );
        fs::write(dir.join("pgbouncer.ini"), ini).expect("ini");
        for file in ["users.txt", "pgbouncer.ini"] {
            fs::set_permissions(dir.join(file), fs::Permissions::from_mode(0o644)).expect("chmod");
        }
        let runuser = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(&binary)
            .arg(dir.join("pgbouncer.ini"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(dir.join("stderr")).expect("stderr"))
            .spawn()
            .expect("spawn runuser -u postgres -- pgbouncer");
        let mut bouncer = Self { runuser, port, dir };
        bouncer.wait_ready().await;
        bouncer
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
            if let Ok(Some(status)) = self.runuser.try_wait() {
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

    fn pid(&self) -> Option<i32> {
        fs::read_to_string(self.dir.join("pgbouncer.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        // PgBouncer itself (started by runuser, running as postgres), by the
        // pid it wrote; then runuser, which waits for it.
        if let Some(pid) = self.pid() {
            let pid = nix::unistd::Pid::from_raw(pid);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let gone = Instant::now();
            let mut exited = false;
            while !exited && gone.elapsed() < Duration::from_secs(2) {
                exited = matches!(self.runuser.try_wait(), Ok(Some(_)));
                std::thread::sleep(Duration::from_millis(10));
            }
            if !exited {
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            }
        }
        let _ = self.runuser.kill();
        let _ = self.runuser.wait();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> u16 {
    let listener = TcpListener::bind(("127.0.0.1", 0)).expect("bind");
    listener.local_addr().expect("address").port()
}
