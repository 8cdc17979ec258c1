//! `holders()` and `holders_of()`: who holds or awaits advisory locks.

use crate::common;

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime};

use common::*;
use distlock::postgres::{AdvisoryKey, Holder, LockMode};
use distlock::{Error, LockKey, PgLocker};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::sync::oneshot;

const APP: &str = "distlock-holders-test";

async fn locker_with_app_name(
    pool_opts: PgPoolOptions,
    connect_opts: &PgConnectOptions,
) -> PgLocker {
    let pool = pool_opts
        .max_connections(10)
        .connect_with(connect_opts.clone().application_name(APP))
        .await
        .unwrap();
    PgLocker::new(pool)
}

fn summary(h: &Holder) -> (AdvisoryKey, i32, bool) {
    (h.key, h.pid, h.granted)
}

/// A name whose `hashtext` is negative, to exercise sign handling.
async fn negative_hash_name(obs: &mut sqlx::PgConnection) -> (String, i32) {
    for i in 0..100 {
        let name = format!("neg-{i}");
        let h = hashtext(obs, &name).await;
        if h < 0 {
            return (name, h);
        }
    }
    panic!("no negative hashtext found");
}

#[sqlx::test(migrations = false)]
async fn holders_lists_exactly_what_is_held_and_awaited(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let locker = locker_with_app_name(pool_opts, &connect_opts).await;
    let mut obs = observer(&connect_opts).await;
    assert!(
        locker.holders().await.unwrap().is_empty(),
        "nothing held yet"
    );

    let (neg_name, neg_hash) = negative_hash_name(&mut obs).await;
    let before = SystemTime::now() - Duration::from_secs(1);
    let a = locker.try_lock(LockKey::id(1)).await.unwrap().unwrap();
    let b = locker.try_lock(LockKey::id(-42)).await.unwrap().unwrap();
    let c = locker.try_lock(neg_name.as_str()).await.unwrap().unwrap();
    let d = locker
        .try_lock(LockKey::namespaced(-3, &neg_name))
        .await
        .unwrap()
        .unwrap();
    // A waiter for id(1).
    let waiter = tokio::spawn({
        let locker = locker.clone();
        async move { locker.lock(LockKey::id(1), Duration::from_secs(30)).await }
    });
    wait_for_waiters(&mut obs, 1, Duration::from_secs(10)).await;
    let waiter_pid = advisory_locks(&mut obs)
        .await
        .iter()
        .find(|r| !r.granted)
        .unwrap()
        .pid;

    let holders = locker.holders().await.unwrap();
    println!("{:?}", holders.iter().map(summary).collect::<Vec<_>>());
    let got: BTreeSet<_> = holders.iter().map(summary).collect();
    let expected: BTreeSet<_> = [
        (AdvisoryKey::BigInt(1), a.backend_pid(), true),
        (AdvisoryKey::BigInt(-42), b.backend_pid(), true),
        (
            AdvisoryKey::BigInt(i64::from(neg_hash)),
            c.backend_pid(),
            true,
        ),
        (AdvisoryKey::Pair(-3, neg_hash), d.backend_pid(), true),
        (AdvisoryKey::BigInt(1), waiter_pid, false),
    ]
    .into_iter()
    .collect();
    assert_eq!(
        holders.len(),
        5,
        "exactly the four held locks and one waiter"
    );
    assert_eq!(got, expected);
    assert!(
        holders[..4].iter().all(|h| h.granted),
        "granted locks come first"
    );
    assert!(!holders[4].granted);
    for h in &holders {
        assert_eq!(h.application_name.as_deref(), Some(APP), "{h:?}");
        assert_eq!(h.mode, LockMode::Exclusive);
        assert!(h.client_addr.is_some(), "TCP client address shown: {h:?}");
        let since = h.since.expect("since is known");
        assert!(
            since >= before && since <= SystemTime::now() + Duration::from_secs(1),
            "{h:?}"
        );
    }

    // Release one, the waiter gets it, holders follows.
    a.release().await.unwrap();
    let w = bounded("waiter acquires", Duration::from_secs(10), waiter)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(w.backend_pid(), waiter_pid);
    let got: BTreeSet<_> = locker
        .holders()
        .await
        .unwrap()
        .iter()
        .map(summary)
        .collect();
    let expected: BTreeSet<_> = [
        (AdvisoryKey::BigInt(1), waiter_pid, true),
        (AdvisoryKey::BigInt(-42), b.backend_pid(), true),
        (
            AdvisoryKey::BigInt(i64::from(neg_hash)),
            c.backend_pid(),
            true,
        ),
        (AdvisoryKey::Pair(-3, neg_hash), d.backend_pid(), true),
    ]
    .into_iter()
    .collect();
    assert_eq!(got, expected);

    for g in [w, b, c, d] {
        g.release().await.unwrap();
    }
    assert!(locker.holders().await.unwrap().is_empty());
    close(obs).await;
    locker.pool().close().await;
}

