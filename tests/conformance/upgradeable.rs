//! Upgradeable read leases ([`UpgradeableLocker`]): one upgradeable holder
//! beside readers, upgrades that wait for readers and shut new ones out,
//! downgrades, upgraders that never deadlock, tokens, loss, cancellation,
//! bad keys, a pooler.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;
use common::drop_after::drop_after;

pub(crate) async fn readers_beside_one_upgrader(backend: &impl UpgradeableBackend) {
    let (a, b) = backend.upgradeable();
    let (ra, rb) = backend.shared();
    let k = key("upgradeable");
    let mut first = a
        .try_lock_upgradeable(k.clone())
        .await
        .unwrap()
        .expect("free key");
    assert_eq!(first.key(), &k);
    assert!(!first.is_upgraded());
    assert!(first.fencing_token().is_none(), "a read has no token");
    let reader = rb
        .try_lock_shared(k.clone())
        .await
        .unwrap()
        .expect("a reader beside it");
    assert!(
        b.try_lock_upgradeable(k.clone()).await.unwrap().is_none(),
        "a second upgradeable holder"
    );
    let err = b
        .lock_upgradeable(k.clone(), Duration::from_millis(300))
        .await
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!(
        ra.try_lock(k.clone()).await.unwrap().is_none(),
        "a writer beside it"
    );
    assert!(!first.try_upgrade().await.unwrap(), "beside a reader");
    reader.release().await.unwrap();
    assert!(first.try_upgrade().await.unwrap(), "alone");
    assert!(
        rb.try_lock_shared(k.clone()).await.unwrap().is_none(),
        "a reader beside the upgraded holder"
    );
    first.release().await.unwrap();
    let second = b
        .try_lock_upgradeable(k.clone())
        .await
        .unwrap()
        .expect("free after release");
    second.release().await.unwrap();
}

