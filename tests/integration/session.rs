//! Session-scoped locks: `try_lock`, `lock`, `SessionLock`.

use crate::common;

use std::task::Poll;
use std::time::{Duration, Instant};

use common::*;
use distlock::{Error, LockKey, LossReason, PgLocker};
use rand::Rng;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[sqlx::test(migrations = false)]
async fn try_lock_twice_second_is_none_then_release_and_retake(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    let first = locker
        .try_lock("session:basic")
        .await
        .unwrap()
        .expect("free key");
    assert_eq!(first.key(), &LockKey::from("session:basic"));
    assert!(!first.is_lost());
    assert!(first.loss().is_none());
    assert!(first.fencing_token().is_none(), "fencing is off by default");
    assert!(
        locker.try_lock("session:basic").await.unwrap().is_none(),
        "second try_lock must be None"
    );
    // A second handle of the locker is no different: it is another session.
    assert!(
        locker
            .clone()
            .try_lock("session:basic")
            .await
            .unwrap()
            .is_none()
    );
    let rows = advisory_locks(&mut obs).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].pid, first.backend_pid());

    first.release().await.unwrap();
    assert!(
        advisory_locks(&mut obs).await.is_empty(),
        "released on the server before release() returns"
    );
    let again = locker
        .try_lock("session:basic")
        .await
        .unwrap()
        .expect("retake after release");
    assert!(locker.try_lock("session:basic").await.unwrap().is_none());
    again.release().await.unwrap();
    assert!(advisory_locks(&mut obs).await.is_empty());
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn dropped_guard_frees_the_lock_fifty_times_in_a_row(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    let raw = Raw::text("session:drop");
    let mut worst = Duration::ZERO;
    for i in 0..50 {
        let guard = locker
            .try_lock("session:drop")
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("iteration {i}: free"));
        assert!(!raw_can_take(&mut obs, &raw).await, "iteration {i}: held");
        drop(guard);
        let took = eventually(
            &format!("iteration {i}: another session takes the dropped lock"),
            Duration::from_secs(2),
            async || raw_can_take(&mut obs, &raw).await,
        )
        .await;
        worst = worst.max(took);
    }
    println!("dropped guard -> lock free: worst of 50 = {worst:?}");
    assert!(pool.size() <= 5);
    // The connections went back to the pool healthy: no lock lingers on them.
    for _ in 0..5 {
        let g = locker
            .try_lock("session:drop")
            .await
            .unwrap()
            .expect("free");
        g.release().await.unwrap();
    }
    assert!(advisory_locks(&mut obs).await.is_empty());
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn terminated_backend_makes_lost_fire_within_two_heartbeats(pool: PgPool) {
    let heartbeat = Duration::from_millis(200);
    let locker = PgLocker::builder(pool.clone())
        .heartbeat(heartbeat)
        .build()
        .expect("valid settings");
    let mut obs = observer_for(&pool).await;
    let guard = locker
        .try_lock("session:terminate")
        .await
        .unwrap()
        .expect("free");
    assert!(!guard.is_lost());

    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(guard.backend_pid())
        .fetch_one(&mut obs)
        .await
        .unwrap();
    assert!(terminated);
    let started = Instant::now();
    let reason = bounded(
        "lost() after pg_terminate_backend",
        Duration::from_secs(10),
        guard.lost(),
    )
    .await;
    let took = started.elapsed();
    println!("lost() fired {took:?} after pg_terminate_backend ({reason})");
    assert!(
        took <= 2 * heartbeat,
        "lost() must fire within 2x heartbeat ({:?}), took {took:?}",
        2 * heartbeat
    );
    assert!(
        matches!(reason, LossReason::ConnectionFailed(_)),
        "reason: {reason:?}"
    );
    assert!(guard.is_lost());
    assert_eq!(guard.loss(), Some(reason.clone()));
    // lost() keeps answering.
    assert_eq!(guard.lost().await, reason);
    match guard.release().await {
        Err(Error::LockLost { key, reason: r }) => {
            assert_eq!(key, LockKey::from("session:terminate"));
            assert_eq!(r, reason);
        }
        other => panic!("release() of a lost lock must be Err(LockLost), got {other:?}"),
    }
    assert!(raw_can_take(&mut obs, &Raw::text("session:terminate")).await);
    // The pool recovers.
    let g = locker
        .try_lock("session:terminate")
        .await
        .unwrap()
        .expect("free");
    g.release().await.unwrap();
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn blocked_lock_acquires_within_milliseconds_of_release(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    let mut figures = Vec::new();
    for round in 0..3 {
        let holder = locker
            .try_lock("session:handoff")
            .await
            .unwrap()
            .expect("free");
        let waiter = tokio::spawn({
            let locker = locker.clone();
            async move {
                let lock = locker
                    .lock("session:handoff", Duration::from_secs(20))
                    .await;
                (lock, Instant::now())
            }
        });
        wait_for_waiters(&mut obs, 1, Duration::from_secs(10)).await;
        let released_at = Instant::now();
        holder.release().await.unwrap();
        let (lock, acquired_at) = bounded("waiter acquires", Duration::from_secs(10), waiter)
            .await
            .unwrap();
        let lock = lock.expect("waiter gets the lock");
        let handoff = acquired_at.duration_since(released_at);
        println!("round {round}: release() -> lock() acquired in {handoff:?}");
        figures.push(handoff);
        assert!(
            handoff < Duration::from_millis(500),
            "hand-off took {handoff:?}"
        );
        let rows = advisory_locks(&mut obs).await;
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].pid, lock.backend_pid());
        lock.release().await.unwrap();
    }
    println!("hand-off figures: {figures:?}");
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn lock_timeout_returns_timeout_near_deadline_naming_holder(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let pool = pool_opts
        .max_connections(5)
        .connect_with(connect_opts.application_name("distlock-session-holder"))
        .await
        .unwrap();
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    let holder = locker
        .try_lock("session:timeout")
        .await
        .unwrap()
        .expect("free");

    for timeout in [Duration::from_millis(300), Duration::from_millis(1000)] {
        let started = Instant::now();
        let res = locker.lock("session:timeout", timeout).await;
        let took = started.elapsed();
        println!("lock() with {timeout:?} gave up after {took:?}");
        match res {
            Err(Error::Timeout {
                key,
                waited,
                holder_pid,
                holder_application,
                chain,
            }) => {
                assert_eq!(key, LockKey::from("session:timeout"));
                assert_eq!(
                    chain.pids(),
                    [holder.backend_pid()],
                    "the holder is the root"
                );
                assert_eq!(
                    holder_pid,
                    Some(holder.backend_pid()),
                    "names the holder's pid"
                );
                assert_eq!(
                    holder_application.as_deref(),
                    Some("distlock-session-holder")
                );
                assert!(waited >= timeout, "waited {waited:?} < {timeout:?}");
            }
            other => panic!("expected Err(Timeout), got {other:?}"),
        }
        assert!(
            took >= timeout,
            "gave up before the deadline: {took:?} < {timeout:?}"
        );
        assert!(
            took <= timeout + Duration::from_secs(1),
            "gave up too late: {took:?}"
        );
        // The waiter holds nothing and waits for nothing.
        let rows = advisory_locks(&mut obs).await;
        assert_eq!(rows.len(), 1, "only the holder remains: {rows:?}");
        assert_eq!(rows[0].pid, holder.backend_pid());
        assert!(rows[0].granted);
    }
    holder.release().await.unwrap();
    assert!(
        advisory_locks(&mut obs).await.is_empty(),
        "the timed-out waiters left nothing behind"
    );
    // The key is free for anyone.
    assert!(raw_can_take(&mut obs, &Raw::text("session:timeout")).await);
    close(obs).await;
    pool.close().await;
}

