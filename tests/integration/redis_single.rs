//! `RedisLocker` against real `redis-server` processes started by the tests.
#![cfg(feature = "redis")]

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::redis::RedisServer;
use common::{eventually, init_tracing};
use distlock::redis::{RedisLocker, RedisLockerBuilder};
use distlock::{Error, LockKey, Locker, LossReason};

const SHORT_TTL: Duration = Duration::from_millis(300);
/// For a test that expects `Expired`, the watchdog's own finding or the
/// clock's before any extension was sent: long enough that the answer to
/// the first extension (a third of a TTL in) is read within the validity,
/// and that the test's steps end before that extension is sent, on a loaded
/// machine too. An extension sent and unanswered at the deadline reads as
/// `HeartbeatTimedOut`, as the lease's clock says.
const LOSS_TTL: Duration = Duration::from_secs(1);

async fn locker(server: &RedisServer) -> RedisLocker {
    init_tracing();
    RedisLocker::connect(&server.url()).await.expect("connect")
}

/// A `RedisLocker` on `server` with the settings `configure` gives its builder.
async fn locker_with(
    server: &RedisServer,
    configure: impl FnOnce(RedisLockerBuilder) -> RedisLockerBuilder,
) -> RedisLocker {
    init_tracing();
    configure(RedisLocker::builder(server.url()))
        .build()
        .await
        .expect("connect")
}

#[tokio::test]
async fn exclusive_acquire_and_busy_returns_none() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let (a, b) = (locker(&server).await, locker(&server).await);

    let lease = a.try_lock("jobs:exclusive").await?.expect("free lock");
    assert!(b.try_lock("jobs:exclusive").await?.is_none());
    let token = server.get("jobs:exclusive").await.expect("key set");
    assert_eq!(token.len(), 32, "a 128-bit token in hex: {token}");
    assert!(
        a.try_lock("jobs:exclusive").await?.is_none(),
        "not reentrant"
    );

    lease.release().await?;
    assert_eq!(server.get("jobs:exclusive").await, None);
    let again = b
        .try_lock("jobs:exclusive")
        .await?
        .expect("free after release");
    again.release().await?;
    Ok(())
}

#[tokio::test]
async fn release_after_expiry_does_not_delete_the_next_owners_key() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let (a, b) = (locker(&server).await, locker(&server).await);
    let stale = a.try_lock("jobs:expiring").await?.expect("free lock");

    // A is "paused" past its TTL (its watchdog would run only after 10 s):
    // the key expires and B takes the lock.
    let _: i64 = server.run(&["PEXPIRE", "jobs:expiring", "1"]).await;
    eventually("the condition holds", Duration::from_secs(1), async || {
        server.get("jobs:expiring").await.is_none()
    })
    .await;
    let current = b
        .try_lock("jobs:expiring")
        .await?
        .expect("expired lock is free");
    let b_token = server.get("jobs:expiring").await;

    let err = stale.release().await.expect_err("A no longer holds it");
    assert!(
        matches!(
            err,
            Error::LockLost {
                reason: LossReason::Expired,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        server.get("jobs:expiring").await,
        b_token,
        "B's key survives"
    );
    assert!(!current.is_lost());
    current.release().await?;
    Ok(())
}

#[tokio::test]
async fn watchdog_keeps_a_lease_alive_for_three_ttls() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let a = locker_with(&server, |b| b.ttl(SHORT_TTL)).await;
    let b = locker_with(&server, |b| b.ttl(SHORT_TTL)).await;
    let lease = a.try_lock("jobs:long").await?.expect("free lock");

    tokio::time::sleep(SHORT_TTL * 3 + Duration::from_millis(100)).await;
    assert!(!lease.is_lost(), "lost: {:?}", lease.loss());
    assert!(lease.validity() > Duration::ZERO);
    assert!(
        b.try_lock("jobs:long").await?.is_none(),
        "still held after 3 TTLs"
    );
    let pttl: i64 = server.run(&["PTTL", "jobs:long"]).await;
    assert!(pttl > 0 && pttl <= 300, "pttl {pttl}");
    lease.release().await?;
    Ok(())
}

#[tokio::test]
async fn deleting_the_key_externally_makes_lost_fire() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let locker = locker_with(&server, |b| b.ttl(LOSS_TTL)).await;
    let lease = locker.try_lock("jobs:deleted").await?.expect("free lock");

    let _: i64 = server.run(&["DEL", "jobs:deleted"]).await;
    let reason = tokio::time::timeout(LOSS_TTL, lease.lost()).await?;
    assert_eq!(reason, LossReason::Expired);
    assert!(lease.is_lost());
    assert_eq!(lease.validity(), Duration::ZERO);
    let err = lease.release().await.expect_err("lost");
    assert!(
        matches!(
            err,
            Error::LockLost {
                reason: LossReason::Expired,
                ..
            }
        ),
        "{err}"
    );
    Ok(())
}