pub(crate) async fn upgrade_waits_for_readers_and_downgrade_lets_them_in(
    backend: &impl UpgradeableBackend,
) {
    let (a, _) = backend.upgradeable();
    let (_, rb) = backend.shared();
    let k = key("upgradeable-wait");
    let mut held = a
        .lock_upgradeable(k.clone(), Duration::from_secs(5))
        .await
        .unwrap();
    let reader = rb
        .lock_shared(k.clone(), Duration::from_secs(5))
        .await
        .unwrap();
    let err = held.upgrade(Duration::from_millis(300)).await.unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!(!held.is_upgraded() && !held.is_lost(), "still a read");
    let upgrading = tokio::spawn(async move {
        held.upgrade(Duration::from_secs(10)).await?;
        Ok::<_, Error>(held)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!upgrading.is_finished(), "upgraded beside a reader");
    assert!(
        rb.try_lock_shared(k.clone()).await.unwrap().is_none(),
        "a new reader beside a waiting upgrade"
    );
    reader.release().await.unwrap();
    let mut held = common::bounded("the upgrade", Duration::from_secs(10), upgrading)
        .await
        .unwrap()
        .unwrap();
    assert!(held.is_upgraded());
    assert!(rb.try_lock_shared(k.clone()).await.unwrap().is_none());
    held.downgrade().await.unwrap();
    assert!(!held.is_upgraded());
    let reader = rb
        .try_lock_shared(k.clone())
        .await
        .unwrap()
        .expect("readers in after the downgrade");
    reader.release().await.unwrap();
    held.release().await.unwrap();
}

/// Upgraders, readers and writers on one key: at most one upgradeable
/// holder, no reader beside a writer, no two writers, and every upgrade
/// granted (none deadlocks).
pub(crate) async fn upgraders_never_deadlock(backend: &impl UpgradeableBackend) {
    let (a, b) = backend.upgradeable();
    let (ra, rb) = backend.shared();
    let k = key("upgraders");
    let rounds = if full() { 100 } else { 8 };
    let counts = Arc::new(Counts::default());
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..4 {
        let locker = if task % 2 == 0 {
            Arc::clone(&a)
        } else {
            Arc::clone(&b)
        };
        let (k, counts) = (k.clone(), Arc::clone(&counts));
        tasks.spawn(async move {
            for round in 0..rounds {
                let mut held = locker
                    .lock_upgradeable(k.clone(), Duration::from_secs(30))
                    .await?;
                counts.enter(&counts.upgradeable, 1);
                counts.enter(&counts.readers, usize::MAX);
                tokio::time::sleep(Duration::from_millis(1)).await;
                counts.readers.fetch_sub(1, Ordering::SeqCst);
                held.upgrade(Duration::from_secs(30)).await?;
                counts.enter(&counts.writers, 1);
                tokio::time::sleep(Duration::from_millis(1)).await;
                counts.writers.fetch_sub(1, Ordering::SeqCst);
                if round % 2 == 0 {
                    held.downgrade().await?;
                }
                counts.upgradeable.fetch_sub(1, Ordering::SeqCst);
                held.release().await?;
            }
            Ok::<_, Error>(())
        });
    }
    for task in 0..2 {
        let locker = if task == 0 {
            Arc::clone(&ra)
        } else {
            Arc::clone(&rb)
        };
        let (k, counts) = (k.clone(), Arc::clone(&counts));
        tasks.spawn(async move {
            for round in 0..rounds * 2 {
                let lease = if round % 4 == 0 {
                    let lease = locker.lock(k.clone(), Duration::from_secs(30)).await?;
                    counts.enter(&counts.writers, 1);
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    counts.writers.fetch_sub(1, Ordering::SeqCst);
                    lease
                } else {
                    let lease = locker
                        .lock_shared(k.clone(), Duration::from_secs(30))
                        .await?;
                    counts.enter(&counts.readers, usize::MAX);
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    counts.readers.fetch_sub(1, Ordering::SeqCst);
                    lease
                };
                lease.release().await?;
            }
            Ok::<_, Error>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap().expect("no deadlock, no timeout");
    }
    assert_eq!(
        counts.violations.load(Ordering::SeqCst),
        0,
        "overlapping holders"
    );
}

/// Who holds the key now, in the contention case.
#[derive(Debug, Default)]
struct Counts {
    upgradeable: AtomicUsize,
    readers: AtomicUsize,
    writers: AtomicUsize,
    violations: AtomicUsize,
}

impl Counts {
    /// Counts one holder into `of`, which allows `most` at once; a writer
    /// allows no one else, a reader no writer.
    fn enter(&self, of: &AtomicUsize, most: usize) {
        let before = of.fetch_add(1, Ordering::SeqCst);
        let writer = std::ptr::eq(of, &self.writers);
        let reader = std::ptr::eq(of, &self.readers);
        let clash = (writer && self.readers.load(Ordering::SeqCst) > 0)
            || (reader && self.writers.load(Ordering::SeqCst) > 0);
        if before >= most || clash {
            self.violations.fetch_add(1, Ordering::SeqCst);
        }
    }
}

pub(crate) async fn upgrades_draw_fresh_tokens(backend: &impl UpgradeableBackend) {
    let (a, _) = backend.upgradeable();
    let (writers, _) = backend.lockers();
    let k = key("upgradeable-tokens");
    let mut held = a
        .lock_upgradeable(k.clone(), Duration::from_secs(5))
        .await
        .unwrap();
    let mut last = None;
    for _ in 0..3 {
        held.upgrade(Duration::from_secs(5)).await.unwrap();
        let token = held.fencing_token();
        assert_eq!(token.is_some(), backend.tokens(), "{token:?}");
        if backend.tokens() {
            assert!(token > last, "{token:?} after {last:?}");
        }
        last = token;
        held.downgrade().await.unwrap();
        assert!(held.fencing_token().is_none(), "a read has no token");
    }
    held.release().await.unwrap();
    let writer = writers.lock(k, Duration::from_secs(5)).await.unwrap();
    if backend.tokens() {
        assert!(writer.fencing_token() > last, "a later writer's token");
    }
    writer.release().await.unwrap();
}

pub(crate) async fn lost_on_loss(backend: &impl UpgradeableBackend) {
    let (a, b) = backend.upgradeable();
    let k = key("upgradeable-lost");
    for upgraded in [false, true] {
        let mut held = a
            .lock_upgradeable(k.clone(), Duration::from_secs(5))
            .await
            .unwrap();
        if upgraded {
            held.upgrade(Duration::from_secs(5)).await.unwrap();
        }
        backend.break_lease(&k).await;
        common::bounded("lost() fires", LOSS_NOTICED_WITHIN, held.lost()).await;
        assert!(held.is_lost());
        let err = held.upgrade(Duration::from_secs(1)).await.unwrap_err();
        assert!(matches!(err, Error::LockLost { .. }), "{err:?}");
        assert!(held.release().await.is_err(), "releasing a lost lease");
        let again = common::bounded(
            "the key is free after the loss",
            LOSS_NOTICED_WITHIN,
            b.lock_upgradeable(k.clone(), LOSS_NOTICED_WITHIN),
        )
        .await
        .expect("free");
        again.release().await.unwrap();
    }
}

/// Acquisitions, upgrades and downgrades dropped after each number of
/// `Pending`s in turn: nothing is left held that no guard owns, and a
/// dropped upgrade or downgrade says it gave the lock up.
pub(crate) async fn dropped_at_every_await(backend: &impl UpgradeableBackend) {
    let (a, b) = backend.upgradeable();
    let k = key("upgradeable-every-await");
    for (what, waits) in [("try_lock_upgradeable", false), ("lock_upgradeable", true)] {
        for budget in budgets() {
            let attempt = async {
                if waits {
                    a.lock_upgradeable(k.clone(), Duration::from_secs(5))
                        .await
                        .map(Some)
                } else {
                    a.try_lock_upgradeable(k.clone()).await
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
            upgradeable_free_soon(b.as_ref(), &k, &what).await;
            if completed {
                break;
            }
            assert!(budget + 1 < MAX_AWAITS, "{what}: never completed");
        }
    }
    for what in ["upgrade", "downgrade"] {
        for budget in budgets() {
            let mut held = a
                .lock_upgradeable(k.clone(), Duration::from_secs(5))
                .await
                .unwrap();
            if what == "downgrade" {
                held.upgrade(Duration::from_secs(5)).await.unwrap();
            }
            let done = {
                let change = async {
                    if what == "upgrade" {
                        held.upgrade(Duration::from_secs(5)).await
                    } else {
                        held.downgrade().await
                    }
                };
                drop_after(budget, change).await
            };
            let what = format!("{what} dropped after {budget} Pendings");
            let completed = done.is_some();
            match done {
                Some(done) => {
                    done.expect(&what);
                    held.release().await.expect("release");
                }
                None => {
                    let reason = common::bounded(&what, LOSS_NOTICED_WITHIN, held.lost()).await;
                    assert_eq!(reason, LossReason::Interrupted, "{what}");
                }
            }
            upgradeable_free_soon(b.as_ref(), &k, &what).await;
            if completed {
                break;
            }
            assert!(budget + 1 < MAX_AWAITS, "{what}: never completed");
        }
    }
}

/// Waits until `locker` can take `key` upgradeable and upgrade it (and
/// lets it go), or panics with `what`.
async fn upgradeable_free_soon<L: UpgradeableLocker<Guard: UpgradeGuard>>(
    locker: &L,
    key: &LockKey,
    what: &str,
) {
    let started = Instant::now();
    loop {
        if let Some(mut held) = locker.try_lock_upgradeable(key.clone()).await.expect(what) {
            let upgraded = held.try_upgrade().await.expect(what);
            held.release().await.expect(what);
            if upgraded {
                return;
            }
        }
        assert!(
            started.elapsed() < DROP_FREED_WITHIN,
            "{what}: {key} still held after {DROP_FREED_WITHIN:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub(crate) async fn bad_keys_are_refused(backend: &impl UpgradeableBackend) {
    let (a, _) = backend.upgradeable();
    let intent = LockKey::namespaced(distlock::UpgradeableLock::INTENT_NAMESPACE, "x");
    for bad in [LockKey::from(""), LockKey::from("nul\0inside"), intent] {
        let err = a
            .try_lock_upgradeable(bad.clone())
            .await
            .map(|_| ())
            .unwrap_err();
        assert!(matches!(err, Error::InvalidKey { .. }), "{bad:?}: {err:?}");
        let err = a
            .lock_upgradeable(bad.clone(), Duration::from_millis(10))
            .await
            .map(|_| ())
            .unwrap_err();
        assert!(matches!(err, Error::InvalidKey { .. }), "{bad:?}: {err:?}");
    }
}

/// An upgradeable holder through the pooler; a second one, or a writer,
/// through it is refused, finds the key busy, or one of them is told; an
/// upgrade through it takes nothing on a session the pooler moved it to.
pub(crate) async fn behind_a_pooler<B: PooledBackend + UpgradeableBackend>(backend: &B) {
    let (_proxy, pooled) = backend.behind_a_pooler().await;
    let (a, b) = pooled.upgradeable();
    let (_, writers) = pooled.lockers();
    let k = key("upgradeable-pooled");
    let attempt = common::bounded("A's attempt", Duration::from_secs(10), async {
        a.try_lock_upgradeable(k.clone()).await
    })
    .await;
    let mut held = match attempt {
        Ok(held) => held.expect("A takes the free key"),
        Err(Error::PoolerDetected { .. }) => return,
        Err(other) => panic!("A's try_lock_upgradeable behind a pooler: {other:?}"),
    };
    let second = common::bounded("B's attempt", Duration::from_secs(10), async {
        b.try_lock_upgradeable(k.clone()).await
    })
    .await;
    refused_or_told(
        "a second upgradeable holder behind a pooler",
        second,
        async |second: <B::Upgradeable as UpgradeableLocker>::Guard| {
            tokio::select! {
                _ = held.lost() => {}
                _ = second.lost() => {}
            }
        },
    )
    .await;
    let upgraded =
        common::bounded("A's upgrade", Duration::from_secs(10), held.try_upgrade()).await;
    match upgraded {
        Ok(true) => {
            let writer = common::bounded("B's writer", Duration::from_secs(10), async {
                writers.try_lock(k.clone()).await
            })
            .await;
            refused_or_told(
                "a writer beside an upgraded holder behind a pooler",
                writer,
                async |writer: Box<dyn Lease>| {
                    tokio::select! {
                        _ = held.lost() => {}
                        _ = writer.lost() => {}
                    }
                },
            )
            .await;
        }
        Ok(false) | Err(Error::LockLost { .. } | Error::PoolerDetected { .. }) => {}
        Err(other) => panic!("A's upgrade behind a pooler: {other:?}"),
    }
    drop(held);
}