#[sqlx::test(migrations = false)]
async fn lock_with_zero_timeout_is_a_single_try(pool: PgPool) {
    // Documented: "A timeout of zero is a single try."
    let locker = PgLocker::new(pool.clone());
    // Warm the pool so an idle connection is there.
    locker
        .try_lock("warm")
        .await
        .unwrap()
        .unwrap()
        .release()
        .await
        .unwrap();
    let lock = locker.lock("session:zero", Duration::ZERO).await;
    let lock = lock.expect("a free key is taken by a zero-timeout lock()");
    let other = locker.lock("session:zero", Duration::ZERO).await;
    match other {
        Err(Error::Timeout { holder_pid, .. }) => assert_eq!(holder_pid, Some(lock.backend_pid())),
        other => panic!("expected Timeout, got {other:?}"),
    }
    lock.release().await.unwrap();
}

#[sqlx::test(migrations = false)]
async fn cancelling_lock_while_waiting_leaks_no_lock(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    let holder = locker
        .try_lock("session:cancel")
        .await
        .unwrap()
        .expect("free");
    // Cancel by timeout around the call ...
    let res = tokio::time::timeout(
        Duration::from_millis(300),
        locker.lock("session:cancel", Duration::from_secs(3)),
    )
    .await;
    assert!(res.is_err(), "lock() was still waiting");
    // ... and by dropping a spawned attempt.
    let task = tokio::spawn({
        let locker = locker.clone();
        async move { locker.lock("session:cancel", Duration::from_secs(3)).await }
    });
    wait_for_waiters(&mut obs, 1, Duration::from_secs(10)).await;
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());

    holder.release().await.unwrap();
    // Whatever became of the abandoned waits, no lock may stay held.
    let took = assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(10)).await;
    println!("no lock left {took:?} after the holder released");
    assert!(raw_can_take(&mut obs, &Raw::text("session:cancel")).await);
    let g = locker
        .try_lock("session:cancel")
        .await
        .unwrap()
        .expect("free for the locker too");
    g.release().await.unwrap();
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn cancelled_lock_waiter_leaves_pg_locks_promptly(pool: PgPool) {
    // Documented: "the server abandons the wait within 100 ms".
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    let holder = locker
        .try_lock("session:cancel")
        .await
        .unwrap()
        .expect("free");
    let task = tokio::spawn({
        let locker = locker.clone();
        async move { locker.lock("session:cancel", Duration::from_secs(30)).await }
    });
    wait_for_waiters(&mut obs, 1, Duration::from_secs(10)).await;
    task.abort();
    let took = wait_for_no_waiters(&mut obs, Duration::from_secs(3)).await;
    println!("orphaned waiter gone {took:?} after cancel");
    holder.release().await.unwrap();
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn cancelling_try_lock_lock_release_at_random_points_leaks_no_lock(pool: PgPool) {
    // Heartbeats often, so that cancellations meet them.
    let locker = PgLocker::builder(pool.clone())
        .heartbeat(Duration::from_millis(50))
        .heartbeat_timeout(PATIENT)
        .build()
        .expect("valid settings");
    let mut obs = observer_for(&pool).await;
    let keys = ["session:rand:a", "session:rand:b", "session:rand:c"];
    // Warm up: the one-time pooler probe and a first connection, so that
    // the short budgets below meet statements, not connection set-up on a
    // busy machine.
    let warm = locker.try_lock("session:rand:warm").await.unwrap().unwrap();
    warm.release().await.unwrap();
    let mut rng = rand::rng();
    let mut held = Vec::new();
    let mut stats = [0usize; 6]; // try ok, try cancelled, lock ok, lock cancelled, release ok, release cancelled
    for _ in 0..400 {
        let budget = match rng.random_range(0..4) {
            0 => Duration::ZERO,
            1 => Duration::from_micros(rng.random_range(50..800)),
            2 => Duration::from_micros(rng.random_range(800..3000)),
            // Long enough to outlast sqlx's occasional ~90 ms wait for a
            // fresh pooled connection, so that locks get held and releases
            // get cancelled too.
            _ => Duration::from_millis(rng.random_range(3..150)),
        };
        let key = keys[rng.random_range(0..keys.len())];
        match rng.random_range(0..3) {
            0 if held.len() < 2 => match tokio::time::timeout(budget, locker.try_lock(key)).await {
                Ok(res) => {
                    stats[0] += 1;
                    if let Some(g) = res.expect("try_lock") {
                        held.push(g);
                    }
                }
                Err(_) => stats[1] += 1,
            },
            1 if held.len() < 2 => {
                let wait = Duration::from_millis(rng.random_range(0..20));
                match tokio::time::timeout(budget, locker.lock(key, wait)).await {
                    Ok(Ok(g)) => {
                        stats[2] += 1;
                        held.push(g);
                    }
                    // A wait shorter than opening a connection ends without one.
                    Ok(Err(Error::Timeout { .. } | Error::NoConnection { .. })) => stats[2] += 1,
                    Ok(Err(e)) => panic!("lock(): {e}"),
                    Err(_) => stats[3] += 1,
                }
            }
            _ if !held.is_empty() => {
                let g = held.swap_remove(rng.random_range(0..held.len()));
                if rng.random_bool(0.1) {
                    drop(g);
                } else {
                    match tokio::time::timeout(budget, g.release()).await {
                        Ok(res) => {
                            res.expect("release");
                            stats[4] += 1;
                        }
                        Err(_) => stats[5] += 1,
                    }
                }
            }
            _ => {}
        }
        for g in &held {
            assert!(
                !g.is_lost(),
                "a held lock was reported lost: {:?}",
                g.loss()
            );
        }
    }
    // Releases are quick, so random budgets rarely cut one short: cut a few
    // on purpose, after their first poll (the unlock sent and its answer
    // not yet read, or the connection still held by a heartbeat). Not with
    // `timeout(Duration::ZERO, ..)`: its timer fires at the time driver's
    // next tick, and a fast unlock beats it every time. A cut release lets
    // the lock go in the background, so the next round waits for it.
    // On a busy machine the server may answer before the first poll reads
    // the socket: try many times (three tries usually cut three).
    for _ in 0..200 {
        if stats[5] >= 3 {
            break;
        }
        let g = locker
            .lock("session:rand:cut", Duration::from_secs(10))
            .await
            .unwrap();
        let mut release = Box::pin(g.release());
        let polled = std::future::poll_fn(|cx| Poll::Ready(release.as_mut().poll(cx))).await;
        match polled {
            Poll::Ready(res) => res.expect("release"),
            Poll::Pending => stats[5] += 1,
        }
    }
    println!(
        "try ok/cancelled {}/{}, lock done/cancelled {}/{}, release ok/cancelled {}/{}",
        stats[0], stats[1], stats[2], stats[3], stats[4], stats[5]
    );
    assert!(
        stats[1] > 0 && stats[3] > 0 && stats[5] > 0,
        "every kind of cancellation happened: {stats:?}"
    );
    // Exactly the locks we hold are held on the server.
    let granted = granted_count(&mut obs).await;
    assert!(
        granted >= held.len(),
        "our {} guards must hold their locks, server shows {granted}",
        held.len()
    );
    drop(held);
    let took = assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(5)).await;
    println!("all advisory locks gone {took:?} after the loop");
    for key in keys {
        assert!(raw_can_take(&mut obs, &Raw::text(key)).await, "{key} free");
        let g = locker
            .try_lock(key)
            .await
            .unwrap()
            .expect("pool still healthy");
        g.release().await.unwrap();
    }
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn exhausted_pool_gives_an_error_not_a_hang(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let pool = pool_opts
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(300))
        .connect_with(connect_opts)
        .await
        .unwrap();
    let locker = PgLocker::new(pool.clone());
    let guard = locker
        .try_lock("session:exhaust:held")
        .await
        .unwrap()
        .expect("free");
    let limit = Duration::from_secs(5);

    let started = Instant::now();
    let res = bounded(
        "try_lock on an exhausted pool",
        limit,
        locker.try_lock("session:exhaust:other"),
    )
    .await;
    println!(
        "try_lock on exhausted pool: {:?} after {:?}",
        res.as_ref().map(|o| o.is_some()),
        started.elapsed()
    );
    assert!(res.is_err(), "try_lock must fail, got {res:?}");

    let res = bounded(
        "lock on an exhausted pool",
        limit,
        locker.lock("session:exhaust:other", Duration::from_secs(2)),
    )
    .await;
    assert!(res.is_err(), "lock must fail, got {res:?}");

    let res = bounded(
        "with_advisory_lock on an exhausted pool",
        limit,
        locker.with_advisory_lock("session:exhaust:other", async |_c| Ok::<_, Error>(())),
    )
    .await;
    assert!(res.is_err(), "with_advisory_lock must fail, got {res:?}");

    let res = bounded("holders on an exhausted pool", limit, locker.holders()).await;
    assert!(res.is_err(), "holders must fail, got {res:?}");

    // The held lock is unaffected, and the pool works again after release.
    assert!(!guard.is_lost());
    guard.release().await.unwrap();
    let g = bounded(
        "try_lock after release",
        limit,
        locker.try_lock("session:exhaust:other"),
    )
    .await
    .unwrap();
    g.expect("free").release().await.unwrap();
    pool.close().await;
}

