//! Reads that wait for nothing on a network that stalls: `holders_of`
//! (behind a timed-out lock's report and the CLI's hint of who holds a
//! busy lock) answers within its deadline instead of hanging its caller.

use crate::common;

use std::time::{Duration, Instant};

use crate::faults::{proxied_unpinged, teardown};
use common::*;
use distlock::{Error, PgLocker};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[sqlx::test(migrations = false)]
async fn holders_of_over_a_stalled_network_ends_in_time(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    init_tracing();
    let (proxy, pool) = proxied_unpinged(&connect_opts).await;
    let locker = PgLocker::new(pool.clone());
    assert!(locker.holders_of("reads:k").await.unwrap().is_empty());
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
    let res = bounded(
        "holders_of over a stalled network",
        Duration::from_secs(10),
        locker.holders_of("reads:k"),
    )
    .await;
    let took = started.elapsed();
    assert!(
        matches!(&res, Err(Error::CommandTimedOut { after, .. }) if *after == Duration::from_secs(5)),
        "{res:?}"
    );
    assert!(took < Duration::from_secs(6), "{took:?}");
    // Its connection was closed, not kept: the pool's one slot is free.
    proxy.pass();
    assert!(locker.holders_of("reads:k").await.unwrap().is_empty());
    teardown(proxy, pool).await;
}
