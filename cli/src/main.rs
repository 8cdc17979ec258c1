//! The `distlock` command-line tool: a cluster-wide `flock(1)` on PostgreSQL
//! advisory locks, and a view of who holds them.
//!
//! ```sh
//! distlock run nightly-backup -- ./backup.sh        # one host at a time
//! distlock run --wait 2m migrations -- ./migrate.sh # queue up instead
//! distlock holders --json
//! ```
//!
//! Installed with `cargo install distlock-cli` (or `cargo install --path cli`
//! from a checkout of distlock).
// `deny` rather than `forbid`: the one exception is the child's pre-exec
// hook in `process.rs`, which the standard library only offers as `unsafe`.
#![deny(unsafe_code)]
#![warn(
    missing_docs,
    unreachable_pub,
    missing_debug_implementations,
    rust_2018_idioms
)]
#![deny(clippy::unwrap_used)]

/// `eprintln!` that never panics: a message that cannot be written (stderr
/// closed, or a pipe nobody reads any more) is dropped, so that what comes
/// after it (stopping the command when its lock is lost) still happens.
/// The standard macro panics there, since Rust ignores `SIGPIPE`.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// `print!` that never panics, as [`say!`]: output nobody reads is dropped
/// (`distlock holders | head -1`).
macro_rules! show {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stdout(), $($arg)*);
    }};
}

mod args;
mod backend;
mod columns;
mod holders;
mod inherit;
mod leases;
mod process;
mod redact;
mod run;

use std::io::IsTerminal;
use std::process::ExitCode;

use args::Command;
use redact::{ScrubbingStderr, Secrets};

/// Bad arguments: an unknown option, an invalid key, duration or URL.
pub(crate) const EXIT_USAGE: u8 = 64;
/// The database could not be reached, or another distlock error.
pub(crate) const EXIT_UNAVAILABLE: u8 = 69;
/// `run` skipped the command: the lock is held elsewhere (EX_TEMPFAIL).
pub(crate) const EXIT_BUSY: u8 = 75;
/// `run` lost the lock while the command ran and stopped the command, or
/// found at release that the lock was gone before the command ended.
pub(crate) const EXIT_LOST: u8 = 76;
/// `run --wait`: the deadline passed before the lock was free (as timeout(1)).
pub(crate) const EXIT_TIMEOUT: u8 = 124;
/// `run`: the command was found but could not be executed.
pub(crate) const EXIT_CANNOT_EXECUTE: u8 = 126;
/// `run`: the command was not found.
pub(crate) const EXIT_NOT_FOUND: u8 = 127;

/// Shown at the end of `--help`.
pub(crate) const EXIT_CODES_HELP: &str = "\
Exit codes of `distlock run`:
  (the command's)  the command ran; 128+N if a signal N killed it
  64   usage error (bad argument, key, duration or URL)
  69   the database could not be reached, or another error
  75   skipped: the lock is held elsewhere (EX_TEMPFAIL)
  76   the lock was lost while the command ran: its process group got SIGTERM
       (SIGKILL after --grace), or the release found the lock already gone
  124  --wait: the deadline passed before the lock was free
  126  the command could not be executed
  127  the command was not found

Environment:
  DATABASE_URL        connection URL when --database-url is not given
  DISTLOCK_REDIS_URL  Redis URL(s), separated by single spaces, when no
                      --redis-url is given (keeps them off the command line)
  DISTLOCK_LEASE_TABLE  as --lease-table: 1/true/yes/on or 0/false/no/off
  RUST_LOG            log filter (default: warn), e.g. RUST_LOG=info

Environment of the command run by `distlock run`:
  DISTLOCK_KEY            the lock's name
  DISTLOCK_FENCING_TOKEN  the lock's fencing token, with --fencing (PostgreSQL)
                          or a single --redis-url; unset otherwise";

/// Why a command ended early: the exit code and a message for stderr.
#[derive(Debug)]
pub(crate) struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    pub(crate) fn new(code: u8, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub(crate) fn usage(message: impl Into<String>) -> Self {
        Self::new(EXIT_USAGE, message)
    }

    pub(crate) fn unavailable(message: impl Into<String>) -> Self {
        Self::new(EXIT_UNAVAILABLE, message)
    }
}

fn main() -> ExitCode {
    // Collected before anything can fail, so even argument errors are scrubbed.
    let secrets = secrets_in_use();
    let cli = match args::parse(std::env::args_os()) {
        Ok(cli) => cli,
        Err(err) => {
            let text = secrets.scrub(&err.render().to_string());
            if err.use_stderr() {
                say!("{}", text.trim_end_matches('\n'));
                return ExitCode::from(EXIT_USAGE);
            }
            show!("{text}");
            return ExitCode::SUCCESS;
        }
    };
    init_tracing(secrets.clone());
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            say!("distlock: cannot start the async runtime: {err}");
            return ExitCode::from(EXIT_UNAVAILABLE);
        }
    };
    let outcome = runtime.block_on(async {
        match cli.command {
            Command::Run(args) => run::run(args).await,
            Command::Holders(args) => holders::holders(args).await,
        }
    });
    match outcome {
        Ok(code) => ExitCode::from(code),
        Err(failure) => {
            say!("distlock: {}", secrets.scrub(&failure.message));
            ExitCode::from(failure.code)
        }
    }
}

/// Every URL the process was given, by argument or environment.
fn secrets_in_use() -> Secrets {
    let env_url = std::env::var("DATABASE_URL").ok();
    let env_redis = std::env::var("DISTLOCK_REDIS_URL").unwrap_or_default();
    // `args()` would panic on an argument that is not UTF-8 (a file name
    // passed to the child command, say); such an argument holds no URL of
    // ours, and a lossy copy is enough to find the ones that are.
    let args: Vec<String> = std::env::args_os()
        .map(|arg| arg.to_string_lossy().into_owned())
        .collect();
    let urls = env_url
        .iter()
        .map(String::as_str)
        .chain(env_redis.split_whitespace())
        .chain(args.iter().map(String::as_str))
        .filter(|text| text.contains("://") || text.contains("password="))
        // `--database-url=postgres://...`
        .map(|text| {
            text.split_once('=')
                .filter(|(k, _)| k.starts_with("--"))
                .map_or(text, |(_, v)| v)
        });
    Secrets::from_urls(urls)
}

/// Logs to stderr, filtered by `RUST_LOG` (default `warn`), scrubbed of secrets.
fn init_tracing(secrets: Secrets) {
    // sqlx warns about statements slower than a second; waiting for a lock
    // on the server is such a statement by design.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,sqlx::query=error"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(ScrubbingStderr::new(secrets))
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .try_init();
}