#[sqlx::test(migrations = false)]
async fn release_returns_the_connection_to_the_pool(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let pool = pool_opts
        .max_connections(3)
        .connect_with(connect_opts)
        .await
        .unwrap();
    let locker = PgLocker::new(pool.clone());
    // Settle on exactly one open connection.
    eventually("pool settles", Duration::from_secs(5), async || {
        pool.size() == 1 && pool.num_idle() == 1
    })
    .await;

    let guard = locker
        .try_lock("session:pool")
        .await
        .unwrap()
        .expect("free");
    let pid = guard.backend_pid();
    assert_eq!(pool.size(), 1, "the lock uses the pooled connection");
    assert_eq!(
        pool.num_idle(),
        0,
        "the lock keeps its connection while held"
    );
    guard.release().await.unwrap();
    eventually(
        "connection back in the pool",
        Duration::from_secs(2),
        async || pool.num_idle() == 1,
    )
    .await;
    assert_eq!(pool.size(), 1, "the connection was returned, not closed");

    // The very same backend serves the next lock.
    let guard = locker
        .try_lock("session:pool")
        .await
        .unwrap()
        .expect("free");
    assert_eq!(
        guard.backend_pid(),
        pid,
        "release() returned the same connection to the pool"
    );
    guard.release().await.unwrap();
    eventually(
        "connection back again",
        Duration::from_secs(2),
        async || pool.num_idle() == 1,
    )
    .await;

    // A dropped guard returns it too (in the background).
    let guard = locker
        .try_lock("session:pool")
        .await
        .unwrap()
        .expect("free");
    drop(guard);
    eventually(
        "dropped guard's connection back in the pool",
        Duration::from_secs(2),
        async || pool.num_idle() == 1,
    )
    .await;
    assert_eq!(pool.size(), 1);
    let pid2: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(pid2, pid);
    pool.close().await;
}

