//! Transaction-scoped locks: `with_advisory_lock` and its wait and shared
//! variants.
// `f(&mut *tx)` is the documented way to pass a transaction's connection.
#![allow(clippy::explicit_auto_deref)]

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;
use distlock::{Error, PgLocker};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::sync::oneshot;

/// A caller's own error type, as the contract allows.
#[derive(Debug)]
enum AppError {
    Lock(Error),
    Db(sqlx::Error),
    Business { code: u32, detail: String },
}

impl From<Error> for AppError {
    fn from(e: Error) -> Self {
        AppError::Lock(e)
    }
}

impl From<sqlx::Error> for AppError {
    fn from(e: sqlx::Error) -> Self {
        AppError::Db(e)
    }
}

#[sqlx::test(migrations = false)]
async fn concurrent_with_advisory_lock_one_runs_other_gets_none_at_once(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    let (entered_tx, entered_rx) = oneshot::channel::<i32>();
    let (finish_tx, finish_rx) = oneshot::channel::<()>();
    let first = tokio::spawn({
        let locker = locker.clone();
        async move {
            locker
                .with_advisory_lock("xact:one", async |conn| {
                    let pid = backend_pid(conn).await;
                    entered_tx.send(pid).unwrap();
                    finish_rx.await.unwrap();
                    Ok::<_, Error>("first ran")
                })
                .await
        }
    });
    let holder_pid = bounded(
        "first enters its closure",
        Duration::from_secs(10),
        entered_rx,
    )
    .await
    .unwrap();

    // The second attempt answers at once, while the first is inside its closure.
    let second_ran = AtomicBool::new(false);
    let started = Instant::now();
    let second = locker
        .with_advisory_lock("xact:one", async |_conn| {
            second_ran.store(true, Ordering::SeqCst);
            Ok::<_, Error>("second ran")
        })
        .await
        .expect("contention is not an error");
    let took = started.elapsed();
    println!("contended with_advisory_lock answered in {took:?}");
    assert!(second.is_none(), "second caller must get Ok(None)");
    assert!(
        !second_ran.load(Ordering::SeqCst),
        "second closure must not run"
    );
    assert!(
        took < Duration::from_secs(2),
        "Ok(None) must come at once, took {took:?}"
    );
    // The first really is still holding it (as a transaction lock).
    let rows = advisory_locks(&mut obs).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].pid, holder_pid);

    finish_tx.send(()).unwrap();
    let out = bounded("first finishes", Duration::from_secs(10), first)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(out, Some("first ran"));
    // Released at commit: free immediately after the call returned.
    assert!(
        advisory_locks(&mut obs).await.is_empty(),
        "lock must be free after commit"
    );
    assert!(raw_can_take(&mut obs, &Raw::text("xact:one")).await);
    let again = locker
        .with_advisory_lock("xact:one", async |_c| Ok::<_, Error>(1))
        .await
        .unwrap();
    assert_eq!(again, Some(1));
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn closure_error_rolls_back_returns_error_unchanged_and_frees_lock(pool: PgPool) {
    sqlx::query("CREATE TABLE effects (id int PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;

    let res: Result<Option<()>, AppError> = locker
        .with_advisory_lock("xact:rollback", async |conn| {
            sqlx::query("INSERT INTO effects VALUES (1), (2)")
                .execute(&mut *conn)
                .await?;
            let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
                .fetch_one(&mut *conn)
                .await?;
            assert_eq!(seen, 2, "the closure sees its own writes");
            Err(AppError::Business {
                code: 402,
                detail: "card declined".into(),
            })
        })
        .await;
    match res {
        Err(AppError::Business { code: 402, detail }) => assert_eq!(detail, "card declined"),
        other => panic!("the closure's error must come back unchanged, got {other:?}"),
    }
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 0, "the closure's writes must be rolled back");
    assert!(
        advisory_locks(&mut obs).await.is_empty(),
        "lock freed after rollback"
    );
    assert!(raw_can_take(&mut obs, &Raw::text("xact:rollback")).await);

    // A database error inside the closure is also returned as is, and rolled back.
    let res: Result<Option<()>, AppError> = locker
        .with_advisory_lock("xact:rollback", async |conn| {
            sqlx::query("INSERT INTO effects VALUES (3)")
                .execute(&mut *conn)
                .await?;
            sqlx::query("INSERT INTO effects VALUES (3)")
                .execute(&mut *conn)
                .await?; // duplicate key
            Ok(())
        })
        .await;
    match res {
        Err(AppError::Db(e)) => {
            assert_eq!(
                e.as_database_error().and_then(|d| d.code()).as_deref(),
                Some("23505"),
                "{e}"
            )
        }
        other => panic!("expected the closure's sqlx error, got {other:?}"),
    }
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 0);
    assert!(advisory_locks(&mut obs).await.is_empty());

    // And Ok commits.
    let res: Result<Option<i32>, AppError> = locker
        .with_advisory_lock("xact:rollback", async |conn| {
            sqlx::query("INSERT INTO effects VALUES (7)")
                .execute(&mut *conn)
                .await?;
            Ok(7)
        })
        .await;
    assert_eq!(res.unwrap(), Some(7));
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 1, "Ok commits");
    // The crate's own errors reach the caller through From<distlock::Error>.
    let res: Result<Option<()>, AppError> =
        locker.with_advisory_lock("", async |_conn| Ok(())).await;
    assert!(
        matches!(res, Err(AppError::Lock(Error::InvalidKey { .. }))),
        "got {res:?}"
    );
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn with_advisory_lock_wait_hands_off_when_the_holder_commits(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    let (entered_tx, entered_rx) = oneshot::channel::<()>();
    let (finish_tx, finish_rx) = oneshot::channel::<()>();
    let holder = tokio::spawn({
        let locker = locker.clone();
        async move {
            let out = locker
                .with_advisory_lock("xact:handoff", async |_conn| {
                    entered_tx.send(()).unwrap();
                    finish_rx.await.unwrap();
                    Ok::<_, Error>(())
                })
                .await;
            (out, Instant::now())
        }
    });
    bounded("holder enters", Duration::from_secs(10), entered_rx)
        .await
        .unwrap();
    let waiter = tokio::spawn({
        let locker = locker.clone();
        async move {
            locker
                .with_advisory_lock_wait("xact:handoff", Duration::from_secs(20), async |_conn| {
                    Ok::<_, Error>(Instant::now())
                })
                .await
        }
    });
    wait_for_waiters(&mut obs, 1, Duration::from_secs(10)).await;
    let finish_sent = Instant::now();
    finish_tx.send(()).unwrap();
    let (out, _committed) = bounded("holder commits", Duration::from_secs(10), holder)
        .await
        .unwrap();
    assert_eq!(out.unwrap(), Some(()));
    let entered = bounded("waiter gets the lock", Duration::from_secs(10), waiter)
        .await
        .unwrap()
        .unwrap();
    let handoff = entered.duration_since(finish_sent);
    println!("xact hand-off (holder told to finish -> waiter inside its closure): {handoff:?}");
    assert!(
        handoff < Duration::from_millis(500),
        "hand-off must be immediate, took {handoff:?}"
    );
    assert!(advisory_locks(&mut obs).await.is_empty());
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn with_advisory_lock_wait_times_out_near_deadline_naming_the_holder(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    let obs_pid = backend_pid(&mut obs).await;
    assert!(raw_try_lock(&mut obs, &Raw::text("xact:timeout")).await);

    let timeout = Duration::from_millis(800);
    let ran = AtomicBool::new(false);
    let started = Instant::now();
    let res = locker
        .with_advisory_lock_wait("xact:timeout", timeout, async |_conn| {
            ran.store(true, Ordering::SeqCst);
            Ok::<_, Error>(())
        })
        .await;
    let took = started.elapsed();
    println!("with_advisory_lock_wait timed out after {took:?} (deadline {timeout:?})");
    match res {
        Err(Error::Timeout {
            key,
            holder_pid,
            holder_application,
            waited,
            chain,
        }) => {
            assert_eq!(key, distlock::LockKey::from("xact:timeout"));
            assert_eq!(chain.pids(), [obs_pid], "the holder is the root");
            assert_eq!(holder_pid, Some(obs_pid), "the timeout names the holder");
            assert_eq!(holder_application.as_deref(), Some(OBSERVER_APP));
            assert!(waited >= timeout, "waited {waited:?}");
        }
        other => panic!("expected Error::Timeout, got {other:?}"),
    }
    assert!(!ran.load(Ordering::SeqCst));
    assert!(
        took >= timeout,
        "must not give up before the deadline: {took:?}"
    );
    assert!(
        took <= timeout + Duration::from_secs(1),
        "must give up near the deadline: {took:?}"
    );
    // Only the raw holder remains; no waiter is left behind.
    let rows = advisory_locks(&mut obs).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].pid, obs_pid);
    assert!(raw_unlock(&mut obs, &Raw::text("xact:timeout")).await);
    // With the holder gone, the wait variant runs at once.
    let v = locker
        .with_advisory_lock_wait("xact:timeout", timeout, async |_conn| Ok::<_, Error>(5))
        .await
        .unwrap();
    assert_eq!(v, 5);
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn wait_variant_leaves_callers_lock_timeout_unchanged(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    // One connection, so the session setting and the closure share it.
    let pool = pool_opts
        .max_connections(1)
        .connect_with(connect_opts)
        .await
        .unwrap();
    sqlx::query("SET lock_timeout = '4321ms'")
        .execute(&pool)
        .await
        .unwrap();
    let session_value: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(session_value, "4321ms");
    let locker = PgLocker::new(pool.clone());

    for wait in [Duration::from_millis(250), Duration::from_secs(3)] {
        let inside = locker
            .with_advisory_lock_wait("xact:settings", wait, async |conn| {
                let v: String = sqlx::query_scalar("SHOW lock_timeout")
                    .fetch_one(&mut *conn)
                    .await?;
                Ok::<_, Error>(v)
            })
            .await
            .unwrap();
        assert_eq!(
            inside, session_value,
            "lock_timeout inside the closure must be the caller's"
        );
    }
    let after: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(after, session_value, "and unchanged after the call");

    // Also when the caller's value is the default (0 = no timeout).
    sqlx::query("RESET lock_timeout")
        .execute(&pool)
        .await
        .unwrap();
    let default: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(&pool)
        .await
        .unwrap();
    let inside = locker
        .with_advisory_lock_wait("xact:settings", Duration::from_millis(250), async |conn| {
            let v: String = sqlx::query_scalar("SHOW lock_timeout")
                .fetch_one(&mut *conn)
                .await?;
            Ok::<_, Error>(v)
        })
        .await
        .unwrap();
    assert_eq!(inside, default);
    pool.close().await;
}

