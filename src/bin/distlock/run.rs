//! `distlock run`: hold a lock while a command runs.

use std::io::IsTerminal;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Duration;

use distlock::{Error, Lease, LockKey, LockWaiter, LossReason};
use indicatif::{ProgressBar, ProgressStyle};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::signal::unix::{SignalKind, signal};

use crate::args::RunArgs;
use crate::backend::{self, Backend};
use crate::{
    EXIT_BUSY, EXIT_CANNOT_EXECUTE, EXIT_LOST, EXIT_NOT_FOUND, EXIT_TIMEOUT, EXIT_UNAVAILABLE,
    Failure,
};

/// How the command's run ended.
enum Ended {
    Exited(ExitStatus),
    Lost(LossReason),
}

/// Takes the lock, runs the command, releases the lock; returns the exit code.
pub(crate) async fn run(args: RunArgs) -> Result<u8, Failure> {
    let key = LockKey::from(args.key.as_str());
    key.validate()
        .map_err(|err| Failure::usage(err.to_string()))?;
    let application = format!("distlock run {}", args.key);
    let backend = backend::connect(&args.conn, &application, args.heartbeat).await?;

    let Some(lease) = acquire(&backend, &key, args.wait, args.quiet).await? else {
        return Ok(EXIT_BUSY);
    };
    let mut child = match spawn(&args, &key) {
        Ok(child) => child,
        Err(failure) => {
            release(lease, args.quiet).await;
            return Err(failure);
        }
    };
    match supervise(&mut child, &*lease).await? {
        Ended::Exited(status) => {
            release(lease, args.quiet).await;
            Ok(exit_code(status))
        }
        Ended::Lost(reason) => {
            // Say it even with --quiet: the command was cut short.
            eprintln!(
                "distlock: lock {key} was lost ({reason}); stopping the command \
                 (SIGTERM, then SIGKILL after {})",
                humantime::format_duration(args.grace)
            );
            stop(&mut child, args.grace).await;
            drop(lease);
            Ok(EXIT_LOST)
        }
    }
}

/// Tries the lock, or waits for it up to `wait`. `Ok(None)`: busy, skip.
async fn acquire(
    backend: &Backend,
    key: &LockKey,
    wait: Option<Duration>,
    quiet: bool,
) -> Result<Option<Box<dyn Lease>>, Failure> {
    let Some(wait) = wait else {
        let lease = backend
            .locker
            .try_lock(key.clone())
            .await
            .map_err(|err| Failure::unavailable(format!("could not take lock {key}: {err}")))?;
        if lease.is_none() && !quiet {
            eprintln!(
                "distlock: skipped: lock {key} is held elsewhere{}",
                holder_hint(backend, key).await
            );
        }
        return Ok(lease);
    };
    let progress = Progress::start(quiet, key);
    let result = match &backend.postgres {
        // PostgreSQL can say who holds the lock: show it on the progress line.
        Some(pg) => {
            let bar = progress.bar.clone();
            LockWaiter::new(pg, key.clone(), wait)
                .report_every(Duration::from_secs(1))
                .on_report(move |report| {
                    if let Some(bar) = &bar {
                        bar.set_message(format!("waiting for lock {}: {report}", report.key));
                    }
                })
                .lock()
                .await
                .map(|lock| Box::new(lock) as Box<dyn Lease>)
        }
        None => backend.locker.lock(key.clone(), wait).await,
    };
    progress.finish();
    match result {
        Ok(lease) => Ok(Some(lease)),
        Err(err @ Error::Timeout { .. }) => Err(Failure::new(EXIT_TIMEOUT, err.to_string())),
        Err(err) => Err(Failure::unavailable(format!(
            "could not take lock {key}: {err}"
        ))),
    }
}

/// ` (pid 42, application "x")` when PostgreSQL shows who holds the lock.
async fn holder_hint(backend: &Backend, key: &LockKey) -> String {
    let Some(pg) = &backend.postgres else {
        return String::new();
    };
    let holders = pg.holders_of(key.clone()).await.unwrap_or_default();
    match holders.into_iter().find(|h| h.granted) {
        Some(holder) => match holder.application_name {
            Some(app) => format!(" (pid {}, application {app:?})", holder.pid),
            None => format!(" (pid {})", holder.pid),
        },
        None => String::new(),
    }
}