/// After a failed acquisition no lock may be left on a connection that
/// nobody tracks: the key must be free once the failure is reported.
#[sqlx::test(migrations = false)]
async fn a_token_write_timing_out_after_the_grant_leaves_no_lock_in_the_pool(
    _opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    // A pool that keeps idle connections, as production pools do (the test
    // harness's own pool closes them after a second, which would hide a
    // leak).
    let pool = PgPoolOptions::new()
        .idle_timeout(None)
        .connect_with(connect.clone())
        .await
        .unwrap();
    distlock::migrate(&pool).await.unwrap();
    let locker = PgLocker::builder(pool.clone())
        .fencing(true)
        .build()
        .expect("valid settings");
    let mut obs = observer_for(&pool).await;
    let raw = Raw::text("session:leak");
    // The counter row exists, so the token write is an UPDATE of it.
    let first = locker
        .try_lock("session:leak")
        .await
        .unwrap()
        .expect("free");
    first.release().await.unwrap();
    // Someone holds the key, so lock() waits on the server ...
    assert!(raw_try_lock(&mut obs, &raw).await);
    let waiter = tokio::spawn({
        let locker = locker.clone();
        async move {
            locker
                .lock("session:leak", Duration::from_millis(1500))
                .await
        }
    });
    wait_for_waiters(&mut obs, 1, Duration::from_secs(5)).await;
    // ... and is granted while the counters are blocked: its token write
    // waits until the statement's lock_timeout ends it.
    let blocker = block_fencing_counters(&pool).await;
    assert!(raw_unlock(&mut obs, &raw).await);
    let outcome = bounded("lock() returns", Duration::from_secs(10), waiter)
        .await
        .unwrap();
    assert!(outcome.is_err(), "no token, no lock: {outcome:?}");
    unblock_fencing_counters(blocker).await;
    // Nobody may hold it: not a pooled connection, not a shared session.
    eventually(
        "no advisory lock left",
        Duration::from_secs(2),
        async || granted_count(&mut obs).await == 0,
    )
    .await;
    assert!(raw_can_take(&mut obs, &raw).await);
    let again = locker.try_lock("session:leak").await.unwrap();
    assert!(again.is_some(), "the key leaked into the pool");
}

#[sqlx::test(migrations = false)]
async fn a_fenced_try_whose_token_write_fails_leaves_no_lock_in_the_pool(
    _opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    // The pool's own lock_timeout ends the token write of a try.
    let pool = PgPoolOptions::new()
        .idle_timeout(None)
        .connect_with(connect.clone().options([("lock_timeout", "300ms")]))
        .await
        .unwrap();
    distlock::migrate(&pool).await.unwrap();
    let locker = PgLocker::builder(pool.clone())
        .fencing(true)
        .build()
        .expect("valid settings");
    let mut obs = observer(&connect).await;
    let raw = Raw::text("session:leak-try");
    let first = locker.try_lock("session:leak-try").await.unwrap();
    first.expect("free").release().await.unwrap();
    let blocker = block_fencing_counters(&pool).await;
    let outcome = locker.try_lock("session:leak-try").await;
    assert!(outcome.is_err(), "no token, no lock: {outcome:?}");
    unblock_fencing_counters(blocker).await;
    // Nobody may hold it: not a pooled connection, not a shared session.
    eventually(
        "no advisory lock left",
        Duration::from_secs(2),
        async || granted_count(&mut obs).await == 0,
    )
    .await;
    assert!(raw_can_take(&mut obs, &raw).await);
}

/// A timeout too large for an `Instant` means "as long as the server
/// allows", never a panic.
#[sqlx::test(migrations = false)]
async fn huge_timeouts_saturate_instead_of_panicking(pool: PgPool) {
    let lockers = [
        ("default", PgLocker::new(pool.clone())),
        (
            "multiplexed",
            PgLocker::builder(pool.clone())
                .multiplex(1)
                .build()
                .expect("valid settings"),
        ),
    ];
    let mut obs = observer_for(&pool).await;
    let raw = Raw::text("session:forever");
    for (mode, locker) in lockers {
        for timeout in [Duration::MAX, Duration::from_secs(u64::MAX / 2)] {
            // Free: taken at once.
            let lock = locker.lock("session:forever", timeout).await;
            let lock = lock.unwrap_or_else(|e| panic!("{mode}: {e}"));
            lock.release().await.unwrap();
            // Busy: waits until the holder lets go.
            assert!(raw_try_lock(&mut obs, &raw).await);
            let waiter = tokio::spawn({
                let locker = locker.clone();
                async move { locker.lock("session:forever", timeout).await }
            });
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert!(raw_unlock(&mut obs, &raw).await);
            let lock = bounded("the waiter gets the lock", Duration::from_secs(10), waiter)
                .await
                .unwrap()
                .unwrap_or_else(|e| panic!("{mode}: {e}"));
            lock.release().await.unwrap();
        }
        // The job runner's waiting entry point too.
        let lock = distlock::postgres::LockWaiter::new(&locker, "session:forever", Duration::MAX)
            .lock()
            .await
            .unwrap_or_else(|e| panic!("{mode}: {e}"));
        lock.release().await.unwrap();
    }
}

