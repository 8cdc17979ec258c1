//! Upgradeable read locks: `PgLocker::try_lock_upgradeable`,
//! `lock_upgradeable`, and `UpgradeableLock`'s upgrade and downgrade, as
//! PostgreSQL sees them (`pg_locks`), under contention, cancellation and
//! backend termination, and beside a variant without the upgrade intent
//! that the same checks catch.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::drop_after::drop_after;
use common::*;
use distlock::{Error, LockKey, LossReason, PgLocker, UpgradeableLock};
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, Postgres};
use sqlx::{PgConnection, PgPool};

const WAIT: Duration = Duration::from_secs(10);

fn locker(pool: &PgPool) -> PgLocker {
    PgLocker::builder(pool.clone())
        .heartbeat(Duration::from_millis(200))
        .heartbeat_timeout(PATIENT)
        .build()
        .expect("valid settings")
}

/// A second pool of the same database: another "process".
async fn other_pool(pool: &PgPool) -> PgPool {
    PgPoolOptions::new()
        .max_connections(8)
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .expect("second pool")
}

/// The `pg_locks` rows of `pid`, as (triple, mode).
async fn locks_of(obs: &mut sqlx::PgConnection, pid: i32) -> Vec<((i64, i64, i32), String)> {
    advisory_locks(obs)
        .await
        .into_iter()
        .filter(|row| row.pid == pid && row.granted)
        .map(|row| (row.triple(), row.mode))
        .collect()
}

