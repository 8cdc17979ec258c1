//! `TableLocker` under a stalled network (bytes stop flowing, nothing is
//! closed): `lock` and `try_lock` give up at their documented deadlines
//! instead of hanging until the kernel gives up on TCP, and a grant that
//! comes in after the caller gave up is released, not left held.

use crate::common;

use std::time::{Duration, Instant};

use common::proxy::Proxy;
use common::{bounded, eventually, init_tracing};
use distlock::postgres::TableLocker;
use distlock::{ElectionLocker, Error, LockKey, Proclamation, Seat};
use sqlx::PgPool;
use sqlx::postgres::{PgListener, PgPoolOptions};

/// The leases' TTL; an attempt's answer is awaited for two thirds of it
/// (the renewal deadline) beyond the caller's deadline, and its task keeps
/// the connection a third of it more (the window in which the tests that
/// restore the network see the late grant released, not left to expire).
const TTL: Duration = Duration::from_millis(1500);
const GRACE: Duration = Duration::from_millis(1000);

/// A migrated test database, a proxy in front of it, and a locker on a pool
/// of one connection through the proxy (handing out connections without a
/// ping, so a statement goes straight into a stalled link; waiting 3 s at
/// most for one). One lease taken and released with `lock` on a healthy
/// network first, so the listening connection is up and the pool's
/// connection is idle.
async fn prepared(pool: &PgPool) -> (Proxy, PgPool, TableLocker) {
    init_tracing();
    distlock::migrate(pool).await.expect("migrate");
    let direct = pool.connect_options();
    let proxy = Proxy::start(direct.get_host(), direct.get_port())
        .await
        .expect("proxy");
    let proxied = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(3))
        .test_before_acquire(false)
        .connect_with(proxy.options(&direct))
        .await
        .expect("pool through the proxy");
    let locker = TableLocker::builder(proxied.clone())
        .ttl(TTL)
        .build()
        .expect("valid settings");
    locker
        .lock("stalled:warm", Duration::from_secs(5))
        .await
        .expect("free")
        .release()
        .await
        .expect("released");
    eventually(
        "the connection is idle in the pool",
        Duration::from_secs(5),
        async || proxied.num_idle() == 1,
    )
    .await;
    (proxy, proxied, locker)
}

/// [`prepared`], then the network stalls (current and new connections).
async fn stalled(pool: &PgPool) -> (Proxy, PgPool, TableLocker) {
    let (proxy, proxied, locker) = prepared(pool).await;
    proxy.stall();
    (proxy, proxied, locker)
}

/// A connection to the test database (not through the proxy) that hears
/// every release of a lease.
async fn releases(pool: &PgPool) -> PgListener {
    let mut listener = PgListener::connect_with(pool).await.expect("listener");
    listener.listen("distlock_lease").await.expect("listen");
    listener
}

/// Once the network is back, the stalled statement's grant (if the server
/// granted it) is released by the attempt's task: a release of `key` is
/// announced and its row is gone (an expired row would still be there).
async fn late_grant_released(pool: &PgPool, proxy: &Proxy, mut heard: PgListener, key: &str) {
    let lock_id: i32 = sqlx::query_scalar("SELECT hashtext($1)")
        .bind(key)
        .fetch_one(pool)
        .await
        .expect("hashtext");
    proxy.pass();
    let released = bounded("the late grant's release", TTL / 2, heard.recv())
        .await
        .expect("notification");
    assert_eq!(released.payload(), format!("1:{lock_id}"));
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM distlock.leases WHERE lock_id = $1::int8")
            .bind(lock_id)
            .fetch_one(pool)
            .await
            .expect("count");
    assert_eq!(rows, 0, "the late grant's row was deleted");
}

/// Restores the network and closes everything (a pool cannot close over a
/// stalled link).
async fn teardown(proxy: Proxy, pool: PgPool) {
    proxy.pass();
    proxy.cut();
    bounded("pool close", Duration::from_secs(10), pool.close()).await;
    drop(proxy);
}

#[sqlx::test(migrations = false)]
async fn table_lock_under_stalled_network_times_out_instead_of_hanging(pool: PgPool) {
    // Documented: an attempt not answered within `timeout` plus the renewal
    // deadline (two thirds of the TTL) is abandoned and reported as a
    // timeout.
    let timeout = Duration::from_millis(500);
    let (proxy, proxied, locker) = stalled(&pool).await;
    // Listening from here: the warm-up's release is not heard.
    let heard = releases(&pool).await;
    let started = Instant::now();
    let res = bounded(
        "TableLocker::lock() under a stalled network",
        Duration::from_secs(10),
        locker.lock("stalled:lock", timeout),
    )
    .await;
    let took = started.elapsed();
    println!("TableLocker::lock() under a stalled network: {res:?} after {took:?}");
    assert!(matches!(res, Err(Error::Timeout { .. })), "got {res:?}");
    assert!(took >= timeout, "{took:?}");
    assert!(
        took <= timeout + GRACE + Duration::from_millis(700),
        "{took:?}"
    );
    late_grant_released(&pool, &proxy, heard, "stalled:lock").await;
    teardown(proxy, proxied).await;
}