/// The TCP keepalives that let the server free a cut-off holder's lock in
/// about 25 s are set by the lock statement itself, not by a later
/// heartbeat: a holder cut off right after the grant is covered too.
#[sqlx::test(migrations = false)]
async fn keepalives_are_set_from_the_grant_on(_opts: PgPoolOptions, connect: PgConnectOptions) {
    // One connection, so the pool hands back the lock's connection.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(connect.clone())
        .await
        .unwrap();
    let settings = async |pool: &PgPool| -> (String, String, String, String) {
        sqlx::query_as(
            "SELECT current_setting('tcp_keepalives_idle'), \
             current_setting('tcp_keepalives_interval'), \
             current_setting('tcp_keepalives_count'), current_setting('tcp_user_timeout')",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    };
    let expected = ("10".into(), "5".into(), "3".into(), "30000".into());
    // No heartbeat runs while these locks are held.
    let locker = PgLocker::builder(pool.clone())
        .heartbeat(Duration::from_secs(10))
        .build()
        .expect("valid settings");
    let lock = locker.try_lock("session:keepalive").await.unwrap().unwrap();
    lock.release().await.unwrap();
    assert_eq!(settings(&pool).await, expected, "after try_lock");
    sqlx::query("RESET ALL").execute(&pool).await.unwrap();
    let lock = locker
        .lock("session:keepalive", Duration::from_secs(1))
        .await
        .unwrap();
    lock.release().await.unwrap();
    assert_eq!(settings(&pool).await, expected, "after lock");
    sqlx::query("RESET ALL").execute(&pool).await.unwrap();
    // Transaction-scoped: set by the lock statement, seen inside the
    // closure, and kept by the connection (as a session lock's are), so the
    // next transaction on it only reads them.
    let inside = locker
        .with_advisory_lock("session:keepalive", async |conn| {
            let row: (String, String, String, String) = sqlx::query_as(
                "SELECT current_setting('tcp_keepalives_idle'), \
                 current_setting('tcp_keepalives_interval'), \
                 current_setting('tcp_keepalives_count'), current_setting('tcp_user_timeout')",
            )
            .fetch_one(&mut *conn)
            .await?;
            Ok::<_, Error>(row)
        })
        .await
        .unwrap();
    assert_eq!(inside, Some(expected.clone()));
    assert_eq!(settings(&pool).await, expected, "after with_advisory_lock");
    // The waiting form's try statement sets them too.
    sqlx::query("RESET ALL").execute(&pool).await.unwrap();
    locker
        .with_advisory_lock_wait("session:keepalive", Duration::from_secs(1), async |_| {
            Ok::<_, Error>(())
        })
        .await
        .unwrap();
    assert_eq!(
        settings(&pool).await,
        expected,
        "after with_advisory_lock_wait"
    );
}

#[sqlx::test(migrations = false)]
async fn heartbeat_settings_that_outlast_the_servers_keepalive_cutoff_are_refused(pool: PgPool) {
    // The server frees a cut-off holder's lock about 25 s after the last
    // answered heartbeat; the holder must have given up before that, so a
    // builder refuses (rather than lowers) any pair that would notice later.
    for (every, deadline) in [
        (Duration::from_secs(60), None),
        (Duration::from_secs(5), Some(Duration::from_secs(60))),
        (Duration::from_secs(20), Some(Duration::from_secs(20))),
    ] {
        let mut builder = PgLocker::builder(pool.clone()).heartbeat(every);
        if let Some(deadline) = deadline {
            builder = builder.heartbeat_timeout(deadline);
        }
        let built = builder.build();
        assert!(
            matches!(
                built,
                Err(Error::InvalidSetting {
                    setting: "heartbeat + heartbeat_timeout",
                    ..
                })
            ),
            "heartbeat {every:?} / deadline {deadline:?}: {built:?}"
        );
    }
    let default = PgLocker::new(pool.clone());
    assert_eq!(default.heartbeat(), Duration::from_secs(1));
    assert_eq!(default.heartbeat_timeout(), Duration::from_secs(1));
}

/// Dropping a guard after its runtime shut down must not panic (sqlx's
/// pooled connection spawns in `Drop` when the pool keeps
/// `min_connections`), and the lock must still end with its session.
#[sqlx::test(migrations = false)]
async fn a_guard_dropped_after_its_runtime_shut_down_does_not_panic(
    _opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let mut obs = observer(&connect).await;
    let inner = connect.clone();
    let outcome = std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let lock = rt.block_on(async {
            let pool = PgPoolOptions::new()
                .min_connections(1)
                .connect_with(inner)
                .await
                .unwrap();
            PgLocker::new(pool)
                .try_lock("session:shutdown")
                .await
                .unwrap()
                .unwrap()
        });
        drop(rt);
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(lock)))
    })
    .join()
    .unwrap();
    assert!(outcome.is_ok(), "dropping the guard panicked");
    eventually(
        "the lock ends with its session",
        Duration::from_secs(5),
        async || granted_count(&mut obs).await == 0,
    )
    .await;
}

