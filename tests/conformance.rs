//! One contract, every backend: the behaviour of [`Locker`] and [`Lease`]
//! written once as test cases (`cases`), and run against every backend by
//! one line each at the bottom of this file (`backend!`).
//!
//! A backend supplies two lockers that behave as two processes, a way to
//! make a held lease lost from outside, and whether it issues fencing
//! tokens. The cases are: exclusive, `lock` waits and is handed the lock,
//! `lock` times out, release frees, drop frees, `lost()` on loss, tokens
//! increase, cancellation at every `.await` leaves nothing held, bad keys,
//! and many tasks contending on one key. `a_locker_that_skips_the_lock_fails_the_suite`
//! shows the cases can fail.
//!
//! Run one backend: `cargo test --all-features --test conformance redis_single::`.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use distlock::{Error, Lease, LockKey, Locker, PgLocker};
use sqlx::PgPool;

/// What a backend gives the cases.
#[async_trait]
trait Backend: Send + Sync {
    /// Two lockers that behave as two processes (separate connections).
    fn lockers(&self) -> (Arc<dyn Locker>, Arc<dyn Locker>);
    /// Makes whoever holds `key` lose it, from outside the process.
    async fn break_lease(&self, key: &LockKey);
    /// Whether every lease carries a fencing token.
    fn tokens(&self) -> bool;
}

/// How long a loss may take to be noticed by the backends as configured
/// here (heartbeats of 200 ms, Redis TTLs of 1 s).
const LOSS_NOTICED_WITHIN: Duration = Duration::from_secs(5);
/// How long a dropped lease may take to be freed in the background.
const DROP_FREED_WITHIN: Duration = Duration::from_secs(5);

mod cases {
    use super::*;

    fn key(name: &str) -> LockKey {
        LockKey::from(format!("conformance:{name}"))
    }

