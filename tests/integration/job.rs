//! The singleton-job runner and the migration-runner waiter: one replica
//! runs, the others skip; a lost lease stops the job; the lock outlives a fast
//! job by the minimum hold; a run record keeps a window to one run; a panic
//! releases the lock.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;
use distlock::postgres::LockWaiter;
use distlock::{
    Error, JobContext, JobOutcome, LockKey, Locker, LossReason, PgLocker, SingletonJob,
};
use sqlx::PgPool;
use tokio::sync::oneshot;

/// A locker with a fast heartbeat; a terminated session is noticed at once,
/// by the server's goodbye.
fn locker(pool: &PgPool) -> Arc<dyn Locker> {
    Arc::new(
        PgLocker::builder(pool.clone())
            .heartbeat(Duration::from_millis(100))
            .heartbeat_timeout(PATIENT)
            .build()
            .expect("valid settings"),
    )
}

/// The pid of the session holding `key` (granted), as an observer sees it.
async fn holder_pid(pool: &PgPool, key: &str) -> Option<i32> {
    PgLocker::new(pool.clone())
        .holders_of(key)
        .await
        .expect("holders_of")
        .into_iter()
        .find(|h| h.granted)
        .map(|h| h.pid)
}

#[sqlx::test(migrations = false)]
async fn two_runners_on_one_key_one_runs_the_other_skips(pool: PgPool) {
    init_tracing();
    let first = SingletonJob::new(locker(&pool), "job:report");
    let second = SingletonJob::new(locker(&pool), "job:report");
    let (started_tx, started_rx) = oneshot::channel();
    let (finish_tx, finish_rx) = oneshot::channel::<()>();

    let running = tokio::spawn(async move {
        first
            .run(async |_ctx| {
                let _ = started_tx.send(());
                let _ = finish_rx.await;
                Ok::<_, Error>("report")
            })
            .await
    });
    started_rx.await.expect("first job started");
    let ran_twice = Arc::new(AtomicBool::new(false));
    let flag = ran_twice.clone();
    let skipped = second
        .run(async |_ctx| {
            flag.store(true, Ordering::SeqCst);
            Ok::<_, Error>("report")
        })
        .await
        .expect("second run");
    assert!(matches!(skipped, JobOutcome::Skipped), "{skipped:?}");
    assert!(skipped.is_skipped());
    assert!(
        !ran_twice.load(Ordering::SeqCst),
        "the second job must not run"
    );

    finish_tx.send(()).expect("first job waits");
    let ran = running.await.expect("join").expect("first run");
    assert_eq!(ran.name(), "ran");
    assert_eq!(ran.ran(), Some("report"));

    let mut obs = observer_for(&pool).await;
    assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(2)).await;
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn concurrent_ticks_run_the_job_exactly_once(pool: PgPool) {
    let runs = Arc::new(AtomicUsize::new(0));
    let mut ticks = tokio::task::JoinSet::new();
    for _ in 0..3 {
        // Each replica has its own locker; min_hold covers ticks that arrive
        // after a fast run has finished.
        let job = SingletonJob::builder(locker(&pool), "job:tick")
            .min_hold(Duration::from_millis(500))
            .build()
            .expect("valid settings");
        let runs = runs.clone();
        ticks.spawn(async move {
            job.run(async |_ctx| {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Error>(())
            })
            .await
            .expect("run")
        });
    }
    let outcomes = ticks.join_all().await;
    let ran = outcomes.iter().filter(|o| o.is_ran()).count();
    let skipped = outcomes.iter().filter(|o| o.is_skipped()).count();
    assert_eq!((ran, skipped), (1, 2), "{outcomes:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[sqlx::test(migrations = false)]
async fn a_lost_lease_cancels_the_job_and_reports_lost(pool: PgPool) {
    init_tracing();
    let job = SingletonJob::builder(locker(&pool), "job:lost")
        .stop_grace(Duration::from_secs(5))
        .build()
        .expect("valid settings");
    let told = Arc::new(AtomicBool::new(false));
    let (started_tx, started_rx) = oneshot::channel();

    let told_in_job = told.clone();
    let run = tokio::spawn(async move {
        job.run(async |ctx| {
            let _ = started_tx.send(());
            // A well-behaved job: work until told the lock is gone.
            tokio::select! {
                () = ctx.cancelled() => told_in_job.store(true, Ordering::SeqCst),
                () = tokio::time::sleep(Duration::from_secs(30)) => {}
            }
            assert!(ctx.lease().is_lost(), "the token fires because of the loss");
            Ok::<_, Error>(())
        })
        .await
    });
    started_rx.await.expect("job started");
    let pid = holder_pid(&pool, "job:lost").await.expect("lock held");
    let mut obs = observer_for(&pool).await;
    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&mut obs)
        .await
        .expect("terminate");
    assert!(terminated);

    let outcome = bounded("lost job ends", Duration::from_secs(5), run)
        .await
        .expect("join")
        .expect("run");
    assert!(
        matches!(outcome, JobOutcome::Lost(LossReason::ConnectionFailed(_))),
        "{outcome:?}"
    );
    assert!(told.load(Ordering::SeqCst), "the job saw its token fire");
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn without_grace_a_lost_job_is_stopped_at_once(pool: PgPool) {
    let job = SingletonJob::new(locker(&pool), "job:stubborn");
    let token_seen = Arc::new(std::sync::Mutex::new(None));
    let (started_tx, started_rx) = oneshot::channel();
    let slot = token_seen.clone();
    let run = tokio::spawn(async move {
        job.run(async |ctx| {
            *slot.lock().expect("slot") = Some(ctx.cancellation_token().clone());
            let _ = started_tx.send(());
            // Ignores its token: the runner must drop it.
            tokio::time::sleep(Duration::from_secs(60)).await;
            Ok::<_, Error>(())
        })
        .await
    });
    started_rx.await.expect("job started");
    let pid = holder_pid(&pool, "job:stubborn").await.expect("lock held");
    let mut obs = observer_for(&pool).await;
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .execute(&mut obs)
        .await
        .expect("terminate");
    let outcome = bounded("stubborn job stopped", Duration::from_secs(5), run)
        .await
        .expect("join")
        .expect("run");
    assert!(matches!(outcome, JobOutcome::Lost(_)), "{outcome:?}");
    let token = token_seen.lock().expect("slot").clone().expect("token");
    assert!(
        token.is_cancelled(),
        "spawned helpers holding the token are told"
    );
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn a_loss_found_only_at_release_reports_lost_not_ran(pool: PgPool) {
    init_tracing();
    // A heartbeat too slow (the longest, 10 s) to notice the loss while the
    // job runs, and a network that stalls while the session ends, so that
    // the server's goodbye does not reach the lock either: only the release
    // finds the lock's session gone.
    let opts = pool.connect_options().as_ref().clone();
    let network = common::proxy::Proxy::start(opts.get_host(), opts.get_port())
        .await
        .expect("proxy");
    let through = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with(network.options(&opts))
        .await
        .expect("pool through the proxy");
    let slow: Arc<dyn Locker> = Arc::new(
        PgLocker::builder(through)
            .heartbeat(Duration::from_secs(10))
            .build()
            .expect("valid settings"),
    );
    let job = SingletonJob::new(slow, "job:release-loss");
    let (started_tx, started_rx) = oneshot::channel();
    let (finish_tx, finish_rx) = oneshot::channel::<()>();
    let run = tokio::spawn(async move {
        job.run(async |ctx| {
            let _ = started_tx.send(());
            let _ = finish_rx.await;
            assert!(!ctx.lease().is_lost(), "the heartbeat has not noticed");
            Ok::<_, Error>("done")
        })
        .await
    });
    started_rx.await.expect("job started");
    let pid = holder_pid(&pool, "job:release-loss")
        .await
        .expect("lock held");
    let mut obs = observer_for(&pool).await;
    network.stall();
    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&mut obs)
        .await
        .expect("terminate");
    assert!(terminated);
    eventually("the session is gone", Duration::from_secs(5), async || {
        holder_pid(&pool, "job:release-loss").await.is_none()
    })
    .await;
    finish_tx.send(()).expect("job waits");
    // The job has checked its lease and returned; its release now waits on
    // the stalled network, which then delivers the goodbye.
    tokio::time::sleep(Duration::from_millis(200)).await;
    network.pass();

    let outcome = bounded("job ends", Duration::from_secs(10), run)
        .await
        .expect("join")
        .expect("run");
    assert!(
        matches!(outcome, JobOutcome::Lost(LossReason::ConnectionFailed(_))),
        "the job may have run its last part without the lock: {outcome:?}"
    );
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn the_lock_is_kept_for_the_minimum_hold_time(pool: PgPool) {
    let min_hold = Duration::from_millis(800);
    let job = SingletonJob::builder(locker(&pool), "job:fast")
        .min_hold(min_hold)
        .build()
        .expect("valid settings");
    let acquired = Instant::now();
    let outcome = job.run(async |_ctx| Ok::<_, Error>(())).await.expect("run");
    assert!(outcome.is_ran());
    assert!(
        acquired.elapsed() < min_hold / 2,
        "run returns without waiting for the minimum hold"
    );

    // Another replica's identical tick, a little later, still finds it held.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let late = SingletonJob::new(locker(&pool), "job:fast")
        .run(async |_ctx| Ok::<_, Error>(()))
        .await
        .expect("late run");
    assert!(matches!(late, JobOutcome::Skipped), "{late:?}");

    let mut obs = observer_for(&pool).await;
    let raw = Raw::text("job:fast");
    assert!(!raw_can_take(&mut obs, &raw).await, "still held");
    eventually(
        "lock freed after min hold",
        Duration::from_secs(3),
        async || raw_can_take(&mut obs, &raw).await,
    )
    .await;
    assert!(
        acquired.elapsed() >= min_hold,
        "freed only after the minimum hold ({:?})",
        acquired.elapsed()
    );
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn a_run_record_prevents_a_second_run_in_the_same_window(pool: PgPool) {
    distlock::migrate(&pool).await.expect("migrate");
    let day = Duration::from_secs(86_400);
    let job = SingletonJob::builder(locker(&pool), "job:daily")
        .once_per_window(pool.clone(), day)
        .build()
        .expect("valid settings");

    let first = job
        .run(async |ctx| Ok::<_, Error>(ctx.window_start()))
        .await
        .expect("first run");
    let window_start = first.ran().flatten().expect("ran with a window start");
    let since_epoch = window_start
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after epoch");
    assert_eq!(since_epoch.as_secs() % 86_400, 0, "aligned to midnight UTC");
    assert_eq!(since_epoch.subsec_nanos(), 0);

    // A restarted replica (a new runner) in the same window.
    let restarted = SingletonJob::builder(locker(&pool), "job:daily")
        .once_per_window(pool.clone(), day)
        .build()
        .expect("valid settings");
    let second = restarted
        .run(
            async |_ctx| -> Result<Option<std::time::SystemTime>, Error> {
                panic!("must not run twice in one window")
            },
        )
        .await
        .expect("second run");
    match second {
        JobOutcome::AlreadyRanInWindow { window_start: w } => assert_eq!(w, window_start),
        other => panic!("expected AlreadyRanInWindow, got {other:?}"),
    }

    // Another job in the same window is independent.
    let other = SingletonJob::builder(locker(&pool), "job:other")
        .once_per_window(pool.clone(), day)
        .build()
        .expect("valid settings")
        .run(async |_ctx| Ok::<_, Error>(()))
        .await
        .expect("other job");
    assert!(other.is_ran());

    let rows: Vec<(String, Option<String>, bool)> = sqlx::query_as(
        "SELECT job, outcome, finished_at IS NOT NULL FROM distlock.job_runs ORDER BY job",
    )
    .fetch_all(&pool)
    .await
    .expect("job_runs");
    assert_eq!(
        rows,
        vec![
            ("job:daily".to_owned(), Some("ran".to_owned()), true),
            ("job:other".to_owned(), Some("ran".to_owned()), true),
        ]
    );
    let mut obs = observer_for(&pool).await;
    assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(2)).await;
    close(obs).await;
}

/// Two jobs on different locks whose names read the same (one name in two
/// namespaces; an id and its decimal text) keep a run record each: each
/// runs once in the window. A record kept under the key's display text
/// would skip the second of each pair as "already ran".
#[sqlx::test(migrations = false)]
async fn jobs_on_different_locks_keep_different_run_records(pool: PgPool) {
    distlock::migrate(&pool).await.expect("migrate");
    let day = Duration::from_secs(86_400);
    let keys = [
        LockKey::namespaced(1, "report"),
        LockKey::namespaced(2, "report"),
        LockKey::id(42),
        LockKey::from("42"),
    ];
    for key in &keys {
        let job = SingletonJob::builder(locker(&pool), key)
            .once_per_window(pool.clone(), day)
            .build()
            .expect("valid settings");
        let outcome = job.run(async |_ctx| Ok::<_, Error>(())).await.unwrap();
        assert!(outcome.is_ran(), "{key:?}: {outcome:?}");
        let again = job.run(async |_ctx| Ok::<_, Error>(())).await.unwrap();
        assert!(
            matches!(again, JobOutcome::AlreadyRanInWindow { .. }),
            "{key:?} ran twice: {again:?}"
        );
    }
    let records: i64 = sqlx::query_scalar("SELECT count(*) FROM distlock.job_runs")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(records, 4);
}

/// A job with a run record whose ticks find the lock held by a replica that
/// will not run this window: one whose tick reached the server just before
/// the window began (its clock a little ahead), which claimed the window
/// that was ending, found it already run and is about to let go. Here the
/// previous window's run is recorded and that replica is a plain lease
/// released after 300 ms. Every other replica's tick fell in the new
/// window; they used to skip at once, and nobody ran the window. They now
/// try again while no run started in this window: exactly one runs it.
#[sqlx::test(migrations = false)]
async fn ticks_that_find_the_lock_held_by_a_replica_of_the_last_window_run_this_one(pool: PgPool) {
    distlock::migrate(&pool).await.expect("migrate");
    let day = 86_400_000_000_i64;
    sqlx::query(
        "INSERT INTO distlock.job_runs (job, window_start, finished_at, outcome) \
         SELECT 'job:boundary', 'epoch'::timestamptz + (s - $1) * '1 microsecond'::interval, now(), 'ran' \
         FROM (SELECT n - n % $1 AS s FROM (SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::int8 AS n) t) w",
    )
    .bind(day)
    .execute(&pool)
    .await
    .expect("the previous window's run");
    let holder = PgLocker::new(pool.clone())
        .try_lock("job:boundary")
        .await
        .expect("try")
        .expect("free");
    let ran = Arc::new(AtomicUsize::new(0));
    // Replicas on one pool of five connections: a tick that waited on the
    // server would hold one for as long as it waits.
    let replicas: Vec<_> = (0..6)
        .map(|_| {
            let job = SingletonJob::builder(locker(&pool), "job:boundary")
                .once_per_window(pool.clone(), Duration::from_secs(86_400))
                .build()
                .expect("valid settings");
            let ran = ran.clone();
            tokio::spawn(async move {
                job.run(async |_ctx| {
                    ran.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Error>(())
                })
                .await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    holder.release().await.expect("release");
    let mut outcomes = Vec::new();
    for replica in replicas {
        let outcome = bounded("a replica's tick", Duration::from_secs(10), replica)
            .await
            .expect("joined")
            .expect("run");
        outcomes.push(outcome);
    }
    assert_eq!(ran.load(Ordering::SeqCst), 1, "{outcomes:?}");
    // The others found the window run, with the lock (AlreadyRanInWindow)
    // or without it while the run held it (Skipped).
    let ran_here = outcomes.iter().filter(|o| o.is_ran()).count();
    assert_eq!(ran_here, 1, "{outcomes:?}");
    assert!(
        outcomes.iter().all(|o| o.is_ran()
            || matches!(
                o,
                JobOutcome::Skipped | JobOutcome::AlreadyRanInWindow { .. }
            )),
        "{outcomes:?}"
    );
    let records: i64 = sqlx::query_scalar("SELECT count(*) FROM distlock.job_runs")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(records, 2, "the previous window's and this one's");
}

/// A tick that finds the lock held waits at most until its window ends by
/// the server's clock: a holder that keeps it longer (a job of an earlier
/// window still running) leaves the tick `Skipped` once the window it
/// ticked in is over, not when the holder lets go.
#[sqlx::test(migrations = false)]
async fn a_tick_waits_for_a_held_lock_until_its_window_ends(pool: PgPool) {
    distlock::migrate(&pool).await.expect("migrate");
    let holder = PgLocker::new(pool.clone())
        .try_lock("job:overrun")
        .await
        .expect("try")
        .expect("free");
    let length_us = 2_000_000;
    let job = SingletonJob::builder(locker(&pool), "job:overrun")
        .once_per_window(pool.clone(), Duration::from_micros(length_us as u64))
        .build()
        .expect("valid settings");
    // Start with at least 400 ms of the window left.
    let before = loop {
        let (now, soon) = server_windows(&pool, length_us, 400_000).await;
        if now == soon {
            break now;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let started = Instant::now();
    let outcome = bounded(
        "a tick behind a long holder",
        Duration::from_secs(10),
        job.run(async |_ctx| -> Result<(), Error> { panic!("the lock is held") }),
    )
    .await
    .expect("run");
    let waited = started.elapsed();
    let (after, _) = server_windows(&pool, length_us, 0).await;
    assert!(matches!(outcome, JobOutcome::Skipped), "{outcome:?}");
    assert_eq!(
        after,
        before + 1,
        "gave up in the window it ticked in, or later: waited {waited:?}"
    );
    assert!(waited < Duration::from_secs(3), "waited {waited:?}");
    holder.release().await.expect("release");
    // Without a run record a tick never waits.
    let plain = SingletonJob::new(locker(&pool), "job:overrun");
    let _held = PgLocker::new(pool.clone())
        .try_lock("job:overrun")
        .await
        .expect("try")
        .expect("free");
    let started = Instant::now();
    let outcome = plain
        .run(async |_ctx| -> Result<(), Error> { panic!("the lock is held") })
        .await
        .expect("run");
    assert!(matches!(outcome, JobOutcome::Skipped), "{outcome:?}");
    assert!(started.elapsed() < Duration::from_millis(900));
}

/// The server's window of `length_us` microseconds now and `ahead_us` from
/// now, as numbers.
async fn server_windows(pool: &PgPool, length_us: i64, ahead_us: i64) -> (i64, i64) {
    sqlx::query_as(
        "SELECT n / $1, (n + $2) / $1 \
         FROM (SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::int8 AS n) t",
    )
    .bind(length_us)
    .bind(ahead_us)
    .fetch_one(pool)
    .await
    .expect("the server's windows")
}

/// A tick that finds the lock held by a replica running the job in this
/// window (the record shows it) skips at once: it does not wait for the
/// job, and the job runs once.
#[sqlx::test(migrations = false)]
async fn a_tick_that_finds_this_window_running_skips_at_once(pool: PgPool) {
    distlock::migrate(&pool).await.expect("migrate");
    let job = || {
        SingletonJob::builder(locker(&pool), "job:running")
            .once_per_window(pool.clone(), Duration::from_secs(86_400))
            .build()
            .expect("valid settings")
    };
    let (started_tx, started_rx) = oneshot::channel();
    let (finish_tx, finish_rx) = oneshot::channel::<()>();
    let first = job();
    let running = tokio::spawn(async move {
        first
            .run(async |_ctx| {
                let _ = started_tx.send(());
                let _ = finish_rx.await;
                Ok::<_, Error>(())
            })
            .await
    });
    started_rx.await.expect("the first run started");
    let outcome = bounded(
        "a tick while this window runs",
        Duration::from_secs(2),
        job().run(async |_ctx| -> Result<(), Error> { panic!("ran twice in one window") }),
    )
    .await
    .expect("run");
    assert!(matches!(outcome, JobOutcome::Skipped), "{outcome:?}");
    let _ = finish_tx.send(());
    let first = running.await.expect("joined").expect("first run");
    assert!(first.is_ran(), "{first:?}");
}

/// A key too long for the run record's index is refused by `build`, not by
/// the server at every run after the lock was taken.
#[sqlx::test(migrations = false)]
async fn a_key_too_long_for_the_run_record_is_refused_by_build(pool: PgPool) {
    let long = "j".repeat(1025);
    let err = SingletonJob::builder(locker(&pool), long.as_str())
        .once_per_window(pool.clone(), Duration::from_secs(60))
        .build()
        .expect_err("too long");
    assert!(matches!(err, Error::InvalidKey { .. }), "{err:?}");
    // Without a run record the name is not indexed anywhere: no limit.
    let _job = SingletonJob::builder(locker(&pool), long.as_str())
        .build()
        .expect("no record, no limit");
    let _job = SingletonJob::builder(locker(&pool), "j".repeat(1024))
        .once_per_window(pool.clone(), Duration::from_secs(60))
        .build()
        .expect("at the limit");
}

#[sqlx::test(migrations = false)]
async fn windows_out_of_range_are_refused_by_build(pool: PgPool) {
    for window in [
        Duration::ZERO,
        Duration::from_nanos(999),
        Duration::from_micros(u64::MAX),
        Duration::MAX,
    ] {
        let err = SingletonJob::builder(locker(&pool), "job:zero")
            .once_per_window(pool.clone(), window)
            .build()
            .expect_err("out of range");
        assert!(
            matches!(
                err,
                Error::InvalidSetting {
                    setting: "once_per_window",
                    ..
                }
            ),
            "{window:?}: {err:?}"
        );
    }
    // The edges are kept as given.
    for window in [
        Duration::from_micros(1),
        Duration::from_micros(i64::MAX as u64),
    ] {
        let _job = SingletonJob::builder(locker(&pool), "job:edge")
            .once_per_window(pool.clone(), window)
            .build()
            .expect("at the edge");
    }
}

#[sqlx::test(migrations = false)]
async fn a_panicking_job_releases_the_lock(pool: PgPool) {
    let job = SingletonJob::new(locker(&pool), "job:panics");
    let outcome = job
        .run(async |_ctx| -> Result<(), Error> { panic!("boom in the job") })
        .await
        .expect("run");
    match &outcome {
        JobOutcome::Panicked(message) => assert_eq!(message, "boom in the job"),
        other => panic!("expected Panicked, got {other:?}"),
    }
    let mut obs = observer_for(&pool).await;
    assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(2)).await;
    // A plain function that returns a future runs code when called: a
    // panic there is the job's too, not the runner's.
    fn panics_before_its_future(_ctx: JobContext<'_>) -> std::future::Ready<Result<(), Error>> {
        panic!("boom before the future")
    }
    let outcome = job.run(panics_before_its_future).await.expect("run");
    match &outcome {
        JobOutcome::Panicked(message) => assert_eq!(message, "boom before the future"),
        other => panic!("expected Panicked, got {other:?}"),
    }
    assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(2)).await;
    // And the next tick can run.
    let next = job
        .run(async |_ctx| Ok::<_, Error>(()))
        .await
        .expect("next");
    assert!(next.is_ran());
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn a_failing_job_is_reported_and_releases_the_lock(pool: PgPool) {
    let job = SingletonJob::new(locker(&pool), "job:fails");
    let outcome = job
        .run(async |_ctx| Err::<(), _>(std::io::Error::other("disk full")))
        .await
        .expect("run");
    match outcome {
        JobOutcome::Failed(err) => assert_eq!(err.to_string(), "disk full"),
        other => panic!("expected Failed, got {other:?}"),
    }
    let mut obs = observer_for(&pool).await;
    assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(2)).await;
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn the_waiter_reports_the_holder_and_names_it_at_the_deadline(pool: PgPool) {
    init_tracing();
    let mut obs = observer_for(&pool).await;
    let obs_pid = backend_pid(&mut obs).await;
    assert!(raw_try_lock(&mut obs, &Raw::text("app:migrations")).await);

    let locker = PgLocker::new(pool.clone());
    let mut reports = Vec::new();
    let err = LockWaiter::new(&locker, "app:migrations", Duration::from_millis(1200))
        .report_every(Duration::from_millis(300))
        .on_report(|report| reports.push(report.clone()))
        .lock()
        .await
        .expect_err("held by the observer");
    assert!(!reports.is_empty(), "reported while waiting");
    let report = &reports[0];
    assert_eq!(report.key, LockKey::from("app:migrations"));
    assert_eq!(report.holders.len(), 1);
    assert_eq!(report.holders[0].pid, obs_pid);
    assert_eq!(
        report.holders[0].application_name.as_deref(),
        Some(OBSERVER_APP)
    );
    assert!(report.holders[0].since.is_some());
    assert_eq!(report.waiting, 1, "this waiter");
    let text = report.to_string();
    assert!(text.contains(&format!("held by pid {obs_pid}")), "{text}");
    assert!(text.contains(OBSERVER_APP), "{text}");

    match &err {
        Error::Timeout {
            holder_pid,
            holder_application,
            ..
        } => {
            assert_eq!(*holder_pid, Some(obs_pid));
            assert_eq!(holder_application.as_deref(), Some(OBSERVER_APP));
        }
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(err.to_string().contains(&obs_pid.to_string()), "{err}");

    // Once the holder lets go, a waiter gets the lock.
    let waiter = {
        let locker = locker.clone();
        tokio::spawn(async move {
            LockWaiter::new(&locker, "app:migrations", Duration::from_secs(5))
                .lock()
                .await
        })
    };
    wait_for_waiters(&mut obs, 1, Duration::from_secs(3)).await;
    assert!(raw_unlock(&mut obs, &Raw::text("app:migrations")).await);
    let lock = bounded("waiter gets the lock", Duration::from_secs(3), waiter)
        .await
        .expect("join")
        .expect("lock");
    lock.release().await.expect("release");
    close(obs).await;
}

/// A recorder that keeps every counter's total and every histogram's number
/// of samples, keyed by `name{label=value,...}`.
#[cfg(feature = "metrics")]
pub(crate) mod recorder {
    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex, OnceLock};

    use metrics::{
        Counter, CounterFn, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
        SharedString, Unit,
    };

    #[derive(Debug, Default)]
    pub struct Captured(Mutex<BTreeMap<String, f64>>);

    impl Captured {
        /// The process-wide recorder (installed once).
        pub fn global() -> &'static Arc<Captured> {
            static CAPTURED: OnceLock<Arc<Captured>> = OnceLock::new();
            CAPTURED.get_or_init(|| {
                let captured = Arc::new(Captured::default());
                metrics::set_global_recorder(Handle(captured.clone(), String::new()))
                    .expect("no other recorder in this test binary");
                captured
            })
        }

        pub fn get(&self, series: &str) -> f64 {
            self.0
                .lock()
                .expect("captured")
                .get(series)
                .copied()
                .unwrap_or(0.0)
        }

        fn add(&self, series: &str, value: f64) {
            *self
                .0
                .lock()
                .expect("captured")
                .entry(series.to_owned())
                .or_default() += value;
        }
    }

    struct Handle(Arc<Captured>, String);

    fn series(key: &Key) -> String {
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        format!("{}{{{}}}", key.name(), labels.join(","))
    }

    impl CounterFn for Handle {
        fn increment(&self, value: u64) {
            self.0.add(&self.1, value as f64);
        }
        fn absolute(&self, _value: u64) {}
    }

    impl HistogramFn for Handle {
        fn record(&self, _value: f64) {
            self.0.add(&self.1, 1.0);
        }
    }

    impl Recorder for Handle {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            Counter::from_arc(Arc::new(Handle(self.0.clone(), series(key))))
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }
        fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::from_arc(Arc::new(Handle(self.0.clone(), series(key))))
        }
    }
}

/// Lock and job metrics, labelled by the key's prefix (the default), from a
/// run, a skip, a loss and a timeout. The prefix `metricsprobe` is used by no
/// other test in this binary, so their metrics do not mix in.
#[cfg(feature = "metrics")]
#[sqlx::test(migrations = false)]
async fn metrics_count_runs_skips_losses_and_timeouts(pool: PgPool) {
    let captured = recorder::Captured::global();
    let pg = "backend=postgres,key=metricsprobe";

    // A run while another replica's run is in progress: one ran, one skipped.
    let job = SingletonJob::new(locker(&pool), "metricsprobe:a");
    let (started_tx, started_rx) = oneshot::channel();
    let (finish_tx, finish_rx) = oneshot::channel::<()>();
    let first = {
        let job = job.clone();
        tokio::spawn(async move {
            job.run(async |_ctx| {
                let _ = started_tx.send(());
                let _ = finish_rx.await;
                Ok::<_, Error>(())
            })
            .await
        })
    };
    started_rx.await.expect("started");
    let skipped = job
        .run(async |_ctx| Ok::<_, Error>(()))
        .await
        .expect("second");
    assert!(skipped.is_skipped());
    finish_tx.send(()).expect("finish");
    assert!(first.await.expect("join").expect("first").is_ran());

    let job_ran = "distlock_job_runs_total{job=metricsprobe,outcome=ran}";
    assert_eq!(captured.get(job_ran), 1.0);
    assert_eq!(
        captured.get("distlock_job_runs_total{job=metricsprobe,outcome=skipped}"),
        1.0
    );
    assert_eq!(
        captured.get("distlock_job_seconds{job=metricsprobe,outcome=ran}"),
        1.0
    );
    assert_eq!(
        captured.get(&format!("distlock_acquired_total{{{pg}}}")),
        1.0
    );
    assert_eq!(captured.get(&format!("distlock_busy_total{{{pg}}}")), 1.0);
    assert!(captured.get(&format!("distlock_wait_seconds{{{pg}}}")) >= 1.0);
    eventually("release counted", Duration::from_secs(2), async || {
        captured.get(&format!("distlock_released_total{{{pg}}}")) == 1.0
    })
    .await;
    assert_eq!(captured.get(&format!("distlock_hold_seconds{{{pg}}}")), 1.0);

    // A lost lease.
    let lost_job = SingletonJob::new(locker(&pool), "metricsprobe:lost");
    let (started_tx, started_rx) = oneshot::channel();
    let run = tokio::spawn(async move {
        lost_job
            .run(async |ctx| {
                let _ = started_tx.send(());
                ctx.cancelled().await;
                Ok::<_, Error>(())
            })
            .await
    });
    started_rx.await.expect("started");
    let pid = holder_pid(&pool, "metricsprobe:lost").await.expect("held");
    let mut obs = observer_for(&pool).await;
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .execute(&mut obs)
        .await
        .expect("terminate");
    let outcome = bounded("lost", Duration::from_secs(5), run)
        .await
        .expect("join")
        .expect("run");
    assert!(matches!(outcome, JobOutcome::Lost(_)), "{outcome:?}");
    assert_eq!(captured.get(&format!("distlock_lost_total{{{pg}}}")), 1.0);
    assert_eq!(
        captured.get("distlock_job_runs_total{job=metricsprobe,outcome=lost}"),
        1.0
    );

    // A wait that times out.
    assert!(raw_try_lock(&mut obs, &Raw::text("metricsprobe:busy")).await);
    let locker = PgLocker::new(pool.clone());
    let err = LockWaiter::new(&locker, "metricsprobe:busy", Duration::from_millis(200))
        .lock()
        .await
        .expect_err("times out");
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert_eq!(
        captured.get(&format!("distlock_timeout_total{{{pg}}}")),
        1.0
    );
    close(obs).await;
}

/// The job runner against the in-memory backend: no database, and a loss
/// caused on purpose stops the job and is reported as `Lost`.
#[tokio::test]
async fn a_job_on_the_memory_backend_is_stopped_when_its_lease_is_lost() {
    let memory = distlock::memory::MemoryLocker::new();
    let job = SingletonJob::new(Arc::new(memory.clone()), "job:memory");
    let other = SingletonJob::new(Arc::new(memory.clone()), "job:memory");
    let running = tokio::spawn(async move {
        job.run(async |ctx| {
            ctx.cancellation_token().cancelled().await;
            Ok::<_, Error>("stopped")
        })
        .await
    });
    // While it runs, a second runner skips.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let skipped = other.run(async |_| Ok::<_, Error>("no")).await.unwrap();
    assert!(skipped.is_skipped(), "{skipped:?}");
    assert!(memory.lose("job:memory"));
    let outcome = tokio::time::timeout(Duration::from_secs(5), running)
        .await
        .expect("the job stops")
        .unwrap()
        .unwrap();
    assert_eq!(outcome.name(), "lost", "{outcome:?}");
}

/// A job whose future panics as it is dropped (a value it holds panics in
/// its `Drop`), dropped because its lease was lost: the panic is caught as
/// one while it runs would be, and the run reports `Lost`, the lease given
/// back; it unwound out of `run`.
#[tokio::test]
async fn a_job_that_panics_as_it_is_dropped_after_a_loss_is_reported_lost() {
    struct PanicsOnDrop;
    impl Drop for PanicsOnDrop {
        fn drop(&mut self) {
            panic!("dropped");
        }
    }
    let memory = distlock::memory::MemoryLocker::new();
    let job = SingletonJob::new(Arc::new(memory.clone()), "job:panics-on-drop");
    let running = tokio::spawn(async move {
        job.run(async |_ctx| {
            let _held = PanicsOnDrop;
            std::future::pending::<()>().await;
            Ok::<_, Error>(())
        })
        .await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(memory.lose("job:panics-on-drop"));
    let outcome = tokio::time::timeout(Duration::from_secs(5), running)
        .await
        .expect("the job stops")
        .expect("run does not panic")
        .unwrap();
    assert_eq!(outcome.name(), "lost", "{outcome:?}");
    assert!(!memory.is_held("job:panics-on-drop"), "the lease went back");
}

/// A minimum hold too long to add to the clock keeps the lock for as long as
/// the runtime lives instead of panicking after the job ran.
#[tokio::test]
async fn a_min_hold_of_duration_max_holds_the_lock_instead_of_panicking() {
    let memory = distlock::memory::MemoryLocker::new();
    let job = SingletonJob::builder(Arc::new(memory.clone()), "job:forever")
        .min_hold(Duration::MAX)
        .build()
        .expect("valid settings");
    let outcome = tokio::spawn(async move { job.run(async |_| Ok::<_, Error>(7)).await })
        .await
        .expect("run does not panic")
        .unwrap();
    assert!(matches!(outcome, JobOutcome::Ran(7)), "{outcome:?}");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        memory.is_held("job:forever"),
        "the minimum hold keeps the lock"
    );
}

#[sqlx::test(migrations = false)]
async fn a_lease_table_release_that_fails_while_the_lease_holds_reports_ran(pool: PgPool) {
    init_tracing();
    distlock::migrate(&pool).await.expect("migrate");
    let locker: Arc<dyn Locker> = Arc::new(distlock::postgres::TableLocker::new(pool.clone()));
    let job = SingletonJob::new(locker, "job:table-release-fails");
    let admin = pool.clone();
    let outcome = job
        .run(async move |ctx| {
            refuse_lease_deletes(&admin).await;
            assert!(!ctx.lease().is_lost());
            Ok::<_, Error>("done")
        })
        .await
        .expect("run");
    assert!(
        matches!(outcome, JobOutcome::Ran("done")),
        "the lease held to the end; only its release failed: {outcome:?}"
    );
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM distlock.leases")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(rows, 1, "the lease stays until it expires");
}
