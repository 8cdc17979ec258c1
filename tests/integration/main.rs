//! The library's integration tests against a real PostgreSQL (and Redis),
//! one module per concern, in one binary so that they build and link once.
//!
//! Every PostgreSQL test runs under `#[sqlx::test]` with a database of its
//! own (advisory locks are per database). Run one module or one test:
//! `cargo test --all-features --test integration session::` or
//! `cargo test --all-features --test integration -- --exact session::try_lock_returns_none_when_held`.
//!
//! Faults that need private servers, proxies or other processes live in
//! `tests/faults/`; the contract every backend meets in
//! `tests/conformance.rs`; the long-running suite in `tests/torture/`.

#[path = "../common/mod.rs"]
mod common;

mod concurrency;
mod examples;
mod fencing;
mod holders;
mod idempotency;
mod job;
mod keys;
mod kinds;
mod migrate;
mod multiplex;
mod redis_single;
mod redlock;
mod security;
mod session;
mod table;
mod warm;
mod xact;