/// The timer task idles once every keeper it knew of has started or gone; a
/// lock taken then must wake it, or the lock would never get its keeper and
/// a loss would go unreported.
#[sqlx::test(migrations = false)]
async fn a_lock_taken_while_the_timer_idles_gets_its_keeper(pool: PgPool) {
    let mut obs = observer_for(&pool).await;
    let locker = PgLocker::builder(pool)
        .heartbeat(Duration::from_millis(100))
        .heartbeat_timeout(PATIENT)
        .build()
        .expect("valid settings");
    let quick = locker.try_lock("session:idle1").await.unwrap().unwrap();
    quick.release().await.unwrap();
    // Its heartbeat would have been due: the timer has nothing left.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let lock = locker.try_lock("session:idle2").await.unwrap().unwrap();
    terminate_and_await_loss(&mut obs, &lock).await;
}

/// A locker of `connect`'s database with a 100 ms heartbeat, no warm
/// connections and a pool that keeps none, so that no connection of one
/// runtime is used on another.
fn locker_for_runtimes(connect: &PgConnectOptions) -> PgLocker {
    PgLocker::builder(common::pool_for_runtimes(connect))
        .heartbeat(Duration::from_millis(100))
        .heartbeat_timeout(PATIENT)
        .keep_warm(0, Duration::ZERO)
        .build()
        .expect("valid settings")
}

/// On a thread of its own, takes `key` with `locker` on the runtime `rt`,
/// holds it past its first heartbeat (so the locker's timer has run there)
/// and releases it; then shuts `rt` down, or (`keep`) returns it idle.
fn lock_once_on(
    rt: tokio::runtime::Runtime,
    locker: &PgLocker,
    key: &'static str,
    keep: bool,
) -> Option<tokio::runtime::Runtime> {
    let locker = locker.clone();
    std::thread::spawn(move || {
        rt.block_on(async {
            let lock = locker.try_lock(key).await.unwrap().unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
            lock.release().await.unwrap();
        });
        keep.then_some(rt)
    })
    .join()
    .unwrap()
}

/// A locker's keepers are started by a timer task per runtime, spawned with
/// its first session lock there. When that runtime shuts down, its task is
/// gone; a lock taken on another runtime must still get its keeper (and so
/// report its loss).
#[sqlx::test(migrations = false)]
async fn keepers_start_after_the_first_runtime_shut_down(
    _opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let mut obs = observer(&connect).await;
    let locker = locker_for_runtimes(&connect);
    let rt = tokio::runtime::Runtime::new().unwrap();
    lock_once_on(rt, &locker, "session:rt1", false);
    let lock = locker.try_lock("session:rt2").await.unwrap().unwrap();
    terminate_and_await_loss(&mut obs, &lock).await;
}

/// A locker shared between runtimes keeps each lock on the runtime that
/// took it. Here the locker's first lock was taken on a current-thread
/// runtime that then sits idle (outside `block_on`, it runs nothing): a
/// lock taken on another runtime must still get its keeper there, and so
/// report its loss.
#[sqlx::test(migrations = false)]
async fn a_lock_is_kept_on_its_own_runtime_while_the_first_sits_idle(
    _opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let mut obs = observer(&connect).await;
    let locker = locker_for_runtimes(&connect);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let idle = lock_once_on(rt, &locker, "session:idle-rt", true).expect("kept");
    let lock = locker.try_lock("session:busy-rt").await.unwrap().unwrap();
    terminate_and_await_loss(&mut obs, &lock).await;
    idle.shutdown_background();
}

/// A locker's kept connections are returned by a sweeper task, spawned
/// on the runtime where the first one was kept. When that runtime shuts
/// down, the sweeper is gone with it; connections kept on another runtime
/// must still go back to the pool after their idle time (they stayed out
/// of it, the sweeper believed running).
#[sqlx::test(migrations = false)]
async fn kept_connections_expire_after_the_first_runtime_shut_down(
    _opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = common::pool_for_runtimes(&connect);
    let idle = Duration::from_millis(200);
    let locker = PgLocker::builder(pool.clone())
        .heartbeat_timeout(PATIENT)
        .keep_warm(2, idle)
        .build()
        .expect("valid settings");
    let rt = tokio::runtime::Runtime::new().unwrap();
    lock_once_on(rt, &locker, "session:sweep-rt1", false);
    let lock = locker.try_lock("session:sweep-rt2").await.unwrap().unwrap();
    lock.release().await.unwrap();
    // Kept, then given back (and so closed) once idle for `idle`.
    let until = Instant::now() + idle * 10;
    while pool.size() > 0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        pool.size(),
        0,
        "connections still kept out of the pool {:?} after their idle time",
        idle * 10
    );
}

/// The connections kept when the sweeper's runtime shuts down go back to
/// the pool with it: nothing else would return them (here they would not
/// expire for a minute), and `PgPool::close` waits for every connection.
#[sqlx::test(migrations = false)]
async fn connections_kept_when_the_sweepers_runtime_shuts_down_go_back(
    _opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = common::pool_for_runtimes(&connect);
    let locker = PgLocker::builder(pool.clone())
        .heartbeat_timeout(PATIENT)
        .keep_warm(2, Duration::from_secs(60))
        .build()
        .expect("valid settings");
    let rt = tokio::runtime::Runtime::new().unwrap();
    lock_once_on(rt, &locker, "session:sweeper-gone", false);
    bounded("pool.close()", Duration::from_secs(5), pool.close()).await;
}

// ---- Reader-writer session locks -------------------------------------------