#[tokio::test]
async fn another_owners_token_makes_lost_fire() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let locker = locker_with(&server, |b| b.ttl(LOSS_TTL)).await;
    let lease = locker.try_lock("jobs:stolen").await?.expect("free lock");

    let _: String = server.run(&["SET", "jobs:stolen", "someone-else"]).await;
    let reason = tokio::time::timeout(LOSS_TTL, lease.lost()).await?;
    assert_eq!(reason, LossReason::Expired);
    // The cleanup after the loss must not delete the other owner's key.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        server.get("jobs:stolen").await.as_deref(),
        Some("someone-else")
    );
    drop(lease);
    Ok(())
}

/// A lease lost by the clock (its runtime starved past the validity) is
/// lost for `release()` too, at once, even though its key still holds its
/// token on the server (its TTL lengthened behind its back here): the
/// holder has been told the lease is lost, and a release answering `Ok`
/// would say the opposite. Without the key lengthened, the watchdog's
/// compare-and-delete would also find the key expired.
#[tokio::test]
async fn a_release_past_the_validity_is_lock_lost_though_the_key_remains() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let locker = locker_with(&server, |b| b.ttl(LOSS_TTL)).await;
    let lease = locker.try_lock("jobs:outlived").await?.expect("free lock");
    let lengthened: i64 = server.run(&["PEXPIRE", "jobs:outlived", "60000"]).await;
    assert_eq!(lengthened, 1);
    // Past the validity before the watchdog's first extension could run;
    // released before it runs (it would find the lease lost and delete the
    // key itself).
    drop(common::starve_runtime(LOSS_TTL));
    let released = lease.release().await;
    assert!(
        matches!(
            released,
            Err(Error::LockLost {
                reason: LossReason::Expired,
                ..
            })
        ),
        "{released:?}"
    );
    Ok(())
}

#[tokio::test]
async fn server_death_makes_lost_fire() -> anyhow::Result<()> {
    let mut server = RedisServer::start().await;
    let locker = locker_with(&server, |b| b.ttl(SHORT_TTL)).await;
    let lease = locker.try_lock("jobs:crash").await?.expect("free lock");

    server.kill();
    // The watchdog reports the failed extension (`ConnectionFailed`, or
    // `HeartbeatTimedOut` if its reconnect runs past the validity, which
    // the lease's own clock then reports too), or `Expired` if on a loaded
    // machine the watchdog sent no extension before the deadline.
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
    Ok(())
}

#[tokio::test]
async fn dropped_lease_is_released_in_the_background() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let locker = locker(&server).await;
    let lease = locker.try_lock("jobs:dropped").await?.expect("free lock");

    // A stalled server answers nothing: a drop that waited for the release
    // would take its deadline (a `release()` in place of the drop took
    // 502 ms here); one that leaves it to the background returns at once.
    server.pause();
    let started = Instant::now();
    drop(lease);
    let took = started.elapsed();
    server.resume();
    assert!(
        took < Duration::from_millis(100),
        "drop blocked for {took:?} on a stalled server"
    );
    eventually("the condition holds", Duration::from_secs(3), async || {
        server.get("jobs:dropped").await.is_none()
    })
    .await;
    Ok(())
}

#[tokio::test]
async fn a_cancelled_acquisition_leaves_no_key() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let locker = locker(&server).await;
    // Writes wait 300 ms, so the SET is sent but the caller gives up first.
    let _: String = server.run(&["CLIENT", "PAUSE", "300", "WRITE"]).await;
    let attempt =
        tokio::time::timeout(Duration::from_millis(50), locker.try_lock("jobs:cancelled")).await;
    assert!(
        attempt.is_err(),
        "the pause should outlast the caller's patience"
    );

    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(server.get("jobs:cancelled").await, None);
    Ok(())
}

