//! The command's processes: a process group of its own, so that every stop
//! reaches everything the command started, and the terminal handed to that
//! group while it runs, so that an interactive command still works.

use std::fs::File;
use std::os::fd::RawFd;

use nix::errno::Errno;
use nix::sys::signal::{SigSet, SigmaskHow, Signal, killpg, pthread_sigmask, raise};
use nix::unistd::{Pid, getpgrp, getpid, tcgetpgrp, tcsetpgrp};
use tokio::process::Command;

/// The command's process group, led by the command (its id is the command's
/// pid). Until distlock reaps the command, that id cannot be reused.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Group(Pid);

impl Group {
    /// The group led by the process `pid`.
    pub(crate) fn led_by(pid: u32) -> Option<Self> {
        i32::try_from(pid).ok().map(|pid| Self(Pid::from_raw(pid)))
    }

    /// Sends `signal` to every process in the group.
    pub(crate) fn signal(self, signal: Signal) {
        let pgid = self.0.as_raw();
        tracing::info!(pgid, ?signal, "signalling the command's process group");
        if let Err(err) = killpg(self.0, signal) {
            tracing::debug!(pgid, ?signal, %err, "could not signal the process group");
        }
    }

    /// `true` when no process is left in the group (an exited command not yet
    /// reaped still counts).
    pub(crate) fn is_empty(self) -> bool {
        matches!(killpg(self.0, None), Err(Errno::ESRCH))
    }

    /// `true` if the group's leader (the command) has been stopped (by
    /// Ctrl-Z, or by reading the terminal from the background) since the
    /// last call. Does not reap it.
    pub(crate) fn leader_stopped(self) -> bool {
        #[cfg(target_os = "linux")]
        {
            use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid};
            // WSTOPPED without WEXITED: an exit stays for tokio to reap.
            matches!(
                waitid(
                    Id::Pid(self.0),
                    WaitPidFlag::WSTOPPED | WaitPidFlag::WNOHANG
                ),
                Ok(WaitStatus::Stopped(..))
            )
        }
        #[cfg(not(target_os = "linux"))]
        {
            false
        }
    }
}

/// Runs `f` with SIGTTOU blocked in the calling thread: a process outside
/// the terminal's foreground group may then change the foreground group
/// (instead of being stopped for trying).
fn with_ttou_blocked<T>(f: impl FnOnce() -> T) -> T {
    let mut ttou = SigSet::empty();
    ttou.add(Signal::SIGTTOU);
    let mut old = SigSet::empty();
    let blocked = pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&ttou), Some(&mut old)).is_ok();
    let result = f();
    if blocked {
        let _ = pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&old), None);
    }
    result
}

/// distlock's controlling terminal, if it has one.
///
/// A terminal sends what the user types, Ctrl-C and Ctrl-Z to its
/// foreground process group only. The command runs in a group of its own, so
/// while it runs that group gets the foreground (if distlock had it), and
/// distlock takes it back afterwards. If the command is stopped (Ctrl-Z),
/// distlock stops as well, so that the shell sees the job stopped, and on
/// `fg` checks the lease, then continues the command with the terminal (or
/// ends it, if the lease was lost meanwhile).
#[derive(Debug)]
pub(crate) struct Terminal {
    tty: File,
    /// distlock's own process group.
    own: Pid,
}

impl Terminal {
    /// The controlling terminal, or `None` (cron, CI, a daemon).
    pub(crate) fn open() -> Option<Self> {
        let tty = File::options()
            .read(true)
            .write(true)
            .open("/dev/tty")
            .ok()?;
        Some(Self {
            tty,
            own: getpgrp(),
        })
    }

    /// `true` while distlock's group is the terminal's foreground group.
    fn in_foreground(&self) -> bool {
        tcgetpgrp(&self.tty) == Ok(self.own)
    }

    /// A handle on the terminal for the command's pre-exec hook, if distlock
    /// has the foreground to hand over.
    fn for_child(&self) -> Option<File> {
        if !self.in_foreground() {
            return None;
        }
        // Opened close-on-exec: the command does not inherit it.
        self.tty.try_clone().ok()
    }

