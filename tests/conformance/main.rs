//! One contract, every backend, every kind: the conformance matrix.
//!
//! Each kind's behaviour is written once as test cases, in a file of its
//! own, and run against every backend that offers the kind by one line each
//! at the bottom of this file (`backend!`):
//!
//! | kind | file | backends |
//! |---|---|---|
//! | exclusive leases ([`Locker`]) | `exclusive.rs` | all |
//! | shared leases ([`distlock::SharedLocker`]) | `shared.rs` | PostgreSQL (default, fenced, multiplexed) |
//! | multi-key locks ([`distlock::MultiKeyLocker`]) | `multi.rs` | PostgreSQL (default, fenced, multiplexed) |
//! | transaction-scoped locks ([`distlock::XactLocker`]) | `xact.rs` | PostgreSQL (default, fenced, multiplexed, `try_with_begin`) |
//! | upgradeable read leases ([`distlock::UpgradeableLocker`]) | `upgradeable.rs` | PostgreSQL (default, fenced, multiplexed) |
//! | [`distlock::Semaphore`] | `semaphore.rs` | all |
//! | [`distlock::LeaderElection`] (terms, `leader()` and `observe()` where the backend records leaders: [`distlock::ElectionLocker`]) | `leader.rs` | all |
//! | leases with a time to live: lost by the clock past their deadline, even with their keeper starved, with the reason its failing renewals gave | `ttl.rs` | lease table, Redis, Redlock |
//!
//! Besides its behaviour, each kind has its fault cases: dropped at every
//! `.await` (`common::drop_after`; in the default run each of the first
//! eight, then a sample, see `budgets`), a lease broken from outside (on
//! PostgreSQL `pg_terminate_backend`), a bad key, and, on the PostgreSQL
//! backends, a transaction pooler in front (`common::txpool`): refused,
//! busy, or told through `lost()`, never two silent holders.
//!
//! A backend lacks a kind by not implementing its trait (here: the backend
//! traits below), so a kind listed for a backend that lacks it does not
//! compile. `broken.rs` wraps PostgreSQL in a locker that skips the lock
//! every other call and shows that each kind's cases catch it.
//!
//! Run one backend: `cargo test --all-features --test conformance redis_single::`;
//! one kind: `... --test conformance semaphore::`. `DISTLOCK_TORTURE=full`
//! runs the long variants (more rounds of contention).

#[path = "../common/mod.rs"]
mod common;

mod broken;
mod exclusive;
mod leader;
mod multi;
mod semaphore;
mod shared;
mod ttl;
mod upgradeable;
mod xact;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use common::txpool::TxPool;
use distlock::{Error, Lease, LockKey, Locker, LossReason, MultiKeyLocker, PgLocker, SharedLocker};
use distlock::{MultiLock, UpgradeableLock, UpgradeableLocker, XactLocker};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

/// What a backend gives the cases of every kind.
#[async_trait]
trait Backend: Send + Sync {
    /// Two lockers that behave as two processes (separate connections).
    fn lockers(&self) -> (Arc<dyn Locker>, Arc<dyn Locker>);
    /// Makes whoever holds `key` lose it, from outside the process.
    async fn break_lease(&self, key: &LockKey);
    /// Whether every exclusive lease carries a fencing token.
    fn tokens(&self) -> bool;
    /// Two semaphores of `permits` permits named `name`, one per locker:
    /// by default [`Semaphore::new`](distlock::Semaphore::new) over
    /// [`lockers`](Self::lockers); PostgreSQL's backends give
    /// `PgLocker::semaphore`'s (see [`Postgres::semaphores`]).
    fn semaphores(&self, name: &str, permits: u32) -> (distlock::Semaphore, distlock::Semaphore) {
        let (a, b) = self.lockers();
        (
            distlock::Semaphore::new(a, name, permits).expect("a valid semaphore"),
            distlock::Semaphore::new(b, name, permits).expect("a valid semaphore"),
        )
    }
}

/// A backend whose leases have a time to live.
trait TtlBackend: Backend {
    /// The lockers' TTL: a lease is lost, by the clock, at the latest this
    /// long after its last renewal.
    fn ttl(&self) -> Duration;

