//! `Redlock` over five real `redis-server` processes started by the tests.
#![cfg(feature = "redis")]

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::redis::{RedisServer, servers, urls};
use common::{eventually, init_tracing};
use distlock::redis::{Redlock, RedlockBuilder, SetupWarning};
use distlock::{Error, LockKey, Locker, LossReason};

const SHORT_TTL: Duration = Duration::from_millis(300);
/// For a test that expects the watchdog's own finding (`Expired`): long
/// enough that the answers to its first extension (a third of a TTL in)
/// are read within the validity on a loaded machine too. Answers read past
/// it count as unanswered (`HeartbeatTimedOut`), as the lease's clock says.
const LOSS_TTL: Duration = Duration::from_secs(1);

async fn redlock(servers: &[RedisServer]) -> Redlock {
    init_tracing();
    let urls = urls(servers);
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    Redlock::connect(&urls).await.expect("connect")
}

/// A `Redlock` over `servers` with the settings `configure` gives its builder.
async fn redlock_with(
    servers: &[RedisServer],
    configure: impl FnOnce(RedlockBuilder) -> RedlockBuilder,
) -> Redlock {
    init_tracing();
    configure(Redlock::builder(urls(servers)))
        .build()
        .await
        .expect("connect")
}

/// What every server holds at `key`.
async fn values(servers: &[RedisServer], key: &str) -> Vec<Option<String>> {
    let mut values = Vec::new();
    for server in servers {
        values.push(server.get(key).await);
    }
    values
}

#[tokio::test]
async fn exclusive_acquire_with_the_same_token_on_every_node() -> anyhow::Result<()> {
    let servers = servers(5).await;
    let (a, b) = (redlock(&servers).await, redlock(&servers).await);
    assert_eq!(a.quorum(), 3);

    let lease = a.try_lock("jobs:redlock").await?.expect("free lock");
    assert!(b.try_lock("jobs:redlock").await?.is_none());
    let held = values(&servers, "jobs:redlock").await;
    assert!(
        held[0].is_some() && held.iter().all(|v| *v == held[0]),
        "{held:?}"
    );
    assert_eq!(
        lease.fencing_token(),
        None,
        "Redlock issues no fencing tokens"
    );

    lease.release().await?;
    assert!(
        values(&servers, "jobs:redlock")
            .await
            .iter()
            .all(Option::is_none)
    );
    Ok(())
}

#[tokio::test]
async fn acquires_with_two_of_five_nodes_down() -> anyhow::Result<()> {
    let mut servers = servers(5).await;
    let redlock = redlock(&servers).await;
    servers[0].kill();
    servers[3].kill();

    let lease = redlock
        .try_lock("jobs:minority-down")
        .await?
        .expect("quorum of 3");
    let live = [&servers[1], &servers[2], &servers[4]];
    for server in live {
        assert!(server.get("jobs:minority-down").await.is_some());
    }
    lease.release().await?;
    Ok(())
}

#[tokio::test]
async fn refuses_with_three_of_five_nodes_down() -> anyhow::Result<()> {
    let mut servers = servers(5).await;
    let redlock = redlock(&servers).await;
    for i in [0, 2, 4] {
        servers[i].kill();
    }

    let err = redlock
        .try_lock("jobs:majority-down")
        .await
        .expect_err("no quorum");
    match &err {
        Error::QuorumUnreachable {
            key,
            nodes: 5,
            quorum: 3,
            failures,
            passing: true,
        } => {
            assert_eq!(key, &LockKey::from("jobs:majority-down"));
            assert_eq!(failures.len(), 3, "{failures:?}");
            for i in [0, 2, 4] {
                let port = servers[i].port().to_string();
                assert!(
                    failures.iter().any(|f| f.contains(&port)),
                    "node {i} named: {failures:?}"
                );
            }
        }
        other => panic!("expected QuorumUnreachable, got {other:?}"),
    }
    assert!(
        err.to_string()
            .starts_with("Redlock quorum unreachable for lock \"jobs:majority-down\": 3 of 5 nodes failed and 3 must grant ("),
        "{err}"
    );
    // Nodes that are down may come back: a wait keeps trying until its end.
    let started = Instant::now();
    let err = redlock
        .lock("jobs:majority-down", Duration::from_millis(200))
        .await
        .expect_err("no quorum");
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(started.elapsed() >= Duration::from_millis(200));
    // The failed attempts cleaned up the two nodes that granted them.
    assert_eq!(servers[1].get("jobs:majority-down").await, None);
    assert_eq!(servers[3].get("jobs:majority-down").await, None);
    Ok(())
}

