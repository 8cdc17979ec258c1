//! The crate's own schema `distlock` and what lives in it: the migrations
//! ([`migrate`](self::migrate)), fencing tokens ([`fence`]), idempotency
//! keys ([`idempotency`]) and the singleton job's run records
//! ([`job_runs`]).

pub mod fence;
pub mod idempotency;
pub(crate) mod job_runs;
pub(crate) mod migrate;
