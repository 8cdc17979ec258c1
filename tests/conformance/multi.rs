//! Multi-key locks ([`MultiKeyLocker`]): all or nothing, waits, overlapping
//! sets, loss, cancellation, bad key sets, a pooler.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;
use common::drop_after::drop_after;

fn keys(names: &[&str]) -> Vec<LockKey> {
    names
        .iter()
        .map(|name| key(&format!("multi:{name}")))
        .collect()
}

pub(crate) async fn all_or_nothing(backend: &impl MultiBackend) {
    let (a, b) = backend.multi();
    let both = keys(&["x", "y"]);
    let held = a
        .try_lock_all(both.clone())
        .await
        .unwrap()
        .expect("free keys");
    assert_eq!(held.keys(), &both[..]);
    assert!(
        b.try_lock(both[0].clone()).await.unwrap().is_none(),
        "one of the keys"
    );
    // Not re-entrant: the holder's own locker is busy like any other.
    assert!(
        a.try_lock(both[0].clone()).await.unwrap().is_none(),
        "one of the keys, same locker"
    );
    assert!(
        a.try_lock_all(both.clone()).await.unwrap().is_none(),
        "the same keys, same locker"
    );
    let overlapping = keys(&["y", "z"]);
    assert!(
        b.try_lock_all(overlapping.clone()).await.unwrap().is_none(),
        "an overlapping set"
    );
    // The busy attempt kept nothing: `z` is free.
    let z = b
        .try_lock(overlapping[1].clone())
        .await
        .unwrap()
        .expect("z was given back");
    z.release().await.unwrap();
    held.release().await.unwrap();
    let again = b
        .try_lock_all(both)
        .await
        .unwrap()
        .expect("free after release");
    again.release().await.unwrap();
}

pub(crate) async fn lock_all_waits_and_times_out(backend: &impl MultiBackend) {
    let (a, b) = backend.multi();
    let both = keys(&["wx", "wy"]);
    let y = a
        .try_lock(both[1].clone())
        .await
        .unwrap()
        .expect("free key");
    let err = b
        .lock_all(both.clone(), Duration::from_millis(300))
        .await
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    // The timed-out wait holds none of the keys.
    free_soon(a, &both[0], DROP_FREED_WITHIN, "after a timed-out lock_all").await;
    let waiter = b.lock_all(both.clone(), Duration::from_secs(10));
    tokio::pin!(waiter);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut waiter)
            .await
            .is_err(),
        "lock_all returned while a key was held"
    );
    y.release().await.unwrap();
    let held = common::bounded("the waiter gets both", Duration::from_secs(10), waiter)
        .await
        .expect("handed over");
    assert!(a.try_lock(both[0].clone()).await.unwrap().is_none());
    held.release().await.unwrap();
}

pub(crate) async fn overlapping_sets_never_deadlock<B: MultiBackend>(backend: &B) {
    let (a, b) = backend.multi();
    let rounds = if full() { 200 } else { 15 };
    let inside = AtomicUsize::new(0);
    let overlaps = AtomicUsize::new(0);
    let run = async |locker: &B::Multi, names: &[&str]| {
        for _ in 0..rounds {
            let held = locker
                .lock_all(keys(names), Duration::from_secs(20))
                .await?;
            if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                overlaps.fetch_add(1, Ordering::SeqCst);
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
            inside.fetch_sub(1, Ordering::SeqCst);
            held.release().await?;
        }
        Ok::<_, Error>(())
    };
    let (one, two) = common::bounded(
        "overlapping sets in opposite orders",
        Duration::from_secs(60),
        async { tokio::join!(run(a, &["ox", "oy"]), run(b, &["oy", "ox"])) },
    )
    .await;
    one.unwrap();
    two.unwrap();
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "two holders of one key at once"
    );
}

pub(crate) async fn lost_on_loss(backend: &impl MultiBackend) {
    let (a, b) = backend.multi();
    let both = keys(&["lx", "ly"]);
    let held = a
        .try_lock_all(both.clone())
        .await
        .unwrap()
        .expect("free keys");
    backend.break_lease(&both[0]).await;
    common::bounded("lost() fires", LOSS_NOTICED_WITHIN, held.lost()).await;
    assert!(held.is_lost());
    for k in &both {
        free_soon(b, k, LOSS_NOTICED_WITHIN, "after the loss").await;
    }
    drop(held);
}

pub(crate) async fn dropped_at_every_await(backend: &impl MultiBackend) {
    let (a, b) = backend.multi();
    let both = keys(&["dx", "dy"]);
    for (what, waits) in [("try_lock_all", false), ("lock_all", true)] {
        for budget in budgets() {
            let attempt = async {
                if waits {
                    a.lock_all(both.clone(), Duration::from_secs(5))
                        .await
                        .map(Some)
                } else {
                    a.try_lock_all(both.clone()).await
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
            for k in &both {
                free_soon(b, k, DROP_FREED_WITHIN, &what).await;
            }
            if completed {
                break;
            }
            assert!(budget + 1 < MAX_AWAITS, "{what}: never completed");
        }
    }
}

pub(crate) async fn bad_key_sets_are_refused(backend: &impl MultiBackend) {
    let (a, _) = backend.multi();
    let k = key("multi:bad");
    for bad in [
        vec![],
        vec![k.clone(), k.clone()],
        vec![k.clone(), LockKey::from("")],
        vec![LockKey::from("nul\0inside")],
    ] {
        let err = a.try_lock_all(bad.clone()).await.map(|_| ()).unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidKey { .. }
                    | Error::NoKeys
                    | Error::DuplicateKey { .. }
                    | Error::SameServerLock { .. }
            ),
            "{bad:?}: {err:?}"
        );
        let err = a
            .lock_all(bad.clone(), Duration::from_millis(10))
            .await
            .map(|_| ())
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidKey { .. }
                    | Error::NoKeys
                    | Error::DuplicateKey { .. }
                    | Error::SameServerLock { .. }
            ),
            "{bad:?}: {err:?}"
        );
    }
}

/// One key held through the pooler; a multi-key lock on it through the
/// pooler is refused, finds it busy, or one of them is told.
pub(crate) async fn behind_a_pooler<B: PooledBackend + MultiBackend>(backend: &B) {
    let (_proxy, pooled) = backend.behind_a_pooler().await;
    let (a, b) = pooled.multi();
    let both = keys(&["px", "py"]);
    let held = match a.try_lock(both[0].clone()).await {
        Ok(held) => held.expect("A takes the free key"),
        Err(Error::PoolerDetected { .. }) => return,
        Err(other) => panic!("A's try_lock behind a pooler: {other:?}"),
    };
    let second = common::bounded(
        "B's try_lock_all",
        Duration::from_secs(10),
        b.try_lock_all(both),
    )
    .await;
    refused_or_told("a multi-key lock behind a pooler", second, async |second| {
        tokio::select! {
            _ = held.lost() => {}
            _ = second.lost() => {}
        }
    })
    .await;
    drop(held);
}