#[sqlx::test(migrations = false)]
async fn holders_shows_raw_sql_locks_and_shared_mode(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let locker = locker_with_app_name(pool_opts, &connect_opts).await;
    let mut obs = observer(&connect_opts).await;
    let obs_pid = backend_pid(&mut obs).await;
    assert!(raw_try_lock(&mut obs, &Raw::IntPair(i32::MIN, -1)).await);
    assert!(raw_try_lock(&mut obs, &Raw::BigInt(i64::MIN)).await);
    let holders = locker.holders().await.unwrap();
    let got: BTreeSet<_> = holders.iter().map(summary).collect();
    let expected: BTreeSet<_> = [
        (AdvisoryKey::Pair(i32::MIN, -1), obs_pid, true),
        (AdvisoryKey::BigInt(i64::MIN), obs_pid, true),
    ]
    .into_iter()
    .collect();
    assert_eq!(got, expected);
    assert!(
        holders
            .iter()
            .all(|h| h.application_name.as_deref() == Some(OBSERVER_APP))
    );
    assert!(raw_unlock(&mut obs, &Raw::IntPair(i32::MIN, -1)).await);
    assert!(raw_unlock(&mut obs, &Raw::BigInt(i64::MIN)).await);

    // Shared transaction locks show as shared, one row per holder.
    let (in_tx, in_rx) = oneshot::channel();
    let (done_tx, done_rx) = oneshot::channel::<()>();
    let other = tokio::spawn({
        let locker = locker.clone();
        async move {
            locker
                .with_shared_advisory_lock(LockKey::id(9), async |_c| {
                    in_tx.send(()).unwrap();
                    done_rx.await.unwrap();
                    Ok::<_, Error>(())
                })
                .await
        }
    });
    in_rx.await.unwrap();
    let inside = locker
        .with_shared_advisory_lock(LockKey::id(9), async |conn| {
            let me = backend_pid(conn).await;
            let hs = locker.holders_of(LockKey::id(9)).await?;
            Ok::<_, Error>((me, hs))
        })
        .await
        .unwrap()
        .unwrap();
    let (me, hs) = inside;
    assert_eq!(hs.len(), 2, "{hs:?}");
    assert!(
        hs.iter()
            .all(|h| h.mode == LockMode::Shared && h.granted && h.key == AdvisoryKey::BigInt(9))
    );
    assert!(hs.iter().any(|h| h.pid == me));
    done_tx.send(()).unwrap();
    other.await.unwrap().unwrap();
    assert!(locker.holders().await.unwrap().is_empty());
    close(obs).await;
    locker.pool().close().await;
}

