//! The lock's connection, handed down to the command.
//!
//! PostgreSQL frees a session lock when its connection closes. When distlock
//! is killed with SIGKILL, the kernel closes distlock's sockets before it
//! sends the command the parent-death signal, and processes the command
//! started outlive that signal. Were distlock the only holder of the
//! connection, the server would free the lock while they still ran. So the
//! command inherits distlock's connections to the database (their
//! close-on-exec flag is cleared in the child only): the server frees the
//! lock once the last process holding one is gone. The command never uses
//! them. When distlock ends normally nothing changes: its release unlocks and
//! ends the session with PostgreSQL's `Terminate` message, whoever else holds
//! the socket.

use std::os::fd::{BorrowedFd, RawFd};

use nix::sys::socket::{
    AddressFamily, SockType, SockaddrLike, SockaddrStorage, getpeername, getsockopt, sockopt,
};

/// The descriptors of distlock's connected stream sockets whose peer has an
/// address (TCP, or a Unix socket with a path): in a PostgreSQL run, its
/// connections to the database. The runtime's own socket pairs have unnamed
/// peers and stay behind.
pub(crate) fn database_sockets() -> Vec<RawFd> {
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<RawFd>().ok())
        .filter(|&fd| is_addressed_stream(fd))
        .collect()
}

#[allow(unsafe_code)]
fn is_addressed_stream(fd: RawFd) -> bool {
    // SAFETY: the descriptor is only queried. One closed meanwhile (the
    // directory listing's own, for one) answers EBADF.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    if getsockopt(&borrowed, sockopt::SockType) != Ok(SockType::Stream) {
        return false;
    }
    let Ok(peer) = getpeername::<SockaddrStorage>(fd) else {
        return false;
    };
    match peer.family() {
        Some(AddressFamily::Inet | AddressFamily::Inet6) => true,
        Some(AddressFamily::Unix) => peer
            .as_unix_addr()
            .is_some_and(|unix| unix.path().is_some()),
        _ => false,
    }
}

/// Clears the close-on-exec flag of `fds` in the forked child.
///
/// Async-signal-safe: `fcntl` only, no allocation. A descriptor that is gone
/// is skipped; the command then runs without it, as it did before.
#[allow(unsafe_code)]
pub(crate) fn keep_across_exec(fds: &[RawFd]) {
    for &fd in fds {
        // SAFETY: fcntl(F_SETFD) on a descriptor number touches only this
        // process's descriptor table.
        unsafe {
            nix::libc::fcntl(fd, nix::libc::F_SETFD, 0);
        }
    }
}
