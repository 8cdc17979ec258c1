//! Transaction-scoped locks ([`XactLocker`]): held exactly for the
//! transaction, waits, rollback, a terminated backend, cancellation, bad
//! keys, a pooler.

use std::sync::atomic::{AtomicBool, Ordering};

use super::*;
use common::drop_after::drop_after;
use sqlx::PgConnection;

async fn nothing(_: &mut PgConnection) -> Result<(), Error> {
    Ok(())
}

pub(crate) async fn held_for_the_transaction(backend: &impl XactBackend) {
    let (a, b) = backend.xact();
    let (_, session) = backend.lockers();
    let k = key("xact");
    let (inside, inside_seen) = tokio::sync::oneshot::channel::<()>();
    let (checked, checked_seen) = tokio::sync::oneshot::channel::<()>();
    // The checks run beside the holder's closure, not inside it: inside,
    // the same key is a nested lock (`Error::NestedLock`).
    let holder = a.try_with_xact_lock(k.clone(), async move |conn: &mut PgConnection| {
        sqlx::query("SELECT 1").execute(&mut *conn).await?;
        let _ = inside.send(());
        let _ = checked_seen.await;
        Ok::<_, Error>(7)
    });
    let checks = async {
        inside_seen.await.expect("the holder's closure runs");
        assert!(
            b.try_with_xact_lock(k.clone(), nothing)
                .await
                .unwrap()
                .is_none(),
            "another transaction"
        );
        let err = b
            .with_xact_lock(k.clone(), Duration::from_millis(300), nothing)
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
        assert!(
            session.try_lock(k.clone()).await.unwrap().is_none(),
            "a session lock"
        );
        let _ = checked.send(());
    };
    let (ran, ()) = tokio::join!(holder, checks);
    assert_eq!(ran.unwrap(), Some(7));
    let again = b.try_with_xact_lock(k.clone(), nothing).await.unwrap();
    assert!(again.is_some(), "free after commit");
}

pub(crate) async fn waits_and_times_out(backend: &impl XactBackend) {
    let (a, b) = backend.xact();
    let k = key("xact-wait");
    let committing = AtomicBool::new(false);
    let hold = async |for_: Duration| {
        a.try_with_xact_lock(k.clone(), async |_: &mut PgConnection| {
            tokio::time::sleep(for_).await;
            // Before the commit, which is what frees the lock.
            committing.store(true, Ordering::SeqCst);
            Ok::<_, Error>(())
        })
        .await
        .unwrap()
        .expect("free key")
    };
    let wait = async || {
        tokio::time::sleep(Duration::from_millis(100)).await;
        b.with_xact_lock(
            k.clone(),
            Duration::from_secs(10),
            async |_: &mut PgConnection| {
                assert!(
                    committing.load(Ordering::SeqCst),
                    "granted before the holder committed"
                );
                Ok::<_, Error>(())
            },
        )
        .await
    };
    let ((), waited) = tokio::join!(hold(Duration::from_millis(500)), wait());
    waited.expect("handed over at commit");
    committing.store(false, Ordering::SeqCst);
    let short = async || {
        tokio::time::sleep(Duration::from_millis(100)).await;
        b.with_xact_lock(k.clone(), Duration::from_millis(300), nothing)
            .await
    };
    let ((), timed_out) = tokio::join!(hold(Duration::from_millis(1_000)), short());
    let err = timed_out.unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
}

pub(crate) async fn rollback_frees(backend: &impl XactBackend) {
    let (a, b) = backend.xact();
    let k = key("xact-rollback");
    let err = a
        .try_with_xact_lock(k.clone(), async |conn: &mut PgConnection| {
            sqlx::query("SELECT 1").execute(&mut *conn).await?;
            Err::<(), _>(Error::InvalidArgument {
                argument: "closure",
                reason: "the closure's own error".into(),
            })
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument { reason, .. } if reason == "the closure's own error"),
        "{err:?}"
    );
    assert!(
        b.try_with_xact_lock(k, nothing).await.unwrap().is_some(),
        "free after rollback"
    );
}

