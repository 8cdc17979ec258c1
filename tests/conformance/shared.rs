//! Shared leases ([`SharedLocker`]): readers beside readers, never beside a
//! writer; waits, release, drop, loss, cancellation, bad keys, a pooler.

use super::*;
use common::drop_after::drop_after;

pub(crate) async fn readers_share_writers_exclude(backend: &impl SharedBackend) {
    let (a, b) = backend.shared();
    let k = key("shared");
    let r1 = a
        .try_lock_shared(k.clone())
        .await
        .unwrap()
        .expect("free key");
    let r2 = b
        .try_lock_shared(k.clone())
        .await
        .unwrap()
        .expect("readers share");
    assert_eq!(r1.key(), &k);
    assert!(r1.fencing_token().is_none(), "a shared lease has no token");
    assert!(
        b.try_lock(k.clone()).await.unwrap().is_none(),
        "a writer beside readers"
    );
    assert!(
        a.try_lock(k.clone()).await.unwrap().is_none(),
        "a writer beside its own reader"
    );
    r1.release().await.unwrap();
    assert!(
        b.try_lock(k.clone()).await.unwrap().is_none(),
        "a writer beside one reader"
    );
    r2.release().await.unwrap();
    let w = a
        .try_lock(k.clone())
        .await
        .unwrap()
        .expect("free after the readers");
    assert!(
        b.try_lock_shared(k.clone()).await.unwrap().is_none(),
        "a reader beside a writer"
    );
    let err = b
        .lock_shared(k.clone(), Duration::from_millis(300))
        .await
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!(
        a.try_lock_shared(k.clone()).await.unwrap().is_none(),
        "the writer's own reader"
    );
    w.release().await.unwrap();
}

pub(crate) async fn lock_shared_waits_for_the_writer(backend: &impl SharedBackend) {
    let (a, b) = backend.shared();
    let k = key("shared-wait");
    let w = a.try_lock(k.clone()).await.unwrap().expect("free key");
    let waiter = tokio::spawn({
        let (b, k) = (Arc::clone(&b), k.clone());
        async move { b.lock_shared(k, Duration::from_secs(10)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiter.is_finished(),
        "lock_shared returned beside a writer"
    );
    w.release().await.unwrap();
    let r = common::bounded("the reader gets the lock", Duration::from_secs(10), waiter)
        .await
        .unwrap()
        .expect("handed over");
    let r2 = a
        .lock_shared(k.clone(), Duration::ZERO)
        .await
        .expect("a second reader");
    r.release().await.unwrap();
    r2.release().await.unwrap();
}

pub(crate) async fn release_and_drop_free(backend: &impl SharedBackend) {
    let (a, b) = backend.shared();
    let k = key("shared-free");
    let r = a
        .try_lock_shared(k.clone())
        .await
        .unwrap()
        .expect("free key");
    r.release().await.unwrap();
    let w = b
        .try_lock(k.clone())
        .await
        .unwrap()
        .expect("free after release");
    w.release().await.unwrap();
    let r = a
        .try_lock_shared(k.clone())
        .await
        .unwrap()
        .expect("free key");
    drop(r);
    free_soon(b.as_ref(), &k, DROP_FREED_WITHIN, "after dropping a reader").await;
}

pub(crate) async fn lost_on_loss(backend: &impl SharedBackend) {
    let (a, b) = backend.shared();
    let k = key("shared-lost");
    let r = a
        .try_lock_shared(k.clone())
        .await
        .unwrap()
        .expect("free key");
    backend.break_lease(&k).await;
    common::bounded("lost() fires", LOSS_NOTICED_WITHIN, r.lost()).await;
    assert!(r.is_lost());
    assert!(
        r.release().await.is_err(),
        "releasing a lost lease is an error"
    );
    free_soon(b.as_ref(), &k, LOSS_NOTICED_WITHIN, "after the loss").await;
}

pub(crate) async fn dropped_at_every_await(backend: &impl SharedBackend) {
    let (a, b) = backend.shared();
    let k = key("shared-every-await");
    for (what, waits) in [("try_lock_shared", false), ("lock_shared", true)] {
        for budget in budgets() {
            let attempt = async {
                if waits {
                    a.lock_shared(k.clone(), Duration::from_secs(5))
                        .await
                        .map(Some)
                } else {
                    a.try_lock_shared(k.clone()).await
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
            let what = format!("{what} dropped after {budget} Pendings");
            free_soon(b.as_ref(), &k, DROP_FREED_WITHIN, &what).await;
            if completed {
                break;
            }
            assert!(budget + 1 < MAX_AWAITS, "{what}: never completed");
        }
    }
}

pub(crate) async fn bad_keys_are_refused(backend: &impl SharedBackend) {
    let (a, _) = backend.shared();
    for bad in ["", "nul\0inside"] {
        let err = a
            .try_lock_shared(LockKey::from(bad))
            .await
            .map(|_| ())
            .unwrap_err();
        assert!(matches!(err, Error::InvalidKey { .. }), "{bad:?}: {err:?}");
        let err = a
            .lock_shared(LockKey::from(bad), Duration::from_millis(10))
            .await
            .map(|_| ())
            .unwrap_err();
        assert!(matches!(err, Error::InvalidKey { .. }), "{bad:?}: {err:?}");
    }
}

/// A writer through the pooler; a reader through it is refused, finds the
/// key busy, or one of them is told.
pub(crate) async fn behind_a_pooler<B: PooledBackend + SharedBackend>(backend: &B) {
    let (_proxy, pooled) = backend.behind_a_pooler().await;
    let (a, b) = pooled.shared();
    let k = key("shared-pooled");
    let held = match a.try_lock(k.clone()).await {
        Ok(held) => held.expect("A takes the free key"),
        Err(Error::PoolerDetected { .. }) => return,
        Err(other) => panic!("A's try_lock behind a pooler: {other:?}"),
    };
    for waits in [false, true] {
        let second = common::bounded("B's attempt", Duration::from_secs(10), async {
            if waits {
                b.lock_shared(k.clone(), Duration::from_millis(300))
                    .await
                    .map(Some)
            } else {
                b.try_lock_shared(k.clone()).await
            }
        })
        .await;
        refused_or_told(
            "a reader beside a writer behind a pooler",
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
