//! Leader election under faults, each with a broken variant that the same
//! check must catch:
//!
//! - never two campaigns leading at once when the leader's backend is
//!   terminated (`pg_terminate_backend`), or terminated while the leader is
//!   partitioned away (a stalled proxy: the server frees the lock, the
//!   leader hears nothing). The control turns the takeover grace off, and
//!   the sampler sees two leaders.
//! - a leader stopped with SIGSTOP while its session is ended: when it
//!   wakes, its term ends within heartbeat + deadline and the write it was
//!   about to make is refused by the fence. The control writes unfenced,
//!   and its write lands after its successor's.
//! - `leader()` and `observe()` never name a leader whose session the
//!   server has ended. The control reads the leader record without
//!   `pg_locks` (a table that can go stale), and names the dead leader.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use common::event_log::now_ns;
use common::proxy::Proxy;
use common::*;
use distlock::{
    Campaign, ElectionLocker, Error, LeaderElection, LeaderInfo, Lease, LockKey, Locker, PgLocker,
    Proclaimed, Proclamation, Seat,
};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const KEY: &str = "faults:leader";
const HEARTBEAT: Duration = Duration::from_millis(300);
/// The heartbeat of the leader whose session ends under a reader.
const SLOW_HEARTBEAT: Duration = Duration::from_secs(5);

async fn locker(opts: PgConnectOptions, heartbeat: Duration) -> Arc<PgLocker> {
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(opts)
        .await
        .expect("pool");
    Arc::new(
        PgLocker::builder(pool)
            .fencing(true)
            .heartbeat(heartbeat)
            .heartbeat_timeout(heartbeat)
            .build()
            .expect("valid settings"),
    )
}

fn campaign(locker: Arc<dyn Locker>, identity: &str, grace: Option<Duration>) -> Campaign {
    let builder = LeaderElection::builder(locker, KEY)
        .identity(identity)
        .retry(Duration::from_millis(50));
    let builder = match grace {
        Some(grace) => builder.grace(grace),
        None => builder,
    };
    builder.build().expect("valid settings").campaign()
}

/// Samples two campaigns every millisecond until stopped: how many samples
/// found both leading.
struct Sampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<(usize, usize)>,
}