#[sqlx::test(migrations = false)]
async fn readers_share_with_one_upgradeable_holder_and_writers_wait(pool: PgPool) {
    let a = locker(&pool);
    let b = locker(&other_pool(&pool).await);
    let mut obs = observer_for(&pool).await;
    let name = "upgradeable:basic";
    let upgradeable = a
        .try_lock_upgradeable(name)
        .await
        .unwrap()
        .expect("free key");
    assert_eq!(upgradeable.key(), &LockKey::from(name));
    assert!(!upgradeable.is_upgraded());
    assert!(upgradeable.fencing_token().is_none());
    assert!(!upgradeable.is_lost());

    // On the server: the key shared, and its intent exclusively in the
    // reserved namespace, keyed by the key's own hashtext.
    let hash = hashtext(&mut obs, name).await;
    let mut held = locks_of(&mut obs, upgradeable.backend_pid()).await;
    held.sort();
    let mut expected = vec![
        (bigint_triple(i64::from(hash)), "ShareLock".to_owned()),
        (
            pair_triple(UpgradeableLock::INTENT_NAMESPACE, hash),
            "ExclusiveLock".to_owned(),
        ),
    ];
    expected.sort();
    assert_eq!(held, expected);

    let r1 = b.try_lock_shared(name).await.unwrap().expect("a reader");
    let r2 = a.try_lock_shared(name).await.unwrap().expect("another");
    assert!(
        b.try_lock_upgradeable(name).await.unwrap().is_none(),
        "a second upgradeable holder"
    );
    assert!(b.try_lock(name).await.unwrap().is_none(), "a writer");
    let err = b
        .lock(name, Duration::from_millis(200))
        .await
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    r1.release().await.unwrap();
    r2.release().await.unwrap();
    assert!(b.try_lock(name).await.unwrap().is_none(), "a writer");
    upgradeable.release().await.unwrap();
    assert!(
        advisory_locks(&mut obs).await.is_empty(),
        "release frees the key and its intent"
    );
    b.try_lock(name)
        .await
        .unwrap()
        .expect("free")
        .release()
        .await
        .unwrap();
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn a_second_upgradeable_holder_waits_for_the_first(pool: PgPool) {
    let a = locker(&pool);
    let b = locker(&other_pool(&pool).await);
    let k = "upgradeable:second";
    let first = a.lock_upgradeable(k, WAIT).await.unwrap();
    let err = b
        .lock_upgradeable(k, Duration::from_millis(300))
        .await
        .map(|_| ())
        .unwrap_err();
    match err {
        Error::Timeout { holder_pid, .. } => {
            assert_eq!(holder_pid, Some(first.backend_pid()), "names the holder")
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    let waiter = tokio::spawn({
        let b = b.clone();
        async move { b.lock_upgradeable(k, WAIT).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "two upgradeable holders at once");
    // A reader gets in beside both, the holder and the waiter.
    let reader = b.try_lock_shared(k).await.unwrap().expect("a reader");
    first.release().await.unwrap();
    let second = bounded("handed over", WAIT, waiter).await.unwrap().unwrap();
    reader.release().await.unwrap();
    second.release().await.unwrap();
}

/// Two sessions, the one with the lower pid first: the order in which a
/// lookup of the key's holders lists them.
async fn two_sessions_lower_pid_first(pool: &PgPool) -> ((PgConnection, i32), (PgConnection, i32)) {
    let (mut one, mut two) = (observer_for(pool).await, observer_for(pool).await);
    let (a, b) = (backend_pid(&mut one).await, backend_pid(&mut two).await);
    if a < b {
        ((one, a), (two, b))
    } else {
        ((two, b), (one, a))
    }
}

/// A timed-out `lock_upgradeable` names whom it waited for: the key's
/// upgradeable holder (the holder of its intent), not a plain reader beside
/// it, whose read it would have shared; with the intent free, the writer.
/// The reader has the lower pid, so it is the first of the key's holders.
#[sqlx::test(migrations = false)]
async fn a_timed_out_upgradeable_wait_names_the_intents_holder_not_a_reader(pool: PgPool) {
    let b = locker(&pool);
    let k = "upgradeable:named";
    let ((mut reader, reader_pid), (mut holder, holder_pid)) =
        two_sessions_lower_pid_first(&pool).await;
    sqlx::query("SELECT pg_advisory_lock_shared(hashtext($1)::int8)")
        .bind(k)
        .execute(&mut reader)
        .await
        .unwrap();
    // An upgradeable holder as the library takes it: the intent, then the
    // key shared.
    sqlx::query(
        "SELECT pg_advisory_lock($2, hashtext($1)), pg_advisory_lock_shared(hashtext($1)::int8)",
    )
    .bind(k)
    .bind(UpgradeableLock::INTENT_NAMESPACE)
    .execute(&mut holder)
    .await
    .unwrap();
    for timeout in [Duration::ZERO, Duration::from_millis(300)] {
        match b.lock_upgradeable(k, timeout).await.map(|_| ()) {
            Err(Error::Timeout {
                holder_pid: named, ..
            }) => assert_eq!(
                named,
                Some(holder_pid),
                "names the intent's holder, not the reader {reader_pid} (timeout {timeout:?})"
            ),
            other => panic!("expected a timeout, got {other:?}"),
        }
    }
    // The intent free, a writer holds the key: the wait was for the writer.
    close(holder).await;
    sqlx::query("SELECT pg_advisory_unlock_shared(hashtext($1)::int8), pg_advisory_lock(hashtext($1)::int8)")
        .bind(k)
        .execute(&mut reader)
        .await
        .unwrap();
    match b
        .lock_upgradeable(k, Duration::from_millis(300))
        .await
        .map(|_| ())
    {
        Err(Error::Timeout {
            holder_pid: named, ..
        }) => assert_eq!(named, Some(reader_pid)),
        other => panic!("expected a timeout, got {other:?}"),
    }
    close(reader).await;
}

#[sqlx::test(migrations = false)]
async fn upgrade_waits_for_readers_and_queues_new_readers_behind_it(pool: PgPool) {
    let a = locker(&pool);
    let b = locker(&other_pool(&pool).await);
    let mut obs = observer_for(&pool).await;
    let k = "upgradeable:upgrade";
    let mut upgradeable = a.lock_upgradeable(k, WAIT).await.unwrap();
    let reader = b.lock_shared(k, WAIT).await.unwrap();
    let upgrading = tokio::spawn(async move {
        upgradeable.upgrade(WAIT).await?;
        Ok::<_, Error>(upgradeable)
    });
    wait_for_waiters(&mut obs, 1, WAIT).await;
    assert!(!upgrading.is_finished(), "upgraded beside a reader");
    // A reader that comes now queues behind the upgrade.
    assert!(
        b.try_lock_shared(k).await.unwrap().is_none(),
        "a new reader"
    );
    let err = b
        .lock_shared(k, Duration::from_millis(200))
        .await
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    reader.release().await.unwrap();
    let mut upgraded = bounded("the upgrade", WAIT, upgrading)
        .await
        .unwrap()
        .unwrap();
    assert!(upgraded.is_upgraded());
    assert!(!upgraded.is_lost());
    assert!(b.try_lock_shared(k).await.unwrap().is_none(), "a reader");
    assert!(b.try_lock(k).await.unwrap().is_none(), "a writer");
    assert!(upgraded.upgrade(WAIT).await.is_ok(), "upgrading twice");
    let exclusive = locks_of(&mut obs, upgraded.backend_pid())
        .await
        .into_iter()
        .filter(|(_, mode)| mode == "ExclusiveLock")
        .count();
    assert_eq!(exclusive, 2, "the intent and the key, each once");

    upgraded.downgrade().await.unwrap();
    assert!(!upgraded.is_upgraded());
    let reader = b
        .try_lock_shared(k)
        .await
        .unwrap()
        .expect("readers in after the downgrade");
    assert!(b.try_lock(k).await.unwrap().is_none(), "a writer");
    upgraded.downgrade().await.unwrap();
    reader.release().await.unwrap();
    upgraded.release().await.unwrap();
    assert!(advisory_locks(&mut obs).await.is_empty());
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn a_timed_out_upgrade_keeps_the_read_and_names_a_reader(pool: PgPool) {
    let a = locker(&pool);
    let b = locker(&other_pool(&pool).await);
    let mut obs = observer_for(&pool).await;
    let k = "upgradeable:timeout";
    let mut upgradeable = a.try_lock_upgradeable(k).await.unwrap().expect("free");
    let reader = b.try_lock_shared(k).await.unwrap().expect("a reader");
    assert!(!upgradeable.try_upgrade().await.unwrap(), "beside a reader");
    for timeout in [Duration::ZERO, Duration::from_millis(300)] {
        let err = upgradeable.upgrade(timeout).await.unwrap_err();
        match err {
            Error::Timeout { holder_pid, .. } => {
                assert_eq!(holder_pid, Some(reader.backend_pid()), "names the reader")
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
    }
    // Still a read lock, and nothing more on the server.
    assert!(!upgradeable.is_upgraded());
    assert!(!upgradeable.is_lost());
    let modes: Vec<String> = locks_of(&mut obs, upgradeable.backend_pid())
        .await
        .into_iter()
        .map(|(_, mode)| mode)
        .collect();
    assert_eq!(modes.len(), 2, "{modes:?}");
    assert_eq!(modes.iter().filter(|m| *m == "ShareLock").count(), 1);
    let second = b
        .try_lock_shared(k)
        .await
        .unwrap()
        .expect("readers still in");
    assert!(b.try_lock(k).await.unwrap().is_none(), "a writer");
    second.release().await.unwrap();
    reader.release().await.unwrap();
    assert!(upgradeable.try_upgrade().await.unwrap(), "alone now");
    upgradeable.release().await.unwrap();
    assert!(advisory_locks(&mut obs).await.is_empty());
    close(obs).await;
}

/// PostgreSQL grants a waiting request of a session that holds a
/// conflicting lock ahead of the waiters that wait for that lock: a writer
/// queued behind the upgradeable holder's read does not block its upgrade
/// (a try would be refused while the writer waits), and waits on until the
/// upgraded holder lets go.
#[sqlx::test(migrations = false)]
async fn an_upgrade_overtakes_a_writer_queued_behind_its_read(pool: PgPool) {
    let a = locker(&pool);
    let b = locker(&other_pool(&pool).await);
    let mut obs = observer_for(&pool).await;
    let k = "upgradeable:queued-writer";
    for with_reader in [false, true] {
        let mut upgradeable = a.lock_upgradeable(k, WAIT).await.unwrap();
        let reader = match with_reader {
            true => Some(b.lock_shared(k, WAIT).await.unwrap()),
            false => None,
        };
        let writer = tokio::spawn({
            let b = b.clone();
            async move { b.lock(k, WAIT).await }
        });
        wait_for_waiters(&mut obs, 1, WAIT).await;
        if let Some(reader) = reader {
            // The upgrade waits for the reader, ahead of the writer.
            assert!(!upgradeable.try_upgrade().await.unwrap(), "beside a reader");
            let upgrading = tokio::spawn(async move {
                upgradeable.upgrade(WAIT).await?;
                Ok::<_, Error>(upgradeable)
            });
            wait_for_waiters(&mut obs, 2, WAIT).await;
            reader.release().await.unwrap();
            upgradeable = bounded("the upgrade", WAIT, upgrading)
                .await
                .unwrap()
                .unwrap();
        } else {
            assert!(
                upgradeable.try_upgrade().await.unwrap(),
                "ahead of the writer"
            );
        }
        assert!(upgradeable.is_upgraded());
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !writer.is_finished(),
            "the writer beside the upgraded holder"
        );
        upgradeable.release().await.unwrap();
        let w = bounded("the writer's turn", WAIT, writer)
            .await
            .unwrap()
            .unwrap();
        w.release().await.unwrap();
    }
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn each_upgrade_draws_a_fresh_token(pool: PgPool) {
    distlock::migrate(&pool).await.unwrap();
    let a = PgLocker::builder(pool.clone())
        .fencing(true)
        .build()
        .unwrap();
    let k = "upgradeable:tokens";
    let mut upgradeable = a.lock_upgradeable(k, WAIT).await.unwrap();
    assert!(upgradeable.fencing_token().is_none(), "the read has none");
    let mut last = None;
    for _ in 0..3 {
        assert!(upgradeable.try_upgrade().await.unwrap());
        let token = upgradeable.fencing_token().expect("an upgrade's token");
        assert!(Some(token) > last, "{token:?} after {last:?}");
        last = Some(token);
        upgradeable.downgrade().await.unwrap();
        assert!(
            upgradeable.fencing_token().is_none(),
            "none after the downgrade"
        );
    }
    upgradeable.upgrade(WAIT).await.unwrap();
    let upgraded = upgradeable.fencing_token();
    assert!(upgraded > last);
    upgradeable.release().await.unwrap();
    let plain = a.lock(k, WAIT).await.unwrap();
    assert!(
        plain.fencing_token() > upgraded,
        "later writers get greater tokens"
    );
    plain.release().await.unwrap();
}

#[sqlx::test(migrations = false)]
async fn a_terminated_backend_is_reported_lost(pool: PgPool) {
    let a = locker(&pool);
    let b = locker(&other_pool(&pool).await);
    let mut obs = observer_for(&pool).await;
    let k = "upgradeable:terminated";

    // Held, read or upgraded: the heartbeat reports it.
    for upgraded in [false, true] {
        let mut upgradeable = a.lock_upgradeable(k, WAIT).await.unwrap();
        if upgraded {
            upgradeable.upgrade(WAIT).await.unwrap();
        }
        terminate(&mut obs, upgradeable.backend_pid()).await;
        let reason = bounded("lost()", WAIT, upgradeable.lost()).await;
        assert!(
            matches!(reason, LossReason::ConnectionFailed(_)),
            "{reason:?}"
        );
        assert!(upgradeable.is_lost());
        let err = upgradeable.upgrade(WAIT).await.unwrap_err();
        assert!(matches!(err, Error::LockLost { .. }), "{err:?}");
        assert!(upgradeable.release().await.is_err());
        b.try_lock(k)
            .await
            .unwrap()
            .expect("freed")
            .release()
            .await
            .unwrap();
    }

    // Terminated while its upgrade waits: the upgrade says so.
    let mut upgradeable = a.lock_upgradeable(k, WAIT).await.unwrap();
    let reader = b.lock_shared(k, WAIT).await.unwrap();
    let pid = upgradeable.backend_pid();
    let upgrading = tokio::spawn(async move {
        let outcome = upgradeable.upgrade(WAIT).await;
        (outcome, upgradeable)
    });
    wait_for_waiters(&mut obs, 1, WAIT).await;
    terminate(&mut obs, pid).await;
    let (outcome, upgradeable) = bounded("the upgrade ends", WAIT, upgrading).await.unwrap();
    assert!(
        matches!(outcome, Err(Error::LockLost { .. })),
        "{outcome:?}"
    );
    let reason = bounded("lost()", WAIT, upgradeable.lost()).await;
    assert!(
        matches!(reason, LossReason::ConnectionFailed(_)),
        "{reason:?}"
    );
    reader.release().await.unwrap();
    assert_no_advisory_locks_eventually(&mut obs, WAIT).await;
    close(obs).await;
}

/// Ends the session `pid` from another thread, blocking this one (and so
/// every task of a current-thread runtime): no keeper runs meanwhile. Waits
/// a moment more for the server's goodbye to reach the lock's socket.
fn terminate_blocking(connect: &PgConnectOptions, pid: i32) {
    let connect = connect.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut obs = observer(&connect).await;
            terminate(&mut obs, pid).await;
            close(obs).await;
        });
    })
    .join()
    .unwrap();
    std::thread::sleep(Duration::from_millis(50));
}

/// A downgrade that finds the connection broken closes it and reports the
/// lock lost; the guard must say so at once, before its keeper has run (on
/// a current-thread runtime it runs only once the caller yields): an
/// `upgrade()` right after must not answer `Ok` from the guard's "already
/// upgraded" shortcut.
#[sqlx::test(migrations = false)]
async fn a_broken_downgrade_is_a_loss_the_guard_reports_at_once(pool: PgPool) {
    let a = locker(&pool);
    let mut obs = observer_for(&pool).await;
    let mut lock = a
        .try_lock_upgradeable("upgradeable:broken-downgrade")
        .await
        .unwrap()
        .expect("free");
    // The keeper runs (and watches the connection) from 10 ms on.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(lock.try_upgrade().await.unwrap());
    terminate_blocking(pool.connect_options().as_ref(), lock.backend_pid());
    let err = lock.downgrade().await.unwrap_err();
    assert!(matches!(err, Error::LockLost { .. }), "{err:?}");
    assert!(lock.is_lost(), "downgrade said lost, is_lost() did not");
    assert!(lock.loss().is_some());
    let err = lock.upgrade(WAIT).await.unwrap_err();
    assert!(matches!(err, Error::LockLost { .. }), "{err:?}");
    assert_no_advisory_locks_eventually(&mut obs, WAIT).await;
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn acquisitions_dropped_at_every_await_leave_nothing_held(pool: PgPool) {
    let a = locker(&pool);
    let b = locker(&other_pool(&pool).await);
    let mut obs = observer_for(&pool).await;
    let k = "upgradeable:dropped-acquisition";
    for waits in [false, true] {
        for budget in 0..200 {
            let attempt = async {
                if waits {
                    a.lock_upgradeable(k, Duration::from_secs(5))
                        .await
                        .map(Some)
                } else {
                    a.try_lock_upgradeable(k).await
                }
            };
            match drop_after(budget, attempt).await {
                Some(done) => {
                    done.unwrap().expect("free key").release().await.unwrap();
                    assert_no_advisory_locks_eventually(&mut obs, WAIT).await;
                    break;
                }
                None => {
                    assert_no_advisory_locks_eventually(&mut obs, WAIT).await;
                    // A statement the dropped attempt had written may still
                    // reach the server after that check (its connection is
                    // closed, so whatever it takes ends with its session):
                    // a lock left held would keep B out for good.
                    eventually("nothing left held", WAIT, async || {
                        match b.try_lock_upgradeable(k).await.unwrap() {
                            Some(other) => {
                                other.release().await.unwrap();
                                true
                            }
                            None => false,
                        }
                    })
                    .await;
                }
            }
        }
    }
    close(obs).await;
}

/// An upgrade or downgrade dropped midway gives up the whole lock, and says
/// so: nothing stays held on the server that no guard owns, and the pool
/// keeps working.
#[sqlx::test(migrations = false)]
async fn upgrades_and_downgrades_dropped_at_every_await_give_up_the_lock(pool: PgPool) {
    let a = locker(&pool);
    let b = locker(&other_pool(&pool).await);
    let mut obs = observer_for(&pool).await;
    let k = "upgradeable:dropped-upgrade";
    for (what, with_reader) in [("upgrade", false), ("upgrade", true), ("downgrade", false)] {
        for budget in 0..200 {
            let mut upgradeable = a.lock_upgradeable(k, WAIT).await.unwrap();
            let pid = upgradeable.backend_pid();
            let reader = match with_reader {
                true => Some(b.lock_shared(k, WAIT).await.unwrap()),
                false => None,
            };
            if what == "downgrade" {
                upgradeable.upgrade(WAIT).await.unwrap();
            }
            // With a reader, the upgrade waits until the reader leaves.
            let release_reader = reader.map(|reader| {
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    reader.release().await.unwrap();
                })
            });
            let done = {
                let change = async {
                    match what {
                        "upgrade" => upgradeable.upgrade(WAIT).await,
                        _ => upgradeable.downgrade().await,
                    }
                };
                drop_after(budget, change).await
            };
            if let Some(handle) = release_reader {
                handle.await.unwrap();
            }
            let what = format!("{what} (reader: {with_reader}) dropped after {budget} Pendings");
            match done {
                Some(outcome) => {
                    outcome.unwrap();
                    assert_eq!(upgradeable.is_upgraded(), what.starts_with("upgrade"));
                    upgradeable.release().await.unwrap();
                    assert_no_advisory_locks_eventually(&mut obs, WAIT).await;
                    break;
                }
                None => {
                    let reason = bounded(&what, WAIT, upgradeable.lost()).await;
                    assert_eq!(reason, LossReason::Interrupted, "{what}");
                    assert!(upgradeable.release().await.is_err(), "{what}");
                    eventually(&what, WAIT, async || {
                        locks_of(&mut obs, pid).await.is_empty()
                    })
                    .await;
                    assert_no_advisory_locks_eventually(&mut obs, WAIT).await;
                }
            }
            assert!(budget < 199, "{what}: never completed");
        }
    }
    // The pool handed out no connection left mid-statement.
    for _ in 0..10 {
        let mut upgradeable = a.lock_upgradeable(k, WAIT).await.unwrap();
        upgradeable.upgrade(WAIT).await.unwrap();
        upgradeable.release().await.unwrap();
    }
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn the_intent_namespace_is_refused_in_keys(pool: PgPool) {
    let a = locker(&pool);
    let intent = LockKey::namespaced(UpgradeableLock::INTENT_NAMESPACE, "x");
    let err = a.try_lock(intent.clone()).await.map(|_| ()).unwrap_err();
    assert!(matches!(err, Error::InvalidKey { .. }), "{err:?}");
    let err = a
        .try_lock_upgradeable(intent.clone())
        .await
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(err, Error::InvalidKey { .. }), "{err:?}");
    for bad in ["", "nul\0inside"] {
        let err = a
            .lock_upgradeable(bad, Duration::from_millis(10))
            .await
            .map(|_| ())
            .unwrap_err();
        assert!(matches!(err, Error::InvalidKey { .. }), "{bad:?}: {err:?}");
    }
    // Other key forms have their intents too, apart from each other.
    let forms = [
        LockKey::id(i64::MAX),
        LockKey::id(7),
        LockKey::namespaced(3, "x"),
        LockKey::hashed64("x"),
        LockKey::from("x"),
    ];
    let mut held = Vec::new();
    for key in forms {
        let mut upgradeable = a
            .try_lock_upgradeable(key.clone())
            .await
            .unwrap()
            .expect("free");
        assert!(upgradeable.try_upgrade().await.unwrap(), "{key:?}");
        held.push(upgradeable);
    }
    for upgradeable in held {
        upgradeable.release().await.unwrap();
    }
}

#[sqlx::test(migrations = false)]
async fn a_session_statement_timeout_cuts_neither_the_upgrade_nor_the_read(pool: PgPool) {
    let options = (*pool.connect_options())
        .clone()
        .options([("statement_timeout", "500ms")]);
    let limited = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .unwrap();
    let a = locker(&limited);
    let b = locker(&other_pool(&pool).await);
    let mut obs = observer_for(&pool).await;
    let k = "upgradeable:statement-timeout";
    let mut upgradeable = a.lock_upgradeable(k, WAIT).await.unwrap();
    let reader = b.lock_shared(k, WAIT).await.unwrap();
    // Times out after the session's limit, in its own aborted transaction
    // block: rolled back, the read kept.
    let err = upgradeable
        .upgrade(Duration::from_millis(800))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!(!upgradeable.is_upgraded());
    assert!(!upgradeable.is_lost());
    assert!(
        !upgradeable.try_upgrade().await.unwrap(),
        "beside the reader"
    );
    let leaves = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1000)).await;
        reader.release().await.unwrap();
    });
    upgradeable.upgrade(WAIT).await.unwrap();
    leaves.await.unwrap();
    upgradeable.downgrade().await.unwrap();
    let reader = b.try_lock_shared(k).await.unwrap().expect("a reader again");
    reader.release().await.unwrap();
    upgradeable.release().await.unwrap();
    assert!(advisory_locks(&mut obs).await.is_empty());
    close(obs).await;
}

