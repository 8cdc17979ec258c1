//! `with_advisory_lock` on a network that stalls after the lock statement
//! answered: the `ROLLBACK` that ends a busy try, a timed-out wait or a
//! closure's error gets no answer. The call still ends within the
//! heartbeat deadline, its connection closed (the server rolls the
//! transaction back when the session ends).

use crate::common;

use std::time::{Duration, Instant};

use crate::faults::{proxied_unpinged, teardown};
use common::*;
use distlock::{Error, PgLocker};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const HEARTBEAT_TIMEOUT: Duration = Duration::from_millis(300);

/// Upper bound for a call that must not wait on the stalled link.
const LIMIT: Duration = Duration::from_secs(5);

fn locker(pool: sqlx::PgPool) -> PgLocker {
    trying_locker(pool, false)
}

/// [`locker`], sending `with_advisory_lock`'s try with its `BEGIN` when
/// `try_with_begin`.
fn trying_locker(pool: sqlx::PgPool, try_with_begin: bool) -> PgLocker {
    PgLocker::builder(pool)
        .heartbeat_timeout(HEARTBEAT_TIMEOUT)
        .try_with_begin(try_with_begin)
        .build()
        .expect("valid settings")
}

/// A busy try's `ROLLBACK` stalls (the proxy holds back the call's last
/// round trip): `Ok(None)` (the try answered: busy) within the deadline.
#[sqlx::test(migrations = false)]
async fn a_busy_try_whose_rollback_stalls_ends_in_time(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    busy_try_whose_rollback_stalls(&connect_opts, false).await;
}

/// The same with the try in the `BEGIN`'s round trip (`try_with_begin`),
/// whose failed transaction's `ROLLBACK` stalls.
#[sqlx::test(migrations = false)]
async fn a_busy_try_with_begin_whose_rollback_stalls_ends_in_time(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    busy_try_whose_rollback_stalls(&connect_opts, true).await;
}

async fn busy_try_whose_rollback_stalls(connect_opts: &PgConnectOptions, try_with_begin: bool) {
    let (proxy, pool) = proxied_unpinged(connect_opts).await;
    let locker = trying_locker(pool.clone(), try_with_begin);
    let mut holder = observer(connect_opts).await;
    assert!(raw_try_lock(&mut holder, &Raw::text("xact:busy")).await);
    let busy = async || {
        locker
            .with_advisory_lock("xact:busy", async |_| Ok::<_, Error>(()))
            .await
    };
    // Twice, so the second call's round trips are those of a warm one.
    assert!(busy().await.unwrap().is_none());
    let before = proxy.round_trips();
    assert!(busy().await.unwrap().is_none());
    let per_call = proxy.round_trips() - before;
    assert!(per_call >= 2, "{per_call} round trips");
    proxy.stall_at_round_trip(proxy.round_trips() + per_call);
    let started = Instant::now();
    let res = bounded("a busy try over a stalled rollback", LIMIT, busy()).await;
    let took = started.elapsed();
    println!("busy try ({try_with_begin}), its ROLLBACK stalled: {res:?} after {took:?}");
    assert!(matches!(res, Ok(None)), "{res:?}");
    assert!(
        took < HEARTBEAT_TIMEOUT + Duration::from_secs(1),
        "{took:?}"
    );
    teardown(proxy, pool).await;
}

/// The closure fails and the network stalls before its `ROLLBACK`: the
/// closure's error, within the deadline.
#[sqlx::test(migrations = false)]
async fn a_closure_error_whose_rollback_stalls_ends_in_time(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let (proxy, pool) = proxied_unpinged(&connect_opts).await;
    let locker = locker(pool.clone());
    let started = Instant::now();
    let res = bounded(
        "a failed closure over a stalled rollback",
        LIMIT,
        locker.with_advisory_lock("xact:failed", async |_| {
            proxy.stall();
            Err::<(), _>(Error::NotInTransaction)
        }),
    )
    .await;
    let took = started.elapsed();
    println!("closure error, its ROLLBACK stalled: {res:?} after {took:?}");
    assert!(matches!(res, Err(Error::NotInTransaction)), "{res:?}");
    assert!(
        took < HEARTBEAT_TIMEOUT + Duration::from_secs(1),
        "{took:?}"
    );
    teardown(proxy, pool).await;
}
