//! The lock kinds under contention from several OS processes, with the
//! histories checked afterwards, and dropped at every `.await`.
//!
//! The worker processes are this test binary run again with
//! `DISTLOCK_KINDS_WORKER` set: `worker_entry` then runs the workload and
//! writes one line per critical section (`enter exit` in `CLOCK_MONOTONIC`
//! nanoseconds, one clock for every process on the machine).

use crate::common;
use common::event_log::now_ns;
use common::url_of;

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use distlock::{LockKey, PgLocker};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

const PERMITS: u32 = 2;
const PROCESSES: usize = 3;
const TASKS: usize = 4;
const ROUNDS: usize = 15;

/// The worker side: `DISTLOCK_KINDS_WORKER=semaphore|multi`, the database
/// in `DISTLOCK_KINDS_URL`, the history file in `DISTLOCK_KINDS_OUT`.
#[test]
fn worker_entry() {
    let Ok(kind) = std::env::var("DISTLOCK_KINDS_WORKER") else {
        return; // an ordinary test run
    };
    let url = std::env::var("DISTLOCK_KINDS_URL").expect("DISTLOCK_KINDS_URL");
    let out = std::env::var("DISTLOCK_KINDS_OUT").expect("DISTLOCK_KINDS_OUT");
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(work(&kind, &url, &out));
}

