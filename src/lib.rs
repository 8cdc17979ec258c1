//! PostgreSQL-first distributed locks: exactly-one execution for processes
//! that share a PostgreSQL database.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), distlock::Error> {
//! let locker = distlock::PgLocker::new(pool);
//! // Database work: the lock lives in the transaction that does the work.
//! let ran = locker
//!     .with_advisory_lock("cron:invoice-reminders", async |conn| {
//!         sqlx::query("UPDATE invoices SET reminded = true WHERE due < now()")
//!             .execute(conn)
//!             .await?;
//!         Ok::<_, distlock::Error>(())
//!     })
//!     .await?;
//! // Work outside the database: a session lock that knows when it is lost.
//! if let Some(lock) = locker.try_lock("reports:nightly").await? {
//!     tokio::select! {
//!         () = async { /* the work */ } => lock.release().await?,
//!         reason = lock.lost() => eprintln!("stopped: {reason}"),
//!     }
//! }
//! # let _ = ran; Ok(()) }
//! ```
//!
//! # Where things are
//!
//! | module | what it holds |
//! |---|---|
//! | the crate root | what every backend shares: [`LockKey`], [`Error`], [`FencingToken`], [`LossReason`], and the [`Locker`]/[`Lease`] traits ([`lease`]) |
//! | [`postgres`] | the PostgreSQL backend: [`PgLocker`] (transaction-scoped and session locks, multiplexed mode), [`SessionLock`], holders, [`LockWaiter`], [`TableLocker`] (leases in a table, for transaction poolers and failover), and the crate's schema: [`migrate`], [`fence`] (fencing tokens), [`idempotency`] (keys that make an effect happen once) |
//! | `redis` | the Redis backend (feature `redis`): a single instance with a watchdog, and Redlock |
//! | kinds ([`Semaphore`], [`LeaderElection`]) | kinds of locks over any backend's `Arc<dyn Locker>` |
//! | [`job`] | [`SingletonJob`]: run a job on one replica, over any [`Locker`] |
//! | [`memory`] | an in-memory backend for your own tests, with a way to make a lease lost |
//! | [`metrics`] | counters and histograms through the `metrics` facade (feature `metrics`) |
//!
//! A new backend gets a folder of its own that implements [`Locker`] and
//! [`Lease`], and one line in the conformance suite (`tests/conformance.rs`),
//! which holds every backend to the same contract. A new kind of lock built
//! on any backend takes an `Arc<dyn Locker>`. The `distlock` command is its
//! own crate (`cli/`, one file per command).
//!
//! Every call documents what it costs in round trips to the server, what it
//! writes durably, and what dropping its future does (`# Cancel safety`).
//! The README in the repository is the guide: each use with a runnable
//! example, the fault model, and the measured costs and reliability.
#![forbid(unsafe_code)]
#![warn(
    missing_docs,
    unreachable_pub,
    missing_debug_implementations,
    rust_2018_idioms
)]
#![deny(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss,
    clippy::unwrap_used
)]

mod deadline;
mod error;
pub mod job;
mod key;
mod kinds;
pub mod lease;
mod loss;
pub mod memory;
pub mod metrics;
pub mod postgres;
/// The Redis backend: single-instance leases with a watchdog, and Redlock
/// over independent nodes (cargo feature `redis`).
#[cfg(feature = "redis")]
pub mod redis;
mod span;
mod token;

pub use error::{Error, Result};
pub use job::{JobContext, JobOutcome, SingletonJob};
pub use key::LockKey;
pub use kinds::{Campaign, LeaderElection, Semaphore};
pub use lease::{Lease, Locker};
pub use loss::LossReason;
pub use postgres::{
    AdvisoryKey, Holder, LockMode, LockWaiter, MigrateOptions, MultiLock, PgLocker,
    PgLockerBuilder, SCHEMA, SessionLock, TableLease, TableLocker, TableLockerBuilder, WaitReport,
    fence, idempotency, lock_xact, migrate, migrate_with, try_lock_xact,
};
pub use token::FencingToken;

// The README's examples are compiled as doctests, without making the README
// the crate's documentation.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