#[sqlx::test(migrations = false)]
async fn shared_lock_admits_many_shared_holders_and_excludes_exclusive(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    let (a_in_tx, a_in_rx) = oneshot::channel::<()>();
    let (a_done_tx, a_done_rx) = oneshot::channel::<()>();
    let a = tokio::spawn({
        let locker = locker.clone();
        async move {
            locker
                .with_shared_advisory_lock("xact:shared", async |_conn| {
                    a_in_tx.send(()).unwrap();
                    a_done_rx.await.unwrap();
                    Ok::<_, Error>("a")
                })
                .await
        }
    });
    bounded(
        "first shared holder enters",
        Duration::from_secs(10),
        a_in_rx,
    )
    .await
    .unwrap();

    // A second shared holder runs while the first is inside, and while both
    // are inside, exclusive attempts are refused.
    let b = locker
        .with_shared_advisory_lock("xact:shared", async |_conn| {
            let rows = advisory_locks(&mut obs).await;
            let shared: Vec<_> = rows
                .iter()
                .filter(|r| r.granted && r.mode == "ShareLock")
                .collect();
            assert_eq!(shared.len(), 2, "two shared holders at once: {rows:?}");
            // Inside this closure the same key is a nested lock: named as
            // such rather than reported as held elsewhere.
            let excl = locker
                .with_advisory_lock("xact:shared", async |_c| Ok::<_, Error>(()))
                .await;
            assert!(
                matches!(excl, Err(Error::NestedLock { .. })),
                "a nested exclusive xact lock: {excl:?}"
            );
            let session = locker.try_lock("xact:shared").await.unwrap();
            assert!(
                session.is_none(),
                "exclusive session lock must be excluded by shared holders"
            );
            assert!(!raw_can_take(&mut obs, &Raw::text("xact:shared")).await);
            Ok::<_, Error>("b")
        })
        .await
        .unwrap();
    assert_eq!(b, Some("b"));
    a_done_tx.send(()).unwrap();
    assert_eq!(
        bounded("a", Duration::from_secs(10), a)
            .await
            .unwrap()
            .unwrap(),
        Some("a")
    );
    assert!(advisory_locks(&mut obs).await.is_empty());

    // An exclusive holder excludes shared ones.
    let guard = locker.try_lock("xact:shared").await.unwrap().expect("free");
    let shared = locker
        .with_shared_advisory_lock("xact:shared", async |_c| Ok::<_, Error>(()))
        .await
        .unwrap();
    assert!(
        shared.is_none(),
        "shared must be refused while an exclusive lock is held"
    );
    guard.release().await.unwrap();
    let excl_inside = locker
        .with_advisory_lock("xact:shared", async |_c| {
            let shared = locker
                .with_shared_advisory_lock("xact:shared", async |_c| Ok::<_, Error>(()))
                .await;
            Ok::<_, Error>(matches!(shared, Err(Error::NestedLock { .. })))
        })
        .await
        .unwrap();
    assert_eq!(
        excl_inside,
        Some(true),
        "a nested shared lock inside an exclusive one is NestedLock"
    );
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn dropping_with_advisory_lock_future_while_closure_sleeps_frees_the_lock(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    let entered = Arc::new(AtomicBool::new(false));
    let fut = locker.with_advisory_lock("xact:drop", {
        let entered = entered.clone();
        async move |_conn: &mut sqlx::PgConnection| {
            entered.store(true, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_secs(60)).await;
            Ok::<_, Error>(())
        }
    });
    let res = tokio::time::timeout(Duration::from_millis(300), fut).await;
    assert!(res.is_err(), "the closure was still sleeping");
    assert!(
        entered.load(Ordering::SeqCst),
        "the closure was entered, so the lock was held"
    );
    let took = assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(5)).await;
    println!("lock freed {took:?} after dropping the with_advisory_lock future");
    assert!(raw_can_take(&mut obs, &Raw::text("xact:drop")).await);

    // The pool is healthy afterwards: the connection is usable and not in a transaction.
    for _ in 0..3 {
        let ok = locker
            .with_advisory_lock("xact:drop", async |_c| Ok::<_, Error>(()))
            .await
            .unwrap();
        assert!(ok.is_some());
    }

    // Same for the wait variant, dropped while its closure sleeps.
    let entered = Arc::new(AtomicBool::new(false));
    let fut = locker.with_advisory_lock_wait("xact:drop", Duration::from_secs(5), {
        let entered = entered.clone();
        async move |_conn: &mut sqlx::PgConnection| {
            entered.store(true, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_secs(60)).await;
            Ok::<_, Error>(())
        }
    });
    assert!(
        tokio::time::timeout(Duration::from_millis(300), fut)
            .await
            .is_err()
    );
    assert!(entered.load(Ordering::SeqCst));
    assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(5)).await;
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn dropping_with_advisory_lock_future_during_a_server_statement_frees_the_lock(pool: PgPool) {
    // Principle 5 (DESIGN.md): dropping any future leaves no lock held. Here
    // the closure is blocked in a long server-side statement when the future
    // is dropped.
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    let fut = locker.with_advisory_lock("xact:drop-stmt", async |conn| {
        sqlx::query("SELECT pg_sleep(20)")
            .execute(&mut *conn)
            .await?;
        Ok::<_, Error>(())
    });
    assert!(
        tokio::time::timeout(Duration::from_millis(300), fut)
            .await
            .is_err()
    );
    assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(5)).await;
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn cancelling_wait_variant_while_waiting_leaks_no_lock(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    assert!(raw_try_lock(&mut obs, &Raw::text("xact:cancel-wait")).await);
    let ran = Arc::new(AtomicBool::new(false));
    let waiter = tokio::spawn({
        let locker = locker.clone();
        let ran = ran.clone();
        async move {
            locker
                .with_advisory_lock_wait(
                    "xact:cancel-wait",
                    Duration::from_secs(3),
                    async move |_c| {
                        ran.store(true, Ordering::SeqCst);
                        Ok::<_, Error>(())
                    },
                )
                .await
        }
    });
    wait_for_waiters(&mut obs, 1, Duration::from_secs(10)).await;
    waiter.abort();
    let _ = waiter.await;
    // The holder lets go; whatever became of the abandoned wait, no lock may
    // stay held and nobody may be left waiting.
    assert!(raw_unlock(&mut obs, &Raw::text("xact:cancel-wait")).await);
    let took = assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(10)).await;
    println!("no lock left {took:?} after the holder released");
    assert!(
        !ran.load(Ordering::SeqCst),
        "the cancelled closure never ran"
    );
    assert!(raw_can_take(&mut obs, &Raw::text("xact:cancel-wait")).await);
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn cancelled_wait_variant_waiter_leaves_pg_locks_promptly(pool: PgPool) {
    // Documented: "the server abandons the wait within 100 ms".
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    assert!(raw_try_lock(&mut obs, &Raw::text("xact:cancel-wait")).await);
    let waiter = tokio::spawn({
        let locker = locker.clone();
        async move {
            locker
                .with_advisory_lock_wait("xact:cancel-wait", Duration::from_secs(30), async |_c| {
                    Ok::<_, Error>(())
                })
                .await
        }
    });
    wait_for_waiters(&mut obs, 1, Duration::from_secs(10)).await;
    waiter.abort();
    let took = wait_for_no_waiters(&mut obs, Duration::from_secs(3)).await;
    println!("orphaned xact waiter gone after {took:?}");
    assert!(raw_unlock(&mut obs, &Raw::text("xact:cancel-wait")).await);
    close(obs).await;
}

