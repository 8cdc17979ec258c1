//! Reads that wait for nothing on a network that stalls: `holders_of`
//! (behind a timed-out lock's report and the CLI's hint of who holds a
//! busy lock), `holders` (the CLI's `distlock holders`) and the lease
//! table's `holders` answer within their deadlines instead of hanging
//! their callers.

use crate::common;

use std::time::{Duration, Instant};

use crate::faults::{proxied_unpinged, teardown};
use common::*;
use distlock::postgres::TableLocker;
use distlock::{Error, PgLocker};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// `read` (a count of what it found) through a proxy that stalls once the
/// pool's one connection is idle: it fails within 6 s with an error
/// `expected` accepts, and closes its connection (the read works again,
/// on a new one, once the network is back).
async fn ends_in_time(
    connect_opts: &PgConnectOptions,
    what: &str,
    read: impl AsyncFn(&sqlx::PgPool) -> Result<usize, Error>,
    expected: impl Fn(&Error) -> bool,
) {
    init_tracing();
    let (proxy, pool) = proxied_unpinged(connect_opts).await;
    assert_eq!(read(&pool).await.expect("a read on a healthy network"), 0);
    // sqlx pings a connection given back before it is idle again: the
    // stall must come after that ping, or the pool's one slot waits on it.
    eventually(
        "the connection is idle",
        Duration::from_secs(5),
        async || pool.num_idle() == 1,
    )
    .await;
    proxy.stall();
    let started = Instant::now();
    let res = bounded(what, Duration::from_secs(10), read(&pool)).await;
    let took = started.elapsed();
    assert!(res.as_ref().is_err_and(&expected), "{what}: {res:?}");
    assert!(took < Duration::from_secs(6), "{what}: {took:?}");
    // Its connection was closed, not kept: the pool's one slot is free.
    proxy.pass();
    assert_eq!(read(&pool).await.expect("a read after the stall"), 0);
    teardown(proxy, pool).await;
}

#[sqlx::test(migrations = false)]
async fn holders_of_over_a_stalled_network_ends_in_time(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let read = async |pool: &sqlx::PgPool| {
        let found = PgLocker::new(pool.clone()).holders_of("reads:k").await?;
        Ok(found.len())
    };
    let expected = |err: &Error| matches!(err, Error::CommandTimedOut { after, .. } if *after == Duration::from_secs(5));
    ends_in_time(&connect_opts, "holders_of", read, expected).await;
}

#[sqlx::test(migrations = false)]
async fn holders_over_a_stalled_network_ends_in_time(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let read = async |pool: &sqlx::PgPool| Ok(PgLocker::new(pool.clone()).holders().await?.len());
    let expected = |err: &Error| {
        matches!(err, Error::NoReply { call: "PgLocker::holders", after }
            if *after == Duration::from_secs(5))
    };
    ends_in_time(&connect_opts, "holders", read, expected).await;
}

#[sqlx::test(migrations = false)]
async fn lease_table_holders_over_a_stalled_network_ends_in_time(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let direct = sqlx::PgPool::connect_with(connect_opts.clone()).await;
    let direct = direct.expect("a pool of the test database");
    distlock::migrate(&direct).await.expect("migrate");
    direct.close().await;
    let read = async |pool: &sqlx::PgPool| {
        // A renewal deadline (two thirds of the TTL) below the reads' 5 s.
        let locker = TableLocker::builder(pool.clone())
            .ttl(Duration::from_secs(3))
            .build()?;
        Ok(locker.holders().await?.len())
    };
    let expected = |err: &Error| {
        matches!(err, Error::NoReply { call: "TableLocker::holders", after }
            if *after == Duration::from_secs(5))
    };
    ends_in_time(&connect_opts, "the lease table's holders", read, expected).await;
}