#[sqlx::test(migrations = false)]
async fn shared_locks_admit_readers_and_exclude_a_writer(pool: PgPool) {
    for locker in [
        PgLocker::new(pool.clone()),
        PgLocker::builder(pool.clone())
            .multiplex(1)
            .build()
            .expect("valid settings"),
    ] {
        let other = PgLocker::new(pool.clone());
        let r1 = locker.try_lock_shared("rw:k").await.unwrap().expect("free");
        let r2 = other
            .try_lock_shared("rw:k")
            .await
            .unwrap()
            .expect("readers share");
        assert!(r1.fencing_token().is_none());
        assert!(
            other.try_lock("rw:k").await.unwrap().is_none(),
            "a writer waits for readers"
        );
        r1.release().await.unwrap();
        assert!(other.try_lock("rw:k").await.unwrap().is_none());
        r2.release().await.unwrap();
        let w = other.try_lock("rw:k").await.unwrap().expect("readers gone");
        assert!(
            locker.try_lock_shared("rw:k").await.unwrap().is_none(),
            "the writer excludes readers"
        );
        let err = locker
            .lock_shared("rw:k", Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
        w.release().await.unwrap();
        // Dropped readers free the key too.
        drop(
            locker
                .lock_shared("rw:k", Duration::from_secs(5))
                .await
                .unwrap(),
        );
        let mut obs = observer_for(&pool).await;
        eventually(
            "the dropped reader is released",
            Duration::from_secs(5),
            async || granted_count(&mut obs).await == 0,
        )
        .await;
    }
}

/// PostgreSQL queues a shared request behind an exclusive one that is
/// already waiting, so readers arriving all the time cannot starve a writer.
#[sqlx::test(migrations = false)]
async fn a_waiting_writer_is_not_starved_by_new_readers(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    let reader = locker.try_lock_shared("rw:queue").await.unwrap().unwrap();
    let writer = tokio::spawn({
        let locker = locker.clone();
        async move { locker.lock("rw:queue", Duration::from_secs(10)).await }
    });
    wait_for_waiters(&mut obs, 1, Duration::from_secs(5)).await;
    // A new reader now queues behind the writer instead of joining the
    // reader that holds the key.
    let late = locker
        .lock_shared("rw:queue", Duration::from_millis(300))
        .await;
    assert!(matches!(late, Err(Error::Timeout { .. })), "{late:?}");
    assert!(locker.try_lock_shared("rw:queue").await.unwrap().is_none());
    reader.release().await.unwrap();
    let w = bounded("the writer gets the key", Duration::from_secs(10), writer)
        .await
        .unwrap()
        .unwrap();
    w.release().await.unwrap();
}

// ---- Several keys at once --------------------------------------------------

#[sqlx::test(migrations = false)]
async fn try_lock_all_is_all_or_nothing(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    let keys = ["multi:a", "multi:b", "multi:c"];
    let all = locker.try_lock_all(keys).await.unwrap().expect("all free");
    assert_eq!(all.keys().len(), 3);
    for key in keys {
        assert!(!raw_can_take(&mut obs, &Raw::text(key)).await, "{key} held");
    }
    assert!(
        locker
            .try_lock_all(["multi:c", "multi:d"])
            .await
            .unwrap()
            .is_none()
    );
    all.release().await.unwrap();
    assert_eq!(granted_count(&mut obs).await, 0);
    // One key busy elsewhere: none is left held by the attempt.
    assert!(raw_try_lock(&mut obs, &Raw::text("multi:b")).await);
    assert!(locker.try_lock_all(keys).await.unwrap().is_none());
    assert_eq!(granted_count(&mut obs).await, 1, "only the observer's key");
    // lock_all waits for it.
    let waiter = tokio::spawn({
        let locker = locker.clone();
        async move { locker.lock_all(keys, Duration::from_secs(10)).await }
    });
    wait_for_waiters(&mut obs, 1, Duration::from_secs(5)).await;
    assert!(raw_unlock(&mut obs, &Raw::text("multi:b")).await);
    let all = bounded("lock_all gets every key", Duration::from_secs(10), waiter)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(granted_count(&mut obs).await, 3);
    // Lost together.
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(
            advisory_locks(&mut obs)
                .await
                .first()
                .map(|r| r.pid)
                .unwrap(),
        )
        .execute(&mut obs)
        .await
        .unwrap();
    bounded("lost() fires", Duration::from_secs(10), all.lost()).await;
    assert!(all.release().await.is_err());
}

#[sqlx::test(migrations = false)]
async fn lock_all_times_out_holding_nothing(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    assert!(raw_try_lock(&mut obs, &Raw::text("multi:z")).await);
    let err = locker
        .lock_all(["multi:a", "multi:z"], Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    eventually(
        "only the observer holds a key",
        Duration::from_secs(3),
        async || granted_count(&mut obs).await == 1,
    )
    .await;
}

#[sqlx::test(migrations = false)]
async fn opposite_orders_never_deadlock(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let inside = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..4 {
        let (locker, inside) = (locker.clone(), inside.clone());
        tasks.spawn(async move {
            let keys = if task % 2 == 0 {
                ["multi:x", "multi:y"]
            } else {
                ["multi:y", "multi:x"]
            };
            for _ in 0..15 {
                let both = locker.lock_all(keys, Duration::from_secs(20)).await?;
                let n = inside.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                assert_eq!(n, 0, "two holders of the same keys");
                tokio::time::sleep(Duration::from_millis(1)).await;
                inside.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                both.release().await?;
            }
            Ok::<_, Error>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap().unwrap();
    }
}

#[sqlx::test(migrations = false)]
async fn bad_key_sets_are_refused(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    let none: [&str; 0] = [];
    let hashed = hashtext(&mut obs, "multi:same").await;
    let cases: Vec<Vec<LockKey>> = vec![
        none.iter().map(|k| LockKey::from(*k)).collect(),
        vec!["multi:a".into(), "multi:a".into()],
        vec!["multi:same".into(), LockKey::id(i64::from(hashed))],
        vec!["multi:a".into(), "".into()],
    ];
    for keys in cases {
        let refused = |err: &Error| {
            matches!(
                err,
                Error::NoKeys
                    | Error::DuplicateKey { .. }
                    | Error::SameServerLock { .. }
                    | Error::InvalidKey { .. }
            )
        };
        let err = locker.try_lock_all(keys.clone()).await.unwrap_err();
        assert!(refused(&err), "{keys:?}: {err:?}");
        let err = locker
            .lock_all(keys.clone(), Duration::MAX)
            .await
            .unwrap_err();
        assert!(refused(&err), "{keys:?}: {err:?}");
    }
    eventually("nothing held", Duration::from_secs(3), async || {
        granted_count(&mut obs).await == 0
    })
    .await;
}

/// A guard's keeper task starts only when its first heartbeat is due; a
/// guard dropped before that is still released at once, in the background.
#[sqlx::test(migrations = false)]
async fn a_guard_dropped_before_its_first_heartbeat_is_released_at_once(pool: PgPool) {
    let locker = PgLocker::builder(pool.clone())
        .heartbeat(Duration::from_secs(10))
        .build()
        .expect("valid settings");
    let mut obs = observer_for(&pool).await;
    for _ in 0..3 {
        drop(
            locker
                .try_lock("session:early-drop")
                .await
                .unwrap()
                .unwrap(),
        );
        let took = eventually(
            "the dropped guard's lock is freed",
            Duration::from_secs(2),
            async || granted_count(&mut obs).await == 0,
        )
        .await;
        assert!(took < Duration::from_secs(2));
    }
    // Held past its first heartbeat, a lock is watched: terminating its
    // backend is noticed.
    let locker = PgLocker::builder(pool.clone())
        .heartbeat(Duration::from_millis(100))
        .heartbeat_timeout(PATIENT)
        .build()
        .expect("valid settings");
    let held = locker.try_lock("session:watched").await.unwrap().unwrap();
    tokio::time::sleep(Duration::from_millis(250)).await;
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(held.backend_pid())
        .execute(&mut obs)
        .await
        .unwrap();
    bounded("lost() fires", Duration::from_secs(3), held.lost()).await;
}

// ---- A guard that outlives its runtime --------------------------------------

/// Takes a lock on a runtime of its own, optionally waits there past the
/// first heartbeat (so the keeper task runs), then shuts that runtime down
/// and hands the guard back.
fn lock_on_a_runtime_that_then_shuts_down(
    connect: &PgConnectOptions,
    (key, multiplex): (&'static str, bool),
    (heartbeat, wait): (Duration, Duration),
) -> distlock::SessionLock {
    let connect = connect.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let lock = rt.block_on(async {
            let pool = PgPoolOptions::new()
                .max_connections(2)
                .connect_lazy_with(connect);
            let mut builder = PgLocker::builder(pool).heartbeat(heartbeat);
            if multiplex {
                builder = builder.multiplex(1);
            }
            let lock = builder
                .build()
                .expect("valid settings")
                .try_lock(key)
                .await
                .unwrap()
                .unwrap();
            tokio::time::sleep(wait).await;
            lock
        });
        drop(rt);
        lock
    })
    .join()
    .unwrap()
}

/// A guard whose runtime shut down has no task keeping its lock: it must say
/// the lock is lost (as the multiplexed mode does), and the server must free
/// the lock, whether the keeper had started (the runtime dropped its task)
/// or was still parked waiting for its first heartbeat.
#[sqlx::test(migrations = false)]
async fn a_guard_whose_runtime_shut_down_reports_its_lock_lost(
    _opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let mut obs = observer(&connect).await;
    let cases = [
        (
            "parked keeper",
            "session:rt-gone-parked",
            false,
            Duration::from_secs(10),
            Duration::ZERO,
        ),
        (
            "running keeper",
            "session:rt-gone-running",
            false,
            Duration::from_millis(50),
            Duration::from_millis(200),
        ),
        (
            "multiplexed",
            "session:rt-gone-mux",
            true,
            Duration::from_secs(10),
            Duration::ZERO,
        ),
    ];
    for (case, key, multiplex, heartbeat, wait) in cases {
        let lock =
            lock_on_a_runtime_that_then_shuts_down(&connect, (key, multiplex), (heartbeat, wait));
        assert!(
            lock.is_lost(),
            "{case}: is_lost() after the runtime shut down"
        );
        let reason = bounded(
            &format!("{case}: lost() after the runtime shut down"),
            Duration::from_secs(5),
            lock.lost(),
        )
        .await;
        assert_eq!(reason, LossReason::KeeperStopped, "{case}");
        assert_eq!(lock.loss(), Some(LossReason::KeeperStopped), "{case}");
        eventually(
            &format!("{case}: the server frees the lock"),
            Duration::from_secs(5),
            async || raw_can_take(&mut obs, &Raw::text(key)).await,
        )
        .await;
        match lock.release().await {
            Err(Error::LockLost { reason, .. }) => {
                assert_eq!(reason, LossReason::KeeperStopped, "{case}");
            }
            other => panic!("{case}: release() must be Err(LockLost), got {other:?}"),
        }
    }
    close(obs).await;
}

/// `release()` promises `LockLost` for a lock that had been lost. A backend
/// terminated just before the release (whether or not the keeper saw it
/// first) is such a loss, not a driver error of the release statement.
#[sqlx::test(migrations = false)]
async fn a_release_after_the_backend_was_terminated_reports_the_lock_lost(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let mut outcomes = Vec::new();
    for round in 0..20 {
        let key = format!("session:terminated-before-release:{round}");
        let guard = locker.try_lock(key.as_str()).await.unwrap().expect("free");
        let gone: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 5000)")
            .bind(guard.backend_pid())
            .fetch_one(&pool)
            .await
            .unwrap();
        assert!(gone, "the backend ended");
        outcomes.push(guard.release().await);
    }
    for outcome in &outcomes {
        assert!(
            matches!(
                outcome,
                Err(Error::LockLost {
                    reason: LossReason::ConnectionFailed(_),
                    ..
                })
            ),
            "{outcomes:#?}"
        );
    }
}