#[tokio::test]
async fn a_failed_attempt_releases_on_all_nodes() -> anyhow::Result<()> {
    let servers = servers(5).await;
    let redlock = redlock(&servers).await;
    for server in &servers[..3] {
        let _: String = server
            .run(&["SET", "jobs:contended", "other", "PX", "10000"])
            .await;
    }

    assert!(redlock.try_lock("jobs:contended").await?.is_none());
    let held = values(&servers, "jobs:contended").await;
    let other = Some("other".to_owned());
    assert_eq!(held, vec![other.clone(), other.clone(), other, None, None]);

    let few_retries = redlock_with(&servers, |b| {
        b.retry_count(2)
            .retry_delay(Duration::from_millis(10))
            .retry_jitter(Duration::ZERO)
    })
    .await;
    // Timed from the call, not from connecting to the five nodes (which a
    // loaded machine can make slow): three attempts end far before the
    // call's own 5 s, which is what would end a wait the retry count did not
    // bound.
    let started = Instant::now();
    let err = few_retries
        .lock("jobs:contended", Duration::from_secs(5))
        .await
        .expect_err("held by a quorum of others");
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(
        started.elapsed() < Duration::from_millis(2_500),
        "retry count bounds the wait: {:?}",
        started.elapsed()
    );
    Ok(())
}

#[tokio::test]
async fn a_slow_node_that_comes_back_is_cleaned_by_release_on_all() -> anyhow::Result<()> {
    let servers = servers(5).await;
    let redlock = redlock_with(&servers, |b| b.node_timeout(Duration::from_millis(100))).await;
    // Node 0 takes writes only after 400 ms: the SET times out, then lands.
    let _: String = servers[0].run(&["CLIENT", "PAUSE", "400", "WRITE"]).await;

    let lease = redlock
        .try_lock("jobs:late")
        .await?
        .expect("4 of 5 granted");
    let token = servers[1].get("jobs:late").await;
    assert!(token.is_some());
    eventually(
        "the late SET landed on node 0",
        Duration::from_secs(2),
        async || servers[0].get("jobs:late").await == token,
    )
    .await;

    lease.release().await?;
    assert_eq!(values(&servers, "jobs:late").await, vec![None; 5]);
    Ok(())
}

/// An attempt whose key landed on a node while its reply did not, and whose
/// cleanup failed there, leaves the call's own token on that node: later
/// attempts of the same call take it as theirs, as the single instance's
/// script does, instead of counting it as another holder's until the TTL.
#[tokio::test]
async fn a_key_left_by_an_earlier_attempt_of_the_same_call_counts_as_ours() -> anyhow::Result<()> {
    let servers = servers(3).await;
    // On nodes 0 and 1 the locker's user may not delete keys, so the
    // cleanups of the attempts that time out there fail and leave the key.
    let mut urls = urls(&servers);
    for (server, url) in servers.iter().zip(urls.iter_mut()).take(2) {
        let _: String = server
            .run(&[
                "ACL", "SETUSER", "locker", "on", ">pw", "+@all", "-del", "~*", "&*",
            ])
            .await;
        *url = format!("redis://locker:pw@127.0.0.1:{}", server.port());
    }
    init_tracing();
    let redlock = Redlock::builder(urls)
        .ttl(Duration::from_secs(30))
        .node_timeout(Duration::from_millis(100))
        .retry_count(1_000)
        .retry_delay(Duration::from_millis(100))
        .retry_jitter(Duration::from_millis(10))
        .poll_interval(Duration::from_millis(200))
        .build()
        .await
        .expect("connect");
    // Nodes 0 and 1 take writes only after 400 ms: the first attempts time
    // out there, then their keys land, and their cleanups fail.
    for server in &servers[..2] {
        let _: String = server.run(&["CLIENT", "PAUSE", "400", "WRITE"]).await;
    }
    let lease = redlock
        .lock("jobs:leftover", Duration::from_secs(3))
        .await
        .expect("the call's own leftover keys do not hold it up");
    let held = values(&servers, "jobs:leftover").await;
    assert!(
        held.iter().all(|v| v.is_some() && *v == held[0]),
        "one token on every node: {held:?}"
    );
    drop(lease);
    Ok(())
}

