//! The PostgreSQL backend: advisory locks through a `sqlx::PgPool`.

pub(crate) mod conn;
mod holders;
mod keeper;
mod locker;
mod mux;
mod pooler;
mod session;
mod sql;
mod xact;

pub use holders::{AdvisoryKey, Holder, LockMode};
pub use locker::{DEFAULT_HEARTBEAT, DEFAULT_RELEASE_TIMEOUT, PgLocker, PgLockerBuilder};
pub use session::SessionLock;
