//! One guard vocabulary: every guard of every backend has the same methods
//! (`key`/`keys`, `fencing_token`, `lost`, `is_lost`, `loss`, `held_for`,
//! `release`), inherent and through [`Lease`], and they tell the truth:
//! `held_for` grows, `loss()` is `None` while held and `Some` once the
//! backend took the lock away, agreeing with `is_lost()` and `lost()`,
//! `fencing_token` is `Some` exactly where fencing is on, `validity` is
//! `Some` exactly for leases with a time to live (and zero once lost), and
//! `release` frees the key (or says the lease was lost).
//!
//! `a_guard_whose_loss_ignores_the_state_is_caught` and
//! `a_guard_whose_clock_stands_still_is_caught` show the check can fail.

use crate::common;

use std::fmt;
use std::future::Future;
use std::time::Duration;

use async_trait::async_trait;
use common::{PATIENT, bounded, init_tracing};
use distlock::memory::MemoryLocker;
use distlock::{Error, FencingToken, Lease, LockKey, LossReason, PgLocker, PgLockerBuilder};
use sqlx::PgPool;

/// How long a loss may take to be seen (heartbeats of 200 ms, TTLs of 1 s).
const LOSS_SEEN_WITHIN: Duration = Duration::from_secs(5);

/// Compiles only if the guard has the whole vocabulary as inherent methods,
/// with the types the contract names. `$keys` is `key` or `keys`.
macro_rules! inherent_vocabulary {
    ($guard:expr, $keys:ident) => {{
        let guard = &$guard;
        let _ = guard.$keys();
        let _: Option<FencingToken> = guard.fencing_token();
        let _: bool = guard.is_lost();
        let _: Option<LossReason> = guard.loss();
        let _: Duration = guard.held_for();
        let _lost = guard.lost();
    }};
}

/// The vocabulary of a held lease, checked through [`Lease`]: `Err` names
/// the first thing that does not hold. `cut` takes the lock away from
/// outside (the backend terminated, the key deleted, `MemoryLocker::lose`).
async fn tells_the_truth(
    lease: Box<dyn Lease>,
    keys: &[LockKey],
    fenced: bool,
    cut: impl Future<Output = ()>,
) -> Result<(), String> {
    if lease.keys() != keys {
        return Err(format!("keys() is {:?}, not {keys:?}", lease.keys()));
    }
    if Some(lease.key()) != keys.first() {
        return Err(format!("key() is {}, not the first key", lease.key()));
    }
    if lease.fencing_token().is_some() != fenced {
        return Err(format!(
            "fencing_token() is {:?} with fencing {}",
            lease.fencing_token(),
            if fenced { "on" } else { "off" }
        ));
    }
    if lease.is_lost() || lease.loss().is_some() {
        return Err(format!("lost while held: {:?}", lease.loss()));
    }
    if lease.validity() == Some(Duration::ZERO) {
        return Err("validity() is zero while held".into());
    }
    if tokio::time::timeout(Duration::from_millis(50), lease.lost())
        .await
        .is_ok()
    {
        return Err("lost() completed while held".into());
    }
    let before = lease.held_for();
    tokio::time::sleep(Duration::from_millis(30)).await;
    let after = lease.held_for();
    if after < before + Duration::from_millis(30) {
        return Err(format!(
            "held_for() went from {before:?} to {after:?} in 30 ms"
        ));
    }

    cut.await;
    let Ok(reason) = tokio::time::timeout(LOSS_SEEN_WITHIN, lease.lost()).await else {
        return Err(format!(
            "lost() did not complete within {LOSS_SEEN_WITHIN:?}"
        ));
    };
    if lease.loss().as_ref() != Some(&reason) {
        return Err(format!(
            "lost() says {reason:?}, loss() says {:?}",
            lease.loss()
        ));
    }
    if !lease.is_lost() {
        return Err("is_lost() is false after lost() completed".into());
    }
    if lease.validity().is_some_and(|left| left > Duration::ZERO) {
        return Err(format!("validity() is {:?} once lost", lease.validity()));
    }
    match lease.release().await {
        Err(Error::LockLost { .. }) => Ok(()),
        other => Err(format!("release() of a lost lease gave {other:?}")),
    }
}

/// A fresh lease on `keys` releases, and the keys are free afterwards.
async fn releases<F, Fut>(take: F) -> Result<(), String>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Option<Box<dyn Lease>>>,
{
    let lease = take().await.ok_or("the key is still held")?;
    lease
        .release()
        .await
        .map_err(|err| format!("release(): {err}"))?;
    let again = take().await.ok_or("held after release()")?;
    again
        .release()
        .await
        .map_err(|err| format!("second release(): {err}"))
}

fn keys(names: &[&str]) -> Vec<LockKey> {
    names.iter().map(|name| LockKey::from(*name)).collect()
}

