//! Leader election: terms, who leads, observers, permanent errors.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use common::*;
use distlock::memory::MemoryLocker;
use distlock::{
    ElectionLocker, Error, LeaderElection, Lease, LockKey, Locker, PgLocker, Proclamation,
};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// A leader loop written as the docs say, deposed and re-elected at once
/// (nobody else campaigns): it must not go on working under its old term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_loop_never_works_under_a_term_it_lost() {
    for round in 0..5 {
        let memory = MemoryLocker::new();
        let campaign =
            Arc::new(LeaderElection::new(Arc::new(memory.clone()), "leader:rewon").campaign());
        // The token the loop works under, published by each unit of work.
        let working_under = Arc::new(AtomicI64::new(0));
        let worker = {
            let (campaign, working_under) = (Arc::clone(&campaign), Arc::clone(&working_under));
            tokio::spawn(async move {
                // The loop of the docs: one iteration per term, work
                // stopped when the term ends.
                loop {
                    let Ok(term) = campaign.elected().await else {
                        break;
                    };
                    let token = term.fencing_token().expect("a token");
                    tokio::select! {
                        () = term.ended() => continue,
                        () = async {
                            loop {
                                working_under.store(token.value(), Ordering::SeqCst);
                                tokio::time::sleep(Duration::from_millis(1)).await;
                            }
                        } => {}
                    }
                }
            })
        };
        bounded("the first term", Duration::from_secs(5), async {
            while working_under.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await;
        let first = working_under.load(Ordering::SeqCst);
        assert!(memory.lose("leader:rewon"));
        // Re-elected under a new token...
        eventually("re-elected", Duration::from_secs(5), async || {
            campaign.fencing_token().is_some_and(|t| t.value() > first)
        })
        .await;
        // ... the loop must follow it: work under the old term stops.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = working_under.load(Ordering::SeqCst);
        assert_ne!(
            now, first,
            "round {round}: still working under the lost term {first}"
        );
        worker.abort();
    }
}

/// Two lockers over two pools of `pool`'s database (two processes), after
/// `migrate`; fencing on, a fast heartbeat.
async fn two_pg_lockers(pool: &PgPool) -> (Arc<dyn Locker>, Arc<dyn Locker>) {
    distlock::migrate(pool).await.expect("migrate");
    let second = PgPoolOptions::new()
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .expect("second pool");
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

fn election(locker: &Arc<dyn Locker>, identity: &str, value: &str) -> LeaderElection {
    LeaderElection::builder(Arc::clone(locker), "leader:who")
        .identity(identity)
        .value(value)
        .poll(Duration::from_millis(50))
        .build()
        .expect("valid settings")
}

/// Who leads, as a candidate and a bystander see it, through a handover:
/// the leader's identity, value, term and token; nobody after it resigns;
/// the next leader under the next term.
async fn leader_is_named_by_anyone(a: Arc<dyn Locker>, b: Arc<dyn Locker>) {
    let bystander = election(&b, "bystander", "");
    assert_eq!(bystander.leader().await.expect("leader()"), None);
    let first = election(&a, "node-a", "http://a").campaign();
    let term = bounded("a leads", Duration::from_secs(5), first.elected())
        .await
        .expect("a term");
    let seen = bystander
        .leader()
        .await
        .expect("leader()")
        .expect("a leader");
    assert_eq!(
        (seen.identity.as_str(), seen.value.as_str()),
        ("node-a", "http://a")
    );
    assert_eq!(Some(seen.term), term.number(), "{seen:?} {term:?}");
    assert_eq!(seen.fencing_token, term.fencing_token());
    assert!(seen.since <= std::time::SystemTime::now() + Duration::from_secs(5));
    // The candidate's own election says the same.
    assert_eq!(
        election(&a, "node-a", "").leader().await.expect("leader()"),
        Some(seen.clone())
    );

    first.resign().await.expect("resign");
    assert!(term.is_over(), "the term ended with the resignation");
    assert_eq!(
        bystander.leader().await.expect("leader()"),
        None,
        "nobody after a resignation"
    );

    let second = election(&b, "node-b", "http://b").campaign();
    let next = bounded("b leads", Duration::from_secs(5), second.elected())
        .await
        .expect("a term");
    let now = bystander
        .leader()
        .await
        .expect("leader()")
        .expect("a leader");
    assert_eq!(now.identity, "node-b");
    assert!(now.term > seen.term, "{now:?} after {seen:?}");
    assert_eq!(Some(now.term), next.number());
    second.resign().await.expect("resign");
}

#[sqlx::test(migrations = false)]
async fn leader_is_named_by_anyone_on_postgres(pool: PgPool) {
    let (a, b) = two_pg_lockers(&pool).await;
    leader_is_named_by_anyone(a, b).await;
}

/// The leader record is keyed as the server keys the election's lock, for
/// every key shape (a name, an id, a namespaced name, an id that takes all
/// 64 bits): `leader()` asks `pg_locks` for that lock, so a record keyed
/// otherwise would name nobody.
#[sqlx::test(migrations = false)]
async fn leader_is_named_for_every_key_shape_on_postgres(pool: PgPool) {
    let (a, b) = two_pg_lockers(&pool).await;
    for key in [
        LockKey::from("leader:shape"),
        LockKey::id(42),
        LockKey::id(-7_000_000_000),
        LockKey::namespaced(-3, "leader:shape"),
    ] {
        let campaign = LeaderElection::builder(Arc::clone(&a), key.clone())
            .identity("shaped")
            .build()
            .expect("valid settings")
            .campaign();
        bounded("it leads", Duration::from_secs(5), campaign.elected())
            .await
            .expect("a term");
        let seen = LeaderElection::new(Arc::clone(&b), key.clone())
            .leader()
            .await
            .expect("leader()");
        assert_eq!(
            seen.map(|info| info.identity).as_deref(),
            Some("shaped"),
            "{key:?}"
        );
        campaign.resign().await.expect("resign");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_is_named_by_anyone_in_memory() {
    let memory = MemoryLocker::new();
    leader_is_named_by_anyone(Arc::new(memory.clone()), Arc::new(memory)).await;
}

/// An observer, candidate or not, sees each change: a leader, nobody, the
/// next leader under a higher term.
async fn observers_follow_the_changes(a: Arc<dyn Locker>, b: Arc<dyn Locker>) {
    let mut observer = election(&b, "bystander", "").observe();
    assert_eq!(observer.leader(), None);
    let first = election(&a, "node-a", "").campaign();
    let seen = bounded("the observer sees a", Duration::from_secs(5), async {
        loop {
            if let Some(leader) = observer.changed().await.expect("observing") {
                return leader;
            }
        }
    })
    .await;
    assert_eq!(seen.identity, "node-a");
    first.resign().await.expect("resign");
    let gone = bounded(
        "the observer sees nobody",
        Duration::from_secs(5),
        observer.changed(),
    )
    .await
    .expect("observing");
    assert_eq!(gone, None);
    let second = election(&a, "node-c", "").campaign();
    let next = bounded(
        "the observer sees c",
        Duration::from_secs(5),
        observer.changed(),
    )
    .await
    .expect("observing")
    .expect("a leader");
    assert_eq!(next.identity, "node-c");
    assert!(next.term > seen.term);
    second.resign().await.expect("resign");
}

#[sqlx::test(migrations = false)]
async fn observers_follow_the_changes_on_postgres(pool: PgPool) {
    let (a, b) = two_pg_lockers(&pool).await;
    observers_follow_the_changes(a, b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observers_follow_the_changes_in_memory() {
    let memory = MemoryLocker::new();
    observers_follow_the_changes(Arc::new(memory.clone()), Arc::new(memory)).await;
}

/// A loss and a new win at once are two terms: the first ends, the second
/// has a higher number and token, and `leader()` names the second.
#[sqlx::test(migrations = false)]
async fn a_lost_and_rewon_lock_is_a_new_term_on_postgres(pool: PgPool) {
    let (a, b) = two_pg_lockers(&pool).await;
    let campaign = election(&a, "node-a", "").campaign();
    let first = bounded("leads", Duration::from_secs(5), campaign.elected())
        .await
        .expect("a term");
    let mut obs = observer_for(&pool).await;
    let pid = advisory_locks(&mut obs)
        .await
        .into_iter()
        .find(|r| r.granted)
        .expect("the leader's lock")
        .pid;
    terminate(&mut obs, pid).await;
    bounded("the first term ends", Duration::from_secs(5), first.ended()).await;
    let second = bounded("leads again", Duration::from_secs(10), campaign.elected())
        .await
        .expect("a second term");
    assert_ne!(first, second, "two terms");
    assert!(
        second.number() > first.number(),
        "{second:?} after {first:?}"
    );
    assert!(second.fencing_token() > first.fencing_token());
    assert!(!second.is_over());
    let named = election(&b, "x", "")
        .leader()
        .await
        .expect("leader()")
        .expect("a leader");
    assert_eq!(Some(named.term), second.number());
    campaign.resign().await.expect("resign");
}

/// A clone of a campaign (say, an HTTP handler's) reads its state and can
/// stop it without owning it; every handle then sees it ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_clone_reads_and_stops_the_campaign() {
    let memory = MemoryLocker::new();
    let campaign = LeaderElection::new(Arc::new(memory.clone()), "leader:clone").campaign();
    let handler = campaign.clone();
    let term = bounded("leads", Duration::from_secs(5), handler.elected())
        .await
        .expect("a term");
    assert!(campaign.is_leader() && handler.is_leader());
    assert_eq!(campaign.term(), Some(term.clone()));
    let work = term.cancellation();
    handler.stop().await.expect("stop from the clone");
    assert!(work.is_cancelled(), "the term's work was told");
    assert!(!campaign.is_leader() && campaign.term().is_none());
    assert!(!memory.is_held("leader:clone"), "the lock was released");
    let ended = campaign.elected().await.unwrap_err();
    assert!(matches!(ended, Error::CampaignEnded { .. }), "{ended:?}");
    // Stopping again, from either handle, is fine.
    campaign.stop().await.expect("stopped already");
    handler.resign().await.expect("resigned already");
    drop(campaign);
}

/// Whoever `elected()` wakes sees every view of the campaign agree that it
/// leads: the `leadership()` flag is set before the term is published, not
/// just after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elected_returns_with_the_leadership_flag_already_set() {
    for round in 0..50 {
        let memory = MemoryLocker::new();
        let campaign = LeaderElection::new(Arc::new(memory), "leader:flag").campaign();
        let flag = campaign.leadership();
        bounded("leads", Duration::from_secs(5), campaign.elected())
            .await
            .expect("a term");
        assert!(
            *flag.borrow(),
            "round {round}: elected() returned before the flag was set"
        );
        campaign.stop().await.expect("stop");
        assert!(!*flag.borrow(), "round {round}: the flag outlived the term");
    }
}

/// The last handle dropped resigns; one of two dropped does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_campaign_resigns_when_its_last_handle_is_dropped() {
    let memory = MemoryLocker::new();
    let campaign = LeaderElection::new(Arc::new(memory.clone()), "leader:drop").campaign();
    let other = campaign.clone();
    let term = bounded("leads", Duration::from_secs(5), campaign.elected())
        .await
        .expect("a term");
    drop(campaign);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !term.is_over() && other.is_leader(),
        "one handle still lives"
    );
    drop(other);
    bounded("the term ends", Duration::from_secs(5), term.ended()).await;
    eventually("the lock is released", Duration::from_secs(5), async || {
        !memory.is_held("leader:drop")
    })
    .await;
}

type MakeError = fn() -> Error;

/// A locker whose `lock` always fails with a copy of one error.
#[derive(Debug)]
struct Failing(MakeError);

#[async_trait::async_trait]
impl Locker for Failing {
    async fn try_lock(&self, _key: LockKey) -> Result<Option<Box<dyn Lease>>, Error> {
        Err((self.0)())
    }
    async fn lock(&self, _key: LockKey, _timeout: Duration) -> Result<Box<dyn Lease>, Error> {
        Err((self.0)())
    }
    fn backend(&self) -> &'static str {
        "failing"
    }
}

/// Errors no retry can cure end the campaign at once and reach every
/// handle: `failure`, `elected`, `resign`, and the closed channels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permanent_errors_end_the_campaign_and_reach_the_caller() {
    let cases: [(&str, MakeError); 5] = [
        ("NotMigrated", || Error::NotMigrated {
            message: "schema \"distlock\" does not exist".into(),
        }),
        ("UntrustedSchema", || Error::UntrustedSchema {
            schema: "distlock".into(),
            owner: "mallory".into(),
        }),
        ("InvalidSetting", || Error::InvalidSetting {
            setting: "ttl",
            value: "0ns".into(),
            allowed: "at least 1ms".into(),
        }),
        ("PoolerDetected", || Error::PoolerDetected {
            evidence: distlock::PoolerEvidence::BackendChanged { from: 1, to: 2 },
        }),
        ("InvalidArgument", || Error::InvalidArgument {
            argument: "urls",
            reason: "refused".into(),
        }),
    ];
    for (name, make) in cases {
        let campaign = LeaderElection::builder(Arc::new(Failing(make)), "leader:fails")
            .retry(Duration::from_millis(10))
            .build()
            .expect("valid settings")
            .campaign();
        let ended = bounded(name, Duration::from_secs(5), campaign.elected())
            .await
            .unwrap_err();
        let expected = make().to_string();
        assert_eq!(ended.to_string(), expected, "{name}: elected()");
        assert_eq!(
            campaign.failure().map(ToString::to_string),
            Some(expected.clone()),
            "{name}: failure()"
        );
        let mut leadership = campaign.leadership();
        assert!(
            leadership.changed().await.is_err(),
            "{name}: the channel is closed"
        );
        let resigned = campaign.resign().await.unwrap_err();
        assert_eq!(resigned.to_string(), expected, "{name}: resign()");
    }
    // An outage is retried, not final.
    let campaign = LeaderElection::builder(
        Arc::new(Failing(|| Error::Database(sqlx::Error::PoolTimedOut))),
        "leader:outage",
    )
    .retry(Duration::from_millis(10))
    .build()
    .expect("valid settings")
    .campaign();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(campaign.failure().is_none(), "{:?}", campaign.failure());
    campaign.resign().await.expect("resign");
}

