//! The semaphore and leader election across a hard network partition that
//! the server really sees (tests/common/netns.rs), each beside a broken
//! variant that the same check catches.
//!
//! A worker (this test binary run again in the client namespace,
//! `kinds_partition_worker`) holds a permit of a one-permit semaphore and
//! leads an election, through a `PgLocker` with a 1 s heartbeat and a 1 s
//! deadline. The test process, in its own namespace and over the server's
//! Unix-domain socket, waits for the permit and campaigns for the election.
//! Then the link is cut. The server frees the worker's locks when its
//! keepalives run out (about 25–30 s); the worker's heartbeat tells it
//! within about 2 s. The claims:
//!
//! - the worker's permit reports `lost()` before the test's waiter is
//!   granted the permit: never two holders of one permit;
//! - the worker's campaign stops leading before the test's campaign leads:
//!   never two leaders;
//! - `leader()` and an `Observer`, read by the test, never name the worker
//!   once the server no longer shows its backend holding the election's
//!   lock;
//! - the waiter and the successor get their turn within the server's bound.
//!
//! The broken variants run under the same cut, beside them: a holder that
//! keeps its permit's critical section open until the end (it never looks
//! at `lost()`), and a campaign over a locker whose leases never report a
//! loss. The same checks must find two holders and two leaders there.

use crate::common;
use crate::partition::{Scratch, rows};

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use common::cluster::Cluster;
use common::event_log::{Log, event, now_ns, secs};
use common::netns::{Partition, SERVER_ADDR};
use common::*;
use distlock::{Campaign, Error, LeaderElection, Lease, LockKey, Locker, LossReason, PgLocker};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const SEMAPHORE: &str = "partition:semaphore";
const BROKEN_SEMAPHORE: &str = "partition:semaphore-broken";
const ELECTION: &str = "partition:election";
const BROKEN_ELECTION: &str = "partition:election-broken";

const WORKER: &str = "worker";
const SUCCESSOR: &str = "successor";

const HEARTBEAT: Duration = Duration::from_secs(1);
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(1);
/// The documented bound (about 25–30 s) plus slack for a loaded machine,
/// plus the successor's takeover grace (1.25 × (heartbeat + deadline)).
const SERVER_BOUND: Duration = Duration::from_secs(45);

const ENV_URL: &str = "DISTLOCK_KINDS_PARTITION_URL";
const ENV_OUT: &str = "DISTLOCK_KINDS_PARTITION_OUT";
/// A file the test creates once the link has healed: the worker then ends.
const ENV_STOP: &str = "DISTLOCK_KINDS_PARTITION_STOP";

async fn locker(options: PgConnectOptions) -> Arc<PgLocker> {
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .expect("pool");
    Arc::new(
        PgLocker::builder(pool)
            .heartbeat(HEARTBEAT)
            .heartbeat_timeout(HEARTBEAT_TIMEOUT)
            .build()
            .expect("valid settings"),
    )
}

fn campaign(locker: Arc<dyn Locker>, key: &str, identity: &str) -> Campaign {
    LeaderElection::builder(locker, key)
        .identity(identity)
        .retry(Duration::from_millis(50))
        .build()
        .expect("valid settings")
        .campaign()
}

// ---- the broken locker ------------------------------------------------------

/// A `PgLocker` whose leases never report a loss: a campaign over it keeps
/// leading after the server freed its lock.
#[derive(Debug)]
struct Deaf(Arc<PgLocker>);

#[derive(Debug)]
struct DeafLease(Box<dyn Lease>);

#[async_trait]
impl Locker for Deaf {
    async fn try_lock(&self, key: LockKey) -> Result<Option<Box<dyn Lease>>, Error> {
        let lease = Locker::try_lock(&*self.0, key).await?;
        Ok(lease.map(|lease| Box::new(DeafLease(lease)) as Box<dyn Lease>))
    }

    async fn lock(&self, key: LockKey, timeout: Duration) -> Result<Box<dyn Lease>, Error> {
        let lease = Locker::lock(&*self.0, key, timeout).await?;
        Ok(Box::new(DeafLease(lease)))
    }

    fn backend(&self) -> &'static str {
        "postgres"
    }
}