    /// From now on every renewal of the first locker's leases fails at once
    /// (its server gone, its pool closed), as opposed to getting no answer.
    async fn refuse_renewals(&self);

    /// Whether `reason` is what this backend's keeper gives for renewals
    /// refused by [`refuse_renewals`](Self::refuse_renewals), as opposed to
    /// the reason its clock gives on its own.
    fn is_refused_renewal(&self, reason: &LossReason) -> bool;

    /// From now on every renewal of the first locker's leases gets no
    /// answer (its server stopped, its row locked), until
    /// [`answer_renewals`](Self::answer_renewals).
    async fn stall_renewals(&self);

    /// Ends [`stall_renewals`](Self::stall_renewals).
    async fn answer_renewals(&self);
}

/// A backend with shared leases.
trait SharedBackend: Backend {
    fn shared(&self) -> (Arc<dyn SharedLocker>, Arc<dyn SharedLocker>);
}

/// A backend with multi-key locks; the guard is read through [`MultiGuard`].
trait MultiBackend: Backend {
    type Multi: MultiKeyLocker<Guard: MultiGuard>;
    fn multi(&self) -> (&Self::Multi, &Self::Multi);
}

/// A backend with upgradeable read leases; the guard is read through
/// [`UpgradeGuard`]. Shared (`Arc`) so that contending tasks can own them.
trait UpgradeableBackend: SharedBackend {
    type Upgradeable: UpgradeableLocker<Guard: UpgradeGuard> + 'static;
    fn upgradeable(&self) -> (Arc<Self::Upgradeable>, Arc<Self::Upgradeable>);
}

/// What the cases do with an upgradeable guard beyond [`Lease`] (the
/// guards of [`UpgradeableLocker`] do not share a trait for it).
#[async_trait]
trait UpgradeGuard: Lease + Sized + 'static {
    fn is_upgraded(&self) -> bool;
    async fn try_upgrade(&mut self) -> Result<bool, Error>;
    async fn upgrade(&mut self, timeout: Duration) -> Result<(), Error>;
    async fn downgrade(&mut self) -> Result<(), Error>;
    async fn release(self) -> Result<(), Error> {
        Lease::release(Box::new(self)).await
    }
}

#[async_trait]
impl UpgradeGuard for UpgradeableLock {
    fn is_upgraded(&self) -> bool {
        UpgradeableLock::is_upgraded(self)
    }
    async fn try_upgrade(&mut self) -> Result<bool, Error> {
        UpgradeableLock::try_upgrade(self).await
    }
    async fn upgrade(&mut self, timeout: Duration) -> Result<(), Error> {
        UpgradeableLock::upgrade(self, timeout).await
    }
    async fn downgrade(&mut self) -> Result<(), Error> {
        UpgradeableLock::downgrade(self).await
    }
}

/// A backend with transaction-scoped locks.
trait XactBackend: Backend {
    type Xact: XactLocker;
    fn xact(&self) -> (&Self::Xact, &Self::Xact);
}

/// A backend that can be put behind a transaction pooler: the same backend
/// built over two client pools that reach the database through one.
#[async_trait]
trait PooledBackend: Backend + Sized {
    async fn behind_a_pooler(&self) -> (TxPool, Self);
}

/// What the cases read of a multi-key guard (the guards of
/// [`MultiKeyLocker`] do not share a trait yet).
#[async_trait]
trait MultiGuard: Send + Sync {
    fn keys(&self) -> &[LockKey];
    fn is_lost(&self) -> bool;
    async fn lost(&self) -> LossReason;
    async fn release(self) -> Result<(), Error>;
}

#[async_trait]
impl MultiGuard for MultiLock {
    fn keys(&self) -> &[LockKey] {
        MultiLock::keys(self)
    }
    fn is_lost(&self) -> bool {
        MultiLock::is_lost(self)
    }
    async fn lost(&self) -> LossReason {
        MultiLock::lost(self).await
    }
    async fn release(self) -> Result<(), Error> {
        MultiLock::release(self).await
    }
}

