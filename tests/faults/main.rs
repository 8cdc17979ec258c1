//! Faults caused for real: private PostgreSQL clusters that crash and fail
//! over, transaction poolers, fault proxies that stall, cut and delay,
//! OS-process workers. One module per fault family, in one binary.
//!
//! Run one module: `cargo test --all-features --test faults ha::`.

#[path = "../common/mod.rs"]
mod common;

mod backend_crash;
mod conn_limit;
mod faults;
mod german;
mod goodbye;
mod ha;
mod kinds_faults;
mod leadership;
mod partition;
mod partition_kinds;
mod pooler;
mod prepared;
mod stalled_mux;
mod stalled_reads;
mod stalled_table;
mod stalled_xact;
mod standby;
mod table_switchover;