/// A try that gets no reply within the command deadline reports it with a
/// variant of its own, naming the key and the deadline; the `SET` that
/// lands later is deleted again.
#[tokio::test]
async fn a_try_without_a_reply_in_time_is_command_timed_out_and_leaves_no_key() -> anyhow::Result<()>
{
    let server = RedisServer::start().await;
    let locker = locker_with(&server, |b| b.command_timeout(Duration::from_millis(50))).await;
    let _: String = server.run(&["CLIENT", "PAUSE", "300", "WRITE"]).await;

    let err = locker.try_lock("jobs:slow").await.expect_err("no reply");
    match &err {
        Error::CommandTimedOut { key, after } => {
            assert_eq!(key, &LockKey::from("jobs:slow"));
            assert_eq!(*after, Duration::from_millis(50));
        }
        other => panic!("expected CommandTimedOut, got {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        "no reply within 50ms to the command for lock \"jobs:slow\""
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(server.get("jobs:slow").await, None);
    Ok(())
}

/// A grant whose reply is read only after the lease's validity (the
/// server answered in time, but the holder's runtime was starved) is no
/// lease: by its own clock it may already have expired and been taken by
/// another holder. The try reports it as a reply not read in time and
/// deletes the key again (compare-then-`DEL`), as Redlock refuses a quorum
/// reached too late.
#[tokio::test]
async fn a_grant_read_after_the_validity_is_refused_and_its_key_deleted() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let locker = locker_with(&server, |b| b.ttl(SHORT_TTL)).await;
    // The reply leaves the server at 150 ms, within the validity (295 ms);
    // the runtime is starved from 50 to 450 ms, so the reply is read only
    // then, and the command's timer has fired meanwhile.
    let _: String = server.run(&["CLIENT", "PAUSE", "150", "WRITE"]).await;
    let trying = {
        let locker = locker.clone();
        tokio::spawn(async move { locker.try_lock("jobs:read-late").await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let starved = common::starve_runtime(Duration::from_millis(400));
    // Lengthened behind the try's back (from this thread: the runtime is
    // still starved), so that only the try's cleanup, not the TTL, can
    // delete the key within the check below.
    let mut direct = redis::Client::open(server.url())?.get_connection()?;
    let lengthened: i64 = redis::cmd("PEXPIRE")
        .arg("jobs:read-late")
        .arg(60_000)
        .query(&mut direct)?;
    assert_eq!(lengthened, 1, "the grant landed on the server");
    drop(starved);
    match trying.await? {
        Err(Error::CommandTimedOut { key, .. }) => {
            assert_eq!(key, LockKey::from("jobs:read-late"))
        }
        Ok(Some(lease)) => panic!(
            "a lease past its validity was handed out (lost: {:?})",
            lease.loss()
        ),
        other => panic!("expected CommandTimedOut, got {other:?}"),
    }
    eventually(
        "the late grant's key was deleted",
        Duration::from_secs(2),
        async || server.get("jobs:read-late").await.is_none(),
    )
    .await;
    Ok(())
}

/// A semaphore over the Redis locker (the generic path, one try per slot)
/// names the semaphore in the errors of its acquisition, as the PostgreSQL
/// semaphore does, not its internal slot key
/// (`Namespaced(SLOT_NAMESPACE, "name#0")`): a try without a reply in time
/// is `CommandTimedOut`, a wait that met only such tries times out.
#[tokio::test]
async fn a_semaphore_try_without_a_reply_in_time_names_the_semaphore() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let locker = locker_with(&server, |b| b.command_timeout(Duration::from_millis(50))).await;
    let semaphore = distlock::Semaphore::new(Arc::new(locker), "jobs:sem", 2)?;
    let _: String = server.run(&["CLIENT", "PAUSE", "300", "WRITE"]).await;
    let err = semaphore
        .acquire(Duration::ZERO)
        .await
        .expect_err("no reply");
    match &err {
        Error::CommandTimedOut { key, .. } => assert_eq!(key, &LockKey::from("jobs:sem")),
        other => panic!("expected CommandTimedOut, got {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        "no reply within 50ms to the command for lock \"jobs:sem\""
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    let _: String = server.run(&["CLIENT", "PAUSE", "300", "WRITE"]).await;
    let err = semaphore
        .acquire(Duration::from_millis(200))
        .await
        .expect_err("no reply");
    match &err {
        Error::Timeout { key, .. } => assert_eq!(key, &LockKey::from("jobs:sem")),
        other => panic!("expected Timeout, got {other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    Ok(())
}

/// The command deadline is the locker's: a server that answers after a
/// second is waited for under the default 2 s deadline (redis-rs's own
/// 500 ms response timeout must not cut it short), and a second deadline
/// of 300 ms ends it as `CommandTimedOut` at 300 ms, not as an I/O error.
#[tokio::test]
async fn a_reply_within_the_command_deadline_is_waited_for() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let patient = locker(&server).await;
    let _: String = server.run(&["CLIENT", "PAUSE", "1000", "WRITE"]).await;
    let lease = patient.try_lock("jobs:slow-reply").await?;
    let lease = lease.expect("granted once the server answers");
    lease.release().await?;

    let hasty = locker_with(&server, |b| b.command_timeout(Duration::from_millis(300))).await;
    let _: String = server.run(&["CLIENT", "PAUSE", "1000", "WRITE"]).await;
    let err = hasty
        .try_lock("jobs:slow-reply")
        .await
        .expect_err("no reply");
    assert!(
        matches!(err, Error::CommandTimedOut { after, .. } if after == Duration::from_millis(300)),
        "{err:?}"
    );
    Ok(())
}

#[tokio::test]
async fn lock_waits_for_the_holder_and_times_out_while_held() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let (a, b) = (locker(&server).await, locker(&server).await);
    let lease = a.try_lock("jobs:wait").await?.expect("free lock");

    let started = Instant::now();
    let err = b
        .lock("jobs:wait", Duration::from_millis(200))
        .await
        .expect_err("held");
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(started.elapsed() >= Duration::from_millis(200));

    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        lease.release().await
    });
    let started = Instant::now();
    let lease = b.lock("jobs:wait", Duration::from_secs(5)).await?;
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    lease.release().await?;
    let lease = b.lock("jobs:wait", Duration::MAX).await?;
    lease.release().await?;
    Ok(())
}

#[tokio::test]
async fn fencing_tokens_strictly_increase() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let (a, b) = (locker(&server).await, locker(&server).await);
    let mut last = None;
    for i in 0..20 {
        let locker = if i % 2 == 0 { &a } else { &b };
        let lease = locker.try_lock("jobs:fenced").await?.expect("free lock");
        let token = lease.fencing_token().expect("fencing is on by default");
        assert!(Some(token) > last, "{token} after {last:?}");
        last = Some(token);
        if i % 3 == 0 {
            drop(lease);
            eventually("the condition holds", Duration::from_secs(1), async || {
                server.get("jobs:fenced").await.is_none()
            })
            .await;
        } else {
            lease.release().await?;
        }
    }
    // A busy attempt issues no token.
    let held = a.try_lock("jobs:fenced").await?.expect("free lock");
    assert!(b.try_lock("jobs:fenced").await?.is_none());
    let next = b.lock("jobs:fenced", Duration::ZERO).await;
    assert!(next.is_err());
    let after = held.fencing_token().map(|t| t.value());
    held.release().await?;
    let lease = b.try_lock("jobs:fenced").await?.expect("free lock");
    assert_eq!(
        lease.fencing_token().map(|t| t.value()),
        after.map(|v| v + 1)
    );

    let plain = locker_with(&server, |b| b.fencing(false)).await;
    lease.release().await?;
    let unfenced = plain.try_lock("jobs:unfenced").await?.expect("free lock");
    assert_eq!(unfenced.fencing_token(), None);
    unfenced.release().await?;
    Ok(())
}

#[tokio::test]
async fn invalid_keys_are_rejected() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let locker = locker(&server).await;
    for key in [
        LockKey::from(""),
        LockKey::from("a\0b"),
        LockKey::namespaced(1, "jobs"),
    ] {
        let err = locker.try_lock(key.clone()).await.expect_err("invalid");
        assert!(matches!(err, Error::InvalidKey { .. }), "{key:?}: {err}");
        let err = locker
            .lock(key.clone(), Duration::from_millis(10))
            .await
            .expect_err("invalid");
        assert!(matches!(err, Error::InvalidKey { .. }), "{key:?}: {err}");
    }
    Ok(())
}

/// The builder refuses a TTL out of range before it connects; the
/// deprecated `with_ttl` shorthand cannot refuse it, so every acquisition
/// of its locker fails with the builder's error, never with a lease of some
/// other TTL.
#[tokio::test]
#[allow(deprecated)]
async fn a_ttl_out_of_range_is_refused_by_the_builder_and_fails_loudly_through_with_ttl()
-> anyhow::Result<()> {
    let server = RedisServer::start().await;
    for ttl in [
        Duration::ZERO,
        Duration::from_millis(99),
        Duration::from_secs(31 * 24 * 3600),
        Duration::MAX,
    ] {
        let built = RedisLocker::builder(server.url()).ttl(ttl).build().await;
        assert!(
            matches!(built, Err(Error::InvalidSetting { setting: "ttl", .. })),
            "{ttl:?}: {built:?}"
        );
        let shorthand = locker(&server).await.with_ttl(ttl);
        let tried = shorthand.try_lock("jobs:x").await;
        assert!(
            matches!(tried, Err(Error::InvalidSetting { setting: "ttl", .. })),
            "{ttl:?}: {tried:?}"
        );
        let waited = shorthand.lock("jobs:x", Duration::MAX).await;
        assert!(
            matches!(waited, Err(Error::InvalidSetting { setting: "ttl", .. })),
            "{ttl:?}: {waited:?}"
        );
    }
    assert_eq!(server.get("jobs:x").await, None);
    let lease = locker(&server)
        .await
        .with_ttl(Duration::from_millis(100))
        .try_lock("jobs:x")
        .await?
        .expect("free");
    lease.release().await?;
    Ok(())
}

#[tokio::test]
async fn keys_are_the_lock_names_and_ids_their_decimal_text() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let locker = locker(&server).await;
    let by_id = locker.try_lock(LockKey::id(42)).await?.expect("free lock");
    let by_name = locker.try_lock("42").await?;
    assert!(by_name.is_none(), "LockKey::id(42) is the Redis key \"42\"");
    assert!(server.get("42").await.is_some());
    assert_eq!(by_id.key(), &LockKey::id(42));
    by_id.release().await?;
    Ok(())
}