/// A lock's key of another type (an application's data under the lock's
/// name) is a permanent error on that node, as on a single instance: a
/// majority of such nodes ends a wait at once instead of counting as held.
#[tokio::test]
async fn a_lock_key_of_another_type_on_a_majority_is_a_permanent_error() -> anyhow::Result<()> {
    let servers = servers(3).await;
    for server in &servers[..2] {
        let _: i64 = server.run(&["RPUSH", "jobs:typed", "data"]).await;
    }
    let redlock = redlock(&servers).await;
    let tried = redlock.try_lock("jobs:typed").await;
    assert!(
        matches!(&tried, Err(Error::QuorumUnreachable { failures, .. })
            if failures.iter().all(|f| f.contains("WRONGTYPE"))),
        "{:?}",
        tried.map(|l| l.is_some())
    );
    let started = Instant::now();
    let waited = redlock.lock("jobs:typed", Duration::from_secs(5)).await;
    assert!(
        matches!(waited, Err(Error::QuorumUnreachable { .. })),
        "{:?}",
        waited.map(drop)
    );
    assert!(started.elapsed() < Duration::from_secs(2), "at once");
    assert_eq!(servers[2].get("jobs:typed").await, None, "cleaned up");
    Ok(())
}

#[tokio::test]
async fn a_node_down_at_connect_takes_part_once_it_comes_up() -> anyhow::Result<()> {
    let mut servers = servers(2).await;
    for _ in 0..3 {
        servers.push(RedisServer::reserve(&[]));
    }
    let redlock = redlock(&servers).await;
    let err = redlock
        .try_lock("jobs:late-nodes")
        .await
        .expect_err("3 of 5 down");
    assert!(
        matches!(err, Error::QuorumUnreachable { ref failures, .. } if failures.len() == 3),
        "{err}"
    );

    for server in &mut servers[2..] {
        server.spawn().await;
    }
    let lease = redlock
        .try_lock("jobs:late-nodes")
        .await?
        .expect("all 5 up");
    let held = values(&servers, "jobs:late-nodes").await;
    assert!(
        held.iter().all(|v| v.is_some() && *v == held[0]),
        "{held:?}"
    );
    lease.release().await?;
    Ok(())
}

#[tokio::test]
async fn validity_is_below_ttl_and_accounts_for_elapsed_time() -> anyhow::Result<()> {
    let servers = servers(5).await;
    let ttl = Duration::from_secs(2);
    let drift = ttl / 100 + Duration::from_millis(2);
    let redlock = redlock_with(&servers, |b| {
        b.ttl(ttl).node_timeout(Duration::from_secs(1))
    })
    .await;

    let lease = redlock.try_lock("jobs:validity").await?.expect("free lock");
    let validity = lease.validity();
    assert!(validity <= ttl - drift, "{validity:?}");
    assert!(
        validity > ttl - drift - Duration::from_millis(200),
        "{validity:?}"
    );
    lease.release().await?;

    // Three nodes answer writes only after 300 ms, so any quorum waits for one.
    for server in &servers[..3] {
        let _: String = server.run(&["CLIENT", "PAUSE", "300", "WRITE"]).await;
    }
    let started = Instant::now();
    let lease = redlock
        .try_lock("jobs:validity")
        .await?
        .expect("granted, slowly");
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(250), "{took:?}");
    let validity = lease.validity();
    assert!(
        validity <= ttl - drift - Duration::from_millis(250),
        "{validity:?} after {took:?}"
    );
    assert!(validity > Duration::ZERO);
    lease.release().await?;
    Ok(())
}

#[tokio::test]
async fn watchdog_survives_a_minority_and_loses_the_lease_without_quorum() -> anyhow::Result<()> {
    let mut servers = servers(5).await;
    let redlock = redlock_with(&servers, |b| b.ttl(SHORT_TTL)).await;
    let lease = redlock.try_lock("jobs:watched").await?.expect("free lock");

    servers[0].kill();
    servers[1].kill();
    tokio::time::sleep(SHORT_TTL * 3).await;
    assert!(!lease.is_lost(), "3 of 5 still extend: {:?}", lease.loss());
    let pttl: i64 = servers[2].run(&["PTTL", "jobs:watched"]).await;
    assert!(pttl > 0, "extended on the live nodes");

    servers[2].kill();
    // Without a quorum no extension lands, so the validity runs out: the
    // watchdog reports its failed or unanswered extension, or the lease's
    // own clock does, with the same reason (the failure the watchdog was
    // retrying on, or its extension still unanswered), or `Expired` if on
    // a loaded machine the watchdog sent no extension before the deadline.
    let reason = tokio::time::timeout(SHORT_TTL * 5, lease.lost()).await?;
    assert!(
        matches!(
            reason,
            LossReason::ConnectionFailed(_)
                | LossReason::HeartbeatTimedOut(_)
                | LossReason::Expired
        ),
        "{reason:?}"
    );
    assert!(matches!(lease.release().await, Err(Error::LockLost { .. })));
    Ok(())
}