/// How long a loss may take to be noticed by the backends as configured
/// here (heartbeats of 200 ms with deadlines of 1 s, TTLs of 1 s).
const LOSS_NOTICED_WITHIN: Duration = Duration::from_secs(5);
/// How long a dropped lease may take to be freed in the background.
const DROP_FREED_WITHIN: Duration = Duration::from_secs(5);
/// How many `Pending`s a cancellation case lets an acquisition return
/// before it stops dropping it: past every `.await` of one attempt.
const MAX_AWAITS: usize = 400;

/// The numbers of `Pending`s after which the cancellation cases drop an
/// acquisition: each one up to 8, then a third more at each step, and the
/// last, `MAX_AWAITS - 1`; under `DISTLOCK_TORTURE=full`, every one. (A case
/// stops at the first budget its acquisition completes within.)
fn budgets() -> impl Iterator<Item = usize> {
    let mut budgets = Vec::new();
    let mut next = 0;
    while next < MAX_AWAITS {
        budgets.push(next);
        next = if full() || next < 8 {
            next + 1
        } else {
            next + next / 3
        };
    }
    if budgets.last() != Some(&(MAX_AWAITS - 1)) {
        budgets.push(MAX_AWAITS - 1);
    }
    budgets.into_iter()
}

/// Whether the long variants run (`DISTLOCK_TORTURE=full`).
fn full() -> bool {
    std::env::var("DISTLOCK_TORTURE").is_ok_and(|v| v == "full")
}

/// A key of the conformance cases.
fn key(name: &str) -> LockKey {
    LockKey::from(format!("conformance:{name}"))
}

/// Waits until `locker` can take `key` (and lets it go), or panics with
/// `what` after `within`.
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

/// Behind a pooler, a second holder must be refused, find the key busy, or
/// be told through `lost()` (one of the two holders' `lost()` fires): never
/// two holders that both believe they hold the key.
async fn refused_or_told<T>(
    what: &str,
    second: Result<Option<T>, Error>,
    lost: impl AsyncFnOnce(T),
) {
    match second {
        Ok(None) | Err(Error::PoolerDetected { .. } | Error::Timeout { .. }) => {}
        Ok(Some(second)) => {
            common::bounded(
                &format!("{what}: a second holder behind the pooler is told through lost()"),
                LOSS_NOTICED_WITHIN,
                lost(second),
            )
            .await
        }
        Err(other) => panic!("{what}: expected busy or PoolerDetected, got {other:?}"),
    }
}

/// Generates, for a backend, one test per case of each kind listed: a
/// module named `$module` with a module per kind, each test with attribute
/// `$attr`, arguments `$args`, and `$make` building the backend from them.
macro_rules! backend {
    ($module:ident, #[$attr:meta] $args:tt => $make:expr; $($kind:ident),* $(,)?) => {
        mod $module {
            use super::*;
            $( kind!($kind, [$attr] $args $make); )*
        }
    };
}