// ---- Contention, and a variant without the intent ------------------------

/// Who is inside the key's critical sections, and what was seen wrong.
#[derive(Debug, Default)]
struct Sections {
    readers: AtomicUsize,
    writers: AtomicUsize,
    upgradeable: AtomicUsize,
    violations: AtomicUsize,
    errors: AtomicUsize,
    upgrades: AtomicUsize,
    writes: AtomicUsize,
}

impl Sections {
    fn check(&self, ok: bool) {
        if !ok {
            self.violations.fetch_add(1, Ordering::SeqCst);
        }
    }
    fn enter_read(&self) {
        self.readers.fetch_add(1, Ordering::SeqCst);
        self.check(self.writers.load(Ordering::SeqCst) == 0);
    }
    fn exit_read(&self) {
        self.readers.fetch_sub(1, Ordering::SeqCst);
    }
    fn enter_write(&self) {
        let before = self.writers.fetch_add(1, Ordering::SeqCst);
        self.check(before == 0 && self.readers.load(Ordering::SeqCst) == 0);
    }
    fn exit_write(&self) {
        self.writers.fetch_sub(1, Ordering::SeqCst);
    }
    fn enter_upgradeable(&self) {
        let before = self.upgradeable.fetch_add(1, Ordering::SeqCst);
        self.check(before == 0);
        self.enter_read();
    }
    fn exit_upgradeable(&self) {
        self.exit_read();
        self.upgradeable.fetch_sub(1, Ordering::SeqCst);
    }
}

