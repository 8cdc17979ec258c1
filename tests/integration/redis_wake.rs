//! Redis waiters are woken by the release, not by polling: `RedisLocker`
//! and `Redlock` against private `redis-server`s.
//!
//! The waiters here are built with a fallback poll of an hour (and, for
//! Redlock, a retry delay of a minute) and wait without a deadline, so a
//! waiter that gets the key at all was woken by the release's signal; one
//! that is never woken fails its test by hanging (`common::bounded`).
//! Latencies are printed (`--nocapture`), never asserted.
#![cfg(feature = "redis")]

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::redis::{RedisServer, servers, urls};
use common::{bounded, eventually, init_tracing};
use distlock::redis::{RedisLocker, RedisLockerBuilder, Redlock, RedlockBuilder};
use distlock::{Error, Lease, LockKey, Locker};

/// Longer than any test: a waiter that relied on it would time out.
const NO_POLL: Duration = Duration::from_secs(3600);
/// How long a test waits for a waiter that must be woken, or for the
/// fallback poll: far beyond what either takes.
const WAIT: Duration = Duration::from_secs(5);

async fn single(
    server: &RedisServer,
    configure: impl FnOnce(RedisLockerBuilder) -> RedisLockerBuilder,
) -> RedisLocker {
    init_tracing();
    configure(RedisLocker::builder(server.url()))
        .build()
        .await
        .expect("connect")
}

async fn redlock(
    servers: &[RedisServer],
    configure: impl FnOnce(RedlockBuilder) -> RedlockBuilder,
) -> Redlock {
    init_tracing();
    configure(Redlock::builder(urls(servers)))
        .build()
        .await
        .expect("connect")
}

/// A Redlock waiter that can only be woken: no poll, and a retry delay
/// longer than the test.
fn woken_only(builder: RedlockBuilder) -> RedlockBuilder {
    builder
        .poll_interval(NO_POLL)
        .retry_delay(Duration::from_secs(60))
        .retry_jitter(Duration::ZERO)
}

/// The channel on which releases of `key` are signalled.
fn channel(key: &str) -> String {
    format!("distlock:released\0{key}")
}

/// How many clients of `server` listen on `key`'s channel.
async fn listeners(server: &RedisServer, key: &str) -> i64 {
    let reply: (String, i64) = server.run(&["PUBSUB", "NUMSUB", &channel(key)]).await;
    reply.1
}

/// How many subscriber connections `server` has: connections subscribed to
/// some channel, or whose last command was an (un)subscription (a
/// subscriber without channels is an ordinary connection again).
async fn subscriber_connections(server: &RedisServer) -> usize {
    let list: String = server.run(&["CLIENT", "LIST"]).await;
    list.lines()
        .filter(|line| {
            let field = |name: &str| {
                line.split(' ')
                    .find_map(|f| f.strip_prefix(name))
                    .unwrap_or_default()
            };
            field("sub=") != "0" || matches!(field("cmd="), "subscribe" | "unsubscribe")
        })
        .count()
}

/// Waits until `count` clients of every one of `servers` listen on `key`'s
/// channel, then a little longer, so that each waiter has made its try
/// after subscribing and sleeps.
async fn until_listening(servers: &[&RedisServer], key: &str, count: i64) {
    for server in servers {
        eventually("waiters listen", Duration::from_secs(5), async || {
            listeners(server, key).await == count
        })
        .await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
}

type Waiting = tokio::task::JoinHandle<(Instant, Result<Box<dyn Lease>, Error>)>;

/// Starts `lock(key)` without a deadline on a task of its own; its result
/// carries when it returned.
fn spawn_waiter<L: Locker + Clone + 'static>(locker: &L, key: &str) -> Waiting {
    let (locker, key) = (locker.clone(), LockKey::from(key));
    tokio::spawn(async move {
        let lease = locker.lock(key, Duration::MAX).await;
        (Instant::now(), lease)
    })
}

/// The waiter's lease and when it got it; panics if that takes `WAIT`.
async fn granted(waiting: Waiting) -> anyhow::Result<(Instant, Box<dyn Lease>)> {
    let (at, lease) = bounded("the waiter gets the key", WAIT, waiting).await?;
    Ok((at, lease?))
}

/// One hand-off: `holder` holds `key` until a waiter on `waiter` listens,
/// then releases. Returns the time from the start of the release to the
/// waiter's grant.
async fn handoff<L: Locker + Clone + 'static>(
    holder: &L,
    waiter: &L,
    servers: &[&RedisServer],
    key: &str,
) -> anyhow::Result<Duration> {
    let held = holder
        .try_lock(LockKey::from(key))
        .await?
        .expect("free key");
    let waiting = spawn_waiter(waiter, key);
    until_listening(servers, key, 1).await;
    assert!(!waiting.is_finished(), "the key was held");
    let released = Instant::now();
    held.release().await?;
    let (at, lease) = granted(waiting).await?;
    lease.release().await?;
    Ok(at.saturating_duration_since(released))
}

