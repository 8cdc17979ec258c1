#![doc = include_str!("../README.md")]
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
pub mod fence;
pub mod idempotency;
pub mod job;
mod key;
pub mod lease;
mod loss;
pub mod metrics;
mod migrate;
pub mod postgres;
/// The Redis backend: single-instance leases with a watchdog, and Redlock
/// over independent nodes (cargo feature `redis`).
#[cfg(feature = "redis")]
pub mod redis;

pub use error::{Error, Result};
pub use fence::FencingToken;
pub use job::{JobContext, JobOutcome, LockWaiter, SingletonJob, WaitReport};
pub use key::LockKey;
pub use lease::{Lease, Locker};
pub use loss::LossReason;
pub use migrate::{SCHEMA, migrate};
pub use postgres::{AdvisoryKey, Holder, LockMode, PgLocker, PgLockerBuilder, SessionLock};