/// An upgradeable lock as the library gives it, or hand-made without the
/// upgrade intent (the key shared, upgraded on the same session): the
/// broken variant the contention test must catch.
enum Upgradeable {
    Real(UpgradeableLock),
    NoIntent(PoolConnection<Postgres>),
}

const KEY: &str = "upgradeable:contention";

impl Upgradeable {
    async fn take(broken: bool, locker: &PgLocker) -> Result<Self, Error> {
        if !broken {
            return Ok(Self::Real(locker.lock_upgradeable(KEY, WAIT).await?));
        }
        let mut conn = locker.pool().acquire().await?;
        sqlx::query("SET lock_timeout = '10s'")
            .execute(&mut *conn)
            .await?;
        sqlx::query("SELECT pg_advisory_lock_shared(hashtext($1))")
            .bind(KEY)
            .execute(&mut *conn)
            .await?;
        Ok(Self::NoIntent(conn))
    }

    async fn upgrade(&mut self) -> Result<(), Error> {
        match self {
            Self::Real(lock) => lock.upgrade(WAIT).await,
            Self::NoIntent(conn) => {
                sqlx::query("SELECT pg_advisory_lock(hashtext($1))")
                    .bind(KEY)
                    .execute(&mut **conn)
                    .await?;
                Ok(())
            }
        }
    }

