//! Faults on the shared connection of a multiplexed `PgLocker`
//! (`PgLockerBuilder::multiplex`): a stalled network under `lock()`, and a
//! server session that loses its locks behind the driver's back.

use crate::common;

use std::time::{Duration, Instant};

use crate::faults::proxied_unpinged;
use common::txpool::TxPool;
use common::*;
use distlock::{Error, LossReason, PgLocker};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};

/// Upper bound for anything that should be quick, so a wedged proxy fails
/// the test instead of hanging it.
const LIMIT: Duration = Duration::from_secs(10);

/// Documented for `PgLocker::lock`: if the server does not answer within
/// `timeout` plus the heartbeat deadline (a stalled network), the attempt is
/// abandoned and reported as a timeout. In multiplexed mode the try runs on
/// the shared connection; when that stalls, the try must not move on to
/// fresh connections (each opened over the same stalled link) past the
/// caller's deadline.
#[sqlx::test(migrations = false)]
async fn multiplexed_lock_under_stalled_network_times_out_instead_of_hanging(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let heartbeat_timeout = Duration::from_millis(300);
    let timeout = Duration::from_millis(500);
    let (proxy, pool) = proxied_unpinged(&connect_opts).await;
    let locker = PgLocker::builder(pool.clone())
        .multiplex(1)
        .heartbeat_timeout(heartbeat_timeout)
        .build()
        .expect("valid settings");
    // One lock on a healthy network first: the shared connection opens and
    // passes its one-time checks there.
    bounded("warm-up lock", LIMIT, locker.try_lock("faults:mux:warm"))
        .await
        .unwrap()
        .expect("free")
        .release()
        .await
        .unwrap();
    proxy.stall();
    let started = Instant::now();
    let res = bounded(
        "multiplexed lock() under a stalled network",
        LIMIT,
        locker.lock("faults:mux:lock", timeout),
    )
    .await;
    let took = started.elapsed();
    println!("multiplexed lock() under a stalled network: {res:?} after {took:?}");
    assert!(matches!(res, Err(Error::Timeout { .. })), "got {res:?}");
    assert!(took >= timeout, "{took:?}");
    assert!(
        took <= timeout + heartbeat_timeout + Duration::from_millis(700),
        "{took:?}"
    );
    proxy.pass();
    proxy.cut();
    bounded("pool close", LIMIT, pool.close()).await;
}

/// A transaction pooler with one server connection in front of the test
/// database (see `common::txpool`): every client's statements reach the
/// same server session.
async fn txpool(pool: &PgPool) -> TxPool {
    let opts = pool.connect_options();
    TxPool::start(
        opts.get_host(),
        opts.get_port(),
        opts.get_username(),
        opts.get_database().expect("the test database's name"),
    )
    .await
    .expect("transaction pooler")
}

/// Connect options of `pool`, pointed at `proxy`.
fn through(proxy: &TxPool, pool: &PgPool, app: &str) -> PgConnectOptions {
    (*pool.connect_options())
        .clone()
        .host("127.0.0.1")
        .port(proxy.port())
        .application_name(app)
}

/// On the driver's own session an unlock can answer `false` only if
/// something outside the driver released locks there: here another client
/// sharing the server session through a transaction pooler runs
/// `pg_advisory_unlock_all()`, which frees every lock of the session and
/// leaves the session marker alone (so neither the heartbeat nor the next
/// try can see it). The first release that finds its lock gone must put
/// every other lock of that connection in doubt: B's guard must report the
/// loss, not go on vouching for a lock nobody holds.
#[sqlx::test(migrations = false)]
async fn an_unlock_that_finds_its_lock_gone_loses_every_lock_of_the_shared_connection(
    pool: PgPool,
) {
    let proxy = txpool(&pool).await;
    let clients = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(through(&proxy, &pool, "mux-client"))
        .await
        .expect("pool through the transaction pooler");
    let heartbeat = Duration::from_millis(100);
    let locker = PgLocker::builder(clients.clone())
        .multiplex(1)
        .heartbeat(heartbeat)
        .build()
        .expect("valid settings");
    let a = bounded("A's try_lock", LIMIT, locker.try_lock("faults:mux:a"))
        .await
        .unwrap()
        .expect("A is free");
    let b = bounded("B's try_lock", LIMIT, locker.try_lock("faults:mux:b"))
        .await
        .unwrap()
        .expect("B is free");
    assert_eq!(a.backend_pid(), proxy.backend_pid());
    assert_eq!(b.backend_pid(), proxy.backend_pid());

    // Another client of the pooler, on the same server session.
    let mut other = PgConnection::connect_with(&through(&proxy, &pool, "other-client"))
        .await
        .expect("another client through the pooler");
    sqlx::query("SELECT pg_catalog.pg_advisory_unlock_all()")
        .execute(&mut other)
        .await
        .expect("pg_advisory_unlock_all");
    let mut obs = observer_for(&pool).await;
    assert!(
        raw_can_take(&mut obs, &Raw::text("faults:mux:b")).await,
        "the server no longer holds B"
    );

    let released = bounded("A's release", LIMIT, a.release()).await;
    println!("A's release: {released:?}");
    assert!(
        matches!(released, Err(Error::LockLost { .. })),
        "{released:?}"
    );
    let started = Instant::now();
    let reason = bounded("B's lost()", Duration::from_secs(2), b.lost()).await;
    println!("B lost after {:?}: {reason:?}", started.elapsed());
    assert!(matches!(reason, LossReason::SessionShared(_)), "{reason:?}");
    drop(b);

    let _ = other.close().await;
    bounded("pool close", LIMIT, clients.close()).await;
    assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(3)).await;
    close(obs).await;
}

