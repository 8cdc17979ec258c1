//! The matrix can fail: a locker that takes the lock only every other time
//! (and otherwise hands out a guard for nothing), in every kind it offers,
//! fails a case of each kind.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;
use sqlx::PgConnection;

/// PostgreSQL's `PgLocker`, skipping the lock on every other call of any
/// of its methods.
#[derive(Debug)]
struct SkipsTheLock {
    real: Arc<PgLocker>,
    calls: AtomicUsize,
}

impl SkipsTheLock {
    /// Whether this call skips the lock; a bad key is still refused.
    fn skips(&self, key: &LockKey) -> Result<bool, Error> {
        key.validate()?;
        Ok(self.calls.fetch_add(1, Ordering::SeqCst) % 2 == 1)
    }
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
    async fn lost(&self) -> LossReason {
        std::future::pending().await
    }
    fn is_lost(&self) -> bool {
        false
    }
    fn loss(&self) -> Option<LossReason> {
        None
    }
    fn held_for(&self) -> Duration {
        Duration::ZERO
    }
    async fn release(self: Box<Self>) -> Result<(), Error> {
        Ok(())
    }
}

#[async_trait]
impl Locker for SkipsTheLock {
    async fn try_lock(&self, key: LockKey) -> Result<Option<Box<dyn Lease>>, Error> {
        if self.skips(&key)? {
            return Ok(Some(Box::new(Phantom(key))));
        }
        Locker::try_lock(self.real.as_ref(), key).await
    }

    async fn lock(&self, key: LockKey, timeout: Duration) -> Result<Box<dyn Lease>, Error> {
        if self.skips(&key)? {
            return Ok(Box::new(Phantom(key)));
        }
        Locker::lock(self.real.as_ref(), key, timeout).await
    }

    fn backend(&self) -> &'static str {
        "broken"
    }
}

#[async_trait]
impl SharedLocker for SkipsTheLock {
    async fn try_lock_shared(&self, key: LockKey) -> Result<Option<Box<dyn Lease>>, Error> {
        if self.skips(&key)? {
            return Ok(Some(Box::new(Phantom(key))));
        }
        SharedLocker::try_lock_shared(self.real.as_ref(), key).await
    }

    async fn lock_shared(&self, key: LockKey, timeout: Duration) -> Result<Box<dyn Lease>, Error> {
        if self.skips(&key)? {
            return Ok(Box::new(Phantom(key)));
        }
        SharedLocker::lock_shared(self.real.as_ref(), key, timeout).await
    }
}

/// The real guard, or one for nothing.
enum BrokenMulti {
    Real(MultiLock),
    Phantom(Vec<LockKey>),
}

#[async_trait]
impl MultiGuard for BrokenMulti {
    fn keys(&self) -> &[LockKey] {
        match self {
            Self::Real(held) => held.keys(),
            Self::Phantom(keys) => keys,
        }
    }
    fn is_lost(&self) -> bool {
        matches!(self, Self::Real(held) if held.is_lost())
    }
    async fn lost(&self) -> LossReason {
        match self {
            Self::Real(held) => held.lost().await,
            Self::Phantom(_) => std::future::pending().await,
        }
    }
    async fn release(self) -> Result<(), Error> {
        match self {
            Self::Real(held) => held.release().await,
            Self::Phantom(_) => Ok(()),
        }
    }
}

#[async_trait]
impl MultiKeyLocker for SkipsTheLock {
    type Guard = BrokenMulti;

    async fn try_lock_all(&self, keys: Vec<LockKey>) -> Result<Option<BrokenMulti>, Error> {
        if keys.len() > 1 && self.skips(&keys[0])? {
            return Ok(Some(BrokenMulti::Phantom(keys)));
        }
        let held = MultiKeyLocker::try_lock_all(self.real.as_ref(), keys).await?;
        Ok(held.map(BrokenMulti::Real))
    }

    async fn lock_all(&self, keys: Vec<LockKey>, timeout: Duration) -> Result<BrokenMulti, Error> {
        if keys.len() > 1 && self.skips(&keys[0])? {
            return Ok(BrokenMulti::Phantom(keys));
        }
        let held = MultiKeyLocker::lock_all(self.real.as_ref(), keys, timeout).await?;
        Ok(BrokenMulti::Real(held))
    }
}