fn assert_send<T: Send>(t: T) -> T {
    t
}

#[sqlx::test(migrations = false)]
async fn with_advisory_lock_future_is_send_and_spawnable(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let counter = Arc::new(AtomicUsize::new(0));
    let mut handles = Vec::new();
    for i in 0..3 {
        let locker = locker.clone();
        let counter = counter.clone();
        let fut = assert_send(async move {
            let key = format!("xact:send:{i}");
            let a = locker
                .with_advisory_lock(key.as_str(), async move |conn| {
                    let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&mut *conn).await?;
                    counter.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Error>(one)
                })
                .await?;
            let b = locker
                .with_advisory_lock_wait(key.as_str(), Duration::from_secs(1), async |_c| {
                    Ok::<_, Error>(2)
                })
                .await?;
            let c = locker
                .with_shared_advisory_lock(key.as_str(), async |_c| Ok::<_, Error>(3))
                .await?;
            Ok::<_, Error>((a, b, c))
        });
        handles.push(tokio::spawn(fut));
    }
    for h in handles {
        assert_eq!(h.await.unwrap().unwrap(), (Some(1), 2, Some(3)));
    }
    assert_eq!(counter.load(Ordering::SeqCst), 3);
    // The library's own future (not wrapped in an async block) is Send.
    let bare =
        assert_send(locker.with_advisory_lock("xact:send:bare", async |_c| Ok::<_, Error>(9)));
    assert_eq!(bare.await.unwrap(), Some(9));
    let bare = assert_send(locker.with_advisory_lock_wait(
        "xact:send:bare",
        Duration::from_secs(1),
        async |_c| Ok::<_, Error>(9),
    ));
    assert_eq!(bare.await.unwrap(), 9);
}

