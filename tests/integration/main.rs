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
mod config;
mod errors;
mod examples;
mod fencing;
mod future_size;
mod holders;
mod idempotency;
mod job;
mod keys;
mod kinds;
mod leader;
mod migrate;
mod multi;
mod multiplex;
mod redis_single;
mod redis_wake;
mod redlock;
mod search_path;
mod security;
mod semaphore;
mod semaphore_edges;
mod semaphore_fill;
mod semaphore_relay;
mod session;
mod statement_timeout;
mod table;
mod upgradeable;
mod vocabulary;
mod wait_chains;
mod waits;
mod warm;
mod watched;
mod xact;