/// The cases of one kind (and its pooler cases, listed as `*_pooled`).
macro_rules! kind {
    (exclusive, $($rest:tt)*) => { cases!(exclusive, exclusive, $($rest)*;
        exclusive, lock_waits_and_is_handed_the_lock, lock_times_out, release_frees,
        drop_frees, lost_on_loss, tokens_increase,
        cancelled_acquisitions_leave_nothing_held, dropped_at_every_await,
        bad_keys_are_refused, contending_tasks_never_overlap); };
    (exclusive_pooled, $($rest:tt)*) => { cases!(exclusive_pooled, exclusive, $($rest)*;
        behind_a_pooler); };
    (shared, $($rest:tt)*) => { cases!(shared, shared, $($rest)*;
        readers_share_writers_exclude, lock_shared_waits_for_the_writer, release_and_drop_free,
        lost_on_loss, dropped_at_every_await, bad_keys_are_refused); };
    (shared_pooled, $($rest:tt)*) => { cases!(shared_pooled, shared, $($rest)*;
        behind_a_pooler); };
    (multi, $($rest:tt)*) => { cases!(multi, multi, $($rest)*;
        all_or_nothing, lock_all_waits_and_times_out, overlapping_sets_never_deadlock,
        lost_on_loss, dropped_at_every_await, bad_key_sets_are_refused); };
    (multi_pooled, $($rest:tt)*) => { cases!(multi_pooled, multi, $($rest)*;
        behind_a_pooler); };
    (xact, $($rest:tt)*) => { cases!(xact, xact, $($rest)*;
        held_for_the_transaction, waits_and_times_out, rollback_frees,
        terminated_backend_fails_and_frees, dropped_at_every_await, bad_keys_are_refused); };
    (xact_pooled, $($rest:tt)*) => { cases!(xact_pooled, xact, $($rest)*;
        behind_a_pooler); };
    (upgradeable, $($rest:tt)*) => { cases!(upgradeable, upgradeable, $($rest)*;
        readers_beside_one_upgrader, upgrade_waits_for_readers_and_downgrade_lets_them_in,
        upgraders_never_deadlock, upgrades_draw_fresh_tokens, lost_on_loss,
        dropped_at_every_await, bad_keys_are_refused); };
    (upgradeable_pooled, $($rest:tt)*) => { cases!(upgradeable_pooled, upgradeable, $($rest)*;
        behind_a_pooler); };
    (semaphore, $($rest:tt)*) => { cases!(semaphore, semaphore, $($rest)*;
        bounded_by_permits, acquire_waits_and_times_out, contending_tasks_stay_within_permits,
        lost_permit_is_freed, dropped_at_every_await, bad_names_and_permit_counts_are_refused); };
    (semaphore_pooled, $($rest:tt)*) => { cases!(semaphore_pooled, semaphore, $($rest)*;
        behind_a_pooler); };
    (leader, $($rest:tt)*) => { cases!(leader, leader, $($rest)*;
        one_leader_and_takeover, leadership_lost_and_regained, dropped_campaigns_free_the_key,
        bad_key_ends_the_campaign, a_lost_lease_ends_the_term, leader_is_named_or_unsupported,
        observers_follow_the_leader, the_record_refuses_what_it_cannot_keep,
        a_successor_stopped_in_its_grace_leaves_the_grace_to_the_next); };
    (leader_pooled, $($rest:tt)*) => { cases!(leader_pooled, leader, $($rest)*;
        behind_a_pooler); };
    (ttl, $($rest:tt)*) => { cases!(ttl, ttl, $($rest)*;
        starved_past_its_deadline_is_lost_at_first_look, permits_tell_their_validity,
        a_failing_keepers_reason_outlives_its_deadline,
        an_unanswered_renewal_is_the_reason_whoever_looks_first); };
}

macro_rules! cases {
    ($module:ident, $file:ident, [$attr:meta] $args:tt $make:expr; $($case:ident),*) => {
        mod $module {
            use super::*;
            $(
                #[$attr]
                async fn $case $args {
                    common::init_tracing();
                    let started = Instant::now();
                    let backend = $make;
                    crate::$file::$case(&backend).await;
                    // With --nocapture: which cases the runtime goes to.
                    println!("case took {:?}: {}::{}", started.elapsed(), module_path!(), stringify!($case));
                }
            )*
        }
    };
}

// ---- PostgreSQL ---------------------------------------------------------

/// `PgLocker` over two pools of the test's own database, with a fast
/// heartbeat; `connections > 0` is the multiplexed mode.
struct Postgres {
    a: Arc<PgLocker>,
    b: Arc<PgLocker>,
    pool: PgPool,
    fencing: bool,
    connections: usize,
    /// `with_advisory_lock`'s try goes with its `BEGIN`.
    try_with_begin: bool,
}

impl Postgres {
    async fn new(pool: PgPool, fencing: bool, connections: usize) -> Self {
        Self::with(pool, fencing, connections, false).await
    }

    /// The default settings but `try_with_begin`.
    async fn trying_with_begin(pool: PgPool) -> Self {
        Self::with(pool, false, 0, true).await
    }

    async fn with(pool: PgPool, fencing: bool, connections: usize, try_with_begin: bool) -> Self {
        distlock::migrate(&pool).await.expect("migrate");
        let second = PgPoolOptions::new()
            .connect_with(pool.connect_options().as_ref().clone())
            .await
            .expect("second pool");
        let settings = (fencing, connections, try_with_begin);
        Self::over(pool.clone(), second, pool, settings)
    }