/// Extensions that a majority leaves unanswered (paused: SIGSTOP) lose the
/// lease as unanswered (`HeartbeatTimedOut`), whether the watchdog reports
/// it or the lease's own clock with the failure the watchdog was retrying
/// on: silence is not a failed connection. (`Expired`, the clock's own
/// reason, only if on a loaded machine the watchdog sent no extension
/// before the deadline.)
#[tokio::test]
async fn silent_nodes_lose_the_lease_as_unanswered() -> anyhow::Result<()> {
    let servers = servers(3).await;
    let redlock = redlock_with(&servers, |b| b.ttl(SHORT_TTL)).await;
    let lease = redlock.try_lock("jobs:silent").await?.expect("free lock");
    servers[0].pause();
    servers[1].pause();
    let reason = tokio::time::timeout(SHORT_TTL * 5, lease.lost()).await;
    servers[0].resume();
    servers[1].resume();
    let reason = reason?;
    assert!(
        matches!(
            reason,
            LossReason::HeartbeatTimedOut(_) | LossReason::Expired
        ),
        "{reason:?}"
    );
    Ok(())
}

#[tokio::test]
async fn deleting_the_key_on_a_majority_makes_lost_fire() -> anyhow::Result<()> {
    let servers = servers(5).await;
    let redlock = redlock_with(&servers, |b| b.ttl(LOSS_TTL)).await;
    let lease = redlock.try_lock("jobs:deleted").await?.expect("free lock");

    for server in &servers[..3] {
        let _: i64 = server.run(&["DEL", "jobs:deleted"]).await;
    }
    let reason = tokio::time::timeout(LOSS_TTL, lease.lost()).await?;
    assert_eq!(reason, LossReason::Expired);
    // The cleanup after the loss deletes the remaining keys.
    eventually("the condition holds", Duration::from_secs(1), async || {
        values(&servers, "jobs:deleted")
            .await
            .iter()
            .all(Option::is_none)
    })
    .await;
    Ok(())
}

/// A release whose answering nodes already show the lease lost (four of
/// five no longer hold its token) reports the loss, not the silence of the
/// fifth node (paused: SIGSTOP), as `extend` does.
#[tokio::test]
async fn a_release_that_a_quorum_shows_lost_is_lock_lost_whatever_the_rest() -> anyhow::Result<()> {
    let servers = servers(5).await;
    let redlock = redlock_with(&servers, |b| b.node_timeout(Duration::from_millis(200))).await;
    let lease = redlock
        .try_lock("jobs:lost-at-release")
        .await?
        .expect("free lock");
    for server in &servers[..4] {
        let _: i64 = server.run(&["DEL", "jobs:lost-at-release"]).await;
    }
    servers[4].pause();
    let released = lease.release().await;
    servers[4].resume();
    assert!(
        matches!(released, Err(Error::LockLost { .. })),
        "{released:?}"
    );
    Ok(())
}

#[tokio::test]
async fn dropped_lease_is_released_on_all_nodes_in_the_background() -> anyhow::Result<()> {
    let servers = servers(5).await;
    let redlock = redlock(&servers).await;
    let lease = redlock.try_lock("jobs:dropped").await?.expect("free lock");
    drop(lease);
    eventually("the condition holds", Duration::from_secs(1), async || {
        values(&servers, "jobs:dropped")
            .await
            .iter()
            .all(Option::is_none)
    })
    .await;
    Ok(())
}

/// `check_setup` asks each node within the node timeout as the lock
/// commands cap it (the TTL less the drift margin), so `Duration::MAX`
/// does not make it wait for ever on a node that never answers (paused).
#[tokio::test]
async fn check_setup_caps_its_wait_as_the_lock_commands_do() -> anyhow::Result<()> {
    let servers = servers(3).await;
    let redlock = redlock_with(&servers, |b| b.ttl(SHORT_TTL).node_timeout(Duration::MAX)).await;
    servers[2].pause();
    let report = tokio::time::timeout(Duration::from_secs(10), redlock.check_setup()).await;
    servers[2].resume();
    let report = report.expect("check_setup returns within the capped node timeout");
    assert!(
        !report.is_sound(),
        "the silent node is reported: {report:?}"
    );
    Ok(())
}