/// The real upgradeable guard, or one for nothing (whose upgrades and
/// downgrades always succeed).
#[derive(Debug)]
enum BrokenUpgradeable {
    Real(UpgradeableLock),
    Phantom(Phantom, bool),
}

#[async_trait]
impl Lease for BrokenUpgradeable {
    fn key(&self) -> &LockKey {
        match self {
            Self::Real(held) => held.key(),
            Self::Phantom(phantom, _) => phantom.key(),
        }
    }
    fn fencing_token(&self) -> Option<distlock::FencingToken> {
        match self {
            Self::Real(held) => held.fencing_token(),
            Self::Phantom(..) => None,
        }
    }
    async fn lost(&self) -> LossReason {
        match self {
            Self::Real(held) => held.lost().await,
            Self::Phantom(phantom, _) => phantom.lost().await,
        }
    }
    fn is_lost(&self) -> bool {
        matches!(self, Self::Real(held) if held.is_lost())
    }
    fn loss(&self) -> Option<LossReason> {
        match self {
            Self::Real(held) => held.loss(),
            Self::Phantom(..) => None,
        }
    }
    fn held_for(&self) -> Duration {
        match self {
            Self::Real(held) => held.held_for(),
            Self::Phantom(..) => Duration::ZERO,
        }
    }
    async fn release(self: Box<Self>) -> Result<(), Error> {
        match *self {
            Self::Real(held) => held.release().await,
            Self::Phantom(..) => Ok(()),
        }
    }
}

#[async_trait]
impl UpgradeGuard for BrokenUpgradeable {
    fn is_upgraded(&self) -> bool {
        match self {
            Self::Real(held) => held.is_upgraded(),
            Self::Phantom(_, upgraded) => *upgraded,
        }
    }
    async fn try_upgrade(&mut self) -> Result<bool, Error> {
        match self {
            Self::Real(held) => held.try_upgrade().await,
            Self::Phantom(_, upgraded) => {
                *upgraded = true;
                Ok(true)
            }
        }
    }
    async fn upgrade(&mut self, timeout: Duration) -> Result<(), Error> {
        match self {
            Self::Real(held) => held.upgrade(timeout).await,
            Self::Phantom(_, upgraded) => {
                *upgraded = true;
                Ok(())
            }
        }
    }
    async fn downgrade(&mut self) -> Result<(), Error> {
        match self {
            Self::Real(held) => held.downgrade().await,
            Self::Phantom(_, upgraded) => {
                *upgraded = false;
                Ok(())
            }
        }
    }
}

#[async_trait]
impl UpgradeableLocker for SkipsTheLock {
    type Guard = BrokenUpgradeable;

    async fn try_lock_upgradeable(&self, key: LockKey) -> Result<Option<BrokenUpgradeable>, Error> {
        if self.skips(&key)? {
            return Ok(Some(BrokenUpgradeable::Phantom(Phantom(key), false)));
        }
        let held = UpgradeableLocker::try_lock_upgradeable(self.real.as_ref(), key).await?;
        Ok(held.map(BrokenUpgradeable::Real))
    }

    async fn lock_upgradeable(
        &self,
        key: LockKey,
        timeout: Duration,
    ) -> Result<BrokenUpgradeable, Error> {
        if self.skips(&key)? {
            return Ok(BrokenUpgradeable::Phantom(Phantom(key), false));
        }
        let held = UpgradeableLocker::lock_upgradeable(self.real.as_ref(), key, timeout).await?;
        Ok(BrokenUpgradeable::Real(held))
    }
}

impl SkipsTheLock {
    /// Runs `f` in a transaction that holds no lock.
    async fn unlocked<F, T, E>(&self, f: F) -> Result<T, E>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
        E: From<Error>,
    {
        let mut tx = self.real.pool().begin().await.map_err(Error::from)?;
        let value = f(&mut tx).await?;
        tx.commit().await.map_err(Error::from)?;
        Ok(value)
    }
}

impl XactLocker for SkipsTheLock {
    async fn try_with_xact_lock<F, T, E>(&self, key: LockKey, f: F) -> Result<Option<T>, E>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
        E: From<Error>,
    {
        if self.skips(&key)? {
            return self.unlocked(f).await.map(Some);
        }
        self.real.try_with_xact_lock(key, f).await
    }