    /// Lockers over `a` and `b` with `(fencing, connections,
    /// try_with_begin)`.
    fn over(a: PgPool, b: PgPool, pool: PgPool, settings: (bool, usize, bool)) -> Self {
        let (fencing, connections, try_with_begin) = settings;
        Self {
            a: Self::locker(a, fencing, connections, try_with_begin),
            b: Self::locker(b, fencing, connections, try_with_begin),
            pool,
            fencing,
            connections,
            try_with_begin,
        }
    }

    fn locker(
        pool: PgPool,
        fencing: bool,
        connections: usize,
        try_with_begin: bool,
    ) -> Arc<PgLocker> {
        Arc::new(
            PgLocker::builder(pool)
                .fencing(fencing)
                .heartbeat(Duration::from_millis(200))
                // A command's deadline (the heartbeat's by default) of 1 s:
                // the first try of a multiplexed locker opens its shared
                // connection, which took more than 200 ms in a CI run with
                // the suite's tests in parallel on 2 cores
                // (`CommandTimedOut { after: 200ms }`).
                .heartbeat_timeout(Duration::from_secs(1))
                .multiplex(connections)
                .try_with_begin(try_with_begin)
                .build()
                .expect("valid settings"),
        )
    }
}

#[async_trait]
impl Backend for Postgres {
    fn lockers(&self) -> (Arc<dyn Locker>, Arc<dyn Locker>) {
        (self.a.clone(), self.b.clone())
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
        self.fencing
    }

    /// `PgLocker::semaphore`, the path PostgreSQL users take; `pg_fenced`
    /// (fencing, not multiplexed) keeps the generic `Semaphore::new` over a
    /// `PgLocker` in the matrix.
    fn semaphores(&self, name: &str, permits: u32) -> (distlock::Semaphore, distlock::Semaphore) {
        let generic = self.fencing && self.connections == 0;
        if generic {
            let (a, b) = self.lockers();
            return (
                distlock::Semaphore::new(a, name, permits).expect("a valid semaphore"),
                distlock::Semaphore::new(b, name, permits).expect("a valid semaphore"),
            );
        }
        (
            self.a.semaphore(name, permits).expect("a valid semaphore"),
            self.b.semaphore(name, permits).expect("a valid semaphore"),
        )
    }
}

impl SharedBackend for Postgres {
    fn shared(&self) -> (Arc<dyn SharedLocker>, Arc<dyn SharedLocker>) {
        (self.a.clone(), self.b.clone())
    }
}

impl MultiBackend for Postgres {
    type Multi = PgLocker;
    fn multi(&self) -> (&PgLocker, &PgLocker) {
        (&self.a, &self.b)
    }
}

impl UpgradeableBackend for Postgres {
    type Upgradeable = PgLocker;
    fn upgradeable(&self) -> (Arc<PgLocker>, Arc<PgLocker>) {
        (Arc::clone(&self.a), Arc::clone(&self.b))
    }
}

impl XactBackend for Postgres {
    type Xact = PgLocker;
    fn xact(&self) -> (&PgLocker, &PgLocker) {
        (&self.a, &self.b)
    }
}

/// A transaction pooler in front of the database `pool` points at, and two
/// client pools through it.
async fn pooler(pool: &PgPool) -> (TxPool, PgPool, PgPool) {
    let opts = pool.connect_options();
    let proxy = TxPool::start(
        opts.get_host(),
        opts.get_port(),
        opts.get_username(),
        opts.get_database().expect("the test database's name"),
    )
    .await
    .expect("transaction pooler");
    let mut clients = Vec::new();
    for app in ["client-a", "client-b"] {
        let opts = (*pool.connect_options())
            .clone()
            .host("127.0.0.1")
            .port(proxy.port())
            .application_name(app);
        let client = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(opts)
            .await
            .expect("pool through the transaction pooler");
        clients.push(client);
    }
    let b = clients.pop().expect("two clients");
    let a = clients.pop().expect("two clients");
    (proxy, a, b)
}

#[async_trait]
impl PooledBackend for Postgres {
    async fn behind_a_pooler(&self) -> (TxPool, Self) {
        let (proxy, a, b) = pooler(&self.pool).await;
        let settings = (self.fencing, self.connections, self.try_with_begin);
        let pooled = Self::over(a, b, self.pool.clone(), settings);
        (proxy, pooled)
    }
}