/// A `PgLocker` with a 200 ms heartbeat, so that a terminated backend is
/// seen quickly on a connection of its own.
fn pg_locker(
    pool: &PgPool,
    configure: impl FnOnce(PgLockerBuilder) -> PgLockerBuilder,
) -> PgLocker {
    init_tracing();
    let builder = PgLocker::builder(pool.clone())
        .heartbeat(Duration::from_millis(200))
        .heartbeat_timeout(PATIENT);
    configure(builder).build().expect("valid settings")
}

/// Terminates every other session of the test's database that holds an
/// advisory lock: the guard's own connection, or the shared one.
async fn terminate_holders(pool: &PgPool) {
    let terminated: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid, 5000) FROM pg_locks WHERE locktype = 'advisory' \
         AND granted AND pid <> pg_backend_pid() \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_all(pool)
    .await
    .expect("terminate the holder");
    assert!(!terminated.is_empty(), "nobody held an advisory lock");
}

async fn session_lock_case(pool: PgPool, locker: PgLocker, fenced: bool) {
    let key = keys(&["vocabulary:session"]);
    let lock = locker
        .try_lock("vocabulary:session")
        .await
        .unwrap()
        .expect("free");
    inherent_vocabulary!(lock, key);
    assert!(Lease::validity(&lock).is_none(), "no time to live");
    tells_the_truth(Box::new(lock), &key, fenced, terminate_holders(&pool))
        .await
        .unwrap();
    releases(async || {
        let lock = locker.try_lock("vocabulary:session").await.unwrap();
        lock.map(|lock| Box::new(lock) as Box<dyn Lease>)
    })
    .await
    .unwrap();
}

#[sqlx::test(migrations = false)]
async fn session_lock_default_mode(pool: PgPool) {
    let locker = pg_locker(&pool, |b| b);
    session_lock_case(pool, locker, false).await;
}

#[sqlx::test(migrations = false)]
async fn session_lock_multiplexed(pool: PgPool) {
    let locker = pg_locker(&pool, |b| b.multiplex(1));
    session_lock_case(pool, locker, false).await;
}

#[sqlx::test(migrations = false)]
async fn session_lock_fenced(pool: PgPool) {
    distlock::migrate(&pool).await.expect("migrate");
    let locker = pg_locker(&pool, |b| b.fencing(true));
    session_lock_case(pool, locker, true).await;
}

#[sqlx::test(migrations = false)]
async fn multi_lock(pool: PgPool) {
    let locker = pg_locker(&pool, |b| b);
    let names = ["vocabulary:b", "vocabulary:a"];
    let given = keys(&names);
    let lock = locker.try_lock_all(names).await.unwrap().expect("free");
    inherent_vocabulary!(lock, keys);
    assert_eq!(lock.keys(), given, "inherent keys(), in the order given");
    assert!(Lease::validity(&lock).is_none(), "no time to live");
    tells_the_truth(Box::new(lock), &given, false, terminate_holders(&pool))
        .await
        .unwrap();
    releases(async || {
        let lock = locker.try_lock_all(names).await.unwrap();
        lock.map(|lock| Box::new(lock) as Box<dyn Lease>)
    })
    .await
    .unwrap();
}