/// On a database that was not migrated, a PostgreSQL campaign (which needs
/// the leader record, and here fencing tokens) ends with `NotMigrated`
/// instead of logging a warning every second; so do `leader()` and an
/// observer.
#[sqlx::test(migrations = false)]
async fn an_election_before_migrate_ends_with_not_migrated(pool: PgPool) {
    for fencing in [false, true] {
        let locker: Arc<dyn Locker> = Arc::new(
            PgLocker::builder(pool.clone())
                .fencing(fencing)
                .build()
                .expect("valid settings"),
        );
        let election = LeaderElection::new(locker, "leader:unmigrated");
        let campaign = election.campaign();
        let ended = bounded(
            "the campaign ends",
            Duration::from_secs(5),
            campaign.elected(),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(ended, Error::NotMigrated { .. }),
            "fencing {fencing}: {ended:?}"
        );
        let read = election.leader().await.unwrap_err();
        assert!(matches!(read, Error::NotMigrated { .. }), "{read:?}");
        let mut observer = election.observe();
        let observed = bounded("the observer ends", Duration::from_secs(5), async {
            loop {
                if let Err(err) = observer.changed().await {
                    return err;
                }
            }
        })
        .await;
        assert!(
            matches!(observed, Error::NotMigrated { .. }),
            "{observed:?}"
        );
        let mut obs = observer_for(&pool).await;
        assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(5)).await;
    }
}

