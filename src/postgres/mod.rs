//! The PostgreSQL backend's own items: the lease table ([`TableLocker`]),
//! who holds and awaits advisory locks ([`Holder`], [`wait_chain`]), a
//! waiting lock that reports its holder ([`LockWaiter`]), and the locker's
//! bounds. `PgLocker`, its guards, the migrations, fencing and idempotency
//! keys are at the crate root.
//!
//! | folder or file | what it holds |
//! |---|---|
//! | `locker.rs`, `config.rs` | `PgLocker`, its builder and settings |
//! | `request/` | the lock request and its one statement builder: every advisory-lock statement |
//! | `session/` | session locks: taking them, their guards, keeper, heartbeat, timer, unlock |
//! | `xact/` | transaction-scoped locks: `with_advisory_lock*`, locks in the caller's transaction |
//! | `conn/` | the connections locks live on: held, pooled within a deadline, kept warm |
//! | `mux/` | the multiplexed mode: many locks over a few shared sessions |
//! | `table/` | the lease table, for transaction poolers and failover |
//! | `schema/` | schema `distlock`: migrations, fencing tokens, idempotency keys, job runs |
//! | `holders.rs`, `waiter.rs`, `timeout.rs` | who holds what; waiting with reports; naming the holder at a deadline |
//! | `semaphore.rs`, `permit_relay.rs` | `PgLocker::semaphore`'s slots and queue; a process's turn, where permits are handed to its waiters |
//! | `pooler.rs`, `evidence.rs`, `sqlstate.rs` | pooler detection and its evidence; server errors to `Error` |

mod config;
pub(crate) mod conn;
pub(crate) mod election;
pub(crate) mod evidence;
mod holder;
mod holders;
mod lease;
pub(crate) mod locker;
mod mux;
pub(crate) mod permit_relay;
pub(crate) mod pooler;
pub(crate) mod request;
pub(crate) mod schema;
pub(crate) mod semaphore;
pub(crate) mod session;
pub(crate) mod sqlstate;
mod table;
mod timeout;
mod wait_chain;
mod waiter;
pub(crate) mod xact;

pub use config::{
    DEFAULT_HEARTBEAT, DEFAULT_RELEASE_TIMEOUT, MAX_DETECTION, MAX_MULTIPLEX, MIN_HEARTBEAT,
};
pub use holder::{AdvisoryKey, ChainLink, Holder, LockMode};
pub use table::{LeaseHolder, MAX_TTL, MIN_TTL, TableLease, TableLocker, TableLockerBuilder};
pub use wait_chain::{WaitChain, wait_chain};
pub use waiter::{LockWaiter, MIN_REPORT_EVERY, WaitReport};
