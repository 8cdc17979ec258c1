//! Kinds of locks over any backend: `Semaphore` and `LeaderElection`, on
//! PostgreSQL and on the in-memory backend.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;
use distlock::memory::MemoryLocker;
use distlock::{Error, LeaderElection, Lease, LockKey, Locker, PgLocker, Semaphore};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

async fn two_pg_lockers(pool: &PgPool) -> (Arc<dyn Locker>, Arc<dyn Locker>) {
    distlock::migrate(pool).await.unwrap();
    let second = PgPoolOptions::new()
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .unwrap();
    let make = |pool: PgPool| -> Arc<dyn Locker> {
        Arc::new(
            PgLocker::builder(pool)
                .fencing(true)
                .heartbeat(Duration::from_millis(100))
                .heartbeat_timeout(PATIENT)
                .build()
                .expect("valid settings"),
        )
    };
    (make(pool.clone()), make(second))
}

/// Many tasks on two lockers: never more than `permits` inside at once, and
/// all permits do get used.
async fn never_more_than_the_permits(a: Arc<dyn Locker>, b: Arc<dyn Locker>) {
    const PERMITS: u32 = 3;
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..9 {
        let locker = if task % 2 == 0 {
            Arc::clone(&a)
        } else {
            Arc::clone(&b)
        };
        let semaphore = Semaphore::new(locker, "kinds:sem", PERMITS).unwrap();
        let (inside, most) = (Arc::clone(&inside), Arc::clone(&most));
        tasks.spawn(async move {
            for _ in 0..6 {
                let permit = semaphore.acquire(Duration::from_secs(30)).await?;
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5)).await;
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
    assert_eq!(most, PERMITS as usize, "every permit was used");
}

#[sqlx::test(migrations = false)]
async fn a_semaphore_never_admits_more_than_its_permits_on_postgres(pool: PgPool) {
    let (a, b) = two_pg_lockers(&pool).await;
    never_more_than_the_permits(a, b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_never_admits_more_than_its_permits_in_memory() {
    let memory = MemoryLocker::new();
    never_more_than_the_permits(Arc::new(memory.clone()), Arc::new(memory)).await;
}

#[sqlx::test(migrations = false)]
async fn a_freed_permit_reaches_a_waiter_within_milliseconds(pool: PgPool) {
    distlock::migrate(&pool).await.unwrap();
    let second_pool = PgPoolOptions::new()
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .unwrap();
    let fenced = |pool: PgPool| {
        PgLocker::builder(pool)
            .fencing(true)
            .heartbeat(Duration::from_millis(100))
            .heartbeat_timeout(PATIENT)
            .build()
            .expect("valid settings")
    };
    let (a, b) = (fenced(pool.clone()), fenced(second_pool));
    let holders = a.semaphore("kinds:handoff", 2).unwrap();
    let first = holders.try_acquire().await.unwrap().expect("free");
    let second = holders.try_acquire().await.unwrap().expect("free");
    assert!(
        holders.try_acquire().await.unwrap().is_none(),
        "both permits held"
    );
    let (one, two) = (first.fencing_token(), second.fencing_token());
    assert!(one.is_some(), "a permit carries the token");
    assert_ne!(one, two, "two holders at once carry different tokens");
    let waiter = tokio::spawn(async move {
        let semaphore = b.semaphore("kinds:handoff", 2)?;
        let permit = semaphore.acquire(Duration::from_secs(10)).await?;
        Ok::<_, Error>((Instant::now(), permit))
    });
    let mut obs = observer_for(&pool).await;
    // Two slots and the waiter's queue lock.
    eventually(
        "the waiter is at the queue's head",
        Duration::from_secs(5),
        async || granted_count(&mut obs).await == 3,
    )
    .await;
    let freed = Instant::now();
    first.release().await.unwrap();
    let (got, permit) = bounded(
        "the waiter gets the permit",
        Duration::from_secs(10),
        waiter,
    )
    .await
    .unwrap()
    .unwrap();
    let handoff = got.duration_since(freed);
    println!("permit hand-off: {handoff:?}");
    assert!(handoff < Duration::from_secs(2), "{handoff:?}");
    assert_eq!(permit.slot(), 0, "the freed slot");
    permit.release().await.unwrap();
    second.release().await.unwrap();
    eventually("no permit left held", Duration::from_secs(5), async || {
        granted_count(&mut obs).await == 0
    })
    .await;
}

#[tokio::test]
async fn bad_semaphores_are_refused() {
    let memory: Arc<dyn Locker> = Arc::new(MemoryLocker::new());
    let none = Semaphore::new(Arc::clone(&memory), "kinds:none", 0);
    assert!(
        matches!(none, Err(Error::InvalidArgument { .. })),
        "{none:?}"
    );
    let bad = Semaphore::new(Arc::clone(&memory), "bad\0name", 2);
    assert!(matches!(bad, Err(Error::InvalidKey { .. })), "{bad:?}");
    let one = Semaphore::new(memory, "kinds:one", 1).unwrap();
    let permit = one.acquire(Duration::MAX).await.unwrap();
    let err = one.acquire(Duration::from_millis(50)).await.unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    permit.release().await.unwrap();
}

#[sqlx::test(migrations = false)]
async fn bad_postgres_semaphores_are_refused(pool: PgPool) {
    let locker = PgLocker::new(pool);
    let none = locker.semaphore("kinds:none", 0);
    assert!(
        matches!(none, Err(Error::InvalidArgument { .. })),
        "{none:?}"
    );
    let bad = locker.semaphore("bad\0name", 2);
    assert!(matches!(bad, Err(Error::InvalidKey { .. })), "{bad:?}");
}

/// Samples both campaigns' flags until `until` holds; fails if both ever
/// report leadership at once.
async fn watch_flags(
    a: &distlock::Campaign,
    b: &distlock::Campaign,
    limit: Duration,
    until: impl Fn(bool, bool) -> bool,
) -> Duration {
    let started = Instant::now();
    loop {
        let (la, lb) = (a.is_leader(), b.is_leader());
        assert!(!(la && lb), "two leaders at once");
        if until(la, lb) {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < limit,
            "no leader change within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[sqlx::test(migrations = false)]
async fn one_leader_and_a_takeover_when_the_leaders_backend_dies(pool: PgPool) {
    let (a, b) = two_pg_lockers(&pool).await;
    let first = LeaderElection::new(a, "kinds:leader").campaign();
    bounded(
        "the first leads",
        Duration::from_secs(5),
        first.leadership().wait_for(|l| *l),
    )
    .await
    .unwrap();
    let second = LeaderElection::new(b, "kinds:leader").campaign();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(first.is_leader() && !second.is_leader());
    let term = first.fencing_token().expect("a term token");
    // The leader's backend dies: the other campaign takes over.
    let mut obs = observer_for(&pool).await;
    let leader_pid = advisory_locks(&mut obs)
        .await
        .into_iter()
        .find(|r| r.granted)
        .map(|r| r.pid)
        .unwrap();
    let killed = Instant::now();
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(leader_pid)
        .execute(&mut obs)
        .await
        .unwrap();
    // The server frees the lock at once, so the second may lead before the
    // first's heartbeat has noticed: the old leader's writes are fenced off
    // by the new term's higher token, and its flag turns false as soon as
    // the loss is known (within heartbeat + deadline).
    let mut second_leads = second.leadership();
    bounded(
        "the second takes over",
        Duration::from_secs(10),
        second_leads.wait_for(|l| *l),
    )
    .await
    .unwrap();
    println!(
        "takeover {:?} after the leader's backend was terminated",
        killed.elapsed()
    );
    assert!(
        second.fencing_token().unwrap() > term,
        "a new term, a higher token"
    );
    let mut first_leads = first.leadership();
    bounded(
        "the old leader steps down",
        Duration::from_secs(2),
        first_leads.wait_for(|l| !*l),
    )
    .await
    .unwrap();
    println!(
        "the old leader knew {:?} after the termination",
        killed.elapsed()
    );
    // From here on leadership moves without overlap: the second resigns,
    // and its flag turns false before its lock is released.
    let (first_flag, second_flag) = (first.leadership(), second.leadership());
    let resigned = Instant::now();
    let resign = tokio::spawn(second.resign());
    loop {
        let (la, lb) = (*first_flag.borrow(), *second_flag.borrow());
        assert!(!(la && lb), "two leaders at once during a resignation");
        if la {
            break;
        }
        assert!(resigned.elapsed() < Duration::from_secs(10), "no takeover");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    println!("takeover {:?} after a resignation", resigned.elapsed());
    resign.await.unwrap().unwrap();
    // Dropping a campaign resigns too.
    drop(first);
    eventually(
        "the dropped campaign let go",
        Duration::from_secs(5),
        async || granted_count(&mut obs).await == 0,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leadership_moves_when_the_memory_backend_loses_the_lease() {
    let memory = MemoryLocker::new();
    let a = LeaderElection::new(Arc::new(memory.clone()), "kinds:mem").campaign();
    let mut leadership = a.leadership();
    bounded(
        "a leads",
        Duration::from_secs(5),
        leadership.wait_for(|l| *l),
    )
    .await
    .unwrap();
    let b = LeaderElection::new(Arc::new(memory.clone()), "kinds:mem").campaign();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(a.is_leader() && !b.is_leader());
    leadership.borrow_and_update();
    assert!(memory.lose("kinds:mem"));
    // `a` steps down first (its flag changes, even if it wins again at
    // once); until then its flag is stale and its lease already lost.
    bounded("a steps down", Duration::from_secs(5), leadership.changed())
        .await
        .unwrap();
    // Either campaign may win the freed key, never both.
    watch_flags(&a, &b, Duration::from_secs(5), |la, lb| la || lb).await;
    b.resign().await.unwrap();
    bounded(
        "a leads",
        Duration::from_secs(5),
        leadership.wait_for(|l| *l),
    )
    .await
    .unwrap();
    a.resign().await.unwrap();
    assert!(!memory.is_held("kinds:mem"));
}

/// A plain lock named like a permit slot (`"{name}#{i}"`) and the
/// semaphore's permits are different locks, both ways round.
async fn slots_and_plain_keys_never_meet(locker: Arc<dyn Locker>) {
    let backend = locker.backend();
    let plain = locker
        .try_lock("kinds:col#0".into())
        .await
        .unwrap()
        .expect("the plain key is free");
    let semaphore = Semaphore::new(Arc::clone(&locker), "kinds:col", 1).unwrap();
    let permit = semaphore.try_acquire().await.unwrap();
    assert!(
        permit.is_some(),
        "{backend}: a plain lock named kinds:col#0 made the semaphore report busy"
    );
    plain.release().await.unwrap();
    let again = locker.try_lock("kinds:col#0".into()).await.unwrap();
    assert!(
        again.is_some(),
        "{backend}: a held permit made the plain lock kinds:col#0 report busy"
    );
    // The slots still exclude each other.
    assert!(
        semaphore.try_acquire().await.unwrap().is_none(),
        "{backend}"
    );
    // Released, not dropped: a dropped guard is released in the
    // background, and the caller takes the same slot next.
    if let Some(permit) = permit {
        permit.release().await.unwrap();
    }
    if let Some(again) = again {
        again.release().await.unwrap();
    }
}

#[sqlx::test(migrations = false)]
async fn semaphore_slots_are_apart_from_plain_keys_on_postgres(pool: PgPool) {
    slots_and_plain_keys_never_meet(Arc::new(PgLocker::new(pool.clone()))).await;
    // The PostgreSQL path takes the same slots.
    let locker = PgLocker::new(pool.clone());
    let plain = locker.try_lock("kinds:col#0").await.unwrap().expect("free");
    let semaphore = locker.semaphore("kinds:col", 1).unwrap();
    let permit = semaphore.try_acquire().await.unwrap().expect("apart");
    let generic = Semaphore::new(Arc::new(locker.clone()), "kinds:col", 1).unwrap();
    assert!(generic.try_acquire().await.unwrap().is_none(), "same slots");
    permit.release().await.unwrap();
    plain.release().await.unwrap();
    distlock::migrate(&pool).await.unwrap();
    slots_and_plain_keys_never_meet(Arc::new(
        distlock::postgres::TableLocker::builder(pool)
            .build()
            .expect("valid settings"),
    ))
    .await;
}

#[tokio::test]
async fn semaphore_slots_are_apart_from_plain_keys_in_memory() {
    slots_and_plain_keys_never_meet(Arc::new(MemoryLocker::new())).await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn semaphore_slots_are_apart_from_plain_keys_on_redis() {
    let servers = [
        common::redis::RedisServer::start().await,
        common::redis::RedisServer::start().await,
        common::redis::RedisServer::start().await,
    ];
    let single = distlock::redis::RedisLocker::connect(&servers[0].url())
        .await
        .unwrap();
    slots_and_plain_keys_never_meet(Arc::new(single)).await;
    let urls = common::redis::urls(&servers);
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let redlock = distlock::redis::Redlock::connect(&urls).await.unwrap();
    slots_and_plain_keys_never_meet(Arc::new(redlock)).await;
}

/// A locker whose every lock is refused as a bad key, as Redis refuses a
/// key form it cannot hold.
#[derive(Debug)]
struct RefusingLocker;

#[async_trait::async_trait]
impl Locker for RefusingLocker {
    async fn try_lock(&self, key: LockKey) -> Result<Option<Box<dyn Lease>>, Error> {
        Err(refused(&key))
    }

    async fn lock(&self, key: LockKey, _timeout: Duration) -> Result<Box<dyn Lease>, Error> {
        Err(refused(&key))
    }

    fn backend(&self) -> &'static str {
        "refusing"
    }
}

fn refused(key: &LockKey) -> Error {
    Error::InvalidKey {
        key: key.clone(),
        reason: "refused by this backend",
    }
}

/// A campaign that can never lead says so: its leadership channel ends, and
/// `resign` returns the key's error.
async fn a_campaign_that_cannot_lead_says_why(locker: Arc<dyn Locker>, key: LockKey) {
    let campaign = LeaderElection::new(locker, key.clone()).campaign();
    let mut leadership = campaign.leadership();
    let ended = bounded(
        "the leadership channel ends",
        Duration::from_secs(5),
        leadership.wait_for(|l| *l),
    )
    .await;
    assert!(ended.is_err(), "{key:?}: the campaign claimed to lead");
    assert!(!campaign.is_leader());
    let why = campaign.failure().map(ToString::to_string);
    assert!(
        matches!(campaign.failure(), Some(Error::InvalidKey { .. })),
        "{key:?}: {why:?}"
    );
    let resigned = campaign.resign().await;
    assert!(
        matches!(resigned, Err(Error::InvalidKey { .. })),
        "{key:?}: resign gave {resigned:?}"
    );
}

#[sqlx::test(migrations = false)]
async fn a_leader_election_with_an_invalid_key_reports_it(pool: PgPool) {
    let pg: Arc<dyn Locker> = Arc::new(PgLocker::new(pool));
    let memory: Arc<dyn Locker> = Arc::new(MemoryLocker::new());
    for locker in [pg, memory] {
        a_campaign_that_cannot_lead_says_why(Arc::clone(&locker), "".into()).await;
        a_campaign_that_cannot_lead_says_why(locker, "a\0b".into()).await;
    }
    // A key only the backend refuses (as Redis refuses namespaced keys).
    a_campaign_that_cannot_lead_says_why(
        Arc::new(RefusingLocker),
        LockKey::namespaced(7, "kinds:ns"),
    )
    .await;
}

#[test]
fn a_campaign_started_without_a_runtime_reports_it_instead_of_panicking() {
    let election = LeaderElection::new(Arc::new(MemoryLocker::new()), "kinds:no-runtime");
    let campaign = election.campaign();
    assert!(!campaign.is_leader());
    assert!(
        matches!(campaign.failure(), Some(Error::NoRuntime(_))),
        "{:?}",
        campaign.failure()
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let resigned = runtime.block_on(campaign.resign());
    assert!(matches!(resigned, Err(Error::NoRuntime(_))), "{resigned:?}");
    // Inside a runtime the same election campaigns and leads.
    runtime.block_on(async {
        let campaign = election.campaign();
        let mut leadership = campaign.leadership();
        bounded("leads", Duration::from_secs(5), leadership.wait_for(|l| *l))
            .await
            .unwrap();
        campaign.resign().await.unwrap();
    });
}