async fn work(kind: &str, url: &str, out: &str) {
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect(url)
        .await
        .expect("pool");
    let locker = PgLocker::new(pool);
    if kind == "head" {
        // One waiter, which becomes its process's head (see
        // `a_stopped_head_does_not_keep_the_queue`).
        let semaphore = locker.semaphore(HEAD_SEMAPHORE, 1).expect("semaphore");
        let permit = semaphore.acquire(Duration::from_secs(60)).await;
        std::fs::write(out, format!("{:?}", permit.as_ref().map(|_| ()))).expect("write");
        permit
            .expect("the stopped head is served once it runs again")
            .release()
            .await
            .expect("release");
        return;
    }
    let file = Arc::new(std::sync::Mutex::new(
        std::fs::File::create(out).expect("history file"),
    ));
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let (locker, file, kind) = (locker.clone(), file.clone(), kind.to_owned());
        tasks.push(tokio::spawn(async move {
            for round in 0..ROUNDS {
                let line = match kind.as_str() {
                    "semaphore" => semaphore_section(&locker).await,
                    _ => multi_section(&locker, task + round).await,
                };
                writeln!(file.lock().unwrap(), "{line}").expect("write history");
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
}

/// One permit held for a moment: `sem enter exit`.
async fn semaphore_section(locker: &PgLocker) -> String {
    let semaphore = locker.semaphore("procs", PERMITS).expect("semaphore");
    let permit = semaphore
        .acquire(Duration::from_secs(30))
        .await
        .expect("permit");
    let enter = now_ns();
    tokio::time::sleep(Duration::from_millis(2)).await;
    let exit = now_ns();
    permit.release().await.expect("release");
    format!("sem {enter} {exit}")
}

/// Two of four keys, in an order that differs between callers:
/// `multi enter exit a b`.
async fn multi_section(locker: &PgLocker, i: usize) -> String {
    let (a, b) = (i % 4, (i + 1 + i % 3) % 4);
    let (a, b) = if a == b { (a, (a + 1) % 4) } else { (a, b) };
    let keys = if i.is_multiple_of(2) { [a, b] } else { [b, a] };
    let all = locker
        .lock_all(
            keys.map(|k| LockKey::from(format!("multi:{k}"))),
            Duration::from_secs(30),
        )
        .await
        .expect("lock_all");
    let enter = now_ns();
    tokio::time::sleep(Duration::from_millis(1)).await;
    let exit = now_ns();
    all.release().await.expect("release");
    format!("multi {enter} {exit} {} {}", keys[0], keys[1])
}

/// Runs `PROCESSES` workers of `kind`; all their history lines.
fn run_workers(kind: &'static str, url: String) -> Vec<Vec<String>> {
    let dir = std::env::temp_dir().join(format!("distlock-kinds-{}-{kind}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let exe = std::env::current_exe().expect("current_exe");
    let children: Vec<_> = (0..PROCESSES)
        .map(|p| {
            let out = dir.join(format!("{p}.log"));
            let child = std::process::Command::new(&exe)
                .args(["kinds_faults::worker_entry", "--exact", "--nocapture"])
                .env("DISTLOCK_KINDS_WORKER", kind)
                .env("DISTLOCK_KINDS_URL", &url)
                .env("DISTLOCK_KINDS_OUT", &out)
                .spawn()
                .expect("spawn worker");
            (child, out)
        })
        .collect();
    let mut lines = Vec::new();
    for (mut child, out) in children {
        assert!(child.wait().expect("wait").success(), "a worker failed");
        let text = std::fs::read_to_string(out).expect("history");
        lines.extend(
            text.lines()
                .map(|l| l.split(' ').map(str::to_owned).collect::<Vec<_>>()),
        );
    }
    let _ = std::fs::remove_dir_all(dir);
    assert_eq!(
        lines.len(),
        PROCESSES * TASKS * ROUNDS,
        "every section logged"
    );
    lines
}

/// The most sections open at one instant.
fn max_concurrent(sections: &[(u64, u64)]) -> usize {
    let mut events: Vec<(u64, i32)> = Vec::new();
    for (enter, exit) in sections {
        events.push((*enter, 1));
        events.push((*exit, -1));
    }
    // At equal instants, exits first: touching sections do not overlap.
    events.sort_by_key(|&(t, d)| (t, d));
    let (mut open, mut most) = (0_i32, 0_i32);
    for (_, d) in events {
        open += d;
        most = most.max(open);
    }
    most as usize
}

fn spans(lines: &[Vec<String>]) -> Vec<(u64, u64)> {
    lines
        .iter()
        .map(|l| (l[1].parse().expect("enter"), l[2].parse().expect("exit")))
        .collect()
}

/// The semaphore of the stopped-head case.
const HEAD_SEMAPHORE: &str = "procs-head";

/// A waiting process (a worker) holds the semaphore's queue as its head and
/// is stopped with SIGSTOP; its permit is freed. Its session goes quiet, the
/// server ends it after the head's idle guard (2 s), and this process's
/// waiter gets the permit. Resumed, the worker lines up again and is served.
/// (`a_head_without_the_guard_keeps_the_queue` in the integration suite is
/// the broken variant: a head without the guard keeps every waiter out.)
#[sqlx::test(migrations = false)]
async fn a_stopped_head_does_not_keep_the_queue(pool: PgPool) {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let locker = PgLocker::new(pool.clone());
    let semaphore = locker.semaphore(HEAD_SEMAPHORE, 1).expect("semaphore");
    let held = semaphore.try_acquire().await.unwrap().expect("free");
    let out = std::env::temp_dir().join(format!("distlock-head-{}.log", std::process::id()));
    let mut worker = std::process::Command::new(std::env::current_exe().expect("current_exe"))
        .args(["kinds_faults::worker_entry", "--exact", "--nocapture"])
        .env("DISTLOCK_KINDS_WORKER", "head")
        .env("DISTLOCK_KINDS_URL", url_of(&pool))
        .env("DISTLOCK_KINDS_OUT", &out)
        .spawn()
        .expect("spawn worker");
    let pid = Pid::from_raw(i32::try_from(worker.id()).expect("pid"));
    let mut obs = common::observer_for(&pool).await;
    common::semaphore_head_idle_with_queue(&mut obs, HEAD_SEMAPHORE).await;
    kill(pid, Signal::SIGSTOP).expect("SIGSTOP");
    // A try it sent just before the stop has answered: it is idle, and
    // still holds the queue (it took no slot).
    common::semaphore_head_idle_with_queue(&mut obs, HEAD_SEMAPHORE).await;
    held.release().await.unwrap();
    let started = std::time::Instant::now();
    let served = semaphore.acquire(Duration::from_secs(10)).await;
    let took = started.elapsed();
    kill(pid, Signal::SIGCONT).expect("SIGCONT");
    println!("served past the stopped head after {took:?}");
    served
        .expect("served past the stopped head")
        .release()
        .await
        .unwrap();
    let status = tokio::task::spawn_blocking(move || worker.wait().expect("wait"))
        .await
        .expect("worker");
    assert!(status.success(), "the resumed worker was served");
    let _ = std::fs::remove_file(out);
    common::close(obs).await;
}

#[test]
fn the_checker_sees_too_many_holders() {
    // The control: three sections open at once are three, touching ones
    // are not two.
    assert_eq!(max_concurrent(&[(0, 10), (5, 15), (6, 7)]), 3);
    assert_eq!(max_concurrent(&[(0, 10), (10, 20)]), 1);
}

#[sqlx::test(migrations = false)]
async fn a_semaphore_across_processes_never_admits_more_than_its_permits(pool: PgPool) {
    distlock::migrate(&pool).await.expect("migrate");
    let url = url_of(&pool);
    let lines = tokio::task::spawn_blocking(move || run_workers("semaphore", url))
        .await
        .expect("workers");
    let most = max_concurrent(&spans(&lines));
    println!("semaphore({PERMITS}) across {PROCESSES} processes: at most {most} holders at once");
    assert!(
        most <= PERMITS as usize,
        "{most} holders of {PERMITS} permits"
    );
    assert_eq!(most, PERMITS as usize, "the permits were used");
}

#[sqlx::test(migrations = false)]
async fn multi_key_locks_across_processes_exclude_per_key_and_never_deadlock(pool: PgPool) {
    let url = url_of(&pool);
    let lines = tokio::task::spawn_blocking(move || run_workers("multi", url))
        .await
        .expect("workers");
    for key in 0..4 {
        let k = key.to_string();
        let on_key: Vec<_> = lines
            .iter()
            .filter(|l| l[3] == k || l[4] == k)
            .cloned()
            .collect();
        let most = max_concurrent(&spans(&on_key));
        assert_eq!(most, 1, "key {key}: {most} holders at once");
    }
}

mod cancel {
    //! Each kind's waiting call dropped after 0, 1, 2, ... Pendings until it
    //! completes. The connections go through a proxy that holds every chunk
    //! back 300 µs, so every statement takes several Pendings (on loopback a
    //! fast server can answer within a single poll, and a sweep would then
    //! test no drop point at all).

    use std::future::Future;
    use std::time::Duration;

    use distlock::{PgLocker, Semaphore};
    use sqlx::PgPool;
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

    use super::common::drop_after::drop_after;
    use super::common::proxy::Proxy;
    use super::common::{assert_no_advisory_locks_eventually, observer_for};

    /// Drops `call()` after 0, 1, 2, ... Pendings until it completes; after
    /// every drop nothing may stay held. Returns the drops.
    async fn sweep<F, T, E>(pool: &PgPool, what: &str, mut call: impl FnMut() -> F) -> usize
    where
        F: Future<Output = Result<T, E>>,
        E: std::fmt::Debug,
    {
        let mut obs = observer_for(pool).await;
        for budget in 0..500 {
            let done = drop_after(budget, call()).await;
            let finished = match done {
                Some(Ok(held)) => {
                    drop(held);
                    true
                }
                Some(Err(err)) => panic!("{what} failed: {err:?}"),
                None => false,
            };
            assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(5)).await;
            if finished {
                assert!(budget >= 2, "{what}: only {budget} drop points");
                return budget;
            }
        }
        panic!("{what}: still pending after 500 polls");
    }

    #[sqlx::test(migrations = false)]
    async fn every_kind_dropped_at_every_pending_leaves_nothing_held(pool: PgPool) {
        distlock::migrate(&pool).await.expect("migrate");
        let opts: PgConnectOptions = pool.connect_options().as_ref().clone();
        let proxy = Proxy::start(opts.get_host(), opts.get_port())
            .await
            .expect("proxy");
        proxy.delay(Duration::from_micros(300));
        let slow = PgPoolOptions::new()
            .max_connections(8)
            .connect_with(proxy.options(&opts))
            .await
            .expect("pool through the proxy");
        let locker = PgLocker::new(slow.clone());
        let semaphore = locker.semaphore("cancel", 3).expect("semaphore");
        let mut seen = Vec::new();
        seen.push((
            "Semaphore::try_acquire",
            sweep(&pool, "try_acquire", || semaphore.try_acquire()).await,
        ));
        seen.push((
            "lock_all",
            sweep(&pool, "lock_all", || {
                locker.lock_all(["c:1", "c:2", "c:3"], Duration::from_secs(5))
            })
            .await,
        ));
        seen.push((
            "lock_shared",
            sweep(&pool, "lock_shared", || {
                locker.lock_shared("c:shared", Duration::from_secs(5))
            })
            .await,
        ));
        seen.push((
            "lock_xact",
            sweep(&pool, "lock_xact", || {
                let slow = slow.clone();
                async move {
                    let mut tx = slow.begin().await?;
                    distlock::lock_xact(&mut tx, "c:xact", Duration::from_secs(5)).await?;
                    tx.commit().await?;
                    Ok::<_, distlock::Error>(())
                }
            })
            .await,
        ));
        println!("drop points per call: {seen:?}");

        // Waits dropped while the keys are held elsewhere: only the
        // holders' locks stay.
        let holder = PgLocker::new(pool.clone());
        let held = holder.try_lock("c:1").await.expect("try").expect("free");
        let full: Vec<_> = take_every_permit(&semaphore).await;
        let mut obs = observer_for(&pool).await;
        let before = super::common::advisory_locks(&mut obs).await.len();
        // A wait that outlasts its budget of Pendings ends in a timeout:
        // keep it short, it is not what is tested here.
        let wait = Duration::from_millis(500);
        for budget in 0..12 {
            let waiting = drop_after(budget, locker.lock_all(["c:1", "c:2"], wait));
            // Dropped, or (with fewer Pendings than `budget`) timed out.
            let got = waiting.await;
            assert!(
                matches!(got, None | Some(Err(distlock::Error::Timeout { .. }))),
                "c:1 is held: {got:?}"
            );
            let waiting = drop_after(budget, semaphore.acquire(wait));
            let got = waiting.await;
            assert!(
                matches!(got, None | Some(Err(distlock::Error::Timeout { .. }))),
                "every permit is held: {got:?}"
            );
            super::common::eventually(
                "only the holders' locks",
                Duration::from_secs(5),
                async || super::common::advisory_locks(&mut obs).await.len() == before,
            )
            .await;
        }
        drop(full);
        held.release().await.expect("release");
    }

    /// Takes every permit of `semaphore`.
    async fn take_every_permit(semaphore: &Semaphore) -> Vec<distlock::SemaphorePermit> {
        let mut all = Vec::new();
        while let Some(permit) = semaphore.try_acquire().await.expect("try_acquire") {
            all.push(permit);
        }
        assert_eq!(all.len(), semaphore.permits() as usize);
        all
    }
}
