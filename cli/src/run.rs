//! `distlock run`: hold a lock while a command runs.

use std::io::IsTerminal;
use std::os::fd::RawFd;
use std::os::unix::process::ExitStatusExt;
use std::pin::Pin;
use std::process::ExitStatus;
use std::time::Duration;

use distlock::postgres::LockWaiter;
use distlock::{Error, FencingToken, Lease, LockKey, LossReason};
use indicatif::{ProgressBar, ProgressStyle};
use nix::sys::signal::Signal;
use tokio::process::{Child, Command};
use tokio::signal::unix::{Signal as SignalStream, SignalKind, signal};
use tokio::time::Sleep;

use crate::args::{Chosen, RunArgs};
use crate::backend::{self, Backend};
use crate::inherit;
use crate::process::{self, Group, Terminal};
use crate::{
    EXIT_BUSY, EXIT_CANNOT_EXECUTE, EXIT_LOST, EXIT_NOT_FOUND, EXIT_TIMEOUT, EXIT_UNAVAILABLE,
    Failure,
};

/// The command's environment variable holding the lock's name.
const ENV_KEY: &str = "DISTLOCK_KEY";
/// The command's environment variable holding the lock's fencing token.
const ENV_FENCING_TOKEN: &str = "DISTLOCK_FENCING_TOKEN";

/// `--heartbeat` when not given.
const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(1);

/// How the command's run ended.
enum Ended {
    Exited(ExitStatus),
    Lost(LossReason),
}