/// Starts the command with the lock's name in `DISTLOCK_KEY`.
fn spawn(args: &RunArgs, key: &LockKey) -> Result<Child, Failure> {
    let Some((program, rest)) = args.command.split_first() else {
        return Err(Failure::usage("no command given after --"));
    };
    Command::new(program)
        .args(rest)
        .env("DISTLOCK_KEY", key.to_string())
        .spawn()
        .map_err(|err| {
            let code = if err.kind() == std::io::ErrorKind::NotFound {
                EXIT_NOT_FOUND
            } else {
                EXIT_CANNOT_EXECUTE
            };
            Failure::new(
                code,
                format!("cannot run {}: {err}", program.to_string_lossy()),
            )
        })
}

/// Waits for the command to exit or the lease to be lost, forwarding
/// SIGINT, SIGTERM and SIGHUP to the command meanwhile.
async fn supervise(child: &mut Child, lease: &dyn Lease) -> Result<Ended, Failure> {
    let handler = |kind| {
        signal(kind).map_err(|err| Failure::unavailable(format!("cannot watch signals: {err}")))
    };
    let mut interrupt = handler(SignalKind::interrupt())?;
    let mut terminate = handler(SignalKind::terminate())?;
    let mut hangup = handler(SignalKind::hangup())?;
    let pid = child.id();
    loop {
        tokio::select! {
            status = child.wait() => {
                let status = status.map_err(|err| Failure::unavailable(format!("waiting for the command failed: {err}")))?;
                return Ok(Ended::Exited(status));
            }
            reason = lease.lost() => return Ok(Ended::Lost(reason)),
            Some(()) = interrupt.recv() => forward(pid, Signal::SIGINT),
            Some(()) = terminate.recv() => forward(pid, Signal::SIGTERM),
            Some(()) = hangup.recv() => forward(pid, Signal::SIGHUP),
        }
    }
}

/// Sends `signal` to the command (if it still runs).
fn forward(pid: Option<u32>, signal: Signal) {
    let Some(pid) = pid.and_then(|pid| i32::try_from(pid).ok()) else {
        return;
    };
    tracing::info!(pid, ?signal, "forwarding signal to the command");
    if let Err(err) = kill(Pid::from_raw(pid), signal) {
        tracing::debug!(pid, ?signal, %err, "could not forward signal");
    }
}

/// SIGTERM, then SIGKILL if the command has not exited after `grace`.
async fn stop(child: &mut Child, grace: Duration) {
    forward(child.id(), Signal::SIGTERM);
    if tokio::time::timeout(grace, child.wait()).await.is_ok() {
        return;
    }
    tracing::warn!("the command did not exit within the grace period; sending SIGKILL");
    let _ = child.start_kill();
    let _ = child.wait().await;
}

/// Releases the lease; the command has finished, so a failure is only reported.
async fn release(lease: Box<dyn Lease>, quiet: bool) {
    let key = lease.key().clone();
    if let Err(err) = lease.release().await
        && !quiet
    {
        eprintln!("distlock: releasing lock {key} failed: {err}");
    }
}

/// The shell's convention: the exit code, or 128 + the signal that killed it.
fn exit_code(status: ExitStatus) -> u8 {
    if let Some(code) = status.code() {
        return u8::try_from(code).unwrap_or(EXIT_UNAVAILABLE);
    }
    status
        .signal()
        .and_then(|signal| u8::try_from(128 + signal).ok())
        .unwrap_or(EXIT_UNAVAILABLE)
}

/// A spinner on stderr while waiting, only when stderr is a terminal.
struct Progress {
    bar: Option<ProgressBar>,
}

impl Progress {
    fn start(quiet: bool, key: &LockKey) -> Self {
        if quiet || !std::io::stderr().is_terminal() {
            return Self { bar: None };
        }
        let bar = ProgressBar::new_spinner();
        if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} [{elapsed}]") {
            bar.set_style(style);
        }
        bar.set_message(format!("waiting for lock {key}"));
        bar.enable_steady_tick(Duration::from_millis(100));
        Self { bar: Some(bar) }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_shell() {
        assert_eq!(exit_code(ExitStatus::from_raw(0)), 0);
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        // Killed by SIGKILL (9).
        assert_eq!(exit_code(ExitStatus::from_raw(9)), 137);
    }
}