backend!(pg_default, #[sqlx::test(migrations = false)] (pool: PgPool) => Postgres::new(pool, false, 0).await;
    exclusive, exclusive_pooled, shared, shared_pooled, multi, multi_pooled, xact, xact_pooled,
    upgradeable, upgradeable_pooled, semaphore, semaphore_pooled, leader, leader_pooled);
backend!(pg_try_with_begin, #[sqlx::test(migrations = false)] (pool: PgPool) => Postgres::trying_with_begin(pool).await;
    xact, xact_pooled);
backend!(pg_fenced, #[sqlx::test(migrations = false)] (pool: PgPool) => Postgres::new(pool, true, 0).await;
    exclusive, exclusive_pooled, shared, multi, xact, upgradeable, semaphore);
backend!(pg_multiplexed, #[sqlx::test(migrations = false)] (pool: PgPool) => Postgres::new(pool, true, 2).await;
    exclusive, exclusive_pooled, shared, shared_pooled, multi, xact, upgradeable, upgradeable_pooled,
    semaphore, semaphore_pooled, leader, leader_pooled);

// ---- PostgreSQL lease table ----------------------------------------------

/// `TableLocker` over two pools of the test's own database, with a TTL of
/// one second (renewed every 333 ms).
struct Table {
    a: Arc<dyn Locker>,
    b: Arc<dyn Locker>,
    pool: PgPool,
    /// While renewals are stalled: the transaction that holds the leases'
    /// rows.
    stall: tokio::sync::Mutex<Option<sqlx::Transaction<'static, sqlx::Postgres>>>,
}

impl Table {
    const TTL: Duration = Duration::from_secs(1);

    async fn new(pool: PgPool) -> Self {
        distlock::migrate(&pool).await.expect("migrate");
        let second = PgPoolOptions::new()
            .connect_with(pool.connect_options().as_ref().clone())
            .await
            .expect("second pool");
        Self::over(pool.clone(), second, pool, true)
    }

    fn over(a: PgPool, b: PgPool, pool: PgPool, listen: bool) -> Self {
        let make = |pool: PgPool| -> Arc<dyn Locker> {
            Arc::new(
                distlock::postgres::TableLocker::builder(pool)
                    .ttl(Self::TTL)
                    .listen(listen)
                    .build()
                    .expect("valid settings"),
            )
        };
        Self {
            a: make(a),
            b: make(b),
            pool,
            stall: tokio::sync::Mutex::new(None),
        }
    }
}

#[async_trait]
impl Backend for Table {
    fn lockers(&self) -> (Arc<dyn Locker>, Arc<dyn Locker>) {
        (Arc::clone(&self.a), Arc::clone(&self.b))
    }

    async fn break_lease(&self, key: &LockKey) {
        // The rows go: the holder's next renewal finds nothing of its own.
        // Every row, as the cases break one holder at a time in a database
        // of their own (a semaphore slot's key text is not the name).
        let gone = sqlx::query("DELETE FROM distlock.leases")
            .execute(&self.pool)
            .await
            .expect("delete the holder's row");
        assert!(gone.rows_affected() >= 1, "someone held {key}");
    }

    fn tokens(&self) -> bool {
        true
    }
}

impl TtlBackend for Table {
    fn ttl(&self) -> Duration {
        Self::TTL
    }

    async fn refuse_renewals(&self) {
        // The first locker's pool (in `Table::new`; the pooled variant's
        // lockers have pools of their own and do not run the `ttl` kind):
        // closed at once, what `close()` waits for afterwards is its
        // connections coming back.
        let closing = self.pool.close();
        drop(closing);
    }

    fn is_refused_renewal(&self, reason: &LossReason) -> bool {
        // The clock's own reason is `HeartbeatTimedOut`.
        matches!(reason, LossReason::ConnectionFailed(_))
    }

    async fn stall_renewals(&self) {
        // A renewal's `UPDATE` waits for the rows this transaction locks.
        let mut tx = self.pool.begin().await.expect("begin");
        sqlx::query("SELECT 1 FROM distlock.leases FOR UPDATE")
            .execute(&mut *tx)
            .await
            .expect("lock the leases' rows");
        *self.stall.lock().await = Some(tx);
    }

    async fn answer_renewals(&self) {
        if let Some(tx) = self.stall.lock().await.take() {
            tx.rollback().await.expect("rollback");
        }
    }
}