#[async_trait]
impl Lease for DeafLease {
    fn key(&self) -> &LockKey {
        self.0.key()
    }
    fn fencing_token(&self) -> Option<distlock::FencingToken> {
        self.0.fencing_token()
    }
    async fn lost(&self) -> LossReason {
        std::future::pending().await
    }
    fn is_lost(&self) -> bool {
        false
    }
    fn loss(&self) -> Option<LossReason> {
        None
    }
    fn held_for(&self) -> Duration {
        self.0.held_for()
    }
    async fn release(self: Box<Self>) -> Result<(), Error> {
        self.0.release().await
    }
}

// ---- the worker: runs in the client namespace -------------------------------

#[test]
fn kinds_partition_worker() {
    let Ok(url) = std::env::var(ENV_URL) else {
        return; // an ordinary test run
    };
    let out = std::env::var(ENV_OUT).expect(ENV_OUT);
    let stop = std::env::var(ENV_STOP).expect(ENV_STOP);
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(work(&url, &out, Path::new(&stop)));
}

/// Logs `event` when `campaign` stops leading. The flag is set just after
/// `elected()` returns, so it is first awaited as `true`.
fn log_when_deposed(campaign: &Campaign, log: &Log, event: &'static str) {
    let (mut leadership, log) = (campaign.leadership(), log.clone());
    tokio::spawn(async move {
        if leadership.wait_for(|leads| *leads).await.is_ok()
            && leadership.wait_for(|leads| !*leads).await.is_ok()
        {
            log.line(event, "");
        }
    });
}

async fn work(url: &str, out: &str, stop: &Path) {
    let log = Log::create(out);
    let locker = locker(url.parse().expect("database URL")).await;

    let semaphore = locker.semaphore(SEMAPHORE, 1).expect("semaphore");
    let permit = semaphore.try_acquire().await.expect("try").expect("free");
    log.line("permit_held", permit.slot());
    let broken_semaphore = locker.semaphore(BROKEN_SEMAPHORE, 1).expect("semaphore");
    let broken_permit = broken_semaphore
        .try_acquire()
        .await
        .expect("try")
        .expect("free");
    log.line("broken_permit_held", broken_permit.slot());

    let leader = campaign(locker.clone(), ELECTION, WORKER);
    let term = leader.elected().await.expect("elected");
    log.line("leading", format!("{:?}", term.number()));
    log_when_deposed(&leader, &log, "leader_stopped");
    let deaf: Arc<dyn Locker> = Arc::new(Deaf(locker.clone()));
    let broken_leader = campaign(deaf, BROKEN_ELECTION, WORKER);
    broken_leader.elected().await.expect("elected");
    log.line("broken_leading", "");
    log_when_deposed(&broken_leader, &log, "broken_leader_stopped");

    // The honest holder's critical section ends when its permit is lost;
    // the broken one's when the test says stop.
    tokio::select! {
        reason = permit.lost() => log.line("permit_lost", reason),
        () = until_exists(stop) => {}
    }
    until_exists(stop).await;
    log.line("broken_permit_end", "");
    log.line("broken_leader_at_stop", broken_leader.is_leader());
    drop((permit, broken_permit, leader, broken_leader));
    log.line("done", "");
}