    async fn with_xact_lock<F, T, E>(&self, key: LockKey, timeout: Duration, f: F) -> Result<T, E>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
        E: From<Error>,
    {
        if self.skips(&key)? {
            return self.unlocked(f).await;
        }
        self.real.with_xact_lock(key, timeout, f).await
    }
}

/// The PostgreSQL backend with both lockers wrapped in [`SkipsTheLock`].
struct Broken {
    real: Arc<Postgres>,
    a: Arc<SkipsTheLock>,
    b: Arc<SkipsTheLock>,
}

impl Broken {
    fn over(real: &Arc<Postgres>) -> Self {
        let wrap = |real: &Arc<PgLocker>| {
            Arc::new(SkipsTheLock {
                real: Arc::clone(real),
                calls: AtomicUsize::new(0),
            })
        };
        Self {
            real: Arc::clone(real),
            a: wrap(&real.a),
            b: wrap(&real.b),
        }
    }
}

#[async_trait]
impl Backend for Broken {
    fn lockers(&self) -> (Arc<dyn Locker>, Arc<dyn Locker>) {
        (self.a.clone(), self.b.clone())
    }
    async fn break_lease(&self, key: &LockKey) {
        self.real.break_lease(key).await;
    }
    fn tokens(&self) -> bool {
        self.real.tokens()
    }
}

impl SharedBackend for Broken {
    fn shared(&self) -> (Arc<dyn SharedLocker>, Arc<dyn SharedLocker>) {
        (self.a.clone(), self.b.clone())
    }
}

impl MultiBackend for Broken {
    type Multi = SkipsTheLock;
    fn multi(&self) -> (&SkipsTheLock, &SkipsTheLock) {
        (&self.a, &self.b)
    }
}

impl UpgradeableBackend for Broken {
    type Upgradeable = SkipsTheLock;
    fn upgradeable(&self) -> (Arc<SkipsTheLock>, Arc<SkipsTheLock>) {
        (Arc::clone(&self.a), Arc::clone(&self.b))
    }
}

impl XactBackend for Broken {
    type Xact = SkipsTheLock;
    fn xact(&self) -> (&SkipsTheLock, &SkipsTheLock) {
        (&self.a, &self.b)
    }
}

/// Runs `case` on a fresh [`Broken`] over `real` and says whether it failed
/// (panicked) within a minute.
async fn fails<F>(real: &Arc<Postgres>, case: impl FnOnce(Arc<Broken>) -> F) -> bool
where
    F: std::future::Future<Output = ()> + 'static,
{
    let broken = Arc::new(Broken::over(real));
    // Some cases' futures are not `Send` (transaction closures): run them
    // on this thread.
    let local = tokio::task::LocalSet::new();
    let run = local.run_until(async move { tokio::task::spawn_local(case(broken)).await });
    match tokio::time::timeout(Duration::from_secs(60), run).await {
        Ok(outcome) => outcome.is_err_and(|e| e.is_panic()),
        Err(_) => false,
    }
}

#[sqlx::test(migrations = false)]
async fn a_locker_that_skips_the_lock_fails_every_kind(pool: PgPool) {
    common::init_tracing();
    let real = Arc::new(Postgres::new(pool, true, 0).await);
    macro_rules! must_fail {
        ($($file:ident :: $case:ident),* $(,)?) => {
            $(
                assert!(
                    fails(&real, async |b: Arc<Broken>| crate::$file::$case(b.as_ref()).await).await,
                    concat!(stringify!($file), "::", stringify!($case), " passed on a locker that skips the lock")
                );
            )*
        };
    }
    must_fail!(
        exclusive::exclusive,
        exclusive::contending_tasks_never_overlap,
        exclusive::tokens_increase,
        shared::readers_share_writers_exclude,
        multi::all_or_nothing,
        multi::overlapping_sets_never_deadlock,
        xact::held_for_the_transaction,
        upgradeable::readers_beside_one_upgrader,
        upgradeable::upgraders_never_deadlock,
        semaphore::bounded_by_permits,
        semaphore::contending_tasks_stay_within_permits,
        leader::one_leader_and_takeover,
    );
}
