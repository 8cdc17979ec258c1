//! The PostgreSQL backend: advisory locks through a `sqlx::PgPool`.

mod config;
pub(crate) mod conn;
pub mod fence;
mod holders;
pub mod idempotency;
pub(crate) mod job_runs;
mod keeper;
pub(crate) mod key_args;
mod lease;
mod locker;
mod migrate;
mod multi;
mod mux;
mod pooler;
mod session;
mod session_lock;
mod sql;
pub(crate) mod sqlstate;
pub mod table;
mod timeout;
mod timer;
mod waiter;
mod warm;
mod xact;
mod xact_lock;

pub use config::{DEFAULT_HEARTBEAT, DEFAULT_RELEASE_TIMEOUT};
pub use holders::{AdvisoryKey, Holder, LockMode};
pub use locker::{PgLocker, PgLockerBuilder};
pub use migrate::{MigrateOptions, SCHEMA, migrate, migrate_with};
pub use multi::MultiLock;
pub use session_lock::SessionLock;
pub use table::{TableLease, TableLocker, TableLockerBuilder};
pub use waiter::{LockWaiter, WaitReport};
pub use xact_lock::{lock_xact, try_lock_xact};