#[sqlx::test(migrations = false)]
async fn wait_variant_with_zero_timeout_is_a_single_try(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    // Free: the single try takes it and runs the closure.
    let ran = locker
        .with_advisory_lock_wait("xact:zero", Duration::ZERO, async |_conn| Ok::<_, Error>(7))
        .await
        .expect("a free key is taken by the single try");
    assert_eq!(ran, 7);
    // Held elsewhere: a timeout naming the holder, at once.
    let held = locker.try_lock("xact:zero").await.unwrap().unwrap();
    let started = std::time::Instant::now();
    let busy = locker
        .with_advisory_lock_wait("xact:zero", Duration::ZERO, async |_conn| Ok::<_, Error>(0))
        .await;
    match busy {
        Err(Error::Timeout { holder_pid, .. }) => {
            assert_eq!(holder_pid, Some(held.backend_pid()));
        }
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(2));
    held.release().await.unwrap();
}

/// The three transaction-scoped entry points, so each defect below is shown
/// on every one of them.
#[derive(Debug, Clone, Copy)]
enum Entry {
    Try,
    Wait,
    Shared,
}

const ENTRIES: [Entry; 3] = [Entry::Try, Entry::Wait, Entry::Shared];

/// Runs `f` under `key` through `entry`; `Ok(Some)` means "committed".
async fn run_entry<T>(
    locker: &PgLocker,
    entry: Entry,
    key: &str,
    f: impl AsyncFnOnce(&mut sqlx::PgConnection) -> Result<T, Error>,
) -> Result<Option<T>, Error> {
    match entry {
        Entry::Try => locker.with_advisory_lock(key, f).await,
        Entry::Wait => locker
            .with_advisory_lock_wait(key, Duration::from_secs(5), f)
            .await
            .map(Some),
        Entry::Shared => locker.with_shared_advisory_lock(key, f).await,
    }
}