/// Outside a runtime, `observe` reports it instead of panicking, like
/// `campaign`.
#[test]
fn observe_without_a_runtime_reports_it_instead_of_panicking() {
    let election = LeaderElection::new(Arc::new(MemoryLocker::new()), "leader:no-runtime");
    let observer = election.observe();
    assert!(
        matches!(observer.failure(), Some(Error::NoRuntime(_))),
        "{:?}",
        observer.failure()
    );
}

/// An application role with the README's grants campaigns and reads who
/// leads; a reader of another role sees the leader only with
/// `pg_read_all_stats` (it cannot see the session's start time otherwise),
/// as the docs say, and never a wrong one.
#[sqlx::test(migrations = false)]
async fn the_documented_grants_are_enough_for_an_election(pool: PgPool) {
    use common::roles::{drop_role, grant_documented_rights, make_role, pool_as};
    distlock::migrate(&pool).await.expect("migrate");
    let opts = pool.connect_options().as_ref().clone();
    let app = make_role(&pool, "dlleader_app").await;
    let other = make_role(&pool, "dlleader_other").await;
    grant_documented_rights(&pool, &app).await;
    grant_documented_rights(&pool, &other).await;
    let app_pool = pool_as(&opts, &app).await;
    let other_pool = pool_as(&opts, &other).await;
    let app_locker: Arc<dyn Locker> = Arc::new(PgLocker::new(app_pool.clone()));
    let campaign = election(&app_locker, "app", "").campaign();
    let term = bounded("leads", Duration::from_secs(5), campaign.elected())
        .await
        .expect("a term");
    let seen = election(&app_locker, "x", "")
        .leader()
        .await
        .expect("leader()");
    assert_eq!(seen.map(|l| l.term), term.number(), "its own role sees it");
    let other_locker: Arc<dyn Locker> = Arc::new(PgLocker::new(other_pool.clone()));
    let reader = election(&other_locker, "y", "");
    assert_eq!(
        reader.leader().await.expect("leader()"),
        None,
        "another role"
    );
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "GRANT pg_read_all_stats TO {other}"
    )))
    .execute(&pool)
    .await
    .expect("grant pg_read_all_stats");
    let seen = reader.leader().await.expect("leader()");
    assert_eq!(
        seen.map(|l| l.identity),
        Some("app".to_owned()),
        "with pg_read_all_stats"
    );
    campaign.resign().await.expect("resign");
    app_pool.close().await;
    other_pool.close().await;
    sqlx::query("DROP SCHEMA distlock CASCADE")
        .execute(&pool)
        .await
        .expect("drop the schema");
    let _ = drop_role(&pool, &app).await;
    let _ = drop_role(&pool, &other).await;
}