#[tokio::test]
async fn works_through_the_backend_agnostic_traits() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let locker: Arc<dyn Locker> = Arc::new(locker(&server).await);
    assert_eq!(locker.backend(), "redis");
    let lease = locker
        .try_lock(LockKey::from("jobs:dyn"))
        .await?
        .expect("free lock");
    assert!(lease.fencing_token().is_some());
    assert!(!lease.is_lost());
    assert!(locker.try_lock(LockKey::from("jobs:dyn")).await?.is_none());
    lease.release().await?;
    let lease = locker
        .lock(LockKey::from("jobs:dyn"), Duration::from_secs(1))
        .await?;
    assert_eq!(lease.key(), &LockKey::from("jobs:dyn"));
    lease.release().await?;
    Ok(())
}

#[tokio::test]
async fn connect_fails_when_no_server_answers() {
    let port = common::cluster::free_port();
    let err = RedisLocker::connect(&format!("redis://127.0.0.1:{port}")).await;
    assert!(matches!(err, Err(Error::Redis(_))), "{err:?}");
    let err = RedisLocker::connect("not a url").await;
    assert!(matches!(err, Err(Error::Redis(_))), "{err:?}");
}

#[tokio::test]
async fn lock_keeps_waiting_while_the_server_restarts() -> anyhow::Result<()> {
    let mut server = RedisServer::start().await;
    let locker = locker(&server).await;
    server.kill();

    let started = Instant::now();
    let waiter = {
        let locker = locker.clone();
        tokio::spawn(async move { locker.lock("jobs:restart", Duration::from_secs(5)).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiter.is_finished(),
        "the wait ended while the server was down: {:?}",
        waiter.await
    );
    server.spawn().await;
    let lease = waiter.await??;
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(lease.fencing_token().is_some());
    assert!(server.get("jobs:restart").await.is_some());
    lease.release().await?;
    assert_eq!(server.get("jobs:restart").await, None);
    Ok(())
}

#[tokio::test]
async fn lock_keeps_waiting_through_command_timeouts_and_owns_a_late_set() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let locker = locker_with(&server, |b| b.command_timeout(Duration::from_millis(100))).await;
    // Writes wait 500 ms: the first tries time out, their SETs land later.
    let _: String = server.run(&["CLIENT", "PAUSE", "500", "WRITE"]).await;

    let started = Instant::now();
    let lease = locker.lock("jobs:paused", Duration::from_secs(5)).await?;
    assert!(started.elapsed() >= Duration::from_millis(400));
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert!(!lease.is_lost());
    let pttl: i64 = server.run(&["PTTL", "jobs:paused"]).await;
    assert!(pttl > 0, "the key is held with a TTL: {pttl}");
    lease.release().await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        server.get("jobs:paused").await,
        None,
        "no try left a key behind"
    );
    Ok(())
}

