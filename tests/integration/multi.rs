//! Multi-key locks (`try_lock_all`, `lock_all`): the deadline of a wait
//! that takes many busy keys, and what its timeout names.

use crate::common::*;

use std::time::{Duration, Instant};

use distlock::{Error, LockKey, PgLocker};
use sqlx::PgPool;

/// Keys each held by a session of its own.
async fn hold_outside(pool: &PgPool, keys: &[&str]) -> Vec<sqlx::PgConnection> {
    let mut held = Vec::new();
    for key in keys {
        let mut conn = observer_for(pool).await;
        assert!(raw_try_lock(&mut conn, &Raw::text(key)).await);
        held.push(conn);
    }
    held
}

/// Every key of a `lock_all` busy in turn: each is released just before the
/// wait for it would time out, so a wait that gives every key the whole
/// `lock_timeout` would take about (number of keys) × the timeout.
#[sqlx::test(migrations = false)]
async fn lock_all_returns_within_its_timeout_however_many_keys_it_waits_for(pool: PgPool) {
    let keys = ["chain:a", "chain:b", "chain:c", "chain:d"];
    let locker = PgLocker::builder(pool.clone())
        .heartbeat(Duration::from_secs(5))
        .build()
        .expect("valid settings");
    // Freed in the order the wait takes them: by the server's hash.
    let mut obs = observer_for(&pool).await;
    let mut ordered = Vec::new();
    for key in keys {
        ordered.push((hashtext(&mut obs, key).await, key));
    }
    close(obs).await;
    ordered.sort();
    let ordered: Vec<&str> = ordered.into_iter().map(|(_, k)| k).collect();
    let mut held = hold_outside(&pool, &ordered).await;
    let timeout = Duration::from_millis(1500);
    // Free one key every 1.2 s: each would be granted within a fresh
    // 1.5 s lock_timeout, but not all of them within 1.5 s.
    let freer = tokio::spawn(async move {
        for conn in held.iter_mut() {
            tokio::time::sleep(Duration::from_millis(1200)).await;
            sqlx::query("SELECT pg_advisory_unlock_all()")
                .execute(&mut *conn)
                .await
                .expect("unlock");
        }
        held
    });
    let started = Instant::now();
    let outcome = bounded(
        "lock_all",
        Duration::from_secs(20),
        locker.lock_all(keys, timeout),
    )
    .await;
    let took = started.elapsed();
    println!(
        "lock_all(4 keys, {timeout:?}) returned after {took:?}: {:?}",
        outcome.as_ref().map(|m| m.keys().len())
    );
    assert!(
        took < timeout + Duration::from_millis(700),
        "lock_all({timeout:?}) returned after {took:?} ({outcome:?})"
    );
    match outcome {
        Err(Error::Timeout { key, .. }) => {
            assert!(
                keys.contains(&key.to_string().as_str()),
                "names one of its keys: {key}"
            )
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    for conn in freer.await.expect("freer") {
        close(conn).await;
    }
}

/// A wait that times out names the key it was not granted, and that key's
/// holder, not the first key of the list.
#[sqlx::test(migrations = false)]
async fn a_lock_all_timeout_names_the_key_it_waited_for_and_its_holder(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    // "multi:b" is held elsewhere; the others are free.
    let mut holder = observer_for(&pool).await;
    let holder_pid = backend_pid(&mut holder).await;
    assert!(raw_try_lock(&mut holder, &Raw::text("multi:b")).await);
    let keys = [
        LockKey::from("multi:a"),
        LockKey::from("multi:b"),
        LockKey::id(77),
        LockKey::namespaced(3, "multi:c"),
    ];
    for timeout in [Duration::ZERO, Duration::from_millis(300)] {
        match locker.lock_all(keys.clone(), timeout).await {
            Err(Error::Timeout {
                key,
                holder_pid: pid,
                holder_application,
                ..
            }) => {
                assert_eq!(
                    key,
                    LockKey::from("multi:b"),
                    "timeout {timeout:?}: names the busy key"
                );
                assert_eq!(
                    pid,
                    Some(holder_pid),
                    "timeout {timeout:?}: names its holder"
                );
                assert_eq!(holder_application.as_deref(), Some(OBSERVER_APP));
            }
            other => panic!("timeout {timeout:?}: expected a timeout, got {other:?}"),
        }
    }
    // A busy pair key, listed last, is named as well.
    let mut other = observer_for(&pool).await;
    assert!(raw_unlock(&mut holder, &Raw::text("multi:b")).await);
    assert!(raw_try_lock(&mut other, &Raw::pair(3, "multi:c")).await);
    let other_pid = backend_pid(&mut other).await;
    match locker
        .lock_all(keys.clone(), Duration::from_millis(300))
        .await
    {
        Err(Error::Timeout {
            key,
            holder_pid: pid,
            ..
        }) => {
            assert_eq!(key, LockKey::namespaced(3, "multi:c"));
            assert_eq!(pid, Some(other_pid));
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert_no_advisory_locks_held_by_others(&mut holder, other_pid).await;
    close(holder).await;
    close(other).await;
}

/// Only `other_pid` holds an advisory lock now: nothing of the timed-out
/// waits is left.
async fn assert_no_advisory_locks_held_by_others(obs: &mut sqlx::PgConnection, other_pid: i32) {
    eventually(
        "only the outside holder holds locks",
        Duration::from_secs(3),
        async || advisory_locks(obs).await.iter().all(|l| l.pid == other_pid),
    )
    .await;
}

/// `try_lock_all` and `lock_all` count in the lock metrics like every other
/// acquisition, once per call, under the first key's label: acquired, busy,
/// timed out, released, and their wait and hold times. The prefix
/// `metricsmulti` is used by no other test in this binary.
#[cfg(feature = "metrics")]
#[sqlx::test(migrations = false)]
async fn multi_key_calls_count_in_the_lock_metrics(pool: PgPool) {
    let captured = crate::job::recorder::Captured::global();
    let pg = "backend=postgres,key=metricsmulti";
    let series = |name: &str| format!("{name}{{{pg}}}");
    let locker = PgLocker::new(pool.clone());
    let keys = ["metricsmulti:a", "metricsmulti:b"];

    let held = locker
        .try_lock_all(keys)
        .await
        .expect("try_lock_all")
        .expect("free");
    assert_eq!(captured.get(&series("distlock_acquired_total")), 1.0);
    assert!(
        locker.try_lock_all(keys).await.expect("busy").is_none(),
        "held"
    );
    assert_eq!(captured.get(&series("distlock_busy_total")), 1.0);
    let timed_out = locker.lock_all(keys, Duration::from_millis(200)).await;
    assert!(
        matches!(timed_out, Err(Error::Timeout { .. })),
        "{timed_out:?}"
    );
    assert_eq!(captured.get(&series("distlock_timeout_total")), 1.0);
    held.release().await.expect("release");
    assert_eq!(captured.get(&series("distlock_released_total")), 1.0);
    assert_eq!(captured.get(&series("distlock_hold_seconds")), 1.0);

    let waited = locker
        .lock_all(keys, Duration::from_secs(2))
        .await
        .expect("lock_all");
    assert_eq!(captured.get(&series("distlock_acquired_total")), 2.0);
    // Waits are timed for the acquired, busy-free and timed-out calls.
    assert!(captured.get(&series("distlock_wait_seconds")) >= 3.0);
    waited.release().await.expect("release");
}
