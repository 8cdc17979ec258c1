//! Exclusive leases ([`Locker`]), on every backend: exclusion, hand-over
//! to a waiter, timeouts, release and drop, loss, tokens, cancellation,
//! bad keys, contention, and a transaction pooler in front.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;
use common::drop_after::drop_after;

pub(crate) async fn exclusive(backend: &impl Backend) {
    let (a, b) = backend.lockers();
    let k = key("exclusive");
    let held = a.try_lock(k.clone()).await.unwrap().expect("free key");
    assert_eq!(held.key(), &k);
    assert!(!held.is_lost());
    assert!(
        b.try_lock(k.clone()).await.unwrap().is_none(),
        "other process"
    );
    assert!(
        a.try_lock(k.clone()).await.unwrap().is_none(),
        "same locker"
    );
    // Another key is independent.
    let other = b.try_lock(key("exclusive:other")).await.unwrap();
    other.expect("another key is free").release().await.unwrap();
    held.release().await.unwrap();
}

pub(crate) async fn lock_waits_and_is_handed_the_lock(backend: &impl Backend) {
    let (a, b) = backend.lockers();
    let k = key("handoff");
    let held = a.try_lock(k.clone()).await.unwrap().expect("free key");
    let waiter = tokio::spawn({
        let (b, k) = (Arc::clone(&b), k.clone());
        async move { b.lock(k, Duration::from_secs(10)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiter.is_finished(),
        "lock() returned while the key was held"
    );
    let released = Instant::now();
    held.release().await.unwrap();
    let lease = common::bounded("the waiter gets the lock", Duration::from_secs(10), waiter)
        .await
        .unwrap()
        .expect("handed over");
    println!("hand-off after release: {:?}", released.elapsed());
    assert!(a.try_lock(k.clone()).await.unwrap().is_none());
    lease.release().await.unwrap();
}

pub(crate) async fn lock_times_out(backend: &impl Backend) {
    let (a, b) = backend.lockers();
    let k = key("timeout");
    let held = a.try_lock(k.clone()).await.unwrap().expect("free key");
    let started = Instant::now();
    let err = b
        .lock(k.clone(), Duration::from_millis(300))
        .await
        .unwrap_err();
    let took = started.elapsed();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(5),
        "{took:?}"
    );
    // A zero timeout is a single try.
    let err = b.lock(k.clone(), Duration::ZERO).await.unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    held.release().await.unwrap();
    // A huge timeout on a free key is no panic.
    let lease = b.lock(k, Duration::MAX).await.unwrap();
    lease.release().await.unwrap();
}

pub(crate) async fn release_frees(backend: &impl Backend) {
    let (a, b) = backend.lockers();
    let k = key("release");
    for _ in 0..3 {
        let held = a.try_lock(k.clone()).await.unwrap().expect("free key");
        held.release().await.unwrap();
        let next = b
            .try_lock(k.clone())
            .await
            .unwrap()
            .expect("free after release");
        next.release().await.unwrap();
    }
}

pub(crate) async fn drop_frees(backend: &impl Backend) {
    let (a, b) = backend.lockers();
    let k = key("drop");
    let held = a.try_lock(k.clone()).await.unwrap().expect("free key");
    drop(held);
    free_soon(b.as_ref(), &k, DROP_FREED_WITHIN, "after drop").await;
}

pub(crate) async fn lost_on_loss(backend: &impl Backend) {
    let (a, b) = backend.lockers();
    let k = key("lost");
    let held = a.try_lock(k.clone()).await.unwrap().expect("free key");
    backend.break_lease(&k).await;
    let started = Instant::now();
    let reason = common::bounded("lost() fires", LOSS_NOTICED_WITHIN, held.lost()).await;
    println!("loss noticed after {:?}: {reason}", started.elapsed());
    assert!(held.is_lost());
    assert!(
        held.release().await.is_err(),
        "releasing a lost lease is an error"
    );
    free_soon(b.as_ref(), &k, LOSS_NOTICED_WITHIN, "after the loss").await;
}

pub(crate) async fn tokens_increase(backend: &impl Backend) {
    let (a, b) = backend.lockers();
    let k = key("tokens");
    let mut last = None;
    for round in 0..6 {
        let locker = if round % 2 == 0 { &a } else { &b };
        let lease = locker.try_lock(k.clone()).await.unwrap().expect("free key");
        let token = lease.fencing_token();
        assert_eq!(token.is_some(), backend.tokens(), "round {round}");
        if let (Some(before), Some(now)) = (last, token) {
            assert!(now > before, "round {round}: {now:?} after {before:?}");
        }
        last = token;
        lease.release().await.unwrap();
    }
}

pub(crate) async fn cancelled_acquisitions_leave_nothing_held(backend: &impl Backend) {
    let (a, b) = backend.lockers();
    let k = key("cancel");
    // Free key: the future is dropped somewhere between start and grant.
    for micros in [0, 50, 200, 500, 1_000, 2_000, 5_000, 20_000] {
        let attempt = a.lock(k.clone(), Duration::from_secs(5));
        if let Ok(done) = tokio::time::timeout(Duration::from_micros(micros), attempt).await {
            done.unwrap().release().await.unwrap();
        }
        free_soon(
            b.as_ref(),
            &k,
            DROP_FREED_WITHIN,
            "after a cancelled lock()",
        )
        .await;
        let attempt = a.try_lock(k.clone());
        if let Ok(done) = tokio::time::timeout(Duration::from_micros(micros), attempt).await
            && let Some(lease) = done.unwrap()
        {
            lease.release().await.unwrap();
        }
        free_soon(
            b.as_ref(),
            &k,
            DROP_FREED_WITHIN,
            "after a cancelled try_lock()",
        )
        .await;
    }
    // Busy key: a waiter is dropped while it waits.
    let held = b.try_lock(k.clone()).await.unwrap().expect("free key");
    let attempt = a.lock(k.clone(), Duration::from_secs(10));
    assert!(
        tokio::time::timeout(Duration::from_millis(200), attempt)
            .await
            .is_err()
    );
    held.release().await.unwrap();
    free_soon(b.as_ref(), &k, DROP_FREED_WITHIN, "after a cancelled wait").await;
}

pub(crate) async fn bad_keys_are_refused(backend: &impl Backend) {
    let (a, _) = backend.lockers();
    for bad in ["", "nul\0inside"] {
        let err = a.try_lock(LockKey::from(bad)).await.unwrap_err();
        assert!(matches!(err, Error::InvalidKey { .. }), "{bad:?}: {err:?}");
        let err = a
            .lock(LockKey::from(bad), Duration::from_millis(10))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidKey { .. }), "{bad:?}: {err:?}");
    }
}

