//! Mutual exclusion under real parallelism: session lockers and
//! transaction-scoped try-lockers hammer one key at the same time.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;
use distlock::{Error, PgLocker};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const SESSION_TASKS: usize = 8;
const SESSION_ROUNDS: usize = 40;
const XACT_TASKS: usize = 8;
const KEY: &str = "concurrency:one-key";

#[derive(Debug, Default)]
struct Counters {
    in_section: AtomicUsize,
    violations: AtomicUsize,
    session_sections: AtomicUsize,
    xact_sections: AtomicUsize,
    xact_busy: AtomicUsize,
    sessions_done: AtomicBool,
}

impl Counters {
    fn enter(&self) {
        if self.in_section.fetch_add(1, Ordering::SeqCst) != 0 {
            self.violations.fetch_add(1, Ordering::SeqCst);
        }
    }
    fn exit(&self) {
        self.in_section.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn workload(connect_opts: PgConnectOptions) -> Arc<Counters> {
    let pool = PgPoolOptions::new()
        .max_connections((SESSION_TASKS + XACT_TASKS + 2) as u32)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(connect_opts.clone())
        .await
        .expect("pool");
    let locker = PgLocker::builder(pool.clone())
        .heartbeat(Duration::from_millis(100))
        .heartbeat_timeout(PATIENT)
        .build()
        .expect("valid settings");
    let c = Arc::new(Counters::default());

    let mut sessions = Vec::new();
    for t in 0..SESSION_TASKS {
        let locker = locker.clone();
        let c = c.clone();
        sessions.push(tokio::spawn(async move {
            for round in 0..SESSION_ROUNDS {
                let lock = locker
                    .lock(KEY, Duration::from_secs(30))
                    .await
                    .unwrap_or_else(|e| panic!("session task {t} round {round}: {e}"));
                c.enter();
                assert!(!lock.is_lost());
                tokio::time::sleep(Duration::from_micros(500)).await;
                c.session_sections.fetch_add(1, Ordering::SeqCst);
                c.exit();
                lock.release()
                    .await
                    .unwrap_or_else(|e| panic!("session task {t} round {round}: release: {e}"));
                // Leave gaps of varying length so that, now and then, no
                // session task holds or awaits the lock and try-lockers get in.
                let gap = (t * 7 + round * 13) % 5;
                tokio::time::sleep(Duration::from_millis(gap as u64)).await;
            }
        }));
    }
    let mut xacts = Vec::new();
    for _ in 0..XACT_TASKS {
        let locker = locker.clone();
        let c = c.clone();
        xacts.push(tokio::spawn(async move {
            let started = Instant::now();
            // Keep trying while the session tasks run, and at least until
            // this task got in a few times (bounded).
            let mut mine = 0;
            while (!c.sessions_done.load(Ordering::SeqCst) || mine < 3)
                && started.elapsed() < Duration::from_secs(60)
            {
                let got = locker
                    .with_advisory_lock(KEY, async |_conn| {
                        c.enter();
                        tokio::time::sleep(Duration::from_micros(500)).await;
                        c.xact_sections.fetch_add(1, Ordering::SeqCst);
                        c.exit();
                        Ok::<_, Error>(())
                    })
                    .await
                    .expect("with_advisory_lock");
                match got {
                    Some(()) => mine += 1,
                    None => {
                        c.xact_busy.fetch_add(1, Ordering::SeqCst);
                    }
                }
                tokio::task::yield_now().await;
            }
        }));
    }
    for s in sessions {
        s.await.expect("session task");
    }
    let xact_during_sessions = c.xact_sections.load(Ordering::SeqCst);
    c.sessions_done.store(true, Ordering::SeqCst);
    for x in xacts {
        x.await.expect("xact task");
    }
    println!(
        "session sections {}, xact sections {} ({} while session tasks ran), xact busy answers {}, violations {}",
        c.session_sections.load(Ordering::SeqCst),
        c.xact_sections.load(Ordering::SeqCst),
        xact_during_sessions,
        c.xact_busy.load(Ordering::SeqCst),
        c.violations.load(Ordering::SeqCst),
    );
    let mut obs = observer(&connect_opts).await;
    assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(5)).await;
    close(obs).await;
    pool.close().await;
    c
}

#[sqlx::test(migrations = false)]
async fn session_and_xact_lockers_never_overlap(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    // `#[sqlx::test]` runs on a current-thread runtime; run the workload on a
    // multi-threaded one of its own so the tasks really run in parallel.
    let started = Instant::now();
    let c = tokio::task::spawn_blocking(move || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(workload(connect_opts))
    })
    .await
    .expect("workload");
    println!("workload took {:?}", started.elapsed());
    assert_eq!(
        c.violations.load(Ordering::SeqCst),
        0,
        "two holders were inside the critical section at once"
    );
    assert_eq!(c.in_section.load(Ordering::SeqCst), 0);
    assert_eq!(
        c.session_sections.load(Ordering::SeqCst),
        SESSION_TASKS * SESSION_ROUNDS,
        "every session round ran"
    );
    assert!(
        c.xact_sections.load(Ordering::SeqCst) >= XACT_TASKS * 3,
        "transaction-scoped lockers made progress"
    );
    assert!(
        c.xact_busy.load(Ordering::SeqCst) > 0,
        "the try-lockers did meet contention"
    );
}

/// Control for the test above: the same in-section counter does see overlaps
/// when the tasks do *not* share a key, so a zero there means something.
#[sqlx::test(migrations = false)]
async fn overlap_counter_detects_overlap_without_a_common_key(pool: sqlx::PgPool) {
    let locker = PgLocker::new(pool);
    let c = Arc::new(Counters::default());
    let mut tasks = Vec::new();
    for t in 0..3 {
        let locker = locker.clone();
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let lock = locker
                .lock(format!("control:{t}"), Duration::from_secs(10))
                .await
                .unwrap();
            c.enter();
            tokio::time::sleep(Duration::from_millis(200)).await;
            c.exit();
            lock.release().await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert!(
        c.violations.load(Ordering::SeqCst) > 0,
        "distinct keys must overlap"
    );
}
