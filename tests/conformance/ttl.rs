//! Leases with a time to live (the lease table, Redis, Redlock): past its
//! deadline a lease is lost at its holder's first look, even if its keeper
//! could not run meanwhile (a long blocking call, a process stopped and
//! continued), and a loss once seen is never taken back; a keeper whose
//! renewals failed meanwhile, or whose renewal is unanswered, gives the
//! guard its reason; leases and semaphore permits tell their
//! `validity()`. A backend whose locks live as long as their server
//! session (PostgreSQL's advisory locks) or its process (memory) has no
//! deadline, and no such case.

use super::*;

pub(crate) async fn starved_past_its_deadline_is_lost_at_first_look(backend: &impl TtlBackend) {
    let (a, b) = backend.lockers();
    let k = key("ttl:starved");
    let held = a.try_lock(k.clone()).await.unwrap().expect("free key");
    assert!(!held.is_lost());
    let validity = held.validity().expect("a lease with a time to live");
    assert!(
        validity > Duration::ZERO && validity <= backend.ttl(),
        "{validity:?}"
    );
    // A whole TTL: past the deadline of every backend, before its keeper
    // (a task of this runtime) has run again.
    let starved = common::starve_runtime(backend.ttl());
    let reason = held.loss();
    // Looked while no task of the runtime can have run since the grant.
    drop(starved);
    assert!(
        held.is_lost() && reason.is_some(),
        "not lost at the first look past the deadline: {reason:?}"
    );
    assert_eq!(held.loss(), reason, "the first reason is kept");
    assert_eq!(held.validity(), Some(Duration::ZERO));
    common::bounded("lost()", Duration::from_millis(100), held.lost()).await;
    // The keeper runs again: whatever it finds, the loss stands.
    for _ in 0..5 {
        tokio::time::sleep(backend.ttl() / 20).await;
        assert!(held.is_lost(), "a loss was taken back");
    }
    assert!(
        held.release().await.is_err(),
        "releasing a lost lease is an error"
    );
    free_soon(b.as_ref(), &k, LOSS_NOTICED_WITHIN, "after the loss").await;
}

/// A keeper whose renewals fail (refused, not unanswered) retries until
/// the deadline; a holder that first looks past it, its keeper starved
/// since, learns why the renewals failed rather than only that the time
/// ran out. (A single Redis server's watchdog gives up at the first
/// refusal, so there the keeper reports before the deadline.)
pub(crate) async fn a_failing_keepers_reason_outlives_its_deadline(backend: &impl TtlBackend) {
    let (held, reason) =
        first_look_past_the_deadline(backend, "ttl:failing", backend.refuse_renewals()).await;
    assert!(
        backend.is_refused_renewal(&reason),
        "the renewals' failure, not the clock's own reason: {reason:?}"
    );
    the_first_reason_stands(held, reason).await;
}

/// A keeper whose renewal gets no answer (its server stopped, the lease's
/// row locked) gives the lease up at the deadline as `HeartbeatTimedOut`;
/// a holder that first looks past the deadline, its keeper starved since,
/// reads the same: the renewal left unanswered, not the clock's own
/// reason, whichever of the two is read first. (The lease table's clock
/// says `HeartbeatTimedOut` on its own, and Redlock's watchdog notes its
/// nodes' silence after their command deadline, so the case cannot fail
/// on those two.)
pub(crate) async fn an_unanswered_renewal_is_the_reason_whoever_looks_first(
    backend: &impl TtlBackend,
) {
    let (held, reason) =
        first_look_past_the_deadline(backend, "ttl:unanswered", backend.stall_renewals()).await;
    backend.answer_renewals().await;
    assert!(
        matches!(reason, LossReason::HeartbeatTimedOut(_)),
        "the renewal left unanswered, not the clock's own reason: {reason:?}"
    );
    the_first_reason_stands(held, reason).await;
}

/// Takes `name` on the first locker, lets `fault` befall its renewals,
/// and looks at the lease past its deadline, its keeper starved since a
/// quarter of a TTL before it: by then the first renewal (a quarter or a
/// third of a TTL in) has gone out, and the keeper still retries (the
/// lease table's until the deadline, Redlock's until its next retry would
/// come too late, a tenth of a TTL before it). The reason read then.
async fn first_look_past_the_deadline(
    backend: &impl TtlBackend,
    name: &str,
    fault: impl Future<Output = ()>,
) -> (Box<dyn Lease>, LossReason) {
    let (a, _) = backend.lockers();
    let held = a.try_lock(key(name)).await.unwrap().expect("free key");
    let validity = held.validity().expect("a lease with a time to live");
    fault.await;
    tokio::time::sleep(validity.saturating_sub(backend.ttl() / 4)).await;
    let starved = common::starve_runtime(backend.ttl() / 4 + backend.ttl() / 5);
    let reason = held.loss();
    drop(starved);
    (held, reason.expect("lost past the deadline"))
}

/// `lost()` gives the reason the first look read, and the lease cannot be
/// released.
async fn the_first_reason_stands(held: Box<dyn Lease>, reason: LossReason) {
    let told = common::bounded("lost()", Duration::from_millis(100), held.lost()).await;
    assert_eq!(told, reason, "the first reason is kept");
    assert!(held.release().await.is_err(), "released after its loss");
}

pub(crate) async fn permits_tell_their_validity(backend: &impl TtlBackend) {
    let (semaphore, _) = backend.semaphores("ttl:permits", 1);
    let permit = semaphore
        .try_acquire()
        .await
        .unwrap()
        .expect("a free permit");
    let validity = permit.validity();
    assert!(
        validity.is_some_and(|left| left > Duration::ZERO && left <= backend.ttl()),
        "{validity:?}"
    );
    assert!(Lease::validity(&permit).is_some(), "the trait says so too");
    permit.release().await.unwrap();
}