/// A campaign's task and an observer's reader run on the runtime that
/// started them. When that runtime shuts down they go, the campaign's lease
/// with its task (the key is free for another candidate): the term it led
/// must end, the campaign must not say it leads, and the observer must not
/// name a leader it no longer reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_term_and_an_observer_end_with_their_runtime() {
    let memory = MemoryLocker::new();
    let election = LeaderElection::new(Arc::new(memory.clone()), "leader:runtime");
    let (campaign, term, observer) = tokio::task::spawn_blocking(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let started = rt.block_on(async {
            let campaign = election.campaign();
            let term = bounded("it leads", Duration::from_secs(5), campaign.elected())
                .await
                .expect("a term");
            let observer = election.observe();
            bounded("the observer names it", Duration::from_secs(5), async {
                while observer.leader().is_none() {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
            .await;
            (campaign, term, observer)
        });
        drop(rt);
        started
    })
    .await
    .unwrap();
    bounded("the term ends", Duration::from_secs(5), term.ended()).await;
    assert!(!campaign.is_leader(), "its task and its lease are gone");
    assert!(campaign.term().is_none());
    assert!(campaign.fencing_token().is_none());
    assert!(!*campaign.leadership().borrow());
    assert_eq!(observer.leader(), None, "nobody reads the leader any more");
    let key = LockKey::from("leader:runtime");
    let free = memory.try_lock(key).await.expect("try_lock");
    assert!(free.is_some(), "the lease went with the task");
}

/// A role without the grants the leader record needs (here `UPDATE` on
/// `distlock.leaders`): the campaign ends with `PermissionDenied`, which no
/// retry can cure, instead of taking the lock, failing to proclaim and
/// trying again every second with only a warning in the log.
#[sqlx::test(migrations = false)]
async fn a_campaign_without_the_grants_ends_with_permission_denied(pool: PgPool) {
    use common::roles::{drop_role, grant_documented_rights, make_role, pool_as};
    distlock::migrate(&pool).await.expect("migrate");
    let opts = pool.connect_options().as_ref().clone();
    let app = make_role(&pool, "dlleader_nogrant").await;
    grant_documented_rights(&pool, &app).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "REVOKE UPDATE ON distlock.leaders FROM {app}"
    )))
    .execute(&pool)
    .await
    .expect("revoke");
    let app_pool = pool_as(&opts, &app).await;
    let locker: Arc<dyn Locker> = Arc::new(PgLocker::new(app_pool.clone()));
    let campaign = election(&locker, "app", "").campaign();
    let ended = bounded(
        "the campaign ends",
        Duration::from_secs(5),
        campaign.elected(),
    )
    .await
    .expect_err("no right to write the record");
    assert!(matches!(ended, Error::PermissionDenied { .. }), "{ended:?}");
    assert!(
        matches!(campaign.failure(), Some(Error::PermissionDenied { .. })),
        "{:?}",
        campaign.failure()
    );
    drop(campaign);
    app_pool.close().await;
    sqlx::query("DROP SCHEMA distlock CASCADE")
        .execute(&pool)
        .await
        .expect("drop the schema");
    let _ = drop_role(&pool, &app).await;
}