#[tokio::test]
async fn lock_fails_at_once_on_a_permanent_error() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let _: String = server
        .run(&[
            "ACL", "SETUSER", "noeval", "on", ">secret", "~*", "+@all", "-eval",
        ])
        .await;
    init_tracing();
    let url = format!("redis://noeval:secret@127.0.0.1:{}", server.port());
    let locker = RedisLocker::connect(&url).await?;

    let started = Instant::now();
    let err = locker
        .lock("jobs:denied", Duration::from_secs(5))
        .await
        .expect_err("EVAL is not allowed");
    assert!(matches!(err, Error::Redis(_)), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    Ok(())
}

/// The token of a fresh lease on `key` from `locker`, released at once.
async fn next_token(locker: &RedisLocker, key: &str) -> anyhow::Result<i64> {
    let lease = locker.try_lock(key).await?.expect("free lock");
    let token = lease.fencing_token().expect("fencing is on").value();
    lease.release().await?;
    Ok(token)
}

#[tokio::test]
async fn fencing_counters_cannot_collide_with_lock_names() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let locker = locker(&server).await;
    let mut tokens = Vec::new();
    for _ in 0..3 {
        tokens.push(next_token(&locker, "x").await?);
    }

    // A lock named like the key that used to count `x`'s tokens is a lock
    // of its own: free, with its own tokens, and `x` keeps counting.
    let colliding = locker
        .try_lock("distlock:fencing:x")
        .await?
        .expect("a free lock, not x's counter");
    assert_eq!(colliding.fencing_token().map(|t| t.value()), Some(1));
    tokens.push(next_token(&locker, "x").await?);
    colliding.release().await?;
    tokens.push(next_token(&locker, "x").await?);
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "x's tokens: {tokens:?}"
    );
    assert_eq!(
        server.get("distlock:fencing\0x").await.as_deref(),
        Some("5"),
        "the counter's key has a NUL byte, which no lock name can have"
    );

    // The other way round: while the lock named like `y`'s old counter is
    // held (its key holds a random token), `y` still gets tokens.
    let colliding = locker
        .try_lock("distlock:fencing:y")
        .await?
        .expect("free lock");
    assert_eq!(next_token(&locker, "y").await?, 1);
    assert_eq!(next_token(&locker, "y").await?, 2);
    colliding.release().await?;
    Ok(())
}