#[tokio::test]
async fn a_release_wakes_a_waiter_that_does_not_poll() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let holder = single(&server, |b| b).await;
    let waiter = single(&server, |b| b.poll_interval(NO_POLL)).await;

    let mut woken = Vec::new();
    for _ in 0..5 {
        woken.push(handoff(&holder, &waiter, &[&server], "wake:single").await?);
    }
    // The same hand-off to a waiter that cannot subscribe polls with the
    // backoff (5 ms doubling to 100 ms): the comparison, printed.
    let _: String = server
        .run(&[
            "ACL",
            "SETUSER",
            "nochannels",
            "on",
            ">secret",
            "~*",
            "+@all",
            "resetchannels",
        ])
        .await;
    let polling = RedisLocker::connect(&format!(
        "redis://nochannels:secret@127.0.0.1:{}",
        server.port()
    ))
    .await?;
    let mut polled = Vec::new();
    for _ in 0..5 {
        let held = holder.try_lock("wake:polled").await?.expect("free key");
        let waiting = spawn_waiter(&polling, "wake:polled");
        tokio::time::sleep(Duration::from_millis(500)).await;
        let released = Instant::now();
        held.release().await?;
        let (at, lease) = granted(waiting).await?;
        lease.release().await?;
        polled.push(at.saturating_duration_since(released));
    }
    println!("release to waiter, woken by the signal: {woken:?}");
    println!("release to waiter, polling with backoff (no subscription): {polled:?}");
    Ok(())
}

/// A release that comes between a waiter's first try and its
/// subscription sends a signal the waiter cannot hear: the waiter must try
/// once more after subscribing. Releases at random moments around the
/// start of the wait hit that window in some trials; a waiter that does not
/// poll and missed one would wait until its deadline.
#[tokio::test]
async fn a_release_just_before_the_subscription_is_not_missed() -> anyhow::Result<()> {
    const TRIALS: usize = 200;
    let server = RedisServer::start().await;
    let holder = single(&server, |b| b).await;
    let waiter = single(&server, |b| b.poll_interval(NO_POLL)).await;
    let mut slowest = Duration::ZERO;
    for trial in 0..TRIALS {
        let key = format!("wake:race:{trial}");
        let held = holder.try_lock(key.as_str()).await?.expect("free key");
        let waiting = spawn_waiter(&waiter, &key);
        let offset = Duration::from_micros(rand::random_range(0..1_500));
        tokio::time::sleep(offset).await;
        let released = Instant::now();
        held.release().await?;
        let (at, lease) = granted(waiting).await?;
        slowest = slowest.max(at.saturating_duration_since(released));
        lease.release().await?;
    }
    println!("{TRIALS} releases around the start of a wait: slowest hand-off {slowest:?}");
    Ok(())
}

/// A user without access to the channels still releases (the script's
/// `PUBLISH` is refused, the `DEL` is not) and still waits, by polling.
#[tokio::test]
async fn a_user_without_channel_access_releases_and_waits_by_polling() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let _: String = server
        .run(&[
            "ACL",
            "SETUSER",
            "nochannels",
            "on",
            ">secret",
            "~*",
            "+@all",
            "resetchannels",
        ])
        .await;
    init_tracing();
    let url = format!("redis://nochannels:secret@127.0.0.1:{}", server.port());
    let (a, b) = (
        RedisLocker::connect(&url).await?,
        RedisLocker::connect(&url).await?,
    );
    let held = a.try_lock("wake:acl").await?.expect("free key");
    let waiting = spawn_waiter(&b, "wake:acl");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(listeners(&server, "wake:acl").await, 0, "refused");
    held.release().await?;
    let (_, lease) = granted(waiting).await?;
    assert!(server.get("wake:acl").await.is_some(), "the waiter has it");
    lease.release().await?;
    assert_eq!(server.get("wake:acl").await, None);
    Ok(())
}