#[sqlx::test(migrations = false)]
async fn table_lease(pool: PgPool) {
    init_tracing();
    distlock::migrate(&pool).await.expect("migrate");
    let locker = distlock::postgres::TableLocker::builder(pool.clone())
        .ttl(Duration::from_secs(1))
        .build()
        .expect("valid settings");
    let key = keys(&["vocabulary:table"]);
    let lease = locker
        .try_lock("vocabulary:table")
        .await
        .unwrap()
        .expect("free");
    inherent_vocabulary!(lease, key);
    let cut = async {
        // The row goes: the next renewal finds nothing of its own.
        sqlx::query("DELETE FROM distlock.leases WHERE key_text = $1")
            .bind("vocabulary:table")
            .execute(&pool)
            .await
            .expect("delete the row");
    };
    assert!(Lease::validity(&lease).is_some(), "a time to live");
    tells_the_truth(Box::new(lease), &key, true, cut)
        .await
        .unwrap();
    releases(async || {
        let lease = locker.try_lock("vocabulary:table").await.unwrap();
        lease.map(|lease| Box::new(lease) as Box<dyn Lease>)
    })
    .await
    .unwrap();
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use crate::common::redis::{RedisServer, servers, urls};
    use distlock::redis::{RedisLocker, Redlock};

    const TTL: Duration = Duration::from_secs(1);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_lease_single() {
        init_tracing();
        let server = RedisServer::start().await;
        let locker = RedisLocker::builder(server.url())
            .ttl(TTL)
            .build()
            .await
            .expect("connect");
        let key = keys(&["vocabulary:redis"]);
        let lease = locker
            .try_lock("vocabulary:redis")
            .await
            .unwrap()
            .expect("free");
        inherent_vocabulary!(lease, key);
        let cut = async {
            let _: i64 = server.run(&["DEL", "vocabulary:redis"]).await;
        };
        assert!(Lease::validity(&lease).is_some(), "a time to live");
        tells_the_truth(Box::new(lease), &key, true, cut)
            .await
            .unwrap();
        releases(async || {
            let lease = locker.try_lock("vocabulary:redis").await.unwrap();
            lease.map(|lease| Box::new(lease) as Box<dyn Lease>)
        })
        .await
        .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_lease_redlock() {
        init_tracing();
        let servers = servers(3).await;
        let locker = Redlock::builder(urls(&servers))
            .ttl(TTL)
            .build()
            .await
            .expect("connect");
        let key = keys(&["vocabulary:redlock"]);
        let lease = locker
            .try_lock("vocabulary:redlock")
            .await
            .unwrap()
            .expect("free");
        inherent_vocabulary!(lease, key);
        let cut = async {
            for server in &servers {
                let _: i64 = server.run(&["DEL", "vocabulary:redlock"]).await;
            }
        };
        assert!(Lease::validity(&lease).is_some(), "a time to live");
        tells_the_truth(Box::new(lease), &key, false, cut)
            .await
            .unwrap();
        releases(async || {
            let lease = locker.try_lock("vocabulary:redlock").await.unwrap();
            lease.map(|lease| Box::new(lease) as Box<dyn Lease>)
        })
        .await
        .unwrap();
    }
}

#[tokio::test]
async fn memory_lease() {
    let locker = MemoryLocker::new();
    let key = keys(&["vocabulary:memory"]);
    let lease = locker
        .try_lock("vocabulary:memory")
        .await
        .unwrap()
        .expect("free");
    inherent_vocabulary!(lease, key);
    let token: Option<FencingToken> = lease.fencing_token();
    assert!(token.is_some(), "memory leases always carry a token");
    let cut = async {
        assert!(locker.lose("vocabulary:memory"), "someone held it");
    };
    assert!(Lease::validity(&lease).is_none(), "no time to live");
    tells_the_truth(Box::new(lease), &key, true, cut)
        .await
        .unwrap();
    releases(async || {
        let lease = locker.try_lock("vocabulary:memory").await.unwrap();
        lease.map(|lease| Box::new(lease) as Box<dyn Lease>)
    })
    .await
    .unwrap();
}

// ---- The check can fail -------------------------------------------------

/// How a deliberately broken guard lies.
#[derive(Debug, Clone, Copy)]
enum Lie {
    /// `loss()` and `is_lost()` ignore the loss state.
    NeverLost,
    /// `held_for()` stands still.
    Frozen,
}

/// A real lease behind a guard that lies about part of its vocabulary.
struct Lying {
    real: Box<dyn Lease>,
    lie: Lie,
}

impl fmt::Debug for Lying {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lying").field("lie", &self.lie).finish()
    }
}

#[async_trait]
impl Lease for Lying {
    fn key(&self) -> &LockKey {
        self.real.key()
    }
    fn fencing_token(&self) -> Option<FencingToken> {
        self.real.fencing_token()
    }
    async fn lost(&self) -> LossReason {
        self.real.lost().await
    }
    fn is_lost(&self) -> bool {
        matches!(self.lie, Lie::Frozen) && self.real.is_lost()
    }
    fn loss(&self) -> Option<LossReason> {
        match self.lie {
            Lie::NeverLost => None,
            Lie::Frozen => self.real.loss(),
        }
    }
    fn held_for(&self) -> Duration {
        match self.lie {
            Lie::NeverLost => self.real.held_for(),
            Lie::Frozen => Duration::from_millis(1),
        }
    }
    async fn release(self: Box<Self>) -> Result<(), Error> {
        self.real.release().await
    }
}

async fn lying_lease(locker: &MemoryLocker, lie: Lie) -> Box<dyn Lease> {
    let real = locker
        .try_lock("vocabulary:lying")
        .await
        .unwrap()
        .expect("free");
    Box::new(Lying {
        real: Box::new(real),
        lie,
    })
}

#[tokio::test]
async fn a_guard_whose_loss_ignores_the_state_is_caught() {
    let locker = MemoryLocker::new();
    let lease = lying_lease(&locker, Lie::NeverLost).await;
    let cut = async {
        locker.lose("vocabulary:lying");
    };
    let found = bounded(
        "the check",
        Duration::from_secs(10),
        tells_the_truth(lease, &keys(&["vocabulary:lying"]), true, cut),
    )
    .await;
    let err = found.expect_err("a guard whose loss() is always None passed");
    assert!(err.contains("loss() says None"), "{err}");
}

#[tokio::test]
async fn a_guard_whose_clock_stands_still_is_caught() {
    let locker = MemoryLocker::new();
    let lease = lying_lease(&locker, Lie::Frozen).await;
    let found = tells_the_truth(lease, &keys(&["vocabulary:lying"]), true, async {}).await;
    let err = found.expect_err("a guard whose held_for() stands still passed");
    assert!(err.contains("held_for()"), "{err}");
}
