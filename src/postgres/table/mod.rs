//! Leases in a table: [`TableLocker`], for transaction poolers and failover.
//!
//! A [`PgLocker`](crate::PgLocker) session lock lives in a server session:
//! it needs a connection of its own for as long as it is held, which a
//! transaction pooler (PgBouncer in transaction mode) cannot give, and it is
//! gone after a failover (a standby has no sessions). A [`TableLease`] is a
//! row of `distlock.leases` instead, with an owner only its holder knows, an
//! expiry on the server's clock and a fencing token, kept alive by a
//! renewal every quarter of its time to live. Every operation is one
//! statement in one short transaction; a grant committed with synchronous
//! replication survives a failover.
//!
//! The price: a grant, each renewal and a release are durable writes, a
//! holder that vanishes blocks its key for up to one TTL, and a holder
//! that cannot renew gives up after two thirds of one. See [`TableLocker`]
//! for costs, the clock assumption and waiting.
//!
//! | file | what it holds |
//! |---|---|
//! | `locker.rs` | [`TableLocker`], [`TableLockerBuilder`], taking a lease, the `Locker` impl |
//! | `holders.rs` | [`LeaseHolder`]: who holds leases now (`TableLocker::holders`) |
//! | `inner.rs` | what the locker and its leases share (pool, settings, listener) |
//! | `lease.rs` | [`TableLease`] and its `Lease` impl |
//! | `release.rs` | deleting a lease's row, also in the background |
//! | `renew.rs` | the renewal task and its loss deadline |
//! | `row_wait.rs` | a statement whose waits for locked rows end when its client gives up |
//! | `notify.rs` | the `LISTEN` connection that wakes waiters |
//! | `election.rs` | the record of who leads a `LeaderElection` (`ElectionLocker`) |
//! | `sql.rs` | the statements, as simple queries safe for poolers |
//!
//! The SQL functions (`distlock.lease_acquire`, `lease_renew`,
//! `lease_release`, `lease_purge`) are in the crate's migrations and can be
//! called from other languages with the same guarantees.

mod election;
mod holders;
mod inner;
mod lease;
mod locker;
mod notify;
mod release;
mod renew;
mod row_wait;
mod sql;

pub use holders::LeaseHolder;
pub use lease::TableLease;
pub use locker::{MAX_TTL, MIN_TTL, TableLocker, TableLockerBuilder};