impl Sampler {
    fn start(a: &Campaign, b: &Campaign) -> Self {
        let (a, b) = (a.clone(), b.clone());
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let task = tokio::spawn(async move {
            let (mut samples, mut both) = (0, 0);
            while !stopped.load(Ordering::SeqCst) {
                samples += 1;
                if a.is_leader() && b.is_leader() {
                    both += 1;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            (samples, both)
        });
        Self { stop, task }
    }

    /// Stops; the samples that found two leaders.
    async fn both(self) -> usize {
        self.stop.store(true, Ordering::SeqCst);
        let (samples, both) = self.task.await.expect("sampler");
        println!("{samples} samples, {both} with two leaders");
        both
    }
}

/// The backend pid holding the election's lock (the only granted advisory
/// lock of the test database).
async fn leader_pid(pool: &PgPool) -> i32 {
    let mut obs = observer_for(pool).await;
    let mut pid = None;
    eventually(
        "a holder in pg_locks",
        Duration::from_secs(10),
        async || {
            pid = advisory_locks(&mut obs)
                .await
                .into_iter()
                .find(|r| r.granted)
                .map(|r| r.pid);
            pid.is_some()
        },
    )
    .await;
    close(obs).await;
    pid.unwrap_or_default()
}

/// Waits until one of the campaigns leads a term numbered above `after`;
/// returns its number.
async fn next_term(a: &Campaign, b: &Campaign, after: u64) -> u64 {
    let mut number = 0;
    eventually("a new term", Duration::from_secs(15), async || {
        number = [a.term(), b.term()]
            .into_iter()
            .flatten()
            .filter_map(|t| t.number())
            .max()
            .unwrap_or(0);
        number > after
    })
    .await;
    number
}

/// How long the leader's goodbye (the server's notice that it ended the
/// session) takes to reach it in [`terminations`]: a slow network. Less
/// than the default grace (a heartbeat and its deadline), more than the
/// successor needs to take over without a grace.
const GOODBYE_DELAY: Duration = Duration::from_millis(150);

/// Three times, the leader's backend is terminated while its network is
/// slow ([`GOODBYE_DELAY`] each way), so that the deposed leader learns of
/// it late; returns how many samples found two leaders.
async fn terminations(pool: &PgPool, grace: Option<Duration>) -> usize {
    distlock::migrate(pool).await.expect("migrate");
    let opts = pool.connect_options().as_ref().clone();
    let proxies = [
        Proxy::start(opts.get_host(), opts.get_port())
            .await
            .expect("proxy"),
        Proxy::start(opts.get_host(), opts.get_port())
            .await
            .expect("proxy"),
    ];
    let a = campaign(
        locker(proxies[0].options(&opts), HEARTBEAT).await,
        "a",
        grace,
    );
    let b = campaign(
        locker(proxies[1].options(&opts), HEARTBEAT).await,
        "b",
        grace,
    );
    let mut term = next_term(&a, &b, 0).await;
    let sampler = Sampler::start(&a, &b);
    for _ in 0..3 {
        let pid = leader_pid(pool).await;
        let leaders = &proxies[usize::from(!a.is_leader())];
        leaders.delay(GOODBYE_DELAY);
        let mut obs = observer_for(pool).await;
        terminate(&mut obs, pid).await;
        close(obs).await;
        term = next_term(&a, &b, term).await;
        tokio::time::sleep(GOODBYE_DELAY * 2).await;
        leaders.pass();
        // Let the deposed leader notice, if it has not yet.
        tokio::time::sleep(HEARTBEAT * 3).await;
    }
    let both = sampler.both().await;
    a.resign().await.expect("resign");
    b.resign().await.expect("resign");
    both
}

#[sqlx::test(migrations = false)]
async fn never_two_leaders_when_the_leaders_backend_is_terminated(pool: PgPool) {
    assert_eq!(terminations(&pool, None).await, 0, "two leaders at once");
}

/// The control: without the takeover grace, the successor leads before the
/// deposed leader's heartbeat has told it, and the sampler sees it.
#[sqlx::test(migrations = false)]
async fn without_the_grace_terminations_make_two_leaders(pool: PgPool) {
    let both = terminations(&pool, Some(Duration::ZERO)).await;
    assert!(both > 0, "the check must see two leaders without the grace");
}

/// The leader reaches the server through a proxy that stalls; while it
/// stalls, the server ends the leader's session (as an idle timeout or an
/// operator would). The server frees the lock at once, the leader hears
/// nothing until its heartbeat's deadline. Returns how many samples found
/// two leaders.
async fn partition(pool: &PgPool, grace: Option<Duration>) -> usize {
    distlock::migrate(pool).await.expect("migrate");
    let opts = pool.connect_options().as_ref().clone();
    let proxy = Proxy::start(opts.get_host(), opts.get_port())
        .await
        .expect("proxy");
    let a = campaign(locker(proxy.options(&opts), HEARTBEAT).await, "a", grace);
    let term = next_term(&a, &a, 0).await;
    let b = campaign(locker(opts, HEARTBEAT).await, "b", grace);
    let mut obs = observer_for(pool).await;
    wait_for_waiters(&mut obs, 1, Duration::from_secs(10)).await;
    let sampler = Sampler::start(&a, &b);
    let pid = leader_pid(pool).await;
    proxy.stall();
    terminate(&mut obs, pid).await;
    let taken = next_term(&b, &b, term).await;
    // Past the partitioned leader's heartbeat deadline.
    tokio::time::sleep(HEARTBEAT * 4).await;
    assert!(!a.is_leader(), "the partitioned leader stepped down");
    let both = sampler.both().await;
    proxy.pass();
    b.resign().await.expect("resign");
    a.resign().await.expect("resign");
    println!("term {term} → {taken}");
    close(obs).await;
    both
}

#[sqlx::test(migrations = false)]
async fn never_two_leaders_when_a_partitioned_leaders_session_ends(pool: PgPool) {
    assert_eq!(partition(&pool, None).await, 0, "two leaders at once");
}

/// The control: without the grace, the partitioned leader leads beside its
/// successor until its heartbeat's deadline.
#[sqlx::test(migrations = false)]
async fn without_the_grace_a_partition_makes_two_leaders(pool: PgPool) {
    let both = partition(&pool, Some(Duration::ZERO)).await;
    assert!(both > 0, "the check must see two leaders without the grace");
}

// ---- leader() and observe() ----------------------------------------------

/// A `PgLocker` whose `leader()` believes the leader record without asking
/// `pg_locks`: a table that can go stale. Everything else is `PgLocker`'s.
#[derive(Debug)]
struct TrustingTable(Arc<PgLocker>);

#[async_trait]
impl Locker for TrustingTable {
    async fn try_lock(&self, key: LockKey) -> Result<Option<Box<dyn Lease>>, Error> {
        Locker::try_lock(&*self.0, key).await
    }
    async fn lock(&self, key: LockKey, timeout: Duration) -> Result<Box<dyn Lease>, Error> {
        Locker::lock(&*self.0, key, timeout).await
    }
    fn backend(&self) -> &'static str {
        "trusting-table"
    }
    fn election(&self) -> Option<&dyn ElectionLocker> {
        Some(self)
    }
}

#[async_trait]
impl ElectionLocker for TrustingTable {
    async fn lock_seat(
        &self,
        key: LockKey,
        timeout: Duration,
    ) -> Result<(Box<dyn Lease>, Seat), Error> {
        self.0.lock_seat(key, timeout).await
    }
    async fn proclaim(
        &self,
        key: &LockKey,
        seat: Seat,
        proclamation: &Proclamation,
    ) -> Result<Option<Proclaimed>, Error> {
        self.0.proclaim(key, seat, proclamation).await
    }
    async fn withdraw(&self, key: &LockKey, seat: Seat, term: Option<u64>) -> Result<(), Error> {
        self.0.withdraw(key, seat, term).await
    }
    async fn leader(&self, key: &LockKey) -> Result<Option<LeaderInfo>, Error> {
        let row: Option<(String, String, i64)> = sqlx::query_as(
            "SELECT identity, value, term FROM distlock.leaders \
             WHERE key_text = $1 AND pid IS NOT NULL",
        )
        .bind(key.to_string())
        .fetch_optional(self.0.pool())
        .await?;
        Ok(row.map(|(identity, value, term)| {
            LeaderInfo::new(identity, value, term as u64, SystemTime::now(), None)
        }))
    }
    fn loss_notice_bound(&self) -> Duration {
        self.0.loss_notice_bound()
    }
}

/// When backend `pid` last started a statement (its heartbeat, here).
async fn last_query_start(obs: &mut sqlx::PgConnection, pid: i32) -> Option<String> {
    sqlx::query_scalar("SELECT query_start::text FROM pg_stat_activity WHERE pid = $1")
        .bind(pid)
        .fetch_one(obs)
        .await
        .expect("query_start")
}

/// The leader's session is terminated; once `pg_locks` no longer shows its
/// lock, `leader()` must not name its term, nor an observer after one poll
/// and one read deadline. The leader's network stalls meanwhile, so it
/// notices nothing (its next heartbeat is 5 s later), and a reader that
/// trusts the table names it.
/// `Err` says what named the dead leader.
async fn named_after_its_session_ended(
    pool: &PgPool,
    reader: Arc<dyn Locker>,
) -> Result<(), String> {
    distlock::migrate(pool).await.expect("migrate");
    let opts = pool.connect_options().as_ref().clone();
    // The leader hears nothing of its session's end (not the server's
    // goodbye, nor its heartbeat's failure) while its network stalls.
    let network = Proxy::start(opts.get_host(), opts.get_port())
        .await
        .expect("proxy");
    let slow = locker(network.options(&opts), SLOW_HEARTBEAT).await;
    let candidate = campaign(slow, "doomed", None);
    let term = bounded("leads", Duration::from_secs(10), candidate.elected())
        .await
        .expect("a term");
    let number = term.number().expect("PostgreSQL numbers terms");
    let bystander = LeaderElection::builder(reader, KEY)
        .identity("bystander")
        .poll(Duration::from_millis(50))
        .build()
        .expect("valid settings");
    let observer = bystander.observe();
    let mut watching = observer.receiver();
    bounded(
        "the observer names the leader",
        Duration::from_secs(5),
        watching.wait_for(|l| l.as_ref().is_some_and(|l| l.term == number)),
    )
    .await
    .expect("observing");

    let pid = leader_pid(pool).await;
    let mut obs = observer_for(pool).await;
    // Just after one of its heartbeats, so that the leader notices only at
    // the next, a whole interval later.
    let before = last_query_start(&mut obs, pid).await;
    eventually("a heartbeat", SLOW_HEARTBEAT * 2, async || {
        last_query_start(&mut obs, pid).await != before
    })
    .await;
    network.stall();
    terminate(&mut obs, pid).await;
    eventually(
        "the lock is gone from pg_locks",
        Duration::from_secs(5),
        async || advisory_locks(&mut obs).await.iter().all(|r| r.pid != pid),
    )
    .await;
    let gone = Instant::now();
    let mut violations = Vec::new();
    let dead = |l: &Option<LeaderInfo>| l.as_ref().is_some_and(|l| l.term == number);
    let read = bystander.leader().await.expect("leader()");
    if dead(&read) {
        violations.push(format!(
            "leader() named term {number} after its session ended: {read:?}"
        ));
    }
    // An observer may show what it read before, for one poll and one read
    // deadline (at least 1 s); then never again.
    let allowed = Duration::from_millis(50) + Duration::from_secs(1) + Duration::from_millis(500);
    while gone.elapsed() < allowed + Duration::from_secs(1) {
        if gone.elapsed() > allowed && dead(&observer.leader()) {
            violations.push(format!(
                "observe() named term {number} {:?} after its session ended",
                gone.elapsed()
            ));
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    network.pass();
    // The release may find the session gone before the heartbeat did: an
    // error, which says the lock was not released by this call.
    let resigned = candidate.resign().await;
    println!("resign after the session ended: {resigned:?}");
    close(obs).await;
    if violations.is_empty() {
        Ok(())
    } else {
        Err(violations.join("; "))
    }
}

#[sqlx::test(migrations = false)]
async fn leader_and_observe_never_name_a_leader_whose_session_ended(pool: PgPool) {
    let opts = pool.connect_options().as_ref().clone();
    let reader: Arc<dyn Locker> = locker(opts, HEARTBEAT).await;
    named_after_its_session_ended(&pool, reader)
        .await
        .expect("never named");
}

/// The control: a reader that trusts the table names the dead leader.
#[sqlx::test(migrations = false)]
async fn a_leader_record_read_without_pg_locks_names_a_dead_leader(pool: PgPool) {
    let opts = pool.connect_options().as_ref().clone();
    let reader: Arc<dyn Locker> = Arc::new(TrustingTable(locker(opts, HEARTBEAT).await));
    let caught = named_after_its_session_ended(&pool, reader)
        .await
        .expect_err("the check must catch a reader that trusts the table");
    println!("{caught}");
    assert!(caught.contains("leader() named"), "{caught}");
    assert!(caught.contains("observe() named"), "{caught}");
}

// ---- a paused leader ------------------------------------------------------

/// The worker side of the pause cases: `DISTLOCK_LEADER_WORKER` is
/// `fenced` or `unfenced`, the database in `DISTLOCK_LEADER_URL`. It
/// campaigns as `worker` and, while it leads, does units of work: 50 ms of
/// thought, then a write of its term's token (through the fence when
/// `fenced`). A unit is finished once begun; the term is checked between
/// units, as a leader loop that cannot stop mid-write does. Prints
/// `ended <CLOCK_MONOTONIC ns>` when a term ends.
#[test]
fn leadership_worker() {
    let Ok(mode) = std::env::var("DISTLOCK_LEADER_WORKER") else {
        return; // an ordinary test run
    };
    let url = std::env::var("DISTLOCK_LEADER_URL").expect("DISTLOCK_LEADER_URL");
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(lead_and_write(
            &url,
            "worker",
            mode == "fenced",
            |at, token| {
                println!("wrote {at} {token}");
            },
        ));
}

const PAUSE_HEARTBEAT: Duration = Duration::from_millis(200);

/// Campaigns as `identity` and writes while it leads, for ever; `wrote`
/// hears of each write accepted (when it committed, `CLOCK_MONOTONIC` ns,
/// and its token).
async fn lead_and_write(url: &str, identity: &str, fenced: bool, wrote: impl Fn(u64, i64)) {
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(url)
        .await
        .expect("pool");
    let locker = Arc::new(
        PgLocker::builder(pool.clone())
            .fencing(true)
            .heartbeat(PAUSE_HEARTBEAT)
            .heartbeat_timeout(PAUSE_HEARTBEAT)
            .build()
            .expect("valid settings"),
    );
    let campaign = campaign(locker, identity, None);
    loop {
        let term = campaign.elected().await.expect("campaigning");
        let token = term.fencing_token().expect("fencing");
        while !term.is_over() {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if write(&pool, identity, token, fenced).await {
                wrote(now_ns(), token.value());
            }
        }
        println!("ended {}", now_ns());
    }
}

/// One write under `token`: through the fence, or straight into the table.
/// Whether it was accepted.
async fn write(pool: &PgPool, writer: &str, token: distlock::FencingToken, fenced: bool) -> bool {
    let mut tx = pool.begin().await.expect("begin");
    if fenced {
        match distlock::fence::check(&mut tx, "leader-pause", token).await {
            Ok(()) => {}
            Err(Error::StaleFencingToken { .. }) => return false,
            Err(err) => panic!("fence: {err}"),
        }
    }
    sqlx::query("INSERT INTO leader_pause_writes (writer, token) VALUES ($1, $2)")
        .bind(writer)
        .bind(token.value())
        .execute(&mut *tx)
        .await
        .expect("insert");
    tx.commit().await.expect("commit");
    true
}

/// What a pause showed.
#[derive(Debug)]
struct Paused {
    /// Writes committed with a token older than one committed before them.
    stale_accepted: usize,
    /// From SIGCONT to the paused leader's term's end.
    ended_after_resume: Option<Duration>,
}

/// The leader (a worker process) is stopped with SIGSTOP mid-work; its
/// session is ended meanwhile (as an idle timeout would), a successor in
/// this process takes over and writes; then the worker is continued and
/// finishes the unit of work it was in.
async fn pause(pool: &PgPool, fenced: bool) -> Paused {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    distlock::migrate(pool).await.expect("migrate");
    sqlx::query(
        "CREATE TABLE leader_pause_writes (id bigserial PRIMARY KEY, writer text NOT NULL, \
         token bigint NOT NULL)",
    )
    .execute(pool)
    .await
    .expect("table");
    let exe = std::env::current_exe().expect("current_exe");
    let mut worker = tokio::process::Command::new(exe)
        .args(["leadership::leadership_worker", "--exact", "--nocapture"])
        .env(
            "DISTLOCK_LEADER_WORKER",
            if fenced { "fenced" } else { "unfenced" },
        )
        .env("DISTLOCK_LEADER_URL", url_of(pool))
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the worker");
    let opts = pool.connect_options().as_ref().clone();
    let bystander = LeaderElection::builder(locker(opts.clone(), HEARTBEAT).await, KEY)
        .build()
        .expect("valid settings");
    eventually("the worker leads", Duration::from_secs(20), async || {
        bystander
            .leader()
            .await
            .expect("leader()")
            .is_some_and(|l| l.identity == "worker")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let pid = leader_pid(pool).await;
    let successor_wrote = Arc::new(std::sync::Mutex::new(Vec::new()));
    let successor = tokio::spawn(lead_and_write_here(
        url_of(pool),
        fenced,
        Arc::clone(&successor_wrote),
    ));

    let worker_pid = Pid::from_raw(i32::try_from(worker.id().expect("pid")).expect("pid"));
    kill(worker_pid, Signal::SIGSTOP).expect("SIGSTOP");
    let mut obs = observer_for(pool).await;
    terminate(&mut obs, pid).await;
    eventually("the successor leads", Duration::from_secs(10), async || {
        bystander
            .leader()
            .await
            .expect("leader()")
            .is_some_and(|l| l.identity == "successor")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let resumed = now_ns();
    kill(worker_pid, Signal::SIGCONT).expect("SIGCONT");
    tokio::time::sleep(PAUSE_HEARTBEAT * 2 + Duration::from_secs(1)).await;
    worker.start_kill().expect("kill the worker");
    successor.abort();

    let mut out = String::new();
    if let Some(mut stdout) = worker.stdout.take() {
        use tokio::io::AsyncReadExt;
        let _ = stdout.read_to_string(&mut out).await;
    }
    let _ = worker.wait().await;
    let ended_after_resume = out
        .lines()
        .filter_map(|l| l.strip_prefix("ended ")?.trim().parse::<u64>().ok())
        .find(|&t| t >= resumed)
        .map(|t| Duration::from_nanos(t - resumed));
    // Every accepted write in the order it committed: (when, token).
    let mut writes: Vec<(u64, i64)> = out
        .lines()
        .filter_map(|l| {
            let mut parts = l.strip_prefix("wrote ")?.split(' ');
            Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
        })
        .collect();
    writes.extend(successor_wrote.lock().expect("writes").iter().copied());
    writes.sort_unstable();
    println!("writes (ns, token): {writes:?}");
    let mut newest = 0;
    let mut stale_accepted = 0;
    for (_, token) in writes {
        if token < newest {
            stale_accepted += 1;
        }
        newest = newest.max(token);
    }
    close(obs).await;
    let paused = Paused {
        stale_accepted,
        ended_after_resume,
    };
    println!("{paused:?}");
    paused
}

/// The successor: campaigns and writes in this process.
async fn lead_and_write_here(
    url: String,
    fenced: bool,
    wrote: Arc<std::sync::Mutex<Vec<(u64, i64)>>>,
) {
    lead_and_write(&url, "successor", fenced, |at, token| {
        wrote.lock().expect("writes").push((at, token));
    })
    .await;
}

/// A paused leader wakes up still inside its term: its term ends within
/// heartbeat + deadline of waking, and the write it was about to make is
/// refused by the fence (the successor's token is higher).
#[sqlx::test(migrations = false)]
async fn a_paused_leader_is_fenced_off_and_its_term_ends_when_it_wakes(pool: PgPool) {
    let paused = pause(&pool, true).await;
    assert_eq!(paused.stale_accepted, 0, "{paused:?}");
    let ended = paused
        .ended_after_resume
        .expect("the woken leader's term ended");
    assert!(
        ended < PAUSE_HEARTBEAT * 2 + Duration::from_millis(500),
        "{paused:?}"
    );
}

/// The control: without the fence, the woken leader's write lands after
/// its successor's.
#[sqlx::test(migrations = false)]
async fn without_the_fence_a_paused_leader_writes_after_its_successor(pool: PgPool) {
    let paused = pause(&pool, false).await;
    assert!(
        paused.stale_accepted > 0,
        "the check must catch it: {paused:?}"
    );
}
