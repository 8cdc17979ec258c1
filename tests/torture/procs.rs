//! Worker processes: the test binary started again as `worker_entry`, killed
//! (and reaped) when the [`Fleet`] is dropped, whatever happens.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::worker::{Config, ENV};

/// A run's directory: histories, worker output, the stop file. Removed at
/// the end unless the test failed or `DISTLOCK_TORTURE_KEEP` is set (then
/// its path is printed).
#[derive(Debug)]
pub struct RunDir {
    pub path: PathBuf,
}

impl RunDir {
    pub fn new(scenario: &str) -> Self {
        let path = std::env::temp_dir().join(format!(
            "distlock-torture-{scenario}-{}-{}",
            std::process::id(),
            super::clock::now_ns()
        ));
        std::fs::create_dir_all(&path).expect("create run directory");
        Self { path }
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        if std::thread::panicking() || std::env::var_os("DISTLOCK_TORTURE_KEEP").is_some() {
            let _ = std::fs::remove_file(self.path.join(WORKER_BINARY));
            eprintln!("torture: histories kept in {}", self.path.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Name of the private copy of this test binary in a run's directory.
const WORKER_BINARY: &str = "worker-bin";

/// One running worker.
#[derive(Debug)]
pub struct Worker {
    pub proc: i64,
    child: Child,
    status: Option<ExitStatus>,
    /// Killed on purpose (`kill -9`): its exit status is not judged.
    killed: bool,
}

impl Worker {
    pub fn pid(&self) -> Pid {
        Pid::from_raw(i32::try_from(self.child.id()).expect("pid"))
    }
}

/// A set of worker processes.
#[derive(Debug, Default)]
pub struct Fleet {
    workers: Vec<Worker>,
    dir: PathBuf,
}

impl Fleet {
    /// Starts one process per configuration.
    pub fn spawn(dir: &Path, configs: &[Config]) -> Self {
        // Workers run a private copy of this test binary: others may rebuild
        // it in the shared target directory while a long run is under way,
        // and `/proc/self/exe` still reads the image this process runs.
        let exe = dir.join(WORKER_BINARY);
        if !exe.exists() {
            std::fs::copy("/proc/self/exe", &exe).expect("copy the test binary");
        }
        let mut fleet = Fleet {
            workers: Vec::new(),
            dir: dir.to_owned(),
        };
        for cfg in configs {
            fleet.add(cfg);
        }
        fleet
    }

    /// Starts one more worker.
    pub fn add(&mut self, cfg: &Config) {
        let dir = &self.dir;
        let exe = dir.join(WORKER_BINARY);
        let out = File::create(dir.join(format!("worker-{}.out", cfg.proc))).expect("out");
        let err = File::create(dir.join(format!("worker-{}.err", cfg.proc))).expect("err");
        let child = Command::new(&exe)
            .args(["--exact", "worker_entry", "--nocapture", "--test-threads=1"])
            .env(ENV, cfg.to_json())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("spawn worker");
        self.workers.push(Worker {
            proc: cfg.proc,
            child,
            status: None,
            killed: false,
        });
    }

    /// `kill -9` of worker `proc`, reaped before this returns. Returns the
    /// time (`CLOCK_MONOTONIC`) at which `kill` returned: the process runs
    /// no code of its own after it (its sockets close later, as the kernel
    /// tears it down).
    pub fn kill9(&mut self, proc: i64) -> u64 {
        let worker = self
            .workers
            .iter_mut()
            .find(|w| w.proc == proc)
            .expect("no such worker");
        kill(worker.pid(), Signal::SIGKILL).expect("SIGKILL worker");
        let sent = super::clock::now_ns();
        worker.killed = true;
        worker.status = Some(worker.child.wait().expect("reap killed worker"));
        sent
    }

    /// Workers not killed on purpose.
    pub fn survivors(&self) -> usize {
        self.workers.iter().filter(|w| !w.killed).count()
    }

    /// Whether worker `proc` is still running.
    pub fn running(&mut self, proc: i64) -> bool {
        self.workers
            .iter_mut()
            .find(|w| w.proc == proc)
            .is_some_and(|w| matches!(w.child.try_wait(), Ok(None)))
    }

    /// Asks every worker to finish its current operation and stop.
    pub fn stop(&self) {
        File::create(self.dir.join("stop")).expect("stop file");
    }

    pub fn signal(&self, proc: i64, signal: Signal) {
        let worker = self
            .workers
            .iter()
            .find(|w| w.proc == proc)
            .expect("no such worker");
        kill(worker.pid(), signal).expect("signal worker");
    }

    /// Waits (bounded) for every worker to exit; panics with their stderr if
    /// one fails or they do not finish in time.
    pub async fn wait(&mut self, limit: Duration) {
        let started = Instant::now();
        loop {
            let mut running = 0;
            for w in &mut self.workers {
                if w.status.is_none() {
                    w.status = w.child.try_wait().expect("try_wait");
                }
                if w.status.is_none() {
                    running += 1;
                }
            }
            if running == 0 {
                break;
            }
            assert!(
                started.elapsed() < limit,
                "{running} worker(s) still running after {limit:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for w in self.workers.iter().filter(|w| !w.killed) {
            let status = w.status.expect("exited");
            if !status.success() {
                let err = std::fs::read_to_string(self.dir.join(format!("worker-{}.err", w.proc)))
                    .unwrap_or_default();
                let out = std::fs::read_to_string(self.dir.join(format!("worker-{}.out", w.proc)))
                    .unwrap_or_default();
                panic!("worker {} failed ({status}):\n{out}\n{err}", w.proc);
            }
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for w in &mut self.workers {
            if w.status.is_none() && matches!(w.child.try_wait(), Ok(None)) {
                // A stopped process is killed all the same; SIGCONT first so
                // nothing is left half-frozen if the kill is refused.
                let _ = kill(w.pid(), Signal::SIGCONT);
                let _ = w.child.kill();
                let _ = w.child.wait();
            }
        }
    }
}