#[tokio::test]
async fn fencing_counters_continue_above_the_old_counter_key() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let locker = locker(&server).await;
    // A deployment whose tokens for `m` were counted in the old key.
    let _: String = server.run(&["SET", "distlock:fencing:m", "41"]).await;
    assert_eq!(next_token(&locker, "m").await?, 42);
    assert_eq!(next_token(&locker, "m").await?, 43);
    assert_eq!(
        server.get("distlock:fencing:m").await.as_deref(),
        Some("41"),
        "the old key is left alone: it may be another lock's"
    );

    // A lock's token that happens to be all digits is no counter.
    let digits = "12345678901234567890123456789012";
    let _: String = server
        .run(&["SET", "distlock:fencing:n", digits, "PX", "10000"])
        .await;
    assert_eq!(next_token(&locker, "n").await?, 1);
    Ok(())
}

#[tokio::test]
async fn huge_durations_mean_as_long_as_possible_and_never_panic() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let locker = locker_with(&server, |b| b.command_timeout(Duration::MAX)).await;
    assert_eq!(locker.check_setup().await.reachable(), 1);

    let lease = locker.lock("jobs:huge", Duration::MAX).await?;
    assert!(lease.fencing_token().is_some());
    lease.release().await?;
    let lease = locker.try_lock("jobs:huge").await?.expect("free lock");
    lease.release().await?;
    Ok(())
}

/// Runs `acquire` against `url` on a runtime of its own and drops that
/// runtime as soon as it returns, as a process that exits on the error
/// would: background tasks spawned by the acquisition never run.
async fn in_a_runtime_that_stops_at_once<F, Fut>(url: String, acquire: F) -> anyhow::Result<Error>
where
    F: FnOnce(RedisLocker) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Option<Error>>,
{
    tokio::task::spawn_blocking(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let err = runtime.block_on(async {
            let locker = RedisLocker::connect(&url).await?;
            anyhow::Ok(acquire(locker).await)
        });
        drop(runtime);
        err?.ok_or_else(|| anyhow::anyhow!("the acquisition succeeded"))
    })
    .await?
}

#[tokio::test]
async fn an_acquisition_failing_in_the_script_never_sets_the_key() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    // Both counters are lists, so the acquire script's INCR fails.
    for key in [
        "distlock:fencing\0jobs:broken-try",
        "distlock:fencing\0jobs:broken-wait",
    ] {
        let _: i64 = server.run(&["RPUSH", key, "not a number"]).await;
    }

    let err = in_a_runtime_that_stops_at_once(server.url(), |locker| async move {
        locker.try_lock("jobs:broken-try").await.err()
    })
    .await?;
    assert!(matches!(err, Error::Redis(_)), "{err}");
    assert_eq!(
        server.get("jobs:broken-try").await,
        None,
        "a failed try_lock left the key held with no lease to release it"
    );

    let started = Instant::now();
    let err = in_a_runtime_that_stops_at_once(server.url(), |locker| async move {
        locker
            .lock("jobs:broken-wait", Duration::from_secs(5))
            .await
            .err()
    })
    .await?;
    assert!(matches!(err, Error::Redis(_)), "a permanent error: {err}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        server.get("jobs:broken-wait").await,
        None,
        "a failed lock left the key held with no lease to release it"
    );
    Ok(())
}

/// A lock's key that holds another type (an application's list under the
/// lock's name) is a permanent error, as documented: `try_lock` reports it,
/// and a waiting `lock` ends at once rather than at its deadline. The key
/// is left as it was.
#[tokio::test]
async fn a_lock_key_of_another_type_is_a_permanent_error() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let _: i64 = server
        .run(&["RPUSH", "jobs:list", "an application's item"])
        .await;
    let locker = RedisLocker::connect(&server.url()).await?;
    let tried = locker.try_lock("jobs:list").await;
    assert!(matches!(tried, Err(Error::Redis(_))), "{tried:?}");
    let started = Instant::now();
    let waited = locker.lock("jobs:list", Duration::from_secs(3)).await;
    assert!(matches!(waited, Err(Error::Redis(_))), "{waited:?}");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    let kept: i64 = server.run(&["LLEN", "jobs:list"]).await;
    assert_eq!(kept, 1);
    Ok(())
}