    async fn free_soon(locker: &dyn Locker, key: &LockKey, within: Duration, what: &str) {
        let started = Instant::now();
        loop {
            if let Some(lease) = locker.try_lock(key.clone()).await.expect("try_lock") {
                lease.release().await.expect("release");
                return;
            }
            assert!(
                started.elapsed() < within,
                "{what}: {key} still held after {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub(super) async fn exclusive(backend: &dyn Backend) {
        let (a, b) = backend.lockers();
        let k = key("exclusive");
        let held = a.try_lock(k.clone()).await.unwrap().expect("free key");
        assert_eq!(held.key(), &k);
        assert!(!held.is_lost());
        assert!(
            b.try_lock(k.clone()).await.unwrap().is_none(),
            "other process"
        );
        assert!(
            a.try_lock(k.clone()).await.unwrap().is_none(),
            "same locker"
        );
        // Another key is independent.
        let other = b.try_lock(key("exclusive:other")).await.unwrap();
        other.expect("another key is free").release().await.unwrap();
        held.release().await.unwrap();
    }

    pub(super) async fn lock_waits_and_is_handed_the_lock(backend: &dyn Backend) {
        let (a, b) = backend.lockers();
        let k = key("handoff");
        let held = a.try_lock(k.clone()).await.unwrap().expect("free key");
        let waiter = tokio::spawn({
            let (b, k) = (Arc::clone(&b), k.clone());
            async move { b.lock(k, Duration::from_secs(10)).await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !waiter.is_finished(),
            "lock() returned while the key was held"
        );
        let released = Instant::now();
        held.release().await.unwrap();
        let lease = common::bounded("the waiter gets the lock", Duration::from_secs(10), waiter)
            .await
            .unwrap()
            .expect("handed over");
        println!("hand-off after release: {:?}", released.elapsed());
        assert!(a.try_lock(k.clone()).await.unwrap().is_none());
        lease.release().await.unwrap();
    }

    pub(super) async fn lock_times_out(backend: &dyn Backend) {
        let (a, b) = backend.lockers();
        let k = key("timeout");
        let held = a.try_lock(k.clone()).await.unwrap().expect("free key");
        let started = Instant::now();
        let err = b
            .lock(k.clone(), Duration::from_millis(300))
            .await
            .unwrap_err();
        let took = started.elapsed();
        assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_secs(5),
            "{took:?}"
        );
        // A zero timeout is a single try.
        let err = b.lock(k.clone(), Duration::ZERO).await.unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
        held.release().await.unwrap();
        // A huge timeout on a free key is no panic.
        let lease = b.lock(k, Duration::MAX).await.unwrap();
        lease.release().await.unwrap();
    }

    pub(super) async fn release_frees(backend: &dyn Backend) {
        let (a, b) = backend.lockers();
        let k = key("release");
        for _ in 0..3 {
            let held = a.try_lock(k.clone()).await.unwrap().expect("free key");
            held.release().await.unwrap();
            let next = b
                .try_lock(k.clone())
                .await
                .unwrap()
                .expect("free after release");
            next.release().await.unwrap();
        }
    }

    pub(super) async fn drop_frees(backend: &dyn Backend) {
        let (a, b) = backend.lockers();
        let k = key("drop");
        let held = a.try_lock(k.clone()).await.unwrap().expect("free key");
        drop(held);
        free_soon(b.as_ref(), &k, DROP_FREED_WITHIN, "after drop").await;
    }

    pub(super) async fn lost_on_loss(backend: &dyn Backend) {
        let (a, b) = backend.lockers();
        let k = key("lost");
        let held = a.try_lock(k.clone()).await.unwrap().expect("free key");
        backend.break_lease(&k).await;
        let started = Instant::now();
        let reason = common::bounded("lost() fires", LOSS_NOTICED_WITHIN, held.lost()).await;
        println!("loss noticed after {:?}: {reason}", started.elapsed());
        assert!(held.is_lost());
        assert!(
            held.release().await.is_err(),
            "releasing a lost lease is an error"
        );
        free_soon(b.as_ref(), &k, LOSS_NOTICED_WITHIN, "after the loss").await;
    }

    pub(super) async fn tokens_increase(backend: &dyn Backend) {
        let (a, b) = backend.lockers();
        let k = key("tokens");
        let mut last = None;
        for round in 0..6 {
            let locker = if round % 2 == 0 { &a } else { &b };
            let lease = locker.try_lock(k.clone()).await.unwrap().expect("free key");
            let token = lease.fencing_token();
            assert_eq!(token.is_some(), backend.tokens(), "round {round}");
            if let (Some(before), Some(now)) = (last, token) {
                assert!(now > before, "round {round}: {now:?} after {before:?}");
            }
            last = token;
            lease.release().await.unwrap();
        }
    }

    pub(super) async fn cancelled_acquisitions_leave_nothing_held(backend: &dyn Backend) {
        let (a, b) = backend.lockers();
        let k = key("cancel");
        // Free key: the future is dropped somewhere between start and grant.
        for micros in [0, 50, 200, 500, 1_000, 2_000, 5_000, 20_000] {
            let attempt = a.lock(k.clone(), Duration::from_secs(5));
            if let Ok(done) = tokio::time::timeout(Duration::from_micros(micros), attempt).await {
                done.unwrap().release().await.unwrap();
            }
            free_soon(
                b.as_ref(),
                &k,
                DROP_FREED_WITHIN,
                "after a cancelled lock()",
            )
            .await;
            let attempt = a.try_lock(k.clone());
            if let Ok(done) = tokio::time::timeout(Duration::from_micros(micros), attempt).await
                && let Some(lease) = done.unwrap()
            {
                lease.release().await.unwrap();
            }
            free_soon(
                b.as_ref(),
                &k,
                DROP_FREED_WITHIN,
                "after a cancelled try_lock()",
            )
            .await;
        }
        // Busy key: a waiter is dropped while it waits.
        let held = b.try_lock(k.clone()).await.unwrap().expect("free key");
        let attempt = a.lock(k.clone(), Duration::from_secs(10));
        assert!(
            tokio::time::timeout(Duration::from_millis(200), attempt)
                .await
                .is_err()
        );
        held.release().await.unwrap();
        free_soon(b.as_ref(), &k, DROP_FREED_WITHIN, "after a cancelled wait").await;
    }

    pub(super) async fn bad_keys_are_refused(backend: &dyn Backend) {
        let (a, _) = backend.lockers();
        for bad in ["", "nul\0inside"] {
            let err = a.try_lock(LockKey::from(bad)).await.unwrap_err();
            assert!(matches!(err, Error::InvalidKey { .. }), "{bad:?}: {err:?}");
            let err = a
                .lock(LockKey::from(bad), Duration::from_millis(10))
                .await
                .unwrap_err();
            assert!(matches!(err, Error::InvalidKey { .. }), "{bad:?}: {err:?}");
        }
    }

    pub(super) async fn contending_tasks_never_overlap(backend: &dyn Backend) {
        let (a, b) = backend.lockers();
        let k = key("contention");
        let inside = Arc::new(AtomicUsize::new(0));
        let overlaps = Arc::new(AtomicUsize::new(0));
        let mut tasks = tokio::task::JoinSet::new();
        for task in 0..6 {
            let locker = if task % 2 == 0 {
                Arc::clone(&a)
            } else {
                Arc::clone(&b)
            };
            let (k, inside, overlaps) = (k.clone(), Arc::clone(&inside), Arc::clone(&overlaps));
            tasks.spawn(async move {
                for _ in 0..10 {
                    let lease = locker.lock(k.clone(), Duration::from_secs(30)).await?;
                    if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                        overlaps.fetch_add(1, Ordering::SeqCst);
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    lease.release().await?;
                }
                Ok::<_, Error>(())
            });
        }
        while let Some(done) = tasks.join_next().await {
            done.unwrap().unwrap();
        }
        assert_eq!(overlaps.load(Ordering::SeqCst), 0, "two holders at once");
    }
}

/// Generates one test per case for a backend: a module named `$module`, each
/// test with attribute `$attr`, arguments `$args`, and `$make` building the
/// backend from them.
macro_rules! backend {
    ($module:ident, #[$attr:meta] $args:tt => $make:expr) => {
        mod $module {
            use super::*;
            backend!(@cases [$attr] $args $make;
                exclusive, lock_waits_and_is_handed_the_lock, lock_times_out, release_frees,
                drop_frees, lost_on_loss, tokens_increase,
                cancelled_acquisitions_leave_nothing_held, bad_keys_are_refused,
                contending_tasks_never_overlap);
        }
    };
    (@cases [$attr:meta] $args:tt $make:expr; $($case:ident),*) => {
        $(
            #[$attr]
            async fn $case $args {
                common::init_tracing();
                let backend = $make;
                cases::$case(&backend).await;
            }
        )*
    };
}

// ---- PostgreSQL ---------------------------------------------------------

/// `PgLocker` over two pools of the test's own database, with fencing and a
/// fast heartbeat; `connections > 0` is the multiplexed mode.
struct Postgres {
    a: Arc<dyn Locker>,
    b: Arc<dyn Locker>,
    pool: PgPool,
}

impl Postgres {
    async fn new(pool: PgPool, connections: usize) -> Self {
        distlock::migrate(&pool).await.expect("migrate");
        let make = |pool: PgPool| -> Arc<dyn Locker> {
            Arc::new(
                PgLocker::builder(pool)
                    .fencing(true)
                    .heartbeat(Duration::from_millis(200))
                    .multiplex(connections)
                    .build(),
            )
        };
        let second = sqlx::postgres::PgPoolOptions::new()
            .connect_with(pool.connect_options().as_ref().clone())
            .await
            .expect("second pool");
        Self {
            a: make(pool.clone()),
            b: make(second),
            pool,
        }
    }
}

#[async_trait]
impl Backend for Postgres {
    fn lockers(&self) -> (Arc<dyn Locker>, Arc<dyn Locker>) {
        (Arc::clone(&self.a), Arc::clone(&self.b))
    }

    async fn break_lease(&self, _key: &LockKey) {
        // Every session holding an advisory lock in this database is
        // terminated: the holder's connection (or shared connection).
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' \
             AND granted AND pid <> pg_backend_pid() \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .execute(&self.pool)
        .await
        .expect("terminate the holder");
    }

    fn tokens(&self) -> bool {
        true
    }
}

backend!(pg_default, #[sqlx::test(migrations = false)] (pool: PgPool) => Postgres::new(pool, 0).await);
backend!(pg_multiplexed, #[sqlx::test(migrations = false)] (pool: PgPool) => Postgres::new(pool, 2).await);

// ---- PostgreSQL lease table ----------------------------------------------

/// `TableLocker` over two pools of the test's own database, with a TTL of
/// one second (renewed every 333 ms).
struct Table {
    a: Arc<dyn Locker>,
    b: Arc<dyn Locker>,
    pool: PgPool,
}

impl Table {
    const TTL: Duration = Duration::from_secs(1);

    async fn new(pool: PgPool) -> Self {
        distlock::migrate(&pool).await.expect("migrate");
        let make = |pool: PgPool| -> Arc<dyn Locker> {
            Arc::new(distlock::TableLocker::builder(pool).ttl(Self::TTL).build())
        };
        let second = sqlx::postgres::PgPoolOptions::new()
            .connect_with(pool.connect_options().as_ref().clone())
            .await
            .expect("second pool");
        Self {
            a: make(pool.clone()),
            b: make(second),
            pool,
        }
    }
}

#[async_trait]
impl Backend for Table {
    fn lockers(&self) -> (Arc<dyn Locker>, Arc<dyn Locker>) {
        (Arc::clone(&self.a), Arc::clone(&self.b))
    }

    async fn break_lease(&self, key: &LockKey) {
        // The row goes: the holder's next renewal finds nothing of its own.
        let gone = sqlx::query("DELETE FROM distlock.leases WHERE key_text = $1")
            .bind(key.to_string())
            .execute(&self.pool)
            .await
            .expect("delete the holder's row");
        assert_eq!(gone.rows_affected(), 1, "someone held {key}");
    }

    fn tokens(&self) -> bool {
        true
    }
}

backend!(table, #[sqlx::test(migrations = false)] (pool: PgPool) => Table::new(pool).await);

// ---- Redis --------------------------------------------------------------

#[cfg(feature = "redis")]
mod redis_backends {
    use super::*;
    use common::redis::{RedisServer, servers, urls};
    use distlock::redis::{RedisLocker, Redlock};

    const TTL: Duration = Duration::from_secs(1);

    /// `RedisLocker` on a private `redis-server`.
    pub(super) struct Single {
        server: RedisServer,
        a: Arc<dyn Locker>,
        b: Arc<dyn Locker>,
    }

    impl Single {
        pub(super) async fn start() -> Self {
            let server = RedisServer::start().await;
            let make = async || -> Arc<dyn Locker> {
                let locker = RedisLocker::connect(&server.url()).await.expect("connect");
                let locker: Arc<dyn Locker> = Arc::new(locker.with_ttl(TTL));
                locker
            };
            let (a, b) = (make().await, make().await);
            Self { server, a, b }
        }
    }

    #[async_trait]
    impl Backend for Single {
        fn lockers(&self) -> (Arc<dyn Locker>, Arc<dyn Locker>) {
            (Arc::clone(&self.a), Arc::clone(&self.b))
        }

        async fn break_lease(&self, key: &LockKey) {
            let _: i64 = self.server.run(&["DEL", &key.to_string()]).await;
        }

        fn tokens(&self) -> bool {
            true
        }
    }

    /// `Redlock` over three private `redis-server`s.
    pub(super) struct Quorum {
        servers: Vec<RedisServer>,
        a: Arc<dyn Locker>,
        b: Arc<dyn Locker>,
    }

    impl Quorum {
        pub(super) async fn start() -> Self {
            let servers = servers(3).await;
            let urls = urls(&servers);
            let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
            let make = async || -> Arc<dyn Locker> {
                let locker = Redlock::connect(&urls).await.expect("connect");
                let locker: Arc<dyn Locker> = Arc::new(locker.with_ttl(TTL));
                locker
            };
            let (a, b) = (make().await, make().await);
            Self { servers, a, b }
        }
    }

    #[async_trait]
    impl Backend for Quorum {
        fn lockers(&self) -> (Arc<dyn Locker>, Arc<dyn Locker>) {
            (Arc::clone(&self.a), Arc::clone(&self.b))
        }

        async fn break_lease(&self, key: &LockKey) {
            for server in &self.servers {
                let _: i64 = server.run(&["DEL", &key.to_string()]).await;
            }
        }

        fn tokens(&self) -> bool {
            false
        }
    }
}

#[cfg(feature = "redis")]
backend!(redis_single, #[tokio::test(flavor = "multi_thread", worker_threads = 2)] () => redis_backends::Single::start().await);
#[cfg(feature = "redis")]
backend!(redlock, #[tokio::test(flavor = "multi_thread", worker_threads = 2)] () => redis_backends::Quorum::start().await);

// ---- In memory ----------------------------------------------------------

/// `MemoryLocker`: two clones share one table, as two processes share a
/// database.
struct Memory(distlock::memory::MemoryLocker);

#[async_trait]
impl Backend for Memory {
    fn lockers(&self) -> (Arc<dyn Locker>, Arc<dyn Locker>) {
        (Arc::new(self.0.clone()), Arc::new(self.0.clone()))
    }

    async fn break_lease(&self, key: &LockKey) {
        assert!(self.0.lose(key), "someone held {key}");
    }

    fn tokens(&self) -> bool {
        true
    }
}

backend!(memory, #[tokio::test(flavor = "multi_thread", worker_threads = 2)] () => Memory(distlock::memory::MemoryLocker::new()));

// ---- The suite can fail -------------------------------------------------

/// A locker that takes the lock only every other time and otherwise hands
/// out a lease for nothing: what a broken backend looks like.
#[derive(Debug)]
struct SkipsTheLock {
    real: Arc<dyn Locker>,
    calls: AtomicUsize,
}

#[derive(Debug)]
struct Phantom(LockKey);

#[async_trait]
impl Lease for Phantom {
    fn key(&self) -> &LockKey {
        &self.0
    }
    fn fencing_token(&self) -> Option<distlock::FencingToken> {
        None
    }
    async fn lost(&self) -> distlock::LossReason {
        std::future::pending().await
    }
    fn is_lost(&self) -> bool {
        false
    }
    async fn release(self: Box<Self>) -> Result<(), Error> {
        Ok(())
    }
}

#[async_trait]
impl Locker for SkipsTheLock {
    async fn try_lock(&self, key: LockKey) -> Result<Option<Box<dyn Lease>>, Error> {
        if self.calls.fetch_add(1, Ordering::SeqCst) % 2 == 1 {
            key.validate()?;
            return Ok(Some(Box::new(Phantom(key))));
        }
        self.real.try_lock(key).await
    }

    async fn lock(&self, key: LockKey, timeout: Duration) -> Result<Box<dyn Lease>, Error> {
        if self.calls.fetch_add(1, Ordering::SeqCst) % 2 == 1 {
            key.validate()?;
            return Ok(Box::new(Phantom(key)));
        }
        self.real.lock(key, timeout).await
    }

    fn backend(&self) -> &'static str {
        "broken"
    }
}

/// The PostgreSQL backend with both lockers wrapped in [`SkipsTheLock`].
struct Broken(Postgres);

#[async_trait]
impl Backend for Broken {
    fn lockers(&self) -> (Arc<dyn Locker>, Arc<dyn Locker>) {
        let (a, b) = self.0.lockers();
        let wrap = |real| -> Arc<dyn Locker> {
            Arc::new(SkipsTheLock {
                real,
                calls: AtomicUsize::new(0),
            })
        };
        (wrap(a), wrap(b))
    }
    async fn break_lease(&self, key: &LockKey) {
        self.0.break_lease(key).await;
    }
    fn tokens(&self) -> bool {
        true
    }
}

#[sqlx::test(migrations = false)]
async fn a_locker_that_skips_the_lock_fails_the_suite(pool: PgPool) {
    let backend = Arc::new(Broken(Postgres::new(pool, 0).await));
    for (name, case) in [
        ("exclusive", 0),
        ("contending_tasks_never_overlap", 1),
        ("tokens_increase", 2),
    ] {
        let backend = Arc::clone(&backend);
        let run = tokio::spawn(async move {
            match case {
                0 => cases::exclusive(backend.as_ref()).await,
                1 => cases::contending_tasks_never_overlap(backend.as_ref()).await,
                _ => cases::tokens_increase(backend.as_ref()).await,
            }
        });
        let outcome = run.await;
        assert!(
            outcome.is_err_and(|e| e.is_panic()),
            "{name} passed on a locker that skips the lock"
        );
    }
}
