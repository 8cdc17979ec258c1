//! A hot standby grants advisory locks of its own, apart from its
//! primary's. A locker pointed at one must refuse, on every lock path,
//! rather than take a second copy of a lock the primary holds.

use crate::common;

use std::time::Duration;

use common::cluster::Cluster;
use common::pgbouncer::PgBouncer;
use common::{Raw, raw_try_lock, raw_unlock};
use distlock::{Error, PgLocker};
use sqlx::postgres::PgPoolOptions;

/// Every lock path against the standby: each must fail with `HotStandby`.
async fn attempts(
    locker: &PgLocker,
    pool: &sqlx::PgPool,
) -> Vec<(&'static str, Result<(), Error>)> {
    let t = Duration::from_millis(300);
    let mut tx = pool.begin().await.expect("begin on the standby");
    let in_tx = distlock::try_lock_xact(&mut tx, "k").await.map(drop);
    drop(tx);
    let mut tx = pool.begin().await.expect("begin on the standby");
    let waited_in_tx = distlock::lock_xact(&mut tx, "k", t).await.map(drop);
    drop(tx);
    vec![
        ("try_lock", locker.try_lock("k").await.map(drop)),
        ("lock", locker.lock("k", t).await.map(drop)),
        (
            "try_lock_shared",
            locker.try_lock_shared("k").await.map(drop),
        ),
        ("lock_shared", locker.lock_shared("k", t).await.map(drop)),
        (
            "try_lock_all",
            locker.try_lock_all(["k", "j"]).await.map(drop),
        ),
        ("lock_all", locker.lock_all(["k", "j"], t).await.map(drop)),
        (
            "with_advisory_lock",
            locker
                .with_advisory_lock("k", async |_| Ok::<_, Error>(()))
                .await
                .map(drop),
        ),
        (
            "with_advisory_lock trying with BEGIN",
            PgLocker::builder(pool.clone())
                .try_with_begin(true)
                .build()
                .expect("valid settings")
                .with_advisory_lock("k", async |_| Ok::<_, Error>(()))
                .await
                .map(drop),
        ),
        (
            "with_advisory_lock_wait",
            locker
                .with_advisory_lock_wait("k", t, async |_| Ok::<_, Error>(()))
                .await
                .map(drop),
        ),
        ("try_lock_xact", in_tx),
        ("lock_xact", waited_in_tx),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_lock_path_refuses_a_hot_standby() {
    let primary = Cluster::primary("standby_refusal", &[]).await;
    let standby = Cluster::standby_of(&primary, "standby_refusal_s", &[]).await;
    every_lock_path_refuses(&primary, &standby).await;
}

/// `with_advisory_lock` trying with its `BEGIN` reaches a standby session
/// that has its statement prepared only through a pooler that keeps server
/// sessions across clients: PgBouncer (transaction mode, one server
/// connection) in front of a standby. The first client prepares the
/// statement there (and is refused by the plain try); the clients after it
/// run the prepared statement, whose standby check must fail it before it
/// can report the key busy (the key is held on the standby meanwhile).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_try_with_begin_prepared_on_a_standby_session_refuses_it() {
    let primary = Cluster::primary("standby_prepared", &[]).await;
    let standby = Cluster::standby_of(&primary, "standby_prepared_s", &[]).await;
    let bouncer = PgBouncer::builder(standby.port())
        .set("default_pool_size", "1")
        .start()
        .await;
    let standby_pool = standby.pool().await;
    let mut other = standby_pool.acquire().await.expect("a standby session");
    assert!(
        raw_try_lock(&mut other, &Raw::text("k")).await,
        "k on the standby"
    );
    for call in 1..=3 {
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(bouncer.options(&standby.options()))
            .await
            .expect("a client of PgBouncer");
        let outcome = PgLocker::builder(pool.clone())
            .try_with_begin(true)
            .build()
            .expect("valid settings")
            .with_advisory_lock("k", async |_| Ok::<_, Error>(()))
            .await;
        match outcome {
            Err(Error::HotStandby { .. }) => {}
            other => panic!("call {call} through PgBouncer: expected HotStandby, got {other:?}"),
        }
        pool.close().await;
    }
    // The one server connection kept the statement the first call prepared,
    // and the calls after it ran it (each run plans it).
    let through = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(bouncer.options(&standby.options()))
        .await
        .expect("a client of PgBouncer");
    // A simple query: the server session keeps the statements earlier
    // clients' extended queries prepared under sqlx's names.
    let row = sqlx::raw_sql(
        "SELECT count(*), coalesce(sum(generic_plans + custom_plans), 0)::int8 \
         FROM pg_prepared_statements WHERE name LIKE 'distlock_xact_try_%'",
    )
    .fetch_one(&through)
    .await
    .expect("pg_prepared_statements through PgBouncer");
    let (prepared, runs): (i64, i64) = (sqlx::Row::get(&row, 0), sqlx::Row::get(&row, 1));
    assert_eq!(prepared, 1, "the server connection's prepared try");
    assert!(
        runs >= 2,
        "the prepared try ran {runs} times, not in calls 2 and 3"
    );
    through.close().await;
    assert!(
        raw_unlock(&mut other, &Raw::text("k")).await,
        "k on the standby"
    );
    drop(other);
    standby_pool.close().await;
}

/// Every lock path against `standby`, a standby of `primary` (which holds
/// the key meanwhile), refuses with `HotStandby` and takes nothing: with
/// the keys free on the standby, and with them held there by another
/// session, so that a statement which tried the lock before its standby
/// check would answer "busy" (or time out) instead of refusing.
pub(crate) async fn every_lock_path_refuses(primary: &Cluster, standby: &Cluster) {
    let primary_pool = primary.pool().await;
    let standby_pool = standby.pool().await;
    // The primary holds "k": a second copy on the standby would be granted.
    let held = PgLocker::new(primary_pool.clone())
        .try_lock("k")
        .await
        .expect("try_lock on the primary")
        .expect("free on the primary");
    refused_on(&standby_pool).await;
    let mut other = standby_pool.acquire().await.expect("a standby session");
    for name in ["k", "j"] {
        assert!(
            raw_try_lock(&mut other, &Raw::text(name)).await,
            "{name} on the standby"
        );
    }
    refused_on(&standby_pool).await;
    for name in ["k", "j"] {
        assert!(
            raw_unlock(&mut other, &Raw::text(name)).await,
            "{name} on the standby"
        );
    }
    drop(other);
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'")
        .fetch_one(&standby_pool)
        .await
        .expect("pg_locks on the standby");
    assert_eq!(left, 0, "advisory locks left on the standby");
    held.release().await.expect("release on the primary");
    standby_pool.close().await;
    primary_pool.close().await;
}

/// Every lock path on `standby_pool`, plain and multiplexed, fails with
/// `HotStandby`, naming the key.
async fn refused_on(standby_pool: &sqlx::PgPool) {
    for multiplexed in [false, true] {
        let locker = if multiplexed {
            PgLocker::builder(standby_pool.clone())
                .multiplex(1)
                .build()
                .expect("valid settings")
        } else {
            PgLocker::new(standby_pool.clone())
        };
        for (what, outcome) in attempts(&locker, standby_pool).await {
            let what = format!("{what} (multiplexed: {multiplexed})");
            if multiplexed && !what.starts_with("try_lock ") && !what.starts_with("lock ") {
                continue;
            }
            match outcome {
                Err(Error::HotStandby { key }) => {
                    assert!(
                        key.name() == Some("k") || key.name() == Some("j"),
                        "{what}: {key}"
                    )
                }
                other => panic!("{what} on a hot standby: expected HotStandby, got {other:?}"),
            }
        }
    }
}