#[tokio::test]
async fn check_setup_flags_a_replica_and_the_same_server_twice() -> anyhow::Result<()> {
    init_tracing();
    let primary = RedisServer::start().await;
    let replica_of = primary.port().to_string();
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &replica_of]).await;
    let other = RedisServer::start().await;
    let same = format!("{}/1", other.url());
    let redlock = Redlock::connect(&[&primary.url(), &replica.url(), &other.url(), &same]).await?;

    let report = redlock.check_setup().await;
    assert!(!report.is_sound());
    assert!(report.warnings.iter().any(|w| matches!(w, SetupWarning::Replica { node, .. } if node.contains(&replica.port().to_string()))), "{report:?}");
    assert!(
        report
            .warnings
            .iter()
            .any(|w| matches!(w, SetupWarning::SameServer { .. })),
        "{report:?}"
    );
    // Once the replica has connected, its primary is flagged as well.
    eventually("the condition holds", Duration::from_secs(5), async || {
        redlock
            .check_setup()
            .await
            .warnings
            .iter()
            .any(|w| matches!(w, SetupWarning::HasReplicas { .. }))
    })
    .await;

    let independent = servers(3).await;
    let report = redlock_of(&independent).await.check_setup().await;
    assert!(report.is_sound(), "{report:?}");
    assert_eq!(report.reachable(), 3);
    Ok(())
}

async fn redlock_of(servers: &[RedisServer]) -> Redlock {
    redlock(servers).await
}

#[tokio::test]
async fn connect_rejects_a_bad_configuration() {
    assert!(matches!(
        Redlock::connect(&[]).await,
        Err(Error::InvalidArgument { .. })
    ));
    let url = "redis://127.0.0.1:1";
    assert!(matches!(
        Redlock::connect(&[url, url]).await,
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        Redlock::connect(&["not a url"]).await,
        Err(Error::Redis(_))
    ));
}

#[tokio::test]
async fn invalid_keys_are_rejected() -> anyhow::Result<()> {
    let servers = servers(3).await;
    let redlock = redlock(&servers).await;
    for key in [
        LockKey::from(""),
        LockKey::from("a\0b"),
        LockKey::namespaced(7, "jobs"),
    ] {
        let err = redlock.try_lock(key.clone()).await.expect_err("invalid");
        assert!(matches!(err, Error::InvalidKey { .. }), "{key:?}: {err}");
        let err = redlock
            .lock(key.clone(), Duration::from_millis(10))
            .await
            .expect_err("invalid");
        assert!(matches!(err, Error::InvalidKey { .. }), "{key:?}: {err}");
    }
    Ok(())
}

#[tokio::test]
async fn works_through_the_backend_agnostic_traits() -> anyhow::Result<()> {
    let servers = servers(3).await;
    let locker: Arc<dyn Locker> = Arc::new(redlock(&servers).await);
    assert_eq!(locker.backend(), "redlock");
    let lease = locker.try_lock(LockKey::id(7)).await?.expect("free lock");
    assert_eq!(lease.fencing_token(), None);
    assert!(servers[0].get("7").await.is_some());
    assert!(locker.try_lock(LockKey::id(7)).await?.is_none());
    lease.release().await?;
    let lease = locker.lock(LockKey::id(7), Duration::from_secs(1)).await?;
    lease.release().await?;
    let lease = locker.lock(LockKey::id(7), Duration::MAX).await?;
    lease.release().await?;
    Ok(())
}