/// The leader record's statements given up on end on the server too: held
/// up by the record's row (locked by another transaction), a proclamation
/// and a withdrawal on `records` each fail with `CommandTimedOut` at
/// `deadline` (the backend's), having waited that long, and their waits
/// for the row end then as well: none stays behind as a backend waiting on
/// the row (which it would, the server not noticing a closed socket while
/// a statement waits).
async fn record_statements_given_up(
    pool: &PgPool,
    records: &dyn ElectionLocker,
    deadline: Duration,
) {
    use common::row_waits::{rows_locked, waited_at_least, waiting_a_moment_later};
    let key = LockKey::from("leader:late-record");
    let (lease, seat) = records
        .lock_seat(key.clone(), Duration::from_secs(5))
        .await
        .expect("the seat");
    let proclamation = Proclamation {
        identity: "a".to_owned(),
        value: "v".to_owned(),
        fencing_token: lease.fencing_token(),
        grace: Duration::ZERO,
    };
    let term = records.proclaim(&key, seat, &proclamation).await.unwrap();
    let term = term.expect("the seat holds the lock").leader.term;
    let blocker = rows_locked(pool, "distlock.leaders").await;
    let started = std::time::Instant::now();
    let proclaimed = records.proclaim(&key, seat, &proclamation).await;
    assert!(
        matches!(proclaimed, Err(Error::CommandTimedOut { .. })),
        "{proclaimed:?}"
    );
    waited_at_least(started, deadline);
    let proclaiming = waiting_a_moment_later(pool, "leader_proclaim").await;
    let started = std::time::Instant::now();
    let withdrawn = records.withdraw(&key, seat, Some(term)).await;
    assert!(
        matches!(withdrawn, Err(Error::CommandTimedOut { .. })),
        "{withdrawn:?}"
    );
    waited_at_least(started, deadline);
    let withdrawing = waiting_a_moment_later(pool, "leader_withdraw").await;
    blocker.rollback().await.expect("rollback");
    assert_eq!(
        (proclaiming, withdrawing),
        (0, 0),
        "(proclamations, withdrawals) given up still waiting on the server"
    );
    lease.release().await.expect("release");
}

/// [`record_statements_given_up`] on `PgLocker`: the heartbeat deadline.
#[sqlx::test(migrations = false)]
async fn record_statements_given_up_end_on_the_server_too_on_postgres(pool: PgPool) {
    distlock::migrate(&pool).await.expect("migrate");
    let locker = PgLocker::new(pool.clone());
    record_statements_given_up(&pool, &locker, locker.heartbeat_timeout()).await;
}

/// [`record_statements_given_up`] on the lease table: the renewal
/// deadline, two thirds of the TTL.
#[sqlx::test(migrations = false)]
async fn record_statements_given_up_end_on_the_server_too_on_the_lease_table(pool: PgPool) {
    distlock::migrate(&pool).await.expect("migrate");
    let locker = distlock::postgres::TableLocker::builder(pool.clone())
        .ttl(Duration::from_millis(1500))
        .build()
        .expect("valid settings");
    record_statements_given_up(&pool, &locker, Duration::from_millis(1000)).await;
}
