//! [`distlock::LeaderElection`] over every backend: one leader, takeover
//! after a resignation, a lost leadership, dropped campaigns and
//! resignations, a bad key, a pooler; a lost lease ending its term, who
//! leads (`leader()`) and its changes (`observe()`) where the backend
//! records leaders, "unsupported" where it does not; and the leader
//! record's own interface given what it cannot keep.

use super::*;
use common::drop_after::drop_after;
use distlock::{Campaign, LeaderElection, Proclamation};

/// How long a campaign may take to lead once the key is free (Redis polls).
const LEADS_WITHIN: Duration = Duration::from_secs(10);
/// How long the cases watch that a campaign does *not* lead.
const WATCH: Duration = Duration::from_millis(600);

fn elections(backend: &impl Backend, name: &str) -> (LeaderElection, LeaderElection) {
    let (a, b) = backend.lockers();
    let k = key(name);
    (LeaderElection::new(a, k.clone()), LeaderElection::new(b, k))
}

async fn leads(campaign: &Campaign, what: &str) {
    let mut leadership = campaign.leadership();
    common::bounded(what, LEADS_WITHIN, leadership.wait_for(|leader| *leader))
        .await
        .unwrap_or_else(|_| panic!("{what}: the campaign ended: {:?}", campaign.failure()));
}