/// Connections to `port` on 127.0.0.1 still open from the client's side,
/// as the kernel sees them (`/proc/net/tcp`): the proxy's accepted sockets
/// in state ESTABLISHED. A client that closes its socket moves the
/// proxy's to CLOSE_WAIT, even while the proxy reads nothing (a stall).
fn open_to(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    let local = format!("0100007F:{port:04X}");
    table
        .lines()
        .skip(1)
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields.get(1) == Some(&local.as_str()) && fields.get(3) == Some(&"01")
        })
        .count()
}

/// A shared connection lost to a stalled network is closed by dropping its
/// socket, at once: a statement more (the `UNLISTEN *` a dropped listener
/// sends) would wait on the stalled link without a deadline, keeping a
/// task, the socket and the server session (with its locks) until TCP
/// gives up.
#[sqlx::test(migrations = false)]
async fn a_shared_connection_lost_to_a_stalled_network_is_closed_at_once(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let (proxy, pool) = proxied_unpinged(&connect_opts).await;
    let locker = PgLocker::builder(pool.clone())
        .multiplex(1)
        .heartbeat(Duration::from_millis(200))
        .heartbeat_timeout(Duration::from_millis(300))
        .build()
        .expect("valid settings");
    let lock = bounded("try_lock", LIMIT, locker.try_lock("faults:mux:closed"))
        .await
        .unwrap()
        .expect("free");
    // The pool's connection and the shared one.
    let open = open_to(proxy.port());
    assert!(open >= 2, "{open} connections through the proxy");
    proxy.stall();
    let reason = bounded("lost()", LIMIT, lock.lost()).await;
    assert!(
        matches!(reason, LossReason::HeartbeatTimedOut(_)),
        "{reason:?}"
    );
    eventually(
        "the shared connection's socket is closed",
        Duration::from_secs(2),
        async || open_to(proxy.port()) == open - 1,
    )
    .await;
    drop(lock);
    proxy.pass();
    proxy.cut();
    bounded("pool close", LIMIT, pool.close()).await;
}

/// A multiplexed `release()` that times out (the network stalls under its
/// unlock) keeps its place under `max_locks` until the unlock has run on
/// the shared connection: the lock may still be held on the server, so
/// another lock is refused (`TooManyLocks`), not queued behind it. Once the
/// network comes back the unlock runs and the place is free again.
#[sqlx::test(migrations = false)]
async fn a_timed_out_release_keeps_its_place_under_max_locks(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let (proxy, pool) = proxied_unpinged(&connect_opts).await;
    let locker = PgLocker::builder(pool.clone())
        .multiplex(1)
        .max_locks(1)
        .release_timeout(Duration::from_millis(100))
        .heartbeat_timeout(Duration::from_secs(3))
        .build()
        .expect("valid settings");
    let lock = bounded("try_lock", LIMIT, locker.try_lock("faults:mux:place"))
        .await
        .unwrap()
        .expect("free");
    proxy.stall();
    let released = bounded("release()", LIMIT, lock.release()).await;
    assert!(
        matches!(released, Err(Error::ReleaseTimedOut { .. })),
        "{released:?}"
    );
    let refused = bounded("try_lock", LIMIT, locker.try_lock("faults:mux:other")).await;
    assert!(
        matches!(refused, Err(Error::TooManyLocks { limit: 1 })),
        "{refused:?}"
    );
    proxy.pass();
    let mut other = None;
    eventually(
        "the unlock ran and gave the place back",
        Duration::from_secs(5),
        async || {
            other = locker.try_lock("faults:mux:other").await.ok().flatten();
            other.is_some()
        },
    )
    .await;
    drop(other);
    proxy.cut();
    bounded("pool close", LIMIT, pool.close()).await;
}