#[sqlx::test(migrations = false)]
async fn a_swallowed_sql_error_is_reported_as_rolled_back_not_committed(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    sqlx::query("CREATE TABLE work (id int PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();
    for (i, entry) in ENTRIES.into_iter().enumerate() {
        let id = i32::try_from(i).unwrap();
        let result = run_entry(&locker, entry, "xact:swallowed", async |conn| {
            sqlx::query("INSERT INTO work VALUES ($1)")
                .bind(id)
                .execute(&mut *conn)
                .await?;
            // The closure ignores an SQL error: PostgreSQL aborts the
            // transaction and answers the COMMIT with ROLLBACK.
            let _ = sqlx::query("SELECT 1/0").execute(&mut *conn).await;
            Ok(())
        })
        .await;
        assert!(
            matches!(result, Err(Error::TransactionAborted { .. })),
            "{entry:?}: rolled-back work must not be reported as committed, got {result:?}"
        );
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM work")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(rows, 0, "{entry:?}: the insert rolled back");
    }
    // The connections went back usable, and the lock is free.
    let again = locker
        .with_advisory_lock("xact:swallowed", async |_| Ok::<_, Error>(7))
        .await
        .unwrap();
    assert_eq!(again, Some(7));
}

#[sqlx::test(migrations = false)]
async fn a_closure_that_ends_the_transaction_itself_is_an_error(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    for entry in ENTRIES {
        for statement in [
            "COMMIT",
            "ROLLBACK",
            "COMMIT; BEGIN",
            // The transaction's marker setting is gone as well.
            "COMMIT; RESET ALL",
            "ROLLBACK; RESET ALL",
        ] {
            let result = run_entry(&locker, entry, "xact:ended", async |conn| {
                sqlx::raw_sql(statement).execute(&mut *conn).await?;
                // From here on the lock is gone: this runs unlocked.
                Ok(())
            })
            .await;
            assert!(
                matches!(result, Err(Error::TransactionEnded { .. })),
                "{entry:?}/{statement}: the lock ended inside the closure, got {result:?}"
            );
        }
    }
    let again = locker
        .with_advisory_lock("xact:ended", async |_| Ok::<_, Error>(1))
        .await
        .unwrap();
    assert_eq!(again, Some(1));
}

/// A `COMMIT` that fails in the application's own deferred work is the
/// server's error, not "the closure ended the transaction": neither a
/// deferred unique violation nor a deferred trigger that reads a setting
/// nobody set (SQLSTATE 42704, raised by the same server routine as the
/// checked commit's marker check, but inside the trigger's function).
#[sqlx::test(migrations = false)]
async fn a_commit_failing_in_deferred_work_is_the_servers_error(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    sqlx::raw_sql(
        "CREATE TABLE work (id int, CONSTRAINT work_id UNIQUE (id) DEFERRABLE INITIALLY DEFERRED);
         CREATE TABLE tenanted (id int);
         CREATE FUNCTION tenant_check() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN PERFORM current_setting('app.tenant_not_set'); RETURN NULL; END $$;
         CREATE CONSTRAINT TRIGGER tenant_check AFTER INSERT ON tenanted
           DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION tenant_check()",
    )
    .execute(&pool)
    .await
    .unwrap();
    let cases = [
        ("INSERT INTO work VALUES (1), (1)", "23505"),
        ("INSERT INTO tenanted VALUES (1)", "42704"),
    ];
    for entry in ENTRIES {
        for (statement, code) in cases {
            let result = run_entry(&locker, entry, "xact:deferred", async |conn| {
                sqlx::raw_sql(statement).execute(&mut *conn).await?;
                Ok(())
            })
            .await;
            let Err(Error::Database(err)) = &result else {
                panic!("{entry:?}/{statement}: the commit's own error, got {result:?}");
            };
            let got = err.as_database_error().and_then(|db| db.code());
            assert_eq!(got.as_deref(), Some(code), "{entry:?}/{statement}: {err}");
        }
    }
    let committed: i64 =
        sqlx::query_scalar("SELECT (SELECT count(*) FROM work) + (SELECT count(*) FROM tenanted)")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(committed, 0, "nothing of a failed commit is kept");
    let again = locker
        .with_advisory_lock("xact:deferred", async |_| Ok::<_, Error>(1))
        .await
        .unwrap();
    assert_eq!(again, Some(1), "the lock went with the failed commit");
}

#[sqlx::test(migrations = false)]
async fn nested_transactions_in_the_closure_are_savepoints_and_commit(pool: PgPool) {
    use sqlx::Connection;
    let locker = PgLocker::new(pool.clone());
    sqlx::query("CREATE TABLE work (id int PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();
    for (i, entry) in ENTRIES.into_iter().enumerate() {
        let id = i32::try_from(i).unwrap();
        let result = run_entry(&locker, entry, "xact:nested", async |conn| {
            let mut inner = conn.begin().await?;
            sqlx::query("INSERT INTO work VALUES ($1)")
                .bind(id)
                .execute(&mut *inner)
                .await?;
            inner.commit().await?;
            // A failed savepoint rolled back on its own leaves the outer
            // transaction healthy.
            let mut failing = conn.begin().await?;
            let _ = sqlx::query("SELECT 1/0").execute(&mut *failing).await;
            failing.rollback().await?;
            Ok(())
        })
        .await;
        assert!(matches!(result, Ok(Some(()))), "{entry:?}: {result:?}");
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM work")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 3);
}

#[sqlx::test(migrations = false)]
async fn a_committed_closure_leaves_its_connection_idle_and_the_work_visible(
    _opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    // One connection, so the next statement runs where the lock ran.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(connect.clone())
        .await
        .unwrap();
    let locker = PgLocker::new(pool.clone());
    sqlx::query("CREATE TABLE work (id int PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();
    for id in 0..3 {
        let done = locker
            .with_advisory_lock("xact:idle", async |conn| {
                sqlx::query("INSERT INTO work VALUES ($1)")
                    .bind(id)
                    .execute(&mut *conn)
                    .await?;
                Ok::<_, Error>(())
            })
            .await
            .unwrap();
        assert_eq!(done, Some(()));
        // Outside any transaction block, a simple query's now() is its
        // own start.
        let row = sqlx::raw_sql("SELECT now() = statement_timestamp()")
            .fetch_one(&pool)
            .await
            .unwrap();
        let fresh: bool = sqlx::Row::get(&row, 0);
        assert!(fresh, "the pooled connection was left inside a transaction");
    }
    let mut obs = observer(&connect).await;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM work")
        .fetch_one(&mut obs)
        .await
        .unwrap();
    assert_eq!(rows, 3, "committed work is visible to other sessions");
    assert!(advisory_locks(&mut obs).await.is_empty());
}

#[sqlx::test(migrations = false)]
async fn a_huge_wait_timeout_saturates_instead_of_panicking(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    let raw = Raw::text("xact:forever");
    let free = locker
        .with_advisory_lock_wait("xact:forever", Duration::MAX, async |_| Ok::<_, Error>(1))
        .await
        .unwrap();
    assert_eq!(free, 1);
    assert!(raw_try_lock(&mut obs, &raw).await);
    let waiter = tokio::spawn({
        let locker = locker.clone();
        async move {
            locker
                .with_advisory_lock_wait("xact:forever", Duration::MAX, async |_| Ok::<_, Error>(2))
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(raw_unlock(&mut obs, &raw).await);
    let got = bounded("the waiter runs", Duration::from_secs(10), waiter)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got, 2);
}

#[sqlx::test(migrations = false)]
async fn shared_wait_variant_waits_for_an_exclusive_holder(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    assert!(raw_try_lock(&mut obs, &Raw::text("xact:rw")).await);
    let waiter = tokio::spawn({
        let locker = locker.clone();
        async move {
            locker
                .with_shared_advisory_lock_wait("xact:rw", Duration::from_secs(10), async |_| {
                    Ok::<_, Error>("read")
                })
                .await
        }
    });
    wait_for_waiters(&mut obs, 1, Duration::from_secs(5)).await;
    assert!(raw_unlock(&mut obs, &Raw::text("xact:rw")).await);
    let got = bounded("the reader runs", Duration::from_secs(10), waiter)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got, "read");
    // Readers share: two at once.
    let r = locker.try_lock_shared("xact:rw").await.unwrap().unwrap();
    let both = locker
        .with_shared_advisory_lock_wait("xact:rw", Duration::from_millis(500), async |_| {
            Ok::<_, Error>(1)
        })
        .await
        .unwrap();
    assert_eq!(both, 1);
    r.release().await.unwrap();
}

// ---- A lock inside the caller's own transaction ----------------------------

#[sqlx::test(migrations = false)]
async fn try_lock_xact_holds_until_the_callers_transaction_ends(pool: PgPool) {
    use sqlx::Connection;
    let mut obs = observer_for(&pool).await;
    let raw = Raw::text("own:tx");
    for end_with_commit in [true, false] {
        let mut tx = pool.begin().await.unwrap();
        assert!(distlock::try_lock_xact(&mut *tx, "own:tx").await.unwrap());
        assert!(
            !raw_can_take(&mut obs, &raw).await,
            "held inside the transaction"
        );
        sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
        assert!(
            !raw_can_take(&mut obs, &raw).await,
            "still held after more statements"
        );
        if end_with_commit {
            tx.commit().await.unwrap();
        } else {
            tx.rollback().await.unwrap();
        }
        assert!(
            raw_can_take(&mut obs, &raw).await,
            "released with the transaction"
        );
    }
    // Busy elsewhere: false, and the transaction goes on.
    assert!(raw_try_lock(&mut obs, &raw).await);
    let mut tx = pool.begin().await.unwrap();
    assert!(!distlock::try_lock_xact(&mut *tx, "own:tx").await.unwrap());
    sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
    // Inside a savepoint too.
    let mut sp = tx.begin().await.unwrap();
    assert!(
        distlock::try_lock_xact(&mut *sp, "own:other")
            .await
            .unwrap()
    );
    sp.commit().await.unwrap();
    tx.commit().await.unwrap();
}

/// A transaction the server has ended while sqlx still counts it open (a
/// `COMMIT` sent as SQL through the `Transaction`) is no transaction for
/// the lock either: taken, the lock would end with its statement, and the
/// caller would go on believing it holds the key. Both calls refuse it,
/// and a second session can take the key meanwhile; in a transaction
/// begun again by SQL the lock is taken and held.
#[sqlx::test(migrations = false)]
async fn a_transaction_ended_by_sql_is_refused(pool: PgPool) {
    let mut tx = pool.begin().await.unwrap();
    sqlx::raw_sql("COMMIT").execute(&mut *tx).await.unwrap();
    let tried = distlock::try_lock_xact(&mut *tx, "own:ended").await;
    assert!(matches!(tried, Err(Error::NotInTransaction)), "{tried:?}");
    let waited = distlock::lock_xact(&mut *tx, "own:ended", Duration::from_secs(1)).await;
    assert!(matches!(waited, Err(Error::NotInTransaction)), "{waited:?}");
    let mut obs = observer_for(&pool).await;
    let free: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtext('own:ended'))")
        .fetch_one(&mut obs)
        .await
        .unwrap();
    assert!(free, "the key is free: nothing holds it for the caller");
    sqlx::query("SELECT pg_advisory_unlock_all()")
        .execute(&mut obs)
        .await
        .unwrap();
    sqlx::raw_sql("BEGIN").execute(&mut *tx).await.unwrap();
    assert!(
        distlock::try_lock_xact(&mut *tx, "own:ended")
            .await
            .unwrap()
    );
    assert_eq!(granted_count(&mut obs).await, 1, "held in the block");
    drop(tx);
}

#[sqlx::test(migrations = false)]
async fn a_connection_outside_a_transaction_is_refused(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    let err = distlock::try_lock_xact(&mut conn, "own:none")
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotInTransaction), "{err:?}");
    let err = distlock::lock_xact(&mut conn, "own:none", Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotInTransaction), "{err:?}");
    let mut obs = observer_for(&pool).await;
    assert_eq!(granted_count(&mut obs).await, 0, "nothing was taken");
    // Bad keys are refused before anything else.
    let mut tx = pool.begin().await.unwrap();
    let err = distlock::try_lock_xact(&mut *tx, "").await.unwrap_err();
    assert!(matches!(err, Error::InvalidKey { .. }), "{err:?}");
}

#[sqlx::test(migrations = false)]
async fn lock_xact_waits_keeps_the_callers_settings_and_a_savepoint_survives_a_timeout(
    pool: PgPool,
) {
    use sqlx::Connection;
    let mut obs = observer_for(&pool).await;
    let raw = Raw::text("own:wait");
    assert!(raw_try_lock(&mut obs, &raw).await);
    // Waits on the server, and the caller's lock_timeout is as it was.
    let waiter = tokio::spawn({
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await.unwrap();
            sqlx::query("SET LOCAL lock_timeout = '7s'")
                .execute(&mut *tx)
                .await
                .unwrap();
            distlock::lock_xact(&mut *tx, "own:wait", Duration::MAX)
                .await
                .unwrap();
            let after: String = sqlx::query_scalar("SHOW lock_timeout")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            after
        }
    });
    wait_for_waiters(&mut obs, 1, Duration::from_secs(5)).await;
    assert!(raw_unlock(&mut obs, &raw).await);
    let after = bounded("lock_xact returns", Duration::from_secs(10), waiter)
        .await
        .unwrap();
    assert_eq!(after, "7s");
    // A timeout aborts the transaction; inside a savepoint it does not.
    assert!(raw_try_lock(&mut obs, &raw).await);
    let mut tx = pool.begin().await.unwrap();
    let mut sp = tx.begin().await.unwrap();
    let err = distlock::lock_xact(&mut *sp, "own:wait", Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    sp.rollback().await.unwrap();
    let usable: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(usable, 1, "the enclosing transaction is still usable");
    tx.commit().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    let err = distlock::lock_xact(&mut *tx, "own:wait", Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    let aborted = sqlx::query("SELECT 1").execute(&mut *tx).await;
    assert!(
        aborted.is_err(),
        "without a savepoint the transaction is aborted"
    );
    tx.rollback().await.unwrap();
}

/// The transaction-scoped paths count in the lock metrics like every other
/// acquisition: `with_advisory_lock` acquired and busy, its waiting form
/// timed out, `try_lock_xact` and `lock_xact` acquired and busy / timed
/// out. The prefix `metricsxact` is used by no other test in this binary.
#[cfg(feature = "metrics")]
#[sqlx::test(migrations = false)]
async fn transaction_scoped_calls_count_in_the_lock_metrics(pool: PgPool) {
    let captured = crate::job::recorder::Captured::global();
    let series = |name: &str| format!("{name}{{backend=postgres,key=metricsxact}}");
    let locker = PgLocker::new(pool.clone());
    let key = "metricsxact:a";

    let ran = locker
        .with_advisory_lock(key, async |_conn| Ok::<_, Error>(()))
        .await
        .expect("with_advisory_lock");
    assert_eq!(ran, Some(()));
    assert_eq!(captured.get(&series("distlock_acquired_total")), 1.0);

    let held = locker.try_lock(key).await.expect("try_lock").expect("free");
    assert_eq!(captured.get(&series("distlock_acquired_total")), 2.0);
    let busy = locker
        .with_advisory_lock(key, async |_conn| Ok::<_, Error>(()))
        .await
        .expect("busy is no error");
    assert_eq!(busy, None);
    assert_eq!(captured.get(&series("distlock_busy_total")), 1.0);
    let timed_out = locker
        .with_advisory_lock_wait(key, Duration::from_millis(100), async |_conn| {
            Ok::<_, Error>(())
        })
        .await;
    assert!(
        matches!(timed_out, Err(Error::Timeout { .. })),
        "{timed_out:?}"
    );
    assert_eq!(captured.get(&series("distlock_timeout_total")), 1.0);

    let mut tx = pool.begin().await.expect("begin");
    assert!(!distlock::try_lock_xact(&mut tx, key).await.expect("try"));
    assert_eq!(captured.get(&series("distlock_busy_total")), 2.0);
    let waited = distlock::lock_xact(&mut tx, key, Duration::from_millis(100)).await;
    assert!(matches!(waited, Err(Error::Timeout { .. })), "{waited:?}");
    assert_eq!(captured.get(&series("distlock_timeout_total")), 2.0);
    drop(tx);
    held.release().await.expect("release");

    let mut tx = pool.begin().await.expect("begin");
    assert!(distlock::try_lock_xact(&mut tx, key).await.expect("try"));
    distlock::lock_xact(&mut tx, "metricsxact:b", Duration::from_secs(1))
        .await
        .expect("lock_xact");
    assert_eq!(captured.get(&series("distlock_acquired_total")), 4.0);
    tx.commit().await.expect("commit");
}