#[async_trait]
impl PooledBackend for Table {
    async fn behind_a_pooler(&self) -> (TxPool, Self) {
        let (proxy, a, b) = pooler(&self.pool).await;
        // LISTEN is session state, which a transaction pooler does not
        // keep: the pooled lockers poll.
        (proxy, Self::over(a, b, self.pool.clone(), false))
    }
}

backend!(table, #[sqlx::test(migrations = false)] (pool: PgPool) => Table::new(pool).await;
    exclusive, exclusive_pooled, semaphore, semaphore_pooled, leader, leader_pooled, ttl);

// ---- Redis --------------------------------------------------------------

#[cfg(feature = "redis")]
mod redis_backends {
    use super::*;
    use common::redis::{RedisServer, servers, urls};
    use distlock::redis::{RedisLocker, Redlock};

    const TTL: Duration = Duration::from_secs(1);

    /// The Redis key of `key`: a semaphore slot lives under the reserved
    /// prefix, every other key under its name.
    fn redis_key(key: &LockKey) -> String {
        match key.name() {
            Some(name)
                if *key == LockKey::namespaced(distlock::Semaphore::SLOT_NAMESPACE, name) =>
            {
                format!("distlock:semaphore\0{name}")
            }
            _ => key.to_string(),
        }
    }

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
                let locker = RedisLocker::builder(server.url())
                    .ttl(TTL)
                    .build()
                    .await
                    .expect("connect");
                let locker: Arc<dyn Locker> = Arc::new(locker);
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
            let _: i64 = self.server.run(&["DEL", &redis_key(key)]).await;
        }

        fn tokens(&self) -> bool {
            true
        }
    }

    impl TtlBackend for Single {
        fn ttl(&self) -> Duration {
            TTL
        }

        async fn refuse_renewals(&self) {
            self.server.crash();
        }

        async fn stall_renewals(&self) {
            self.server.pause();
        }

        async fn answer_renewals(&self) {
            self.server.resume();
        }

        fn is_refused_renewal(&self, reason: &LossReason) -> bool {
            // The clock's own reason is `Expired`; a reconnect that hangs
            // past the node's deadline is `HeartbeatTimedOut`.
            matches!(
                reason,
                LossReason::ConnectionFailed(_) | LossReason::HeartbeatTimedOut(_)
            )
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
            let make = async || -> Arc<dyn Locker> {
                let locker = Redlock::builder(urls.clone())
                    .ttl(TTL)
                    .build()
                    .await
                    .expect("connect");
                let locker: Arc<dyn Locker> = Arc::new(locker);
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
                let _: i64 = server.run(&["DEL", &redis_key(key)]).await;
            }
        }

        fn tokens(&self) -> bool {
            false
        }
    }

    impl TtlBackend for Quorum {
        fn ttl(&self) -> Duration {
            TTL
        }

        async fn refuse_renewals(&self) {
            // Two of three: no quorum, and the failing nodes might come
            // back, so the watchdog retries while the validity lasts.
            for server in &self.servers[..2] {
                server.crash();
            }
        }

        async fn stall_renewals(&self) {
            // Two of three: no quorum answers.
            for server in &self.servers[..2] {
                server.pause();
            }
        }

        async fn answer_renewals(&self) {
            for server in &self.servers[..2] {
                server.resume();
            }
        }

        fn is_refused_renewal(&self, reason: &LossReason) -> bool {
            matches!(
                reason,
                LossReason::ConnectionFailed(_) | LossReason::HeartbeatTimedOut(_)
            )
        }
    }
}

#[cfg(feature = "redis")]
backend!(redis_single, #[tokio::test(flavor = "multi_thread", worker_threads = 2)] () => redis_backends::Single::start().await;
    exclusive, semaphore, leader, ttl);
#[cfg(feature = "redis")]
backend!(redlock, #[tokio::test(flavor = "multi_thread", worker_threads = 2)] () => redis_backends::Quorum::start().await;
    exclusive, semaphore, leader, ttl);

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

backend!(memory, #[tokio::test(flavor = "multi_thread", worker_threads = 2)] () => Memory(distlock::memory::MemoryLocker::new());
    exclusive, semaphore, leader);