pub(crate) async fn contending_tasks_never_overlap(backend: &impl Backend) {
    let (a, b) = backend.lockers();
    let k = key("contention");
    let rounds = if full() { 200 } else { 10 };
    let inside = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..6 {
        let locker = if task % 2 == 0 {
            Arc::clone(&a)
        } else {
            Arc::clone(&b)
        };
        let (k, inside, overlaps) = (k.clone(), Arc::clone(&inside), Arc::clone(&overlaps));
        tasks.spawn(async move {
            for _ in 0..rounds {
                let lease = locker.lock(k.clone(), Duration::from_secs(30)).await?;
                if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                    overlaps.fetch_add(1, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                lease.release().await?;
            }
            Ok::<_, Error>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap().unwrap();
    }
    assert_eq!(overlaps.load(Ordering::SeqCst), 0, "two holders at once");
}

/// The acquisition dropped after each number of `Pending`s in turn, so at
/// every `.await` it has: nothing is left held.
pub(crate) async fn dropped_at_every_await(backend: &impl Backend) {
    let (a, b) = backend.lockers();
    let k = key("every-await");
    for (what, waits) in [("try_lock", false), ("lock", true)] {
        for budget in budgets() {
            let attempt = async {
                if waits {
                    a.lock(k.clone(), Duration::from_secs(5)).await.map(Some)
                } else {
                    a.try_lock(k.clone()).await
                }
            };
            let done = drop_after(budget, attempt).await;
            let completed = done.is_some();
            // `None` is possible: the previous budget's dropped attempt may
            // have been granted after `b` last looked (its statement runs to
            // its end; what it took is let go in the background). The check
            // below still requires that it lets go.
            if let Some(Some(held)) = done.map(|done| done.expect("acquire")) {
                held.release().await.expect("release");
            }
            free_soon(
                b.as_ref(),
                &k,
                DROP_FREED_WITHIN,
                &format!("{what} dropped after {budget} Pendings"),
            )
            .await;
            if completed {
                // The previous budgets covered every `.await` it has.
                break;
            }
            assert!(budget + 1 < MAX_AWAITS, "{what} never completed");
        }
    }
}

/// Two clients behind a transaction pooler: the second is refused, finds
/// the key busy, or one of them is told through `lost()`.
pub(crate) async fn behind_a_pooler(backend: &impl PooledBackend) {
    let (_proxy, pooled) = backend.behind_a_pooler().await;
    let (a, b) = pooled.lockers();
    let k = key("pooled");
    let held = match common::bounded(
        "A's try_lock",
        Duration::from_secs(10),
        a.try_lock(k.clone()),
    )
    .await
    {
        Ok(held) => held.expect("A takes the free key"),
        // Refusing the first client is as safe as refusing the second.
        Err(Error::PoolerDetected { .. }) => return,
        Err(other) => panic!("A's try_lock behind a pooler: {other:?}"),
    };
    for waits in [false, true] {
        let second = common::bounded("B's attempt", Duration::from_secs(10), async {
            if waits {
                b.lock(k.clone(), Duration::from_millis(300))
                    .await
                    .map(Some)
            } else {
                b.try_lock(k.clone()).await
            }
        })
        .await;
        refused_or_told(
            "exclusive behind a pooler",
            second,
            async |second: Box<dyn Lease>| {
                tokio::select! {
                    _ = held.lost() => {}
                    _ = second.lost() => {}
                }
            },
        )
        .await;
    }
    drop(held);
}
