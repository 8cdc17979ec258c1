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
//! Every item has one path.
//!
//! | where | what it holds |
//! |---|---|
//! | the crate root | what every backend shares: [`LockKey`], [`Error`], [`FencingToken`], [`LossReason`], the [`Locker`]/[`Lease`] traits and what a backend offers beyond them ([`SharedLocker`], [`MultiKeyLocker`], [`XactLocker`], [`UpgradeableLocker`], [`ElectionLocker`]); kinds of locks over any backend: [`Semaphore`], [`LeaderElection`] (with its [`Campaign`], [`Term`], [`LeaderInfo`], [`Observer`]), [`SingletonJob`] (run a job on one replica); and PostgreSQL's everyday items: [`PgLocker`] (transaction-scoped and session locks, multiplexed mode) with its guards [`SessionLock`], [`MultiLock`] and [`UpgradeableLock`], locks in your own transaction ([`try_lock_xact`], [`lock_xact`]), and the crate's schema: [`migrate`], [`fence`] (fencing tokens), [`idempotency`] (keys that make an effect happen once) |
//! | [`postgres`] | the rest of the PostgreSQL backend: [`postgres::TableLocker`] (leases in a table, for transaction poolers and failover), who holds what ([`postgres::Holder`]), [`postgres::LockWaiter`] (a wait that reports its holder), the locker's bounds |
//! | `redis` | the Redis backend (feature `redis`): a single instance with a watchdog, and Redlock |
//! | [`memory`] | an in-memory backend for your own tests, with a way to make a lease lost |
//! | [`metrics`] | counters and histograms through the `metrics` facade (feature `metrics`) |
//!
//! Every backend keeps the same contract, so code written against
//! `Arc<dyn Locker>` (your own, or [`SingletonJob`], [`Semaphore`],
//! [`LeaderElection`]) runs on any of them, and on [`memory`] in its tests.
//! The `distlock` command (run a command under a lock, list holders) is the
//! `distlock-cli` crate.
//!
//! Every call documents what it costs in round trips to the server, what it
//! writes durably, and what dropping its future does (`# Cancel safety`).
//! The README (shown on the crate's crates.io page) is the guide: each use
//! with a runnable example, the fault model, and the measured costs and
//! reliability.
//!
//! # Cargo features
//!
//! None is on by default; PostgreSQL support is always there.
//!
//! - **`redis`**: the Redis backend, module `redis`: `RedisLocker` (one
//!   server; a watchdog keeps the lease's TTL up while it lives; fencing
//!   tokens by default) and `Redlock` (a majority of independent servers),
//!   both [`Locker`]s, whose waiters are woken by the release (pub/sub);
//!   adds the `Error::Redis` and `Error::QuorumUnreachable` variants.
//! - **`metrics`**: counters and histograms of acquisitions, waits, losses
//!   and job runs through the [`metrics`](https://docs.rs/metrics) facade
//!   (the table in [`metrics`]), and `metrics::set_key_label` to choose what
//!   their `key` label carries. Without it those calls compile to nothing.
//! - **`tls-rustls`**: TLS to PostgreSQL through sqlx's rustls support and,
//!   with `redis`, to Redis (`rediss://` URLs). It has no API of its own: the
//!   connection options (`sslmode` in the URL, `PgConnectOptions::ssl_mode`)
//!   choose TLS as usual. For the platform's native TLS instead, enable
//!   `sqlx/tls-native-tls` (and `redis/tokio-native-tls-comp`) in your own
//!   `Cargo.toml`.
#![forbid(unsafe_code)]
// On docs.rs (see Cargo.toml), items that need a feature say which.
#![cfg_attr(docsrs, feature(doc_cfg))]
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

mod backoff;
mod capability;
mod deadline;
mod error;
mod job;
mod key;
mod key_check;
mod kinds;
mod lease;
mod loss;
mod loss_state;
pub mod memory;
pub mod metrics;
pub mod postgres;
/// The Redis backend: single-instance leases with a watchdog, and Redlock
/// over independent nodes (cargo feature `redis`).
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;
mod setting;
mod span;
mod token;

pub use capability::{
    ElectionLocker, MultiKeyLocker, Proclaimed, Proclamation, Seat, SharedLocker,
    UpgradeableLocker, XactLocker,
};
pub use error::{Error, Result};
pub use job::{JobContext, JobOutcome, SingletonJob, SingletonJobBuilder};
pub use key::LockKey;
pub use kinds::{
    Campaign, LeaderElection, LeaderElectionBuilder, LeaderInfo, Observer, Semaphore,
    SemaphorePermit, Term,
};
pub use lease::{DEFAULT_TTL, Lease, Locker};
pub use loss::LossReason;
pub use postgres::evidence::PoolerEvidence;
pub use postgres::locker::{PgLocker, PgLockerBuilder};
pub use postgres::schema::migrate::{Migrator, SCHEMA, migrate};
pub use postgres::schema::{fence, idempotency};
pub use postgres::session::guard::SessionLock;
pub use postgres::session::multi_lock::MultiLock;
pub use postgres::session::upgradeable_lock::UpgradeableLock;
pub use postgres::xact::caller::{lock_xact, try_lock_xact};
pub use token::FencingToken;

// The README's examples are compiled as doctests, without making the README
// the crate's documentation.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
