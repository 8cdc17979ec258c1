//! [`distlock::Semaphore`] over every backend: the bound, waits,
//! contention, a lost permit, cancellation, bad names, a pooler.
//!
//! Written against `try_acquire` / `acquire` returning the backend's lease;
//! the permit's own type changes only this file.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;
use common::drop_after::drop_after;
use distlock::Semaphore;

const PERMITS: u32 = 2;

fn semaphores(backend: &impl Backend, name: &str, permits: u32) -> (Semaphore, Semaphore) {
    backend.semaphores(&format!("conformance:{name}"), permits)
}

/// Waits until every permit of `sem` can be taken at once (and lets them go).
async fn all_free_soon(sem: &Semaphore, within: Duration, what: &str) {
    let started = Instant::now();
    loop {
        let mut held = Vec::new();
        while let Some(permit) = sem.try_acquire().await.expect("try_acquire") {
            held.push(permit);
        }
        let all = held.len() == sem.permits() as usize;
        assert!(
            held.len() <= sem.permits() as usize,
            "{what}: more permits than {}",
            sem.permits()
        );
        for permit in held {
            permit.release().await.expect("release");
        }
        if all {
            return;
        }
        assert!(
            started.elapsed() < within,
            "{what}: a permit still held after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub(crate) async fn bounded_by_permits(backend: &impl Backend) {
    let (a, b) = semaphores(backend, "sem", PERMITS);
    let p1 = a.try_acquire().await.unwrap().expect("a free permit");
    let p2 = b
        .try_acquire()
        .await
        .unwrap()
        .expect("a second free permit");
    assert_ne!(p1.key(), p2.key(), "two permits on one slot");
    assert!(a.try_acquire().await.unwrap().is_none(), "a third permit");
    assert!(
        b.try_acquire().await.unwrap().is_none(),
        "a third permit elsewhere"
    );
    let err = b
        .acquire(Duration::from_millis(300))
        .await
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!(
        a.try_acquire().await.unwrap().is_none(),
        "a third permit after the wait"
    );
    p1.release().await.unwrap();
    let p3 = b.try_acquire().await.unwrap().expect("the released permit");
    p2.release().await.unwrap();
    p3.release().await.unwrap();
}

pub(crate) async fn acquire_waits_and_times_out(backend: &impl Backend) {
    let (a, b) = semaphores(backend, "sem-wait", PERMITS);
    let p1 = a.try_acquire().await.unwrap().expect("free");
    let p2 = a.try_acquire().await.unwrap().expect("free");
    let waiter = tokio::spawn({
        let b = b.clone();
        async move { b.acquire(Duration::from_secs(10)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiter.is_finished(),
        "acquire returned while every permit was held"
    );
    p1.release().await.unwrap();
    let p3 = common::bounded(
        "the waiter gets the permit",
        Duration::from_secs(10),
        waiter,
    )
    .await
    .unwrap()
    .expect("handed over");
    assert!(a.try_acquire().await.unwrap().is_none());
    p2.release().await.unwrap();
    p3.release().await.unwrap();
}

pub(crate) async fn contending_tasks_stay_within_permits(backend: &impl Backend) {
    let (a, b) = semaphores(backend, "sem-contention", PERMITS);
    let rounds = if full() { 100 } else { 8 };
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..5 {
        let sem = if task % 2 == 0 { a.clone() } else { b.clone() };
        let (inside, most) = (Arc::clone(&inside), Arc::clone(&most));
        tasks.spawn(async move {
            for _ in 0..rounds {
                let permit = sem.acquire(Duration::from_secs(30)).await?;
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(3)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                permit.release().await?;
            }
            Ok::<_, Error>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap().unwrap();
    }
    let most = most.load(Ordering::SeqCst);
    assert!(
        most <= PERMITS as usize,
        "{most} holders of {PERMITS} permits"
    );
}

pub(crate) async fn lost_permit_is_freed(backend: &impl Backend) {
    let (a, b) = semaphores(backend, "sem-lost", PERMITS);
    let permit = a.try_acquire().await.unwrap().expect("free");
    backend.break_lease(permit.key()).await;
    common::bounded(
        "the permit's lost() fires",
        LOSS_NOTICED_WITHIN,
        permit.lost(),
    )
    .await;
    assert!(permit.is_lost());
    all_free_soon(&b, LOSS_NOTICED_WITHIN, "after the loss").await;
    drop(permit);
}

pub(crate) async fn dropped_at_every_await(backend: &impl Backend) {
    let (a, b) = semaphores(backend, "sem-every-await", 1);
    for (what, waits) in [("try_acquire", false), ("acquire", true)] {
        for budget in budgets() {
            let attempt = async {
                if waits {
                    a.acquire(Duration::from_secs(5)).await.map(Some)
                } else {
                    a.try_acquire().await
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
            all_free_soon(&b, DROP_FREED_WITHIN, &what).await;
            if completed {
                break;
            }
            assert!(budget + 1 < MAX_AWAITS, "{what}: never completed");
        }
    }
    // A waiter dropped while every permit is held takes none when one frees.
    let held = b.try_acquire().await.unwrap().expect("free");
    let attempt = a.acquire(Duration::from_secs(10));
    assert!(
        tokio::time::timeout(Duration::from_millis(300), attempt)
            .await
            .is_err()
    );
    held.release().await.unwrap();
    all_free_soon(&b, DROP_FREED_WITHIN, "after a dropped wait").await;
}

/// Bad names, no permits and too many permits are refused when the
/// semaphore is built.
pub(crate) async fn bad_names_and_permit_counts_are_refused(backend: &impl Backend) {
    let (a, _) = backend.lockers();
    // Refused when the semaphore is built, before any acquisition.
    for bad in ["", "nul\0inside"] {
        let err = Semaphore::new(Arc::clone(&a), bad, PERMITS)
            .map(|_| ())
            .unwrap_err();
        assert!(matches!(err, Error::InvalidKey { .. }), "{bad:?}: {err:?}");
    }
    // Too many: refused before anything is built (`u32::MAX` slot names
    // would not fit in memory).
    for permits in [0, Semaphore::MAX_PERMITS + 1, u32::MAX] {
        let err = Semaphore::new(Arc::clone(&a), "conformance:permits", permits)
            .map(|_| ())
            .unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument { .. }),
            "{permits}: {err:?}"
        );
    }
    let most = Semaphore::new(a, "conformance:permits", Semaphore::MAX_PERMITS)
        .expect("the most permits a semaphore may have");
    assert_eq!(most.permits(), Semaphore::MAX_PERMITS);
}

/// One permit, taken through the pooler; a second through it is refused,
/// finds none free, or one of the two is told.
pub(crate) async fn behind_a_pooler(backend: &impl PooledBackend) {
    let (_proxy, pooled) = backend.behind_a_pooler().await;
    let (a, b) = semaphores(&pooled, "sem-pooled", 1);
    let held = match a.try_acquire().await {
        Ok(held) => held.expect("A takes the free permit"),
        Err(Error::PoolerDetected { .. }) => return,
        Err(other) => panic!("A's try_acquire behind a pooler: {other:?}"),
    };
    let second = common::bounded("B's try_acquire", Duration::from_secs(10), b.try_acquire()).await;
    refused_or_told(
        "a second permit behind a pooler",
        second,
        async |second: distlock::SemaphorePermit| {
            tokio::select! {
                _ = held.lost() => {}
                _ = second.lost() => {}
            }
        },
    )
    .await;
    drop(held);
}