    /// Takes the foreground back from `group` (if it has it): after the
    /// command has ended, or when it was stopped.
    pub(crate) fn take_back(&self, group: Group) {
        if tcgetpgrp(&self.tty) != Ok(group.0) {
            return;
        }
        // distlock is in the background now: without SIGTTOU blocked, the
        // change would stop distlock.
        if let Err(err) = with_ttou_blocked(|| tcsetpgrp(&self.tty, self.own)) {
            tracing::debug!(%err, "could not take the terminal back");
        }
    }

    /// Takes the foreground back if the group that has it is gone (a child
    /// that took it and then failed to start the command).
    pub(crate) fn take_back_from_dead_group(&self) {
        if let Ok(foreground) = tcgetpgrp(&self.tty)
            && foreground != self.own
            && Group(foreground).is_empty()
        {
            self.take_back(Group(foreground));
        }
    }

    /// The command was stopped: stop distlock too (the shell sees the job
    /// stopped). Returns once distlock is continued (the shell's `fg` or
    /// `bg`), leaving the command stopped: the caller checks the lease
    /// first, then calls [`continue_command`](Self::continue_command).
    pub(crate) fn stop_along(&self, group: Group) {
        tracing::info!("the command was stopped; stopping distlock too");
        self.take_back(group);
        if let Err(err) = raise(Signal::SIGSTOP) {
            tracing::debug!(%err, "could not stop");
        }
    }

    /// Continues the command stopped with [`stop_along`](Self::stop_along),
    /// with the terminal if distlock got it back.
    pub(crate) fn continue_command(&self, group: Group) {
        if self.in_foreground()
            && let Err(err) = tcsetpgrp(&self.tty, group.0)
        {
            tracing::debug!(%err, "could not hand the terminal to the command");
        }
        group.signal(Signal::SIGCONT);
    }
}

/// Sets `command` up to start in a process group of its own (whose id is
/// its pid) and, if distlock has the terminal's foreground, to take it.
///
/// On Linux the command also gets SIGKILL when distlock dies (the parent-death
/// signal), so a distlock killed with SIGKILL, which cannot stop the command
/// itself, does not leave it running without the lock. That signal reaches
/// the command only, not processes it started; and the kernel drops it when
/// the command executes a set-user-ID program. The descriptors in `inherit`
/// stay open in the command (see `inherit.rs`).
#[allow(unsafe_code)]
pub(crate) fn prepare(command: &mut Command, terminal: Option<&Terminal>, inherit: Vec<RawFd>) {
    command.process_group(0);
    let tty = terminal.and_then(Terminal::for_child);
    #[cfg(target_os = "linux")]
    let supervisor = getpid();
    let hook = move || {
        #[cfg(target_os = "linux")]
        {
            // The signal is sent when the thread that forked ends: that is
            // the main thread, on which the single-threaded runtime spawns
            // the command, and which ends only with the process.
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
            // distlock may have died before the line above: the command
            // would then have been adopted by another process already.
            if nix::unistd::getppid() != supervisor {
                return Err(Errno::ESRCH.into());
            }
        }
        crate::inherit::keep_across_exec(&inherit);
        if let Some(tty) = &tty {
            // The child is not in the foreground group yet: block SIGTTOU
            // around the change. A failure leaves the command in the
            // background, which only matters if it reads the terminal.
            let _ = with_ttou_blocked(|| tcsetpgrp(tty, getpid()));
        }
        Ok(())
    };
    // SAFETY: the hook runs in the forked child between `fork` and `exec`
    // (after `process_group(0)` took effect), where only async-signal-safe
    // functions may be called. It makes system calls only (prctl, getppid,
    // fcntl, pthread_sigmask, tcsetpgrp, getpid) and builds its error from an errno
    // code: no allocation, no locks, no tracing.
    unsafe {
        command.pre_exec(hook);
    }
}
