//! A PgBouncer in transaction-pooling mode, started by the test on a free
//! loopback port with a generated configuration, and killed when dropped.
//! Debian's package (`apt-get install pgbouncer`, 1.18 on bookworm; `.ci/run`
//! installs it); tests that need it fail when the binary is missing.

use std::fs;
use std::net::TcpListener;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where Debian installs it (not on a non-root `PATH`).
const CANDIDATES: &[&str] = &["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"];

pub fn binary() -> Option<PathBuf> {
    CANDIDATES
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .or_else(|| {
            let out = Command::new("sh")
                .args(["-c", "command -v pgbouncer"])
                .output()
                .ok()?;
            let path = String::from_utf8(out.stdout).ok()?;
            let path = path.trim();
            (!path.is_empty()).then(|| PathBuf::from(path))
        })
}

/// A running PgBouncer.
#[derive(Debug)]
pub struct PgBouncer {
    child: Child,
    pub port: u16,
    dir: PathBuf,
}

impl PgBouncer {
    /// Starts PgBouncer in front of database `db` of the PostgreSQL on
    /// 127.0.0.1:`pg_port`, under the same name, in transaction mode, with
    /// `overrides` replacing or adding to the default settings. `None` if
    /// the binary is missing.
    pub async fn start(
        dir: &Path,
        db: &str,
        user: &str,
        pg_port: u16,
        overrides: &[(&str, &str)],
    ) -> Option<Self> {
        let binary = binary()?;
        let dir = dir.join(format!("pgbouncer-{}", super::clock::now_ns()));
        fs::create_dir_all(&dir).expect("pgbouncer directory");
        // PgBouncer refuses to run as root; it then runs as `postgres` and
        // must be able to write its log here.
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).expect("chmod");
        let port = free_port();
        let auth = dir.join("users.txt");
        fs::write(&auth, format!("\"{user}\" \"\"\n")).expect("auth file");
        let ini = dir.join("pgbouncer.ini");
        let auth_file = auth.display().to_string();
        let logfile = dir.join("pgbouncer.log").display().to_string();
        let port_text = port.to_string();
        let mut settings: Vec<(&str, &str)> = vec![
            ("listen_addr", "127.0.0.1"),
            ("listen_port", &port_text),
            ("unix_socket_dir", ""),
            ("auth_type", "trust"),
            ("auth_file", &auth_file),
            ("pool_mode", "transaction"),
            ("server_round_robin", "1"),
            ("min_pool_size", "2"),
            ("default_pool_size", "4"),
            ("max_client_conn", "100"),
            ("ignore_startup_parameters", "extra_float_digits"),
            ("logfile", &logfile),
        ];
        for (key, value) in overrides {
            settings.retain(|(k, _)| k != key);
            settings.push((key, value));
        }
        let mut text =
            format!("[databases]\n{db} = host=127.0.0.1 port={pg_port} dbname={db} user={user}\n");
        text.push_str("[pgbouncer]\n");
        for (key, value) in settings {
            text.push_str(&format!("{key} = {value}\n"));
        }
        fs::write(&ini, text).expect("ini");
        let is_root = fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
        let mut cmd = Command::new(binary);
        if is_root {
            cmd.args(["-u", "postgres"]);
        }
        let child = cmd
            .arg(&ini)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(dir.join("stderr")).expect("stderr"))
            .spawn()
            .expect("spawn pgbouncer");
        let mut bouncer = Self { child, port, dir };
        bouncer.wait_ready().await;
        Some(bouncer)
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

    pub fn log(&self) -> String {
        let log = fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default();
        let err = fs::read_to_string(self.dir.join("stderr")).unwrap_or_default();
        format!("{log}{err}")
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    let listener = TcpListener::bind(("127.0.0.1", 0)).expect("bind");
    listener.local_addr().expect("address").port()
}