#[tokio::test]
async fn lock_keeps_waiting_while_a_majority_restarts() -> anyhow::Result<()> {
    let mut servers = servers(3).await;
    let redlock = redlock(&servers).await;
    servers[0].kill();
    servers[1].kill();

    let started = Instant::now();
    let waiter = {
        let redlock = redlock.clone();
        tokio::spawn(async move { redlock.lock("jobs:restart", Duration::from_secs(5)).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiter.is_finished(),
        "the wait ended while a majority was down: {:?}",
        waiter.await
    );
    servers[0].spawn().await;
    servers[1].spawn().await;
    let lease = waiter.await??;
    assert!(started.elapsed() < Duration::from_secs(5));
    let held = values(&servers, "jobs:restart").await;
    assert!(held.iter().filter(|v| v.is_some()).count() >= 2, "{held:?}");
    lease.release().await?;
    assert_eq!(values(&servers, "jobs:restart").await, vec![None; 3]);
    Ok(())
}

/// An ACL refusal: `NOPERM`, or, for a command the acquire script runs,
/// the script's own wording of it.
fn denied(failure: &str) -> bool {
    failure.to_lowercase().contains("noperm")
        || failure.contains("can't run this command or subcommand")
}

#[tokio::test]
async fn lock_fails_at_once_when_a_majority_refuses_for_good() -> anyhow::Result<()> {
    let servers = servers(3).await;
    for server in &servers {
        let _: String = server
            .run(&[
                "ACL", "SETUSER", "noset", "on", ">secret", "~*", "+@all", "-set",
            ])
            .await;
    }
    init_tracing();
    let urls: Vec<String> = servers
        .iter()
        .map(|s| format!("redis://noset:secret@127.0.0.1:{}", s.port()))
        .collect();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let redlock = Redlock::connect(&urls).await?;

    let started = Instant::now();
    let err = redlock
        .lock("jobs:denied", Duration::from_secs(5))
        .await
        .expect_err("SET is not allowed");
    assert!(
        matches!(
            err,
            Error::QuorumUnreachable { ref failures, nodes: 3, quorum: 2, .. }
                if failures.len() == 3 && failures.iter().all(|f| denied(f))
        ),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    Ok(())
}

#[tokio::test]
async fn huge_durations_mean_as_long_as_possible_and_never_panic() -> anyhow::Result<()> {
    let servers = servers(3).await;
    let redlock = redlock_with(&servers, |b| {
        b.node_timeout(Duration::MAX)
            .retry_delay(Duration::MAX)
            .retry_jitter(Duration::MAX)
    })
    .await;
    assert_eq!(redlock.check_setup().await.reachable(), 3);

    let lease = redlock.lock("jobs:huge", Duration::MAX).await?;
    // Held: the next attempt comes after the (huge) retry delay, cut short
    // by the deadline.
    let started = Instant::now();
    let err = redlock
        .lock("jobs:huge", Duration::from_millis(200))
        .await
        .expect_err("held");
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    lease.release().await?;

    #[allow(deprecated)]
    let err = redlock
        .with_ttl(Duration::MAX)
        .lock("jobs:huge", Duration::MAX)
        .await;
    assert!(
        matches!(err, Err(Error::InvalidSetting { setting: "ttl", .. })),
        "{err:?}"
    );
    let built = Redlock::builder(urls(&servers))
        .ttl(Duration::MAX)
        .build()
        .await;
    assert!(
        matches!(built, Err(Error::InvalidSetting { setting: "ttl", .. })),
        "{built:?}"
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// Node restarts

/// Trials per restart variant: 20, or 100 with `DISTLOCK_TORTURE=full`.
fn restart_trials() -> usize {
    if std::env::var("DISTLOCK_TORTURE").is_ok_and(|v| v == "full") {
        100
    } else {
        20
    }
}

/// What one restart trial saw.
#[derive(Debug, Clone, Copy)]
struct RestartOutcome {
    /// B was granted the key.
    b_granted: bool,
    /// A still believed it held the key (not lost, validity left) when B
    /// started its attempt.
    a_believed: bool,
    /// When `lost()` told A, counted from the kill of its node, if it did
    /// before B started.
    a_told_after_kill: Option<Duration>,
}

impl RestartOutcome {
    /// B was granted while A still believed it held the key.
    fn double_grant(&self) -> bool {
        self.b_granted && self.a_believed
    }
}

/// One trial on 3 nodes without persistence. Node 2 is down while A takes
/// `key`, so A holds it on exactly nodes 0 and 1, a bare majority; node 2
/// comes back empty. Then node 1 is killed (SIGKILL) and started again,
/// empty, after `down_for`; and B, a client of its own, makes one attempt.
async fn restart_trial(
    servers: &mut [RedisServer],
    key: &str,
    ttl: Duration,
    down_for: Duration,
) -> anyhow::Result<RestartOutcome> {
    assert_eq!(servers.len(), 3);
    servers[2].kill();
    let a = redlock_with(servers, |b| {
        b.ttl(ttl).node_timeout(Duration::from_millis(250))
    })
    .await;
    let lease = Arc::new(a.try_lock(key).await?.expect("2 of 3 grant"));
    let token = servers[0].get(key).await;
    assert!(token.is_some());
    assert_eq!(servers[1].get(key).await, token, "A holds on node 1 too");
    servers[2].spawn().await;
    assert_eq!(servers[2].get(key).await, None);

    let told = {
        let lease = Arc::clone(&lease);
        tokio::spawn(async move {
            lease.lost().await;
            Instant::now()
        })
    };
    let killed = Instant::now();
    servers[1].kill();
    tokio::time::sleep(down_for).await;
    servers[1].spawn().await;
    assert_eq!(servers[1].get(key).await, None, "restarted empty");

    let b = redlock_with(servers, |b| {
        b.ttl(ttl).node_timeout(Duration::from_millis(250))
    })
    .await;
    let a_believed = !lease.is_lost();
    let a_told_after_kill = if told.is_finished() {
        Some(told.await? - killed)
    } else {
        told.abort();
        None
    };
    let granted = b.try_lock(key).await?;
    if a_told_after_kill.is_some() {
        assert!(!a_believed, "told by lost() yet not lost");
    }
    let outcome = RestartOutcome {
        b_granted: granted.is_some(),
        a_believed,
        a_told_after_kill,
    };
    if let Some(granted) = granted {
        granted.release().await?;
    }
    drop(lease);
    Ok(outcome)
}

/// Runs `trials` restart trials and prints what they saw.
async fn restart_trials_with(
    label: &str,
    ttl: Duration,
    down_for: Duration,
) -> anyhow::Result<Vec<RestartOutcome>> {
    let mut servers = servers(3).await;
    let mut outcomes = Vec::new();
    for i in 0..restart_trials() {
        outcomes.push(restart_trial(&mut servers, &format!("restart:{i}"), ttl, down_for).await?);
    }
    let n = outcomes.len();
    let double = outcomes.iter().filter(|o| o.double_grant()).count();
    let granted = outcomes.iter().filter(|o| o.b_granted).count();
    let told: Vec<Duration> = outcomes
        .iter()
        .filter_map(|o| o.a_told_after_kill)
        .collect();
    println!(
        "{label} (ttl {ttl:?}, node down {down_for:?}): {n} trials, B granted in {granted}, \
         double grants {double} ({} per 100); token regressions: not applicable (no tokens); \
         A told by lost() before B tried in {}, {:?} .. {:?} after the kill",
        double * 100 / n,
        told.len(),
        told.iter().min(),
        told.iter().max(),
    );
    Ok(outcomes)
}

/// A node without persistence that restarts at once forgets A's key; if
/// A held a bare majority including that node, B is granted the key while
/// A still believes it holds it, in every trial. `check_setup` sees the
/// missing append-only file but raises no warning for it: Redlock issues no
/// fencing tokens, and `NoPersistence` is about tokens.
#[tokio::test]
async fn a_node_restarted_empty_at_once_grants_the_key_twice() -> anyhow::Result<()> {
    let servers = servers(3).await;
    let report = redlock(&servers).await.check_setup().await;
    assert!(
        report.nodes.iter().all(|n| n.append_only == Some(false)),
        "{report:?}"
    );
    assert!(report.is_sound(), "{report:?}");
    drop(servers);

    // A long TTL: A's watchdog does not run between the restart and B's
    // attempt, so A cannot have noticed anything.
    let ttl = Duration::from_secs(30);
    let outcomes = restart_trials_with("restart at once", ttl, Duration::ZERO).await?;
    let double = outcomes.iter().filter(|o| o.double_grant()).count();
    assert_eq!(double, outcomes.len(), "{outcomes:?}");
    Ok(())
}

/// Redis's remedy for nodes without persistence: keep a crashed node down
/// for at least one TTL before it rejoins. A then cannot extend on a
/// majority and is told by `lost()` before its validity ends, so B is
/// granted the key (in every trial) only after A gave it up.
#[tokio::test]
async fn a_node_restarted_after_a_ttl_never_grants_the_key_twice() -> anyhow::Result<()> {
    let ttl = Duration::from_secs(1);
    let outcomes = restart_trials_with("restart after one TTL", ttl, ttl).await?;
    let granted = outcomes.iter().filter(|o| o.b_granted).count();
    assert_eq!(granted, outcomes.len(), "B got the freed key: {outcomes:?}");
    let double = outcomes.iter().filter(|o| o.double_grant()).count();
    assert_eq!(double, 0, "{outcomes:?}");
    assert!(
        outcomes.iter().all(|o| o.a_told_after_kill.is_some()),
        "A was told by lost() before B tried: {outcomes:?}"
    );
    Ok(())
}

/// The builder's and the lock's `Debug` print the default retry count as
/// what it means (no limit), not as `u32::MAX`; a count set prints as set.
#[test]
fn the_retry_count_prints_as_no_limit_by_default() {
    let url = "redis://127.0.0.1:1";
    let default = format!("{:?}", Redlock::builder([url]));
    assert!(default.contains("retry_count: unlimited"), "{default}");
    assert!(!default.contains("4294967295"), "{default}");
    let set = format!("{:?}", Redlock::builder([url]).retry_count(3));
    assert!(set.contains("retry_count: 3"), "{set}");
}

/// A split vote among other calls (each holding a minority of the nodes,
/// none a quorum) is not a held key: no release signal will come, since a
/// failed attempt's cleanup publishes none. The wait tries again after the
/// retry delay, as the README says, not after the fallback poll.
#[tokio::test]
async fn a_split_vote_among_others_waits_the_retry_delay() -> anyhow::Result<()> {
    let servers = servers(3).await;
    let redlock = redlock_with(&servers, |b| {
        b.poll_interval(Duration::from_secs(4))
            .retry_delay(Duration::from_millis(50))
            .retry_jitter(Duration::ZERO)
    })
    .await;
    // Two other calls' attempts, one node each; the third node is free.
    let _: String = servers[0]
        .run(&["SET", "split", "call-a", "PX", "10000"])
        .await;
    let _: String = servers[1]
        .run(&["SET", "split", "call-b", "PX", "10000"])
        .await;
    let started = Instant::now();
    let waiting = tokio::spawn(async move { redlock.lock("split", Duration::from_secs(10)).await });
    // Their attempts fail and clean up quietly (a plain DEL, no signal).
    tokio::time::sleep(Duration::from_millis(100)).await;
    for server in &servers[..2] {
        let _: i64 = server.run(&["DEL", "split"]).await;
    }
    let lease = waiting.await??;
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(1_000),
        "granted after {took:?}"
    );
    lease.release().await?;
    Ok(())
}

/// The pause after the first try that does not grant is waited out (it is
/// not spent on subscribing to release signals): with one retry and a
/// retry delay of 1 s, a split vote that never resolves ends in a timeout
/// after that second, not at once.
#[tokio::test]
async fn the_first_pause_after_a_split_vote_is_waited() -> anyhow::Result<()> {
    let servers = servers(3).await;
    let redlock = redlock_with(&servers, |b| {
        b.retry_count(1)
            .retry_delay(Duration::from_secs(1))
            .retry_jitter(Duration::ZERO)
    })
    .await;
    let _: String = servers[0]
        .run(&["SET", "split-once", "call-a", "PX", "10000"])
        .await;
    let _: String = servers[1]
        .run(&["SET", "split-once", "call-b", "PX", "10000"])
        .await;
    let started = Instant::now();
    let err = redlock
        .lock("split-once", Duration::from_secs(10))
        .await
        .expect_err("nobody frees the key");
    let took = started.elapsed();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(took >= Duration::from_millis(900), "gave up after {took:?}");
    Ok(())
}

/// A semaphore's wait over Redlock rides out nodes that stop answering for
/// a while, as `Redlock::lock` does: with the only node paused for 1 s,
/// each try finds no quorum reachable (`QuorumUnreachable`, a failure that
/// passes), and the permit freed after the pause still reaches the waiter.
#[tokio::test]
async fn a_semaphore_wait_survives_a_paused_quorum() -> anyhow::Result<()> {
    let servers = servers(1).await;
    let redlock = redlock(&servers).await;
    let semaphore = distlock::Semaphore::new(Arc::new(redlock), "jobs:paused-quorum", 1)?;
    let held = semaphore.try_acquire().await?.expect("free");
    let waiter = tokio::spawn({
        let semaphore = semaphore.clone();
        async move { semaphore.acquire(Duration::from_secs(10)).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let _: String = servers[0].run(&["CLIENT", "PAUSE", "1000", "ALL"]).await;
    tokio::time::sleep(Duration::from_millis(1300)).await;
    held.release().await?;
    let permit = waiter.await?.expect("the wait outlives the pause");
    permit.release().await?;
    Ok(())
}