async fn until_exists(path: &Path) {
    while !path.exists() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---- the test: runs in the test's own namespace -----------------------------

/// When each of the test's own contenders got its turn (CLOCK_MONOTONIC ns).
#[derive(Debug, Default)]
struct Turns {
    permit: Option<u64>,
    broken_permit: Option<u64>,
    leader: Option<u64>,
    broken_leader: Option<u64>,
}

impl Turns {
    fn all(&self) -> bool {
        [
            self.permit,
            self.broken_permit,
            self.leader,
            self.broken_leader,
        ]
        .iter()
        .all(Option::is_some)
    }
}

/// A waiter for one permit of `name`: returns when it was granted.
fn wait_for_permit(
    locker: &Arc<PgLocker>,
    name: &'static str,
) -> tokio::task::JoinHandle<Result<u64, Error>> {
    let semaphore = locker.semaphore(name, 1).expect("semaphore");
    tokio::spawn(async move {
        let permit = semaphore.acquire(Duration::from_secs(90)).await?;
        let at = now_ns();
        permit.release().await?;
        Ok(at)
    })
}

/// `Some(at)` once the task has finished, with its result.
async fn finished(task: &mut Option<tokio::task::JoinHandle<Result<u64, Error>>>) -> Option<u64> {
    if !task.as_ref().is_some_and(|t| t.is_finished()) {
        return None;
    }
    let done = task.take().expect("a task").await.expect("join");
    Some(done.expect("the waiter was granted its permit"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn across_a_partition_no_permit_or_leadership_is_held_twice() {
    init_tracing();
    // Dropped in reverse: the worker killed, the cluster stopped, the
    // namespaces deleted, also when an assertion fails.
    let mut net = Partition::new();
    let cluster =
        Cluster::primary_in_netns("partition-kinds", &[], net.server_ns(), SERVER_ADDR).await;
    let scratch = Scratch(
        std::env::temp_dir().join(format!("distlock-partition-kinds-{}", std::process::id())),
    );
    std::fs::create_dir_all(&scratch.0).expect("scratch dir");
    let (log, stop) = (scratch.0.join("events.log"), scratch.0.join("stop"));

    let local = cluster.socket_options();
    let setup = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(local.clone())
        .await
        .expect("pool over the Unix socket");
    distlock::migrate(&setup).await.expect("migrate");
    setup.close().await;

    let url = format!(
        "postgres://postgres@{SERVER_ADDR}:{}/postgres",
        cluster.port()
    );
    let mut worker = net.in_client(std::env::current_exe().expect("current_exe"));
    worker
        .args([
            "partition_kinds::kinds_partition_worker",
            "--exact",
            "--nocapture",
        ])
        .env(ENV_URL, &url)
        .env(ENV_OUT, &log)
        .env(ENV_STOP, &stop);
    let mut worker = tokio::process::Command::from(worker)
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the worker in the client namespace");
    eventually(
        "the worker holds its permits and leads",
        Duration::from_secs(60),
        async || {
            if let Ok(Some(status)) = worker.try_wait() {
                panic!("the worker exited early: {status}");
            }
            [
                "permit_held",
                "broken_permit_held",
                "leading",
                "broken_leading",
            ]
            .iter()
            .all(|e| event(&log, e).is_some())
        },
    )
    .await;

    // The test's contenders, over the Unix socket.
    let mut obs = observer(&local).await;
    let leader_pid = rows(&mut obs, ELECTION)
        .await
        .iter()
        .find(|(_, granted)| *granted)
        .map(|(pid, _)| *pid)
        .expect("the worker's backend holds the election's lock");
    let here = locker(local.clone()).await;
    let mut permit_task = Some(wait_for_permit(&here, SEMAPHORE));
    let mut broken_permit_task = Some(wait_for_permit(&here, BROKEN_SEMAPHORE));
    let election = LeaderElection::builder(here.clone(), ELECTION)
        .poll(Duration::from_millis(100))
        .build()
        .expect("valid settings");
    let observer = election.observe();
    let successor = campaign(here.clone(), ELECTION, SUCCESSOR);
    let broken_successor = campaign(here.clone(), BROKEN_ELECTION, SUCCESSOR);
    // A heartbeat or so across the link before it breaks.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(
        worker.try_wait().expect("try_wait").is_none(),
        "the worker is still running"
    );
    let named = election.leader().await.expect("leader()");
    assert_eq!(
        named.map(|info| info.identity).as_deref(),
        Some(WORKER),
        "leader() names the worker before the cut"
    );

    let cut_at = now_ns();
    net.cut();

    // Watch every 100 ms: who holds the election's lock on the server,
    // whom leader() and the observer name, who got their turn.
    let mut turns = Turns::default();
    let mut freed: Option<u64> = None;
    let mut misnamed: Vec<String> = Vec::new();
    let watch_until = cut_at + 75_000_000_000;
    while now_ns() < watch_until && !turns.all() {
        let at = now_ns();
        if freed.is_none() && !rows(&mut obs, ELECTION).await.contains(&(leader_pid, true)) {
            freed = Some(at);
        }
        let named = election.leader().await.expect("leader()");
        if let Some(freed) = freed
            && named.is_some_and(|info| info.identity == WORKER)
        {
            misnamed.push(format!(
                "leader() named the worker {:.3} s after the server freed its lock",
                secs(freed, now_ns())
            ));
        }
        // The observer reads every 100 ms: give it a read and a half.
        if let Some(freed) = freed
            && secs(freed, at) > 0.25
            && observer
                .leader()
                .is_some_and(|info| info.identity == WORKER)
        {
            misnamed.push(format!(
                "the observer named the worker {:.3} s after the server freed its lock",
                secs(freed, at)
            ));
        }
        turns.permit = turns.permit.or(finished(&mut permit_task).await);
        turns.broken_permit = turns
            .broken_permit
            .or(finished(&mut broken_permit_task).await);
        if turns.leader.is_none() && successor.is_leader() {
            turns.leader = Some(at);
        }
        if turns.broken_leader.is_none() && broken_successor.is_leader() {
            turns.broken_leader = Some(at);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let heal_at = now_ns();
    net.heal();
    std::fs::write(&stop, "").expect("stop file");
    bounded(
        "the worker finishes after the heal",
        Duration::from_secs(120),
        worker.wait(),
    )
    .await
    .expect("wait for the worker");
    let named_at_end = election.leader().await.expect("leader()");

    let after_cut = |at: Option<u64>| at.map_or(f64::INFINITY, |at| secs(cut_at, at));
    let worker_at = |name: &str| event(&log, name).map(|(at, _)| at);
    let (permit_lost, leader_stopped) = (worker_at("permit_lost"), worker_at("leader_stopped"));
    let broken_permit_end = worker_at("broken_permit_end");
    let broken_leader_stopped = worker_at("broken_leader_stopped");
    println!(
        "seconds after the cut: the server freed the election's lock {:.3}; worker: permit \
         lost {:.3}, stopped leading {:.3}; here: permit granted {:.3}, successor leads {:.3}; \
         healed {:.3}",
        after_cut(freed),
        after_cut(permit_lost),
        after_cut(leader_stopped),
        after_cut(turns.permit),
        after_cut(turns.leader),
        secs(cut_at, heal_at),
    );
    println!(
        "broken variants, seconds after the cut: the holder ended its section {:.3}, its \
         successor was granted {:.3}; the deaf leader stopped {:.3}, its successor leads {:.3}",
        after_cut(broken_permit_end),
        after_cut(turns.broken_permit),
        after_cut(broken_leader_stopped),
        after_cut(turns.broken_leader),
    );

    // Every claim is checked, and every broken one reported together.
    let mut broken: Vec<String> = misnamed;
    let mut check = |ok: bool, what: String| {
        if !ok {
            broken.push(what);
        }
    };
    let bound = SERVER_BOUND.as_secs_f64();
    let notice = (HEARTBEAT + HEARTBEAT_TIMEOUT).as_secs_f64() + 8.0;
    for (what, stepped_down, successor) in [
        ("permit", permit_lost, turns.permit),
        ("leadership", leader_stopped, turns.leader),
    ] {
        check(
            before(stepped_down, successor),
            format!(
                "{what}: the worker gave it up {:.3} s after the cut, its successor had it \
                 {:.3} s after the cut",
                after_cut(stepped_down),
                after_cut(successor)
            ),
        );
        check(
            stepped_down.is_some_and(|at| at > cut_at),
            format!(
                "{what}: the worker gave it up {:.3} s after the cut, before the cut",
                after_cut(stepped_down)
            ),
        );
        check(
            after_cut(stepped_down) <= notice,
            format!(
                "{what}: the worker learnt of its loss {:.3} s after the cut",
                after_cut(stepped_down)
            ),
        );
        check(
            after_cut(successor) <= bound,
            format!(
                "{what}: the successor had it {:.3} s after the cut",
                after_cut(successor)
            ),
        );
    }
    check(
        named_at_end.as_ref().map(|info| info.identity.as_str()) == Some(SUCCESSOR),
        format!("after the heal leader() names {named_at_end:?}"),
    );
    // The controls: the same comparison finds two holders and two leaders.
    check(
        turns.broken_permit.is_some() && !before(broken_permit_end, turns.broken_permit),
        "the control: the holder that ignores lost() was not seen beside its successor".into(),
    );
    check(
        turns.broken_leader.is_some() && !before(broken_leader_stopped, turns.broken_leader),
        "the control: the deaf leader was not seen leading beside its successor".into(),
    );
    assert!(broken.is_empty(), "{}", broken.join("\n  "));

    successor.resign().await.expect("resign");
    broken_successor.resign().await.expect("resign");
    close(obs).await;
}

/// Whether `first` happened, and before `then` (or `then` never did).
fn before(first: Option<u64>, then: Option<u64>) -> bool {
    first.is_some_and(|first| then.is_none_or(|then| first < then))
}

#[test]
fn the_ordering_check_sees_an_overlap() {
    // The control of the comparison itself: a step-down after the
    // successor's turn, or none at all, is two holders at once.
    assert!(before(Some(1), Some(2)));
    assert!(!before(Some(3), Some(2)));
    assert!(!before(None, Some(2)));
}