/// Takes the lock, runs the command, releases the lock; returns the exit code.
///
/// The command runs in a process group of its own, so that everything it
/// starts can be stopped together: the lock is released only after the
/// whole group is gone.
pub(crate) async fn run(args: RunArgs) -> Result<u8, Failure> {
    let key = LockKey::from(args.key.as_str());
    key.validate()
        .map_err(|err| Failure::usage(err.to_string()))?;
    if args.heartbeat.is_some() && matches!(args.conn.chosen()?, Chosen::Redis(_)) {
        // Silently ignoring it would promise a loss detection Redis does not do.
        return Err(Failure::usage(
            "--heartbeat is for PostgreSQL; a Redis lease is extended by its watchdog \
             every third of its TTL: drop --heartbeat or --redis-url",
        ));
    }
    let heartbeat = args.heartbeat.unwrap_or(DEFAULT_HEARTBEAT);
    let application = format!("distlock run {}", args.key);
    let backend = backend::connect(&args.conn, &application, heartbeat, args.fencing).await?;

    let Some(lease) = acquire(&backend, &key, args.wait, args.quiet).await? else {
        return Ok(EXIT_BUSY);
    };
    // Before the spawn: a signal that arrives while the command starts is
    // forwarded to it rather than killing distlock and orphaning the command.
    let mut signals = match Signals::install() {
        Ok(signals) => signals,
        Err(failure) => {
            release_reporting(lease).await;
            return Err(failure);
        }
    };
    let terminal = Terminal::open();
    let token = lease.fencing_token();
    // A session lock lives as long as its connection: the command holds it
    // too, so a SIGKILL of distlock frees the lock only once the command and
    // what it started are gone. A lease's expiry does not depend on sockets.
    let inherit = if backend.postgres.is_some() {
        inherit::database_sockets()
    } else {
        Vec::new()
    };
    let (mut child, group) = match spawn(&args, &key, token, terminal.as_ref(), inherit) {
        Ok(spawned) => spawned,
        Err(failure) => {
            if let Some(terminal) = &terminal {
                // The child may have taken the terminal before its exec failed.
                terminal.take_back_from_dead_group();
            }
            release_reporting(lease).await;
            return Err(failure);
        }
    };
    let ended = supervise(
        &mut child,
        group,
        &*lease,
        &mut signals,
        terminal.as_ref(),
        args.grace,
    )
    .await;
    // Nothing of the command may run on once the lock is released or lost.
    match &ended {
        Ok(Ended::Exited(_)) => {
            if !group.is_empty() {
                if !args.quiet {
                    say!(
                        "distlock: the command exited but left processes in its process group; \
                         stopping them before releasing lock {key} (SIGTERM, then SIGKILL after {})",
                        humantime::format_duration(args.grace)
                    );
                }
                stop(&mut child, group, args.grace).await;
            }
        }
        Ok(Ended::Lost(reason)) => {
            // Say it even with --quiet: the command was cut short.
            say!(
                "distlock: lock {key} was lost ({reason}); stopping the command \
                 (SIGTERM, then SIGKILL after {})",
                humantime::format_duration(args.grace)
            );
            stop(&mut child, group, args.grace).await;
        }
        // The command cannot be watched any more: stop it while the lock is
        // still held.
        Err(_) => stop(&mut child, group, args.grace).await,
    }
    if let Some(terminal) = &terminal {
        terminal.take_back(group);
    }
    match ended {
        Ok(Ended::Exited(status)) => match release(lease).await {
            Released::Yes => Ok(exit_code(status)),
            // The command may have run its last part without the lock.
            Released::Lost(err) => {
                say!(
                    "distlock: lock {key} was lost before the command ended \
                     (found at release: {err}); the command exited with code {}",
                    exit_code(status)
                );
                Ok(EXIT_LOST)
            }
            Released::Failed(err) => {
                say!("distlock: releasing lock {key} failed: {err}");
                Ok(exit_code(status))
            }
        },
        Ok(Ended::Lost(_)) => {
            drop(lease);
            Ok(EXIT_LOST)
        }
        Err(failure) => {
            release_reporting(lease).await;
            Err(failure)
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
            say!(
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

/// Starts the command, in a process group of its own, with the lock's name
/// in `DISTLOCK_KEY` and its fencing token (if any) in
/// `DISTLOCK_FENCING_TOKEN`.
fn spawn(
    args: &RunArgs,
    key: &LockKey,
    token: Option<FencingToken>,
    terminal: Option<&Terminal>,
    inherit: Vec<RawFd>,
) -> Result<(Child, Group), Failure> {
    let Some((program, rest)) = args.command.split_first() else {
        return Err(Failure::usage("no command given after --"));
    };
    let mut command = Command::new(program);
    command.args(rest).env(ENV_KEY, key.to_string());
    match token {
        Some(token) => command.env(ENV_FENCING_TOKEN, token.value().to_string()),
        // Not one inherited from an outer run: it would belong to another lock.
        None => command.env_remove(ENV_FENCING_TOKEN),
    };
    process::prepare(&mut command, terminal, inherit);
    let child = command.spawn().map_err(|err| {
        let code = if err.kind() == std::io::ErrorKind::NotFound {
            EXIT_NOT_FOUND
        } else {
            EXIT_CANNOT_EXECUTE
        };
        Failure::new(
            code,
            format!("cannot run {}: {err}", program.to_string_lossy()),
        )
    })?;
    match child.id().and_then(Group::led_by) {
        Some(group) => Ok((child, group)),
        // Only possible if the child was already reaped, which nothing did.
        None => Err(Failure::unavailable("the command's process id is unknown")),
    }
}

/// SIGINT, SIGTERM and SIGHUP to distlock, to be forwarded to the command,
/// and SIGCHLD, to notice the command being stopped. On Linux, one of the
/// first three that was ignored when distlock started (`nohup` ignores
/// SIGHUP, a non-interactive shell's `cmd &` SIGINT) is not caught: it stays
/// ignored, for distlock and for the command, which inherits that across
/// `exec`, as under `flock(1)`. Caught, the command would get it back, as
/// it still does elsewhere (see [`ignored_at_start`]).
struct Signals {
    interrupt: Option<SignalStream>,
    terminate: Option<SignalStream>,
    hangup: Option<SignalStream>,
    /// A child changed state (it may have been stopped).
    child: SignalStream,
}

impl Signals {
    /// Replaces the default action of the signals (exit, for the first three).
    fn install() -> Result<Self, Failure> {
        let handler = |kind| {
            signal(kind).map_err(|err| Failure::unavailable(format!("cannot watch signals: {err}")))
        };
        let ignored = ignored_at_start();
        let unless_ignored = |kind: SignalKind, number: Signal| {
            if ignored.contains(&number) {
                return Ok(None);
            }
            handler(kind).map(Some)
        };
        Ok(Self {
            interrupt: unless_ignored(SignalKind::interrupt(), Signal::SIGINT)?,
            terminate: unless_ignored(SignalKind::terminate(), Signal::SIGTERM)?,
            hangup: unless_ignored(SignalKind::hangup(), Signal::SIGHUP)?,
            child: handler(SignalKind::child())?,
        })
    }
}

/// Of SIGINT, SIGTERM and SIGHUP, those this process ignores: the `SigIgn`
/// mask of `/proc/self/status` (bit n - 1 for signal n), read before any
/// handler is installed. None where that file cannot be read (not Linux).
fn ignored_at_start() -> Vec<Signal> {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return Vec::new();
    };
    let mask = status
        .lines()
        .find_map(|line| line.strip_prefix("SigIgn:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0);
    [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP]
        .into_iter()
        .filter(|signal| mask & (1 << (*signal as u32 - 1)) != 0)
        .collect()
}

/// The next delivery of a caught signal; never, for one left ignored.
async fn next(stream: &mut Option<SignalStream>) -> Option<()> {
    match stream {
        Some(stream) => stream.recv().await,
        None => std::future::pending().await,
    }
}

/// Waits for the command to exit or the lease to be lost, forwarding
/// SIGINT, SIGTERM and SIGHUP to the command's process group meanwhile.
///
/// A forwarded SIGTERM asks the command to end: if the group is still there
/// `grace` later (it ignores or traps SIGTERM and goes on), it gets SIGKILL,
/// as `timeout --kill-after` does. Otherwise a stop request would hold the
/// lock for as long as the command chose to ignore it.
async fn supervise(
    child: &mut Child,
    group: Group,
    lease: &dyn Lease,
    signals: &mut Signals,
    terminal: Option<&Terminal>,
    grace: Duration,
) -> Result<Ended, Failure> {
    // Armed by the first forwarded SIGTERM; `sleep` saturates a huge grace.
    let mut kill_after: Option<Pin<Box<Sleep>>> = None;
    loop {
        tokio::select! {
            status = child.wait() => {
                let status = status.map_err(|err| Failure::unavailable(format!("waiting for the command failed: {err}")))?;
                return Ok(Ended::Exited(status));
            }
            reason = lease.lost() => return Ok(Ended::Lost(reason)),
            () = until_armed(&mut kill_after) => {
                tracing::warn!("the command did not exit within the grace period after SIGTERM; sending SIGKILL");
                group.signal(Signal::SIGKILL);
                kill_after = None;
            }
            Some(()) = next(&mut signals.interrupt) => group.signal(Signal::SIGINT),
            Some(()) = next(&mut signals.terminate) => {
                group.signal(Signal::SIGTERM);
                if kill_after.is_none() {
                    kill_after = Some(Box::pin(tokio::time::sleep(grace)));
                }
            }
            Some(()) = next(&mut signals.hangup) => group.signal(Signal::SIGHUP),
            Some(()) = signals.child.recv() => {
                if let Some(terminal) = terminal
                    && group.leader_stopped()
                {
                    terminal.stop_along(group);
                    if let Some(reason) = loss_after_stop(lease).await {
                        return Ok(Ended::Lost(reason));
                    }
                    terminal.continue_command(group);
                }
            }
        }
    }
}

/// How long distlock, continued after a stop, lets the lease's keeper run
/// before it continues the command.
const AFTER_STOP: Duration = Duration::from_millis(50);

/// The lease's loss, if it was lost while distlock and the command were
/// stopped (Ctrl-Z): a Redis lease whose validity ran out or a lease-table
/// lease whose renewal deadline passed (both read off the clock by
/// `loss()`), a session lock whose keeper finds its connection gone within
/// [`AFTER_STOP`]. `None`: the command may go on.
async fn loss_after_stop(lease: &dyn Lease) -> Option<LossReason> {
    if let Some(reason) = lease.loss() {
        return Some(reason);
    }
    if let Ok(reason) = tokio::time::timeout(AFTER_STOP, lease.lost()).await {
        return Some(reason);
    }
    // distlock may have got no CPU for all of AFTER_STOP after it was
    // continued (or been stopped again meanwhile): then the keeper's overdue
    // timer and this one fired in the same turn of the timer driver, and
    // the keeper, woken with it, has not run yet. Let it run first.
    for _ in 0..4 {
        tokio::task::yield_now().await;
        if let Some(reason) = lease.loss() {
            return Some(reason);
        }
    }
    None
}

/// Completes when `timer` is set and has run out; never while it is unset.
async fn until_armed(timer: &mut Option<Pin<Box<Sleep>>>) {
    match timer {
        Some(timer) => timer.await,
        None => std::future::pending().await,
    }
}

/// SIGTERM to the command's whole process group, then SIGKILL to it if any
/// process of it is left after `grace`; returns once the command is reaped.
async fn stop(child: &mut Child, group: Group, grace: Duration) {
    group.signal(Signal::SIGTERM);
    // A group stopped by Ctrl-Z (whose lease ran out meanwhile) acts on the
    // SIGTERM only once continued.
    group.signal(Signal::SIGCONT);
    // `timeout` saturates: a huge grace waits "forever" rather than overflow.
    if tokio::time::timeout(grace, until_gone(child, group))
        .await
        .is_ok()
    {
        return;
    }
    tracing::warn!("the command did not exit within the grace period; sending SIGKILL");
    group.signal(Signal::SIGKILL);
    let _ = child.wait().await;
}

/// Completes when the command has exited (and is reaped) and no other
/// process is left in its group.
async fn until_gone(child: &mut Child, group: Group) {
    loop {
        // Reaped first: the exited leader would otherwise keep the group alive.
        let exited = !matches!(child.try_wait(), Ok(None));
        if exited && group.is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// How a release went.
enum Released {
    Yes,
    /// The release showed that the lock was already gone.
    Lost(Error),
    /// The release failed without showing a loss (it timed out, or Redis
    /// could not be reached); the backend frees the lock.
    Failed(Error),
}

/// Releases the lease.
async fn release(lease: Box<dyn Lease>) -> Released {
    match lease.release().await {
        Ok(()) => Released::Yes,
        Err(err) if shows_loss(&err) => Released::Lost(err),
        Err(err) => Released::Failed(err),
    }
}

/// Whether a failed release shows that the lock was no longer held: lost
/// (or not held by the session at release; a session lock whose connection
/// failed says so too, as that ends the session and its locks), or a
/// different backend answering. A database error does not: a lease-table
/// row whose delete failed still holds until it expires.
fn shows_loss(err: &Error) -> bool {
    matches!(err, Error::LockLost { .. } | Error::PoolerDetected { .. })
}

/// Releases the lease on the way out of a failure, printing (even with
/// `--quiet`) what went wrong with it.
async fn release_reporting(lease: Box<dyn Lease>) {
    let key = lease.key().clone();
    match release(lease).await {
        Released::Yes => {}
        Released::Lost(err) | Released::Failed(err) => {
            say!("distlock: releasing lock {key} failed: {err}");
        }
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