#[sqlx::test(migrations = false)]
async fn table_try_lock_under_stalled_network_is_command_timed_out(pool: PgPool) {
    // Documented: a try not answered within the renewal deadline (two
    // thirds of the TTL) is abandoned and reported as `CommandTimedOut`.
    let (proxy, proxied, locker) = stalled(&pool).await;
    // Listening from here: the warm-up's release is not heard.
    let heard = releases(&pool).await;
    let started = Instant::now();
    let res = bounded(
        "TableLocker::try_lock() under a stalled network",
        Duration::from_secs(10),
        locker.try_lock("stalled:try"),
    )
    .await;
    let took = started.elapsed();
    println!("TableLocker::try_lock() under a stalled network: {res:?} after {took:?}");
    match &res {
        Err(Error::CommandTimedOut { key, after }) => {
            assert_eq!(*key, LockKey::from("stalled:try"));
            assert_eq!(*after, GRACE);
        }
        other => panic!("expected CommandTimedOut, got {other:?}"),
    }
    assert!(took >= GRACE, "{took:?}");
    assert!(took <= GRACE + Duration::from_millis(700), "{took:?}");
    late_grant_released(&pool, &proxy, heard, "stalled:try").await;
    teardown(proxy, proxied).await;
}

#[sqlx::test(migrations = false)]
async fn a_stalled_attempt_gives_its_connection_back_within_a_ttl(pool: PgPool) {
    // The regression: the task of an attempt whose answer never came kept
    // its pooled connection until the link recovered or TCP gave up (about
    // 15 minutes), so every stalled call took one connection out of the
    // pool that renewals share. Here the open connection is blackholed (as
    // a NAT that dropped its state would), new ones work, and the pool has
    // one connection: the next try gets it only once the first attempt's
    // task has closed it, one TTL after the send.
    let (proxy, proxied, locker) = prepared(&pool).await;
    proxy.freeze_open();
    let res = bounded(
        "a try on the frozen connection",
        Duration::from_secs(10),
        locker.try_lock("stalled:first"),
    )
    .await;
    assert!(
        matches!(res, Err(Error::CommandTimedOut { .. })),
        "got {res:?}"
    );
    let started = Instant::now();
    let next = bounded(
        "the next try",
        Duration::from_secs(10),
        locker.try_lock("stalled:next"),
    )
    .await;
    println!("the next try: {next:?} after {:?}", started.elapsed());
    let lease = next
        .expect("a connection came back to the pool")
        .expect("the key is free");
    lease.release().await.expect("released");
    teardown(proxy, proxied).await;
}

/// The lease table's election records (`proclaim`, `withdraw`, `leader`)
/// under a stalled network: each waited for its statement's answer without
/// a deadline, until TCP gave up, so a campaign could hold the election's
/// lease and never lead. Each now fails with `CommandTimedOut` after the
/// renewal deadline (two thirds of the TTL), its connection closed.
#[sqlx::test(migrations = false)]
async fn election_records_under_stalled_network_are_command_timed_out(pool: PgPool) {
    let key = LockKey::from("stalled:e");
    let seat = Seat::new(1);
    let proclamation = Proclamation {
        identity: "stalled".into(),
        value: String::new(),
        fencing_token: None,
        grace: Duration::ZERO,
    };
    for call in ["leader", "withdraw", "proclaim"] {
        let (proxy, proxied, locker) = stalled(&pool).await;
        let started = Instant::now();
        let res = bounded(call, Duration::from_secs(10), async {
            match call {
                "leader" => locker.leader(&key).await.map(drop),
                "withdraw" => locker.withdraw(&key, seat, None).await,
                _ => locker.proclaim(&key, seat, &proclamation).await.map(drop),
            }
        })
        .await;
        let took = started.elapsed();
        match res {
            Err(Error::CommandTimedOut { key: named, after }) => {
                assert_eq!((named, after), (key.clone(), TTL * 2 / 3), "{call}");
            }
            other => panic!("{call}: expected CommandTimedOut, got {other:?}"),
        }
        assert!(took < TTL, "{call}: {took:?}");
        eventually(
            &format!("{call}: its connection closed"),
            Duration::from_secs(1),
            async || proxied.size() == 0,
        )
        .await;
        teardown(proxy, proxied).await;
    }
}