#[sqlx::test(migrations = false)]
async fn holders_of_finds_text_id_and_namespaced_keys(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let locker = locker_with_app_name(pool_opts, &connect_opts).await;
    let mut obs = observer(&connect_opts).await;
    let (neg_name, neg_hash) = negative_hash_name(&mut obs).await;
    let pos_hash = hashtext(&mut obs, "holders:text").await;

    let text = locker.try_lock("holders:text").await.unwrap().unwrap();
    let neg = locker.try_lock(neg_name.as_str()).await.unwrap().unwrap();
    let id = locker
        .try_lock(LockKey::id(-7_000_000_000))
        .await
        .unwrap()
        .unwrap();
    let ns = locker
        .try_lock(LockKey::namespaced(11, "holders:text"))
        .await
        .unwrap()
        .unwrap();
    let ns_neg = locker
        .try_lock(LockKey::namespaced(-11, &neg_name))
        .await
        .unwrap()
        .unwrap();
    let hashed = locker
        .try_lock(LockKey::hashed64("holders:text"))
        .await
        .unwrap()
        .unwrap();

    let one = |hs: Vec<Holder>, what: &str| -> Holder {
        assert_eq!(hs.len(), 1, "{what}: exactly one holder, got {hs:?}");
        hs.into_iter().next().unwrap()
    };
    let h = one(locker.holders_of("holders:text").await.unwrap(), "text");
    assert_eq!(
        (h.key, h.pid, h.granted),
        (
            AdvisoryKey::BigInt(i64::from(pos_hash)),
            text.backend_pid(),
            true
        )
    );
    assert_eq!(h.application_name.as_deref(), Some(APP));

    let h = one(
        locker.holders_of(neg_name.as_str()).await.unwrap(),
        "negative text",
    );
    assert_eq!(
        (h.key, h.pid),
        (AdvisoryKey::BigInt(i64::from(neg_hash)), neg.backend_pid())
    );

    let h = one(
        locker
            .holders_of(LockKey::id(-7_000_000_000))
            .await
            .unwrap(),
        "id",
    );
    assert_eq!(
        (h.key, h.pid),
        (AdvisoryKey::BigInt(-7_000_000_000), id.backend_pid())
    );

    let h = one(
        locker
            .holders_of(LockKey::namespaced(11, "holders:text"))
            .await
            .unwrap(),
        "namespaced",
    );
    assert_eq!(
        (h.key, h.pid),
        (AdvisoryKey::Pair(11, pos_hash), ns.backend_pid())
    );

    let h = one(
        locker
            .holders_of(LockKey::namespaced(-11, &neg_name))
            .await
            .unwrap(),
        "negative namespaced",
    );
    assert_eq!(
        (h.key, h.pid),
        (AdvisoryKey::Pair(-11, neg_hash), ns_neg.backend_pid())
    );

    let k = LockKey::hashed64("holders:text").pg_bigint().unwrap();
    let h = one(
        locker
            .holders_of(LockKey::hashed64("holders:text"))
            .await
            .unwrap(),
        "hashed64",
    );
    assert_eq!(
        (h.key, h.pid),
        (AdvisoryKey::BigInt(k), hashed.backend_pid())
    );

    // Keys nobody holds: none, including the neighbours of held keys.
    for free in [
        LockKey::from("holders:nobody"),
        LockKey::id(7_000_000_000),
        LockKey::id(i64::from(pos_hash) + 1),
        LockKey::namespaced(12, "holders:text"),
        LockKey::namespaced(0, "holders:text"),
        LockKey::namespaced(11, "holders:other"),
    ] {
        assert!(
            locker.holders_of(free.clone()).await.unwrap().is_empty(),
            "{free:?} is not held"
        );
    }

    // A waiter appears in holders_of with granted = false.
    let waiter = tokio::spawn({
        let locker = locker.clone();
        async move {
            locker
                .lock(
                    LockKey::namespaced(11, "holders:text"),
                    Duration::from_secs(30),
                )
                .await
        }
    });
    wait_for_waiters(&mut obs, 1, Duration::from_secs(10)).await;
    let hs = locker
        .holders_of(LockKey::namespaced(11, "holders:text"))
        .await
        .unwrap();
    assert_eq!(hs.len(), 2, "{hs:?}");
    assert!(hs[0].granted && hs[0].pid == ns.backend_pid());
    assert!(!hs[1].granted && hs[1].pid != ns.backend_pid());
    assert_eq!(hs[1].key, AdvisoryKey::Pair(11, pos_hash));

    ns.release().await.unwrap();
    let w = bounded("waiter", Duration::from_secs(10), waiter)
        .await
        .unwrap()
        .unwrap();
    for g in [text, neg, id, ns_neg, hashed, w] {
        g.release().await.unwrap();
    }
    assert!(locker.holders().await.unwrap().is_empty());
    close(obs).await;
    locker.pool().close().await;
}

#[sqlx::test(migrations = false)]
async fn holders_ignores_other_databases(pool_opts: PgPoolOptions, connect_opts: PgConnectOptions) {
    // A lock in another database (the default one) is not ours to see.
    let locker = locker_with_app_name(pool_opts, &connect_opts).await;
    let mut elsewhere = observer(&connect_opts.clone().database("postgres")).await;
    let key = 0x5EED_0000_0000_0001_i64 ^ i64::from(std::process::id());
    assert!(raw_try_lock(&mut elsewhere, &Raw::BigInt(key)).await);
    let mine = locker.try_lock(LockKey::id(key)).await.unwrap();
    assert!(mine.is_some(), "advisory locks are per database");
    let hs = locker.holders().await.unwrap();
    assert_eq!(hs.len(), 1, "{hs:?}");
    assert_eq!(hs[0].pid, mine.as_ref().unwrap().backend_pid());
    mine.unwrap().release().await.unwrap();
    assert!(raw_unlock(&mut elsewhere, &Raw::BigInt(key)).await);
    close(elsewhere).await;
    locker.pool().close().await;
}