    async fn downgrade(&mut self) -> Result<(), Error> {
        match self {
            Self::Real(lock) => lock.downgrade().await,
            Self::NoIntent(conn) => {
                sqlx::query("SELECT pg_advisory_unlock(hashtext($1))")
                    .bind(KEY)
                    .execute(&mut **conn)
                    .await?;
                Ok(())
            }
        }
    }

    async fn release(self) -> Result<(), Error> {
        match self {
            Self::Real(lock) => lock.release().await,
            Self::NoIntent(mut conn) => {
                sqlx::query("SELECT pg_advisory_unlock_all()")
                    .execute(&mut *conn)
                    .await?;
                Ok(())
            }
        }
    }
}

const UPGRADERS: usize = 6;
const READERS: usize = 3;
const WRITERS: usize = 2;
const ROUNDS: usize = 15;

/// Upgraders (each round: read, then upgrade and write, then maybe
/// downgrade and read again), plain readers and plain writers on one key.
async fn contention(connect: PgConnectOptions, broken: bool) -> Arc<Sections> {
    let pool = PgPoolOptions::new()
        .max_connections((UPGRADERS + READERS + WRITERS + 2) as u32)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(connect)
        .await
        .expect("pool");
    let locker = locker(&pool);
    let s = Arc::new(Sections::default());
    let pause =
        |t: usize, round: usize| Duration::from_micros(((t * 7 + round * 13) % 5) as u64 * 300);
    let mut tasks = Vec::new();
    for t in 0..UPGRADERS {
        let (locker, s) = (locker.clone(), Arc::clone(&s));
        tasks.push(tokio::spawn(async move {
            for round in 0..ROUNDS {
                let outcome = async {
                    let mut lock = Upgradeable::take(broken, &locker).await?;
                    s.enter_upgradeable();
                    tokio::time::sleep(pause(t, round)).await;
                    s.exit_read();
                    lock.upgrade().await?;
                    s.enter_write();
                    s.upgrades.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(pause(t, round)).await;
                    s.exit_write();
                    s.enter_read();
                    if round % 2 == 0 {
                        lock.downgrade().await?;
                        tokio::time::sleep(pause(t, round)).await;
                    }
                    s.exit_upgradeable();
                    lock.release().await
                }
                .await;
                if outcome.is_err() {
                    // A deadlock or a timeout: the section is left open,
                    // which later checks see too.
                    s.errors.fetch_add(1, Ordering::SeqCst);
                    return;
                }
            }
        }));
    }
    for t in 0..READERS {
        let (locker, s) = (locker.clone(), Arc::clone(&s));
        tasks.push(tokio::spawn(async move {
            for round in 0..ROUNDS * 2 {
                let Ok(lock) = locker.lock_shared(KEY, WAIT).await else {
                    s.errors.fetch_add(1, Ordering::SeqCst);
                    return;
                };
                s.enter_read();
                tokio::time::sleep(pause(t, round)).await;
                s.exit_read();
                lock.release().await.unwrap();
            }
        }));
    }
    for t in 0..WRITERS {
        let (locker, s) = (locker.clone(), Arc::clone(&s));
        tasks.push(tokio::spawn(async move {
            for round in 0..ROUNDS {
                let Ok(lock) = locker.lock(KEY, WAIT).await else {
                    s.errors.fetch_add(1, Ordering::SeqCst);
                    return;
                };
                s.enter_write();
                s.writes.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(pause(t, round)).await;
                s.exit_write();
                lock.release().await.unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
    pool.close().await;
    s
}

/// Runs [`contention`] on a multi-threaded runtime of its own, bounded.
async fn contended(connect: PgConnectOptions, broken: bool) -> Arc<Sections> {
    tokio::task::spawn_blocking(move || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(async {
                bounded(
                    "the contention",
                    Duration::from_secs(120),
                    contention(connect, broken),
                )
                .await
            })
    })
    .await
    .expect("contention")
}

#[sqlx::test(migrations = false)]
async fn upgraders_readers_and_writers_never_overlap_nor_deadlock(
    _pool_opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let s = contended(connect, false).await;
    println!("{s:?}");
    assert_eq!(
        s.errors.load(Ordering::SeqCst),
        0,
        "a deadlock or a timeout"
    );
    assert_eq!(
        s.violations.load(Ordering::SeqCst),
        0,
        "overlapping sections"
    );
    assert_eq!(s.upgrades.load(Ordering::SeqCst), UPGRADERS * ROUNDS);
    assert_eq!(s.writes.load(Ordering::SeqCst), WRITERS * ROUNDS);
}

/// The control: without the intent, two upgradeable holders read at once
/// and their upgrades deadlock (PostgreSQL breaks the cycle by failing one
/// with SQLSTATE 40P01), and the same counters say so.
#[sqlx::test(migrations = false)]
async fn without_the_intent_the_same_checks_fail(
    _pool_opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let s = contended(connect, true).await;
    println!("{s:?}");
    assert!(
        s.errors.load(Ordering::SeqCst) > 0 || s.violations.load(Ordering::SeqCst) > 0,
        "the checks missed a broken upgradeable lock: {s:?}"
    );
}

/// A lock granted in the instant its wait fails stays held by the session
/// (session locks outlive the statement's error). Forced here: with the
/// fencing counters blocked, the upgrade is granted and then its token's
/// draw times out under the same `lock_timeout`. The timed-out upgrade
/// must give the exclusive lock back, or readers would stay locked out
/// behind a read lock.
#[sqlx::test(migrations = false)]
async fn an_upgrade_granted_as_it_timed_out_is_given_back(pool: PgPool) {
    distlock::migrate(&pool).await.unwrap();
    let a = PgLocker::builder(pool.clone())
        .fencing(true)
        .build()
        .unwrap();
    let b = locker(&other_pool(&pool).await);
    let mut obs = observer_for(&pool).await;
    let k = "upgradeable:granted-at-timeout";
    let mut upgradeable = a.lock_upgradeable(k, WAIT).await.unwrap();
    let blocker = block_fencing_counters(&pool).await;
    for patience in [None, Some(Duration::from_millis(300))] {
        let outcome = match patience {
            None => upgradeable.try_upgrade().await.map(|upgraded| {
                assert!(!upgraded, "upgraded without a token");
            }),
            Some(timeout) => upgradeable.upgrade(timeout).await,
        };
        match patience {
            None => outcome.unwrap(),
            Some(_) => assert!(matches!(outcome, Err(Error::Timeout { .. })), "{outcome:?}"),
        }
        assert!(!upgradeable.is_upgraded());
        assert!(!upgradeable.is_lost());
        let exclusive: Vec<_> = locks_of(&mut obs, upgradeable.backend_pid())
            .await
            .into_iter()
            .filter(|(triple, mode)| mode == "ExclusiveLock" && triple.2 == 1)
            .collect();
        assert!(
            exclusive.is_empty(),
            "still held exclusively: {exclusive:?}"
        );
        let reader = b.try_lock_shared(k).await.unwrap().expect("readers in");
        reader.release().await.unwrap();
    }
    unblock_fencing_counters(blocker).await;
    assert!(upgradeable.try_upgrade().await.unwrap());
    assert!(upgradeable.fencing_token().is_some());
    upgradeable.release().await.unwrap();
    close(obs).await;
}

/// A reader that asks for the upgradeable lock while still reading, during
/// an upgrade that waits for its read: each waits for the other, on
/// sessions PostgreSQL sees as unrelated (the request takes a connection of
/// its own), so no server deadlock check can end it. The upgrade's timeout
/// does, and keeps the read; the request is granted once the upgradeable
/// holder lets go.
#[sqlx::test(migrations = false)]
async fn a_reader_asking_to_upgrade_during_an_upgrade_waits_for_its_timeout(pool: PgPool) {
    let a = locker(&pool);
    let b = locker(&other_pool(&pool).await);
    let mut obs = observer_for(&pool).await;
    let k = "upgradeable:reader-cycle";
    let mut upgradeable = a.lock_upgradeable(k, WAIT).await.unwrap();
    let reader = b.lock_shared(k, WAIT).await.unwrap();
    let upgrading = tokio::spawn(async move {
        let outcome = upgradeable.upgrade(Duration::from_secs(2)).await;
        (outcome, upgradeable)
    });
    wait_for_waiters(&mut obs, 1, WAIT).await;
    let asking = tokio::spawn({
        let b = b.clone();
        async move { b.lock_upgradeable(k, WAIT).await }
    });
    wait_for_waiters(&mut obs, 2, WAIT).await;
    let (upgrade, upgradeable) = bounded("the upgrade", WAIT, upgrading).await.unwrap();
    assert!(matches!(upgrade, Err(Error::Timeout { .. })), "{upgrade:?}");
    assert!(!upgradeable.is_upgraded());
    assert!(!upgradeable.is_lost());
    assert!(!asking.is_finished(), "the intent beside its holder");
    upgradeable.release().await.unwrap();
    let second = bounded("the reader's request", WAIT, asking).await.unwrap();
    second.unwrap().release().await.unwrap();
    reader.release().await.unwrap();
    close(obs).await;
}

/// A keeper dropped with its runtime while an upgrade on another runtime
/// holds the lock's connection cannot close it (it never blocks for the
/// slot): the guard reads `KeeperStopped`, so the upgrade must not answer
/// `Ok` for a lock nobody keeps, and must close the connection it holds,
/// freeing the key, rather than put it back unwatched until the guard drops.
#[sqlx::test(migrations = false)]
async fn an_upgrade_that_outlives_its_keepers_runtime_gives_the_lock_up(
    _opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let k = "upgradeable:keeper-gone";
    // The lock's connection is opened on this runtime, whose reactor then
    // serves its socket: only the keeper lives on the runtime that goes.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(1)
        .connect_with(connect.clone())
        .await
        .unwrap();
    // This runtime must not block meanwhile: it serves the socket.
    let (to_main, from_thread) = tokio::sync::oneshot::channel();
    let (to_thread, from_main) = std::sync::mpsc::channel::<()>();
    let thread = std::thread::spawn({
        let pool = pool.clone();
        move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            let lock = rt.block_on(async {
                let lock = PgLocker::builder(pool)
                    .heartbeat(Duration::from_millis(50))
                    .build()
                    .expect("valid settings")
                    .lock_upgradeable(k, WAIT)
                    .await
                    .unwrap();
                // Past the first heartbeat: the keeper runs on this runtime.
                tokio::time::sleep(Duration::from_millis(200)).await;
                lock
            });
            to_main.send(lock).expect("the test waits");
            from_main.recv().unwrap();
            drop(rt);
        }
    });
    let mut upgradeable = from_thread.await.unwrap();
    let b = locker(&other_pool(&PgPoolOptions::new().connect_lazy_with(connect.clone())).await);
    let reader = b.lock_shared(k, WAIT).await.unwrap();
    let mut obs = observer(&connect).await;
    let upgrading = tokio::spawn(async move {
        let upgraded = upgradeable.upgrade(WAIT).await;
        (upgraded, upgradeable)
    });
    wait_for_waiters(&mut obs, 1, WAIT).await;
    // The keeper's runtime shuts down while the upgrade holds the slot.
    to_thread.send(()).unwrap();
    tokio::task::spawn_blocking(move || thread.join().unwrap())
        .await
        .unwrap();
    reader.release().await.unwrap();
    let (upgraded, upgradeable) = bounded("the upgrade", WAIT, upgrading).await.unwrap();
    assert!(upgradeable.is_lost(), "the keeper stopped");
    match upgraded {
        Err(Error::LockLost { reason, .. }) => assert_eq!(reason, LossReason::KeeperStopped),
        other => panic!("the upgrade of a lock nobody keeps answered {other:?}"),
    }
    eventually(
        "the server frees the key",
        Duration::from_secs(5),
        async || raw_can_take(&mut obs, &Raw::text(k)).await,
    )
    .await;
    drop(upgradeable);
    close(obs).await;
}