#[tokio::test]
async fn many_waiters_each_get_the_key_once_in_turn_over_one_connection_per_locker()
-> anyhow::Result<()> {
    const PER_LOCKER: usize = 6;
    let server = RedisServer::start().await;
    let holder = single(&server, |b| b).await;
    let lockers = [
        single(&server, |b| b.poll_interval(NO_POLL)).await,
        single(&server, |b| b.poll_interval(NO_POLL)).await,
    ];
    let held = holder.try_lock("wake:many").await?.expect("free key");

    let inside = Arc::new(AtomicUsize::new(0));
    let mut waiters = Vec::new();
    for (l, locker) in lockers.iter().enumerate() {
        for w in 0..PER_LOCKER {
            let (locker, inside) = (locker.clone(), Arc::clone(&inside));
            waiters.push(tokio::spawn(async move {
                let lease = locker.lock("wake:many", Duration::MAX).await?;
                assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                tokio::time::sleep(Duration::from_millis(5)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                lease.release().await?;
                anyhow::Ok((l, w, Instant::now()))
            }));
        }
    }
    // Each locker subscribes once, however many of its tasks wait.
    until_listening(&[&server], "wake:many", 2).await;
    assert_eq!(subscriber_connections(&server).await, 2);

    let started = Instant::now();
    held.release().await?;
    let mut turns = Vec::new();
    for waiter in waiters {
        turns.push(bounded("a waiter", Duration::from_secs(20), waiter).await??);
    }
    let took = started.elapsed();
    turns.sort_by_key(|(_, _, at)| *at);
    let order: Vec<(usize, usize)> = turns.iter().map(|(l, w, _)| (*l, *w)).collect();
    println!(
        "{} waiters (2 lockers), each holding 5 ms: all served in {took:?}, order {order:?}",
        order.len()
    );
    let mut served = order.clone();
    served.sort_unstable();
    served.dedup();
    assert_eq!(served.len(), 2 * PER_LOCKER, "each once: {order:?}");
    // The last waiter gone, the channel is left.
    eventually("unsubscribed", Duration::from_secs(2), async || {
        listeners(&server, "wake:many").await == 0
    })
    .await;
    Ok(())
}

/// A holder that vanishes without releasing sends no signal: its key
/// expires, and the fallback poll finds it free.
#[tokio::test]
async fn a_holder_that_vanishes_hands_over_through_the_fallback_poll() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let waiter = single(&server, |b| b.poll_interval(Duration::from_millis(100))).await;
    // What a crashed holder leaves: its key, until the TTL runs out.
    let _: String = server
        .run(&["SET", "wake:vanished", "crashed", "PX", "400"])
        .await;
    let started = Instant::now();
    let lease = bounded(
        "the fallback poll finds the key",
        WAIT,
        waiter.lock("wake:vanished", Duration::MAX),
    )
    .await?;
    let took = started.elapsed();
    println!("a vanished holder's key (TTL 400 ms) reached the waiter after {took:?}");
    assert!(took >= Duration::from_millis(350), "{took:?}");
    lease.release().await?;
    Ok(())
}

/// A server that restarts (and forgets the key) under a listening waiter:
/// its subscriber reconnects and the waiter gets the key.
#[tokio::test]
async fn a_listening_waiter_gets_the_key_after_the_server_restarts() -> anyhow::Result<()> {
    let mut server = RedisServer::start().await;
    let holder = single(&server, |b| b).await;
    let waiter = single(&server, |b| b.poll_interval(NO_POLL)).await;
    let held = holder.try_lock("wake:restart").await?.expect("free key");
    let waiting = spawn_waiter(&waiter, "wake:restart");
    until_listening(&[&server], "wake:restart", 1).await;

    server.kill();
    tokio::time::sleep(Duration::from_millis(200)).await;
    server.spawn().await;
    let back = Instant::now();
    let (at, lease) = granted(waiting).await?;
    println!(
        "after the restart the waiter had the key in {:?}",
        at.saturating_duration_since(back)
    );
    assert!(server.get("wake:restart").await.is_some());
    lease.release().await?;
    drop(held);
    // The subscriber is back, and listens for the next waiter. (The
    // holder's first command after the restart may find its connection
    // broken: `lock` tries again, `try_lock` would report it.)
    let held = holder.lock("wake:restart", WAIT).await?;
    let waiting = spawn_waiter(&waiter, "wake:restart");
    until_listening(&[&server], "wake:restart", 1).await;
    held.release().await?;
    let (_, lease) = granted(waiting).await?;
    lease.release().await?;
    Ok(())
}

/// A subscriber connection killed under a waiting waiter (the server's
/// `CLIENT KILL TYPE pubsub`, or a proxy dropping idle connections):
/// the subscriber reconnects and subscribes again, and the release of the
/// key held all along wakes the waiter.
#[tokio::test]
async fn a_killed_subscriber_connection_comes_back_subscribed() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let holder = single(&server, |b| b).await;
    let waiter = single(&server, |b| b.poll_interval(NO_POLL)).await;
    let held = holder.try_lock("wake:killed").await?.expect("free key");
    let waiting = spawn_waiter(&waiter, "wake:killed");
    until_listening(&[&server], "wake:killed", 1).await;

    let killed: i64 = server.run(&["CLIENT", "KILL", "TYPE", "pubsub"]).await;
    assert_eq!(killed, 1);
    until_listening(&[&server], "wake:killed", 1).await;
    assert!(!waiting.is_finished(), "the key is still held");
    held.release().await?;
    let (_, lease) = granted(waiting).await?;
    lease.release().await?;
    Ok(())
}