/// A semaphore's wait over Redis rides out a failure that passes, as a
/// lock's wait does: the server pauses every client for 1 s (each try then
/// misses its 300 ms command deadline) and the permit freed after the
/// pause still reaches the waiter.
#[tokio::test]
async fn a_semaphore_wait_survives_a_paused_server() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let locker = locker_with(&server, |b| b.command_timeout(Duration::from_millis(300))).await;
    let semaphore = distlock::Semaphore::new(Arc::new(locker), "jobs:paused", 1)?;
    let held = semaphore.try_acquire().await?.expect("free");
    let waiter = tokio::spawn({
        let semaphore = semaphore.clone();
        async move { semaphore.acquire(Duration::from_secs(10)).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let _: String = server.run(&["CLIENT", "PAUSE", "1000", "ALL"]).await;
    tokio::time::sleep(Duration::from_millis(1300)).await;
    held.release().await?;
    let permit = waiter.await?.expect("the wait outlives the pause");
    permit.release().await?;
    Ok(())
}

/// One trial of a Redis restart between two holders: A takes `key`, the
/// server dies (SIGKILL) and comes back, B tries `key`. Returns (B was
/// granted the key A still believes it holds, B's token is not above A's).
async fn restart_trial(server: &mut RedisServer, key: &str) -> anyhow::Result<(bool, bool)> {
    let a = locker_with(server, |b| b.ttl(Duration::from_secs(30))).await;
    let held = a.try_lock(key).await?.expect("free");
    let first = held.fencing_token().expect("fencing on").value();
    server.kill();
    server.spawn().await;
    let b = locker(server).await;
    let Some(second) = b.try_lock(key).await? else {
        drop(held);
        return Ok((false, false));
    };
    let regressed = second.fencing_token().expect("fencing on").value() <= first;
    drop((held, second));
    Ok((true, regressed))
}

/// A private server with its own directory (for the append-only file).
async fn server_in_own_dir(args: &[&str]) -> (RedisServer, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!(
        "distlock-redis-{}-{}",
        std::process::id(),
        common::cluster::free_port()
    ));
    std::fs::create_dir_all(&dir).expect("dir");
    let mut all = vec!["--dir", dir.to_str().expect("utf-8")];
    all.extend_from_slice(args);
    (RedisServer::start_with(&all).await, dir)
}

/// A server that evicts keys at its memory limit deletes a held lock's key
/// (every lock key has a TTL, so a `volatile-*` policy picks it), and the
/// lock is free for another client while its holder still believes it holds
/// it. `check_setup` says so beforehand; with `noeviction` it does not.
#[tokio::test]
async fn a_server_that_evicts_keys_is_flagged() -> anyhow::Result<()> {
    use distlock::redis::SetupWarning;
    let evicts = |report: &distlock::redis::SetupReport| {
        report
            .warnings
            .iter()
            .any(|w| matches!(w, SetupWarning::Evicts { .. }))
    };
    let evicting = RedisServer::start_with(&[
        "--maxmemory",
        "4mb",
        "--maxmemory-policy",
        "volatile-ttl",
        "--enable-debug-command",
        "yes",
    ])
    .await;
    let holder = locker(&evicting).await;
    let report = holder.check_setup().await;
    assert!(evicts(&report), "{report:?}");
    // What it warns of: memory fills with keys without a TTL, and the next
    // write makes the server evict the only key it may, the lock's.
    let held = holder.try_lock("jobs:evicted").await?.expect("free");
    let _: String = evicting
        .run(&["DEBUG", "POPULATE", "8000", "junk", "1024"])
        .await;
    let _: Result<Option<distlock::redis::RedisLease>, Error> =
        locker(&evicting).await.try_lock("jobs:other").await;
    assert_eq!(
        evicting.get("jobs:evicted").await,
        None,
        "the lock's key was evicted"
    );
    assert!(!held.is_lost(), "its holder does not know yet");
    drop(held);

    let bounded =
        RedisServer::start_with(&["--maxmemory", "4mb", "--maxmemory-policy", "noeviction"]).await;
    let report = locker(&bounded).await.check_setup().await;
    assert!(!evicts(&report), "{report:?}");
    Ok(())
}

/// Without persistence a restart forgets every lock and every fencing
/// counter: the key is granted again at once and tokens repeat.
/// `check_setup` says so beforehand. With `appendfsync always`, neither
/// happens.
#[tokio::test]
async fn restarts_with_and_without_persistence() -> anyhow::Result<()> {
    const TRIALS: usize = 20;
    let (mut volatile, dir_a) = server_in_own_dir(&[]).await;
    let report = locker(&volatile).await.check_setup().await;
    assert!(
        report
            .warnings
            .iter()
            .any(|w| matches!(w, distlock::redis::SetupWarning::NoPersistence { .. })),
        "{report:?}"
    );
    let (mut double, mut regressed) = (0, 0);
    for i in 0..TRIALS {
        let (d, r) = restart_trial(&mut volatile, &format!("restart:{i}")).await?;
        double += usize::from(d);
        regressed += usize::from(r);
    }
    println!(
        "no persistence: {} double grants and {} token regressions per 100 restarts",
        double * 100 / TRIALS,
        regressed * 100 / TRIALS
    );
    assert_eq!(double, TRIALS, "every restart forgot the lock");
    assert_eq!(regressed, TRIALS, "every restart repeated a token");

    let (mut durable, dir_b) =
        server_in_own_dir(&["--appendonly", "yes", "--appendfsync", "always"]).await;
    let report = locker(&durable).await.check_setup().await;
    assert!(report.is_sound(), "{report:?}");
    let (mut double, mut regressed) = (0, 0);
    for i in 0..TRIALS {
        let (d, r) = restart_trial(&mut durable, &format!("restart:{i}")).await?;
        double += usize::from(d);
        regressed += usize::from(r);
    }
    println!(
        "appendfsync always: {} double grants and {} token regressions per 100 restarts",
        double * 100 / TRIALS,
        regressed * 100 / TRIALS
    );
    assert_eq!((double, regressed), (0, 0));
    drop((volatile, durable));
    let _ = std::fs::remove_dir_all(dir_a);
    let _ = std::fs::remove_dir_all(dir_b);
    Ok(())
}

/// The builders take connection info in any form `redis` accepts and set
/// what the `with_*` methods set; bad connection info is an error at build.
#[tokio::test]
async fn builders_take_connection_info_and_settings() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let ttl = Duration::from_millis(1500);
    let locker = RedisLocker::builder(("127.0.0.1", server.port()))
        .ttl(ttl)
        .fencing(false)
        .command_timeout(Duration::from_millis(500))
        .build()
        .await?;
    assert_eq!(locker.ttl(), ttl);
    let lease = locker.try_lock("builder").await?.expect("free");
    assert_eq!(lease.fencing_token(), None, "fencing(false) applied");
    let left: i64 = redis::cmd("PTTL")
        .arg("builder")
        .query_async(&mut server.conn().await)
        .await?;
    assert!(left > 0 && left <= 1500, "ttl applied: {left} ms left");
    lease.release().await?;

    let redlock = distlock::redis::Redlock::builder([server.url(), server.url()])
        .ttl(ttl)
        .retry_count(0)
        .build()
        .await;
    assert!(
        matches!(redlock, Err(Error::InvalidArgument { .. })),
        "a node listed twice: {redlock:?}"
    );
    let redlock = distlock::redis::Redlock::builder([server.url()])
        .ttl(ttl)
        .build()
        .await?;
    assert_eq!(redlock.ttl(), ttl);

    let bad = RedisLocker::builder("not a url").build().await;
    assert!(matches!(bad, Err(Error::Redis(_))), "{bad:?}");
    let none = distlock::redis::Redlock::builder(Vec::<String>::new())
        .build()
        .await;
    assert!(
        matches!(none, Err(Error::InvalidArgument { .. })),
        "{none:?}"
    );
    Ok(())
}