/// The transaction's backend is terminated while the closure runs: the
/// call fails (nothing is reported as done under the lock) and the key is
/// free.
pub(crate) async fn terminated_backend_fails_and_frees(backend: &impl XactBackend) {
    let (a, b) = backend.xact();
    let k = key("xact-terminated");
    let outcome = a
        .try_with_xact_lock(k.clone(), async |conn: &mut PgConnection| {
            backend.break_lease(&k).await;
            sqlx::query("SELECT 1").execute(&mut *conn).await?;
            Ok::<_, Error>(())
        })
        .await;
    assert!(
        outcome.is_err(),
        "work on a terminated backend reported done: {outcome:?}"
    );
    common::eventually(
        "the key is free after the termination",
        LOSS_NOTICED_WITHIN,
        async || matches!(b.try_with_xact_lock(k.clone(), nothing).await, Ok(Some(()))),
    )
    .await;
}

pub(crate) async fn dropped_at_every_await(backend: &impl XactBackend) {
    let (a, _) = backend.xact();
    let (_, b) = backend.lockers();
    let k = key("xact-every-await");
    for (what, waits) in [("try_with_xact_lock", false), ("with_xact_lock", true)] {
        for budget in budgets() {
            let work = async |conn: &mut PgConnection| {
                sqlx::query("SELECT 1").execute(&mut *conn).await?;
                Ok::<_, Error>(())
            };
            let attempt = async {
                if waits {
                    a.with_xact_lock(k.clone(), Duration::from_secs(5), work)
                        .await
                        .map(Some)
                } else {
                    a.try_with_xact_lock(k.clone(), work).await
                }
            };
            let done = drop_after(budget, attempt).await;
            let completed = done.is_some();
            // `None` is possible: the previous budget's dropped attempt may
            // have been granted after `b` last looked (its statement runs to
            // its end; what it took is let go in the background). The check
            // below still requires that it lets go.
            if let Some(done) = done {
                done.expect("run");
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

pub(crate) async fn bad_keys_are_refused(backend: &impl XactBackend) {
    let (a, _) = backend.xact();
    for bad in ["", "nul\0inside"] {
        let ran = AtomicBool::new(false);
        let err = a
            .try_with_xact_lock(LockKey::from(bad), async |_: &mut PgConnection| {
                ran.store(true, Ordering::SeqCst);
                Ok::<_, Error>(())
            })
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidKey { .. }), "{bad:?}: {err:?}");
        let err = a
            .with_xact_lock(
                LockKey::from(bad),
                Duration::from_millis(10),
                async |_: &mut PgConnection| {
                    ran.store(true, Ordering::SeqCst);
                    Ok::<_, Error>(())
                },
            )
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidKey { .. }), "{bad:?}: {err:?}");
        assert!(!ran.load(Ordering::SeqCst), "{bad:?}: the closure ran");
    }
}

/// A transaction-scoped lock needs no session, so a transaction pooler is
/// no fault for it: taken through the pooler, it keeps a client that
/// connects directly off the key. (The test pooler has one server
/// connection, so a second client through it would only queue.)
pub(crate) async fn behind_a_pooler<B: PooledBackend + XactBackend>(backend: &B) {
    let (_proxy, pooled) = backend.behind_a_pooler().await;
    let (through, _) = pooled.xact();
    let (_, direct) = backend.xact();
    let k = key("xact-pooled");
    let ran = through
        .try_with_xact_lock(k.clone(), async |conn: &mut PgConnection| {
            sqlx::query("SELECT 1").execute(&mut *conn).await?;
            let other = direct.try_with_xact_lock(k.clone(), nothing).await?;
            assert!(
                other.is_none(),
                "a direct client beside the lock taken through the pooler"
            );
            Ok::<_, Error>(())
        })
        .await
        .unwrap();
    assert!(ran.is_some(), "the free key through the pooler");
    assert!(
        direct
            .try_with_xact_lock(k, nothing)
            .await
            .unwrap()
            .is_some(),
        "free after commit"
    );
}