/// The subscriber connection lives with the locker: dropping the last
/// clone closes it.
#[tokio::test]
async fn dropping_the_locker_closes_its_subscriber_connection() -> anyhow::Result<()> {
    let server = RedisServer::start().await;
    let holder = single(&server, |b| b).await;
    let waiter = single(&server, |b| b.poll_interval(NO_POLL)).await;
    handoff(&holder, &waiter, &[&server], "wake:drop").await?;
    assert_eq!(subscriber_connections(&server).await, 1);
    drop(waiter);
    eventually("closed", Duration::from_secs(2), async || {
        subscriber_connections(&server).await == 0
    })
    .await;
    Ok(())
}

// ---------------------------------------------------------------------------
// Redlock

#[tokio::test]
async fn redlock_a_release_wakes_a_waiter_that_does_not_poll() -> anyhow::Result<()> {
    let servers = servers(3).await;
    let holder = redlock(&servers, |b| b).await;
    let waiter = redlock(&servers, woken_only).await;
    let all: Vec<&RedisServer> = servers.iter().collect();
    let mut woken = Vec::new();
    for _ in 0..5 {
        woken.push(handoff(&holder, &waiter, &all, "wake:redlock").await?);
    }
    println!("Redlock (3 nodes), release to waiter, woken by the signal: {woken:?}");
    Ok(())
}

/// With a node down, the other two (a quorum) still carry the signal.
#[tokio::test]
async fn redlock_a_release_wakes_a_waiter_with_a_node_down() -> anyhow::Result<()> {
    let mut servers = servers(3).await;
    let holder = redlock(&servers, |b| b).await;
    let waiter = redlock(&servers, woken_only).await;
    servers[2].kill();
    let up = [&servers[0], &servers[1]];
    let took = handoff(&holder, &waiter, &up, "wake:minority-down").await?;
    println!("Redlock, one of 3 nodes down: release to waiter {took:?}");
    Ok(())
}

#[tokio::test]
async fn redlock_many_waiters_each_get_the_key_once_in_turn() -> anyhow::Result<()> {
    const PER_LOCKER: usize = 4;
    let servers = servers(3).await;
    let holder = redlock(&servers, |b| b).await;
    let lockers = [
        redlock(&servers, |b| b.poll_interval(NO_POLL)).await,
        redlock(&servers, |b| b.poll_interval(NO_POLL)).await,
    ];
    let held = holder.try_lock("wake:redlock-many").await?.expect("free");
    let inside = Arc::new(AtomicUsize::new(0));
    let mut waiters = Vec::new();
    for (l, locker) in lockers.iter().enumerate() {
        for w in 0..PER_LOCKER {
            let (locker, inside) = (locker.clone(), Arc::clone(&inside));
            waiters.push(tokio::spawn(async move {
                let lease = locker.lock("wake:redlock-many", Duration::MAX).await?;
                assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                tokio::time::sleep(Duration::from_millis(5)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                lease.release().await?;
                anyhow::Ok((l, w))
            }));
        }
    }
    let all: Vec<&RedisServer> = servers.iter().collect();
    until_listening(&all, "wake:redlock-many", 2).await;
    for server in &servers {
        assert_eq!(subscriber_connections(server).await, 2);
    }
    let started = Instant::now();
    held.release().await?;
    let mut served = Vec::new();
    for waiter in waiters {
        served.push(bounded("a waiter", Duration::from_secs(20), waiter).await??);
    }
    println!(
        "Redlock: {} waiters (2 lockers) served in {:?}",
        served.len(),
        started.elapsed()
    );
    served.sort_unstable();
    served.dedup();
    assert_eq!(served.len(), 2 * PER_LOCKER);
    Ok(())
}

#[tokio::test]
async fn redlock_a_holder_that_vanishes_hands_over_through_the_fallback_poll() -> anyhow::Result<()>
{
    let servers = servers(3).await;
    let waiter = redlock(&servers, |b| {
        woken_only(b).poll_interval(Duration::from_millis(100))
    })
    .await;
    for server in &servers {
        let _: String = server
            .run(&["SET", "wake:redlock-vanished", "crashed", "PX", "400"])
            .await;
    }
    let started = Instant::now();
    let lease = bounded(
        "the fallback poll finds the key",
        WAIT,
        waiter.lock("wake:redlock-vanished", Duration::MAX),
    )
    .await?;
    let took = started.elapsed();
    println!("Redlock: a vanished holder's keys (TTL 400 ms) reached the waiter after {took:?}");
    assert!(took >= Duration::from_millis(350), "{took:?}");
    lease.release().await?;
    Ok(())
}