/// `release()` polled once and then dropped (a caller's own short
/// timeout) is still carried out by the watchdog, whose outcome "is then
/// only logged": a release that fails is logged as a warning (it was not
/// logged at all).
#[tokio::test(flavor = "current_thread")]
async fn a_failed_release_whose_caller_went_away_is_logged() -> anyhow::Result<()> {
    let captured = common::captured::Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_writer(captured.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let server = RedisServer::start().await;
    let locker = RedisLocker::builder(server.url())
        .command_timeout(Duration::from_millis(200))
        .build()
        .await?;
    let lease = locker.try_lock("jobs:release-gone").await?.expect("free");
    let _: String = server.run(&["CLIENT", "PAUSE", "1000", "ALL"]).await;
    let dropped = tokio::time::timeout(Duration::from_millis(10), lease.release()).await;
    assert!(dropped.is_err(), "the release answered within 10 ms");
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let logged = captured.text();
    assert!(
        logged.contains("WARN") && logged.contains("jobs:release-gone"),
        "nothing logged of the failed release:\n{logged}"
    );
    Ok(())
}

/// A reconnect whose set-up the server refuses (here its `AUTH`: the
/// password changed while the locker's connection was cut, then changed
/// back) does not break the locker for good. redis-rs's connection manager
/// starts over only after an I/O error; a refused set-up stayed its answer
/// to every later command, until the locker was built again.
#[tokio::test]
async fn a_refused_reconnect_does_not_break_the_locker_for_good() {
    init_tracing();
    let server = RedisServer::start().await;
    let mut admin = server.conn().await;
    let config_set = |password: &'static str| {
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("SET").arg("requirepass").arg(password);
        cmd
    };
    // Set on an open connection, which stays authenticated.
    let () = config_set("pw").query_async(&mut admin).await.unwrap();
    let url = format!("redis://:pw@127.0.0.1:{}", server.port());
    let locker = RedisLocker::connect(&url).await.expect("connect");
    let lease = locker.try_lock("reconnect").await.unwrap().expect("free");
    lease.release().await.unwrap();

    let () = config_set("changed").query_async(&mut admin).await.unwrap();
    let _: i64 = redis::cmd("CLIENT")
        .arg(&["KILL", "TYPE", "normal", "SKIPME", "yes"][..])
        .query_async(&mut admin)
        .await
        .unwrap();
    // The first try finds the connection cut, which starts the reconnect;
    // one a moment later gets its refusal.
    let cut = locker.try_lock("reconnect").await;
    assert!(cut.is_err(), "{cut:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let refused = locker.try_lock("reconnect").await;
    assert!(
        matches!(&refused, Err(Error::Redis(err)) if err.kind() == redis::ErrorKind::AuthenticationFailed),
        "{refused:?}"
    );
    let () = config_set("pw").query_async(&mut admin).await.unwrap();

    let until = Instant::now() + Duration::from_secs(5);
    let mut last = None;
    while Instant::now() < until {
        match locker.try_lock("reconnect").await {
            Ok(Some(lease)) => {
                lease.release().await.unwrap();
                return;
            }
            other => last = Some(format!("{other:?}")),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the locker never recovered: last try {last:?}");
}