/// Samples both campaigns for `WATCH`: they never lead together.
async fn never_both(one: &Campaign, two: &Campaign, what: &str) {
    let started = Instant::now();
    while started.elapsed() < WATCH {
        assert!(!(one.is_leader() && two.is_leader()), "{what}: two leaders");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub(crate) async fn one_leader_and_takeover(backend: &impl Backend) {
    let (a, b) = elections(backend, "leader");
    let first = a.campaign();
    leads(&first, "the first campaign leads").await;
    let term = first.fencing_token();
    assert_eq!(term.is_some(), backend.tokens(), "a term's token");
    let second = b.campaign();
    never_both(&first, &second, "while the first leads").await;
    assert!(!second.is_leader(), "the second leads beside the first");
    first.resign().await.unwrap();
    leads(&second, "the second takes over").await;
    if let (Some(before), Some(now)) = (term, second.fencing_token()) {
        assert!(
            now > before,
            "the next term's token {now:?} after {before:?}"
        );
    }
    // A campaign from the first process again: it waits.
    let third = a.campaign();
    never_both(&second, &third, "after the takeover").await;
    assert!(!third.is_leader(), "a third leads beside the second");
    second.resign().await.unwrap();
    leads(&third, "the third takes over").await;
    third.resign().await.unwrap();
}

pub(crate) async fn leadership_lost_and_regained(backend: &impl Backend) {
    let (a, b) = elections(backend, "leader-lost");
    let first = a.campaign();
    leads(&first, "the first campaign leads").await;
    let second = b.campaign();
    never_both(&first, &second, "before the loss").await;
    // The term, taken before the loss: the flag may be true again (a new
    // term of the same campaign) by the time anyone looks, so it is the
    // term that must be seen to end.
    let term = first.term().expect("the first campaign leads a term");
    backend.break_lease(&key("leader-lost")).await;
    common::bounded(
        "the term ends after the loss",
        LOSS_NOTICED_WITHIN,
        term.ended(),
    )
    .await;
    assert!(term.is_over());
    // Leading again is a new term, never the old one going on.
    if let Some(next) = first.term().filter(|next| !next.is_over()) {
        assert!(next.since() > term.since(), "a new term starts later");
        if let (Some(old), Some(new)) = (term.number(), next.number()) {
            assert!(new > old, "term numbers rise: {old} then {new}");
        }
    }
    // Someone leads again (the second, or the first campaigning again),
    // never both.
    common::eventually("a leader after the loss", LEADS_WITHIN, async || {
        assert!(
            !(first.is_leader() && second.is_leader()),
            "two leaders after the loss"
        );
        first.is_leader() || second.is_leader()
    })
    .await;
    never_both(&first, &second, "after the loss").await;
    first.resign().await.unwrap();
    second.resign().await.unwrap();
}

/// Campaigns dropped at several moments, and resignations dropped at every
/// `.await`: the key is free soon after.
pub(crate) async fn dropped_campaigns_free_the_key(backend: &impl Backend) {
    let (a, _) = elections(backend, "leader-drop");
    let (_, other) = backend.lockers();
    let k = key("leader-drop");
    for delay in [0, 1, 10, 100] {
        let campaign = a.campaign();
        tokio::time::sleep(Duration::from_millis(delay)).await;
        drop(campaign);
        free_soon(
            other.as_ref(),
            &k,
            DROP_FREED_WITHIN,
            &format!("a campaign dropped after {delay} ms"),
        )
        .await;
    }
    for budget in budgets() {
        let campaign = a.campaign();
        leads(&campaign, "the campaign leads").await;
        let done = drop_after(budget, campaign.resign()).await;
        let what = format!("resign dropped after {budget} Pendings");
        free_soon(other.as_ref(), &k, DROP_FREED_WITHIN, &what).await;
        if let Some(done) = done {
            done.expect("resign");
            break;
        }
        assert!(budget + 1 < MAX_AWAITS, "{what}: never completed");
    }
}

pub(crate) async fn bad_key_ends_the_campaign(backend: &impl Backend) {
    let (a, _) = backend.lockers();
    for bad in ["", "nul\0inside"] {
        let campaign = LeaderElection::new(Arc::clone(&a), bad).campaign();
        let mut leadership = campaign.leadership();
        let ended = common::bounded(
            "the campaign ends",
            Duration::from_secs(5),
            leadership.wait_for(|l| *l),
        )
        .await;
        assert!(ended.is_err(), "{bad:?}: a campaign on a bad key led");
        assert!(
            matches!(campaign.failure(), Some(Error::InvalidKey { .. })),
            "{bad:?}: {:?}",
            campaign.failure()
        );
        let err = campaign.resign().await.unwrap_err();
        assert!(matches!(err, Error::InvalidKey { .. }), "{bad:?}: {err:?}");
    }
}

/// Two campaigns through a transaction pooler: never two leaders that stay
/// leaders (a campaign refused by the pooler keeps trying, and never leads).
pub(crate) async fn behind_a_pooler(backend: &impl PooledBackend) {
    let (_proxy, pooled) = backend.behind_a_pooler().await;
    let (a, b) = elections(&pooled, "leader-pooled");
    let first = a.campaign();
    let second = b.campaign();
    let started = Instant::now();
    while started.elapsed() < WATCH * 3 {
        if first.is_leader() && second.is_leader() {
            let (mut one, mut two) = (first.leadership(), second.leadership());
            common::bounded(
                "one of two leaders behind a pooler is told",
                LOSS_NOTICED_WITHIN,
                async {
                    tokio::select! {
                        _ = one.wait_for(|l| !*l) => {}
                        _ = two.wait_for(|l| !*l) => {}
                    }
                },
            )
            .await;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(first);
    drop(second);
}

/// The election over `backend`'s two lockers, with an identity each and a
/// quick observer.
fn named(backend: &impl Backend, name: &str) -> (LeaderElection, LeaderElection) {
    let (a, b) = backend.lockers();
    let build = |locker: Arc<dyn Locker>, identity: &str| {
        LeaderElection::builder(locker, key(name))
            .identity(identity)
            .value(format!("value of {identity}"))
            .poll(Duration::from_millis(50))
            .build()
            .expect("valid settings")
    };
    (build(a, "candidate-a"), build(b, "candidate-b"))
}

/// Whether the backend keeps a record of leaders (`ElectionLocker`).
fn records_leaders(backend: &impl Backend) -> bool {
    backend.lockers().0.election().is_some()
}

/// A lease broken under a leader ends its term; the campaign leads again
/// under a new term (another token, a higher number where the backend
/// numbers them), and `leader()` names the new term, never the old.
pub(crate) async fn a_lost_lease_ends_the_term(backend: &impl Backend) {
    let (a, b) = named(backend, "leader-term");
    let campaign = a.campaign();
    let first = common::bounded("leads", LEADS_WITHIN, campaign.elected())
        .await
        .expect("a term");
    let work = first.cancellation();
    assert_eq!(first.identity(), "candidate-a");
    assert_eq!(first.number().is_some(), records_leaders(backend));
    backend.break_lease(&key("leader-term")).await;
    common::bounded("the term ends", LOSS_NOTICED_WITHIN, first.ended()).await;
    assert!(work.is_cancelled(), "the term's work is told");
    let second = common::bounded("leads again", LEADS_WITHIN * 2, campaign.elected())
        .await
        .expect("a second term");
    assert_ne!(first, second, "a loss and a new win are two terms");
    assert!(!second.is_over());
    if backend.tokens() {
        assert!(
            second.fencing_token() > first.fencing_token(),
            "{second:?} after {first:?}"
        );
    }
    if records_leaders(backend) {
        assert!(
            second.number() > first.number(),
            "{second:?} after {first:?}"
        );
        let named = b.leader().await.expect("leader()").expect("a leader");
        assert_eq!(Some(named.term), second.number(), "{named:?}");
    }
    campaign.resign().await.expect("resign");
}

/// Anyone can ask who leads where the backend records it: identity,
/// value, term, token; nobody once the leader resigned. Elsewhere
/// `leader()` and `observe()` say it is unsupported.
pub(crate) async fn leader_is_named_or_unsupported(backend: &impl Backend) {
    let (a, b) = named(backend, "leader-named");
    if !records_leaders(backend) {
        let err = b.leader().await.unwrap_err();
        assert!(matches!(err, Error::Unsupported { .. }), "{err:?}");
        let observer = b.observe();
        assert!(
            matches!(observer.failure(), Some(Error::Unsupported { .. })),
            "{:?}",
            observer.failure()
        );
        return;
    }
    assert_eq!(b.leader().await.expect("leader()"), None);
    let campaign = a.campaign();
    let term = common::bounded("leads", LEADS_WITHIN, campaign.elected())
        .await
        .expect("a term");
    let leader = b.leader().await.expect("leader()").expect("a leader");
    assert_eq!(leader.identity, "candidate-a");
    assert_eq!(leader.value, "value of candidate-a");
    assert_eq!(Some(leader.term), term.number());
    assert_eq!(leader.fencing_token, term.fencing_token());
    campaign.resign().await.expect("resign");
    assert_eq!(
        b.leader().await.expect("leader()"),
        None,
        "after a resignation"
    );
    for bad in ["", "nul\0inside"] {
        let (locker, _) = backend.lockers();
        let err = LeaderElection::new(locker, bad).leader().await.unwrap_err();
        assert!(matches!(err, Error::InvalidKey { .. }), "{bad:?}: {err:?}");
    }
}

/// An observer follows who leads: a leader, the next one after a
/// resignation, nobody at the end.
pub(crate) async fn observers_follow_the_leader(backend: &impl Backend) {
    if !records_leaders(backend) {
        return; // leader_is_named_or_unsupported covers it
    }
    let (a, b) = named(backend, "leader-observed");
    let mut observer = b.observe();
    let wait_for = |observer: &mut distlock::Observer, identity: Option<&'static str>| {
        let mut receiver = observer.receiver();
        async move {
            common::bounded("the observer follows", LEADS_WITHIN, async {
                receiver
                    .wait_for(|l| l.as_ref().map(|l| l.identity.as_str()) == identity)
                    .await
                    .map(|l| l.clone())
            })
            .await
            .expect("observing")
        }
    };
    let first = a.campaign();
    let seen = wait_for(&mut observer, Some("candidate-a"))
        .await
        .expect("a");
    let second = b.campaign();
    first.resign().await.expect("resign");
    let next = wait_for(&mut observer, Some("candidate-b"))
        .await
        .expect("b");
    assert!(next.term > seen.term, "{next:?} after {seen:?}");
    second.resign().await.expect("resign");
    wait_for(&mut observer, None).await;
    assert!(observer.failure().is_none(), "{:?}", observer.failure());
}

/// The leader record's own interface ([`distlock::ElectionLocker`]), called
/// directly where the backend has one: a grace longer than
/// [`Proclamation::MAX_GRACE`] is refused and leaves the record as it was
/// (in memory it overflowed the clock; on the servers it failed as a
/// database error), and a withdrawal naming a term no record can carry
/// clears nothing (it used to clear the record whatever its term).
pub(crate) async fn the_record_refuses_what_it_cannot_keep(backend: &impl Backend) {
    let (a, _) = backend.lockers();
    let Some(records) = a.election() else {
        return;
    };
    let k = key("leader-record-input");
    let (lease, seat) = records
        .lock_seat(k.clone(), LEADS_WITHIN)
        .await
        .expect("the seat");
    let proclamation = |grace| Proclamation {
        identity: "candidate-a".to_owned(),
        value: "v".to_owned(),
        fencing_token: lease.fencing_token(),
        grace,
    };
    let first = records
        .proclaim(&k, seat, &proclamation(Duration::ZERO))
        .await
        .expect("proclaim")
        .expect("the seat holds the lock");
    // Not withdrawn: the next proclamation replaces a record that still
    // names a leader, so its grace counts.
    for grace in [
        Proclamation::MAX_GRACE + Duration::from_millis(1),
        Duration::MAX,
    ] {
        let err = records
            .proclaim(&k, seat, &proclamation(grace))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidArgument {
                    argument: "grace",
                    ..
                }
            ),
            "{grace:?}: {err:?}"
        );
    }
    let named = |leader: Option<distlock::LeaderInfo>| leader.map(|leader| leader.term);
    assert_eq!(
        named(records.leader(&k).await.expect("leader")),
        Some(first.leader.term),
        "a refused proclamation changed the record"
    );
    records
        .withdraw(&k, seat, Some(u64::MAX))
        .await
        .expect("withdraw");
    assert_eq!(
        named(records.leader(&k).await.expect("leader")),
        Some(first.leader.term),
        "a term no record carries cleared the record"
    );
    records
        .withdraw(&k, seat, Some(first.leader.term))
        .await
        .expect("withdraw");
    assert_eq!(records.leader(&k).await.expect("leader"), None);
    lease.release().await.expect("release");
}

/// A successor that stops during its grace (a deploy, a lost lock, a
/// proclamation whose answer was lost) withdraws a term that never
/// started: the leader it replaced may still believe it leads, so the next
/// proclamation must wait a grace too. It used to see a withdrawn record
/// and lead at once, beside the deposed leader.
pub(crate) async fn a_successor_stopped_in_its_grace_leaves_the_grace_to_the_next(
    backend: &impl Backend,
) {
    let (a, b) = backend.lockers();
    let (Some(first_records), Some(records)) = (a.election(), b.election()) else {
        return;
    };
    let k = key("leader-grace-pending");
    let grace = Duration::from_secs(2);
    let proclamation = |lease: &dyn distlock::Lease, name: &str| Proclamation {
        identity: name.to_owned(),
        value: "v".to_owned(),
        fencing_token: lease.fencing_token(),
        grace,
    };
    // A leads, then loses its lease without withdrawing (it may not know).
    let (deposed, seat) = first_records
        .lock_seat(k.clone(), LEADS_WITHIN)
        .await
        .expect("A's seat");
    first_records
        .proclaim(&k, seat, &proclamation(&*deposed, "a"))
        .await
        .expect("proclaim")
        .expect("A holds the lock");
    backend.break_lease(&k).await;
    // B wins and waits its grace, then stops before its term starts.
    let (lease, seat) = records
        .lock_seat(k.clone(), LEADS_WITHIN)
        .await
        .expect("B's seat");
    let b = records
        .proclaim(&k, seat, &proclamation(&*lease, "b"))
        .await
        .expect("proclaim")
        .expect("B holds the lock");
    assert!(b.after_loss, "A had not withdrawn");
    records
        .withdraw(&k, seat, Some(b.leader.term))
        .await
        .expect("B withdraws");
    lease.release().await.expect("B releases");
    // C wins: A may still believe it leads, so C waits a grace as B did.
    let (lease, seat) = records
        .lock_seat(k.clone(), LEADS_WITHIN)
        .await
        .expect("C's seat");
    let c = records
        .proclaim(&k, seat, &proclamation(&*lease, "c"))
        .await
        .expect("proclaim")
        .expect("C holds the lock");
    assert!(
        c.after_loss,
        "C leads at once while A may still believe it leads"
    );
    assert_eq!(records.leader(&k).await.expect("leader"), None, "C's grace");
    records
        .withdraw(&k, seat, Some(c.leader.term))
        .await
        .expect("C withdraws");
    lease.release().await.expect("C releases");
    drop(deposed);
}
