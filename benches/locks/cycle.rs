//! Uncontended cycles: one task takes and gives back one free key, again and
//! again, with each alternative.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use distlock::{LockKey, PgLocker};
use sqlx::postgres::{PgAdvisoryLock, PgAdvisoryLockKey, PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, Either, PgPool, Row};

use crate::counting::CountingProxy;
use crate::stats::{median_f64, us};

/// One way of taking and releasing an uncontended lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cycle {
    /// `pool.begin()`, `SELECT pg_try_advisory_xact_lock($1)`, `COMMIT`.
    XactRaw,
    /// `BEGIN; SELECT pg_try_advisory_xact_lock(<literal>)` in one simple
    /// query, then `COMMIT`: the 2-round-trip reference (see BENCHMARKS.md
    /// for why distlock does not do this).
    XactPipelined,
    /// `locker.with_advisory_lock(key, async |_| Ok(()))`.
    XactDistlock,
    /// The same with `.try_with_begin(true)`: the try in the `BEGIN`'s
    /// round trip.
    XactDistlockBegin,
    /// The same with `.keep_warm(0, ..)`: a pooled connection per cycle.
    XactDistlockCold,
    /// `with_advisory_lock` on a key another session holds: `Ok(None)`
    /// (`BEGIN`, the try, `ROLLBACK`).
    XactDistlockBusy,
    /// The same with `.try_with_begin(true)` (`BEGIN` with the try, which
    /// fails, then `ROLLBACK`).
    XactDistlockBeginBusy,
    /// `pool.begin()`, `distlock::try_lock_xact(&mut *tx, key)`, `COMMIT`:
    /// the lock inside the caller's own transaction.
    XactCaller,
    /// `pool.acquire()`, `pg_try_advisory_lock($1)`, `pg_advisory_unlock($1)`.
    SessionRaw,
    /// sqlx's `PgAdvisoryLock::try_acquire(pool.acquire())` + `release_now()`.
    SessionSqlx,
    /// `locker.try_lock(key)` + `release()`, heartbeat on (default 1 s).
    SessionDistlock,
    /// The same with `.keep_warm(0, ..)`: a pooled connection per lock.
    SessionDistlockCold,
    /// The same with `.multiplex(2)`.
    SessionDistlockMux,
    /// `try_lock` + `release()` with `.fencing(true)`: the token is issued
    /// by the lock statement, so it should cost no round trip.
    SessionDistlockFenced,
    /// `try_lock_shared` + `release()`.
    SessionDistlockShared,
    /// `Semaphore::try_acquire` (4 permits, all free) + `release()`.
    Semaphore,
    /// `try_lock_all` over 1, 4 and 16 keys + `release()`.
    Multi1,
    Multi4,
    Multi16,
    /// `TableLocker::try_lock` + `release()`: a lease row (one statement
    /// each, a durable write each).
    TableDistlock,
    /// Hand-written lease row: `INSERT ... ON CONFLICT DO UPDATE ... WHERE
    /// expired`, then `DELETE ... WHERE owner`.
    TableRaw,
}

pub const ALL: [Cycle; 21] = [
    Cycle::XactRaw,
    Cycle::XactPipelined,
    Cycle::XactDistlock,
    Cycle::XactDistlockBegin,
    Cycle::XactDistlockCold,
    Cycle::XactDistlockBusy,
    Cycle::XactDistlockBeginBusy,
    Cycle::XactCaller,
    Cycle::SessionRaw,
    Cycle::SessionSqlx,
    Cycle::SessionDistlock,
    Cycle::SessionDistlockCold,
    Cycle::SessionDistlockMux,
    Cycle::SessionDistlockFenced,
    Cycle::SessionDistlockShared,
    Cycle::Semaphore,
    Cycle::Multi1,
    Cycle::Multi4,
    Cycle::Multi16,
    Cycle::TableDistlock,
    Cycle::TableRaw,
];

impl Cycle {
    pub fn label(self) -> &'static str {
        match self {
            Cycle::XactRaw => "sqlx hand-written BEGIN / try / COMMIT",
            Cycle::XactPipelined => "pipelined `BEGIN; try` + COMMIT (reference)",
            Cycle::XactDistlock => "distlock with_advisory_lock",
            Cycle::XactDistlockBegin => "distlock with_advisory_lock, try_with_begin",
            Cycle::XactDistlockCold => "distlock with_advisory_lock, keep_warm(0)",
            Cycle::XactDistlockBusy => "distlock with_advisory_lock, key busy",
            Cycle::XactDistlockBeginBusy => "distlock with_advisory_lock, key busy, try_with_begin",
            Cycle::XactCaller => "distlock try_lock_xact in the caller's BEGIN / COMMIT",
            Cycle::SessionRaw => "sqlx hand-written try/unlock",
            Cycle::SessionSqlx => "sqlx PgAdvisoryLock",
            Cycle::SessionDistlock => "distlock try_lock+release",
            Cycle::SessionDistlockCold => "distlock try_lock+release, keep_warm(0)",
            Cycle::SessionDistlockMux => "distlock multiplexed try_lock+release",
            Cycle::SessionDistlockFenced => "distlock try_lock+release, fencing on",
            Cycle::SessionDistlockShared => "distlock try_lock_shared+release",
            Cycle::Semaphore => "distlock Semaphore(4) try_acquire+release",
            Cycle::Multi1 => "distlock try_lock_all(1 key)+release",
            Cycle::Multi4 => "distlock try_lock_all(4 keys)+release",
            Cycle::Multi16 => "distlock try_lock_all(16 keys)+release",
            Cycle::TableDistlock => "distlock TableLocker try_lock+release",
            Cycle::TableRaw => "sqlx hand-written INSERT ON CONFLICT lease + DELETE",
        }
    }

    /// Short label for charts.
    pub fn short(self) -> &'static str {
        match self {
            Cycle::XactRaw => "xact: sqlx BEGIN/try/COMMIT",
            Cycle::XactPipelined => "xact: pipelined BEGIN+try (ref)",
            Cycle::XactDistlock => "xact: distlock",
            Cycle::XactDistlockBegin => "xact: distlock, try with BEGIN",
            Cycle::XactDistlockCold => "xact: distlock, no warm conns",
            Cycle::XactDistlockBusy => "xact: distlock, busy",
            Cycle::XactDistlockBeginBusy => "xact: distlock, busy, try with BEGIN",
            Cycle::XactCaller => "xact: distlock in caller's tx",
            Cycle::SessionRaw => "session: sqlx raw",
            Cycle::SessionSqlx => "session: PgAdvisoryLock",
            Cycle::SessionDistlock => "session: distlock",
            Cycle::SessionDistlockCold => "session: distlock, no warm conns",
            Cycle::SessionDistlockMux => "session: distlock mux",
            Cycle::SessionDistlockFenced => "session: distlock fenced",
            Cycle::SessionDistlockShared => "session: distlock shared",
            Cycle::Semaphore => "semaphore: 4 permits",
            Cycle::Multi1 => "multi: 1 key",
            Cycle::Multi4 => "multi: 4 keys",
            Cycle::Multi16 => "multi: 16 keys",
            Cycle::TableDistlock => "table: distlock TableLocker",
            Cycle::TableRaw => "table: sqlx INSERT ON CONFLICT",
        }
    }

    pub fn is_xact(self) -> bool {
        matches!(
            self,
            Cycle::XactRaw
                | Cycle::XactPipelined
                | Cycle::XactDistlock
                | Cycle::XactDistlockBegin
                | Cycle::XactDistlockCold
                | Cycle::XactDistlockBusy
                | Cycle::XactDistlockBeginBusy
                | Cycle::XactCaller
        )
    }

    /// Whether the cycle finds its key held elsewhere (it must not take it).
    fn busy(self) -> bool {
        matches!(self, Cycle::XactDistlockBusy | Cycle::XactDistlockBeginBusy)
    }

    /// What the ratio column compares against.
    pub fn baseline(self) -> Cycle {
        if self.is_xact() {
            Cycle::XactRaw
        } else {
            Cycle::SessionSqlx
        }
    }

    fn key(self) -> i64 {
        if self.busy() {
            return BUSY_KEY;
        }
        7_100 + ALL.iter().position(|c| *c == self).unwrap_or(0) as i64
    }
}

/// The key the busy cycles find held, by a connection of [`Ctx`]'s own.
const BUSY_KEY: i64 = 7_000;

/// Pools and lockers for the cycles, all on one database.
pub struct Ctx {
    pool: PgPool,
    locker: PgLocker,
    /// Without warm connections: every lock borrows from the pool.
    cold: PgLocker,
    /// `with_advisory_lock`'s try in the `BEGIN`'s round trip.
    begin: PgLocker,
    mux: PgLocker,
    fenced: PgLocker,
    semaphore: distlock::Semaphore,
    table: distlock::postgres::TableLocker,
    /// Holds [`BUSY_KEY`], outside the pool.
    holder: sqlx::PgConnection,
}

impl Ctx {
    pub async fn new(opts: &PgConnectOptions) -> anyhow::Result<Self> {
        // Default pool options (as users have them): every acquire of an idle
        // connection pings it first (`test_before_acquire`), 1 round trip.
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect_with(opts.clone())
            .await?;
        distlock::migrate(&pool).await?;
        let semaphore = PgLocker::new(pool.clone()).semaphore("bench-semaphore", 4)?;
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS bench_leases (
                 key bigint PRIMARY KEY, owner uuid NOT NULL, expires_at timestamptz NOT NULL)",
        )
        .execute(&pool)
        .await?;
        let mut holder = sqlx::PgConnection::connect_with(opts).await?;
        sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(BUSY_KEY)
            .execute(&mut holder)
            .await?;
        Ok(Self {
            holder,
            semaphore,
            table: distlock::postgres::TableLocker::builder(pool.clone())
                .listen(false)
                .build()
                .expect("valid settings"),
            locker: PgLocker::new(pool.clone()),
            cold: PgLocker::builder(pool.clone())
                .keep_warm(0, std::time::Duration::ZERO)
                .build()
                .expect("valid settings"),
            begin: PgLocker::builder(pool.clone())
                .try_with_begin(true)
                .build()
                .expect("valid settings"),
            mux: PgLocker::builder(pool.clone())
                .multiplex(2)
                .build()
                .expect("valid settings"),
            fenced: PgLocker::builder(pool.clone())
                .fencing(true)
                .build()
                .expect("valid settings"),
            pool,
        })
    }

    pub async fn close(self) {
        let _ = self.holder.close().await;
        drop((
            self.locker,
            self.cold,
            self.begin,
            self.mux,
            self.fenced,
            self.semaphore,
            self.table,
        ));
        self.pool.close().await;
    }

    /// One cycle; fails if the key was not free (held, for a busy cycle).
    pub async fn once(&self, cycle: Cycle) -> anyhow::Result<()> {
        self.timed(cycle).await.map(|_| ())
    }

    /// One cycle, returning how long taking the lock took (for session
    /// locks; the whole cycle for transaction-scoped ones) and the whole.
    pub async fn timed(&self, cycle: Cycle) -> anyhow::Result<(Duration, Duration)> {
        let key = cycle.key();
        let start = Instant::now();
        let mut taken = None;
        let got = match cycle {
            Cycle::XactRaw => {
                let mut tx = self.pool.begin().await?;
                let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
                    .bind(key)
                    .fetch_one(&mut *tx)
                    .await?;
                tx.commit().await?;
                got
            }
            Cycle::XactPipelined => {
                let mut conn = self.pool.acquire().await?;
                // An i64 formatted as a literal cannot inject anything; a
                // text key would need quoting here, which is the catch.
                let sql = format!("BEGIN; SELECT pg_try_advisory_xact_lock({key})");
                let rows = sqlx::raw_sql(AssertSqlSafe(sql))
                    .fetch_all(&mut *conn)
                    .await?;
                let got: bool = rows.first().context("no row")?.try_get(0)?;
                sqlx::raw_sql("COMMIT").execute(&mut *conn).await?;
                got
            }
            Cycle::XactDistlock
            | Cycle::XactDistlockBegin
            | Cycle::XactDistlockCold
            | Cycle::XactDistlockBusy
            | Cycle::XactDistlockBeginBusy => match cycle {
                Cycle::XactDistlock | Cycle::XactDistlockBusy => &self.locker,
                Cycle::XactDistlockBegin | Cycle::XactDistlockBeginBusy => &self.begin,
                _ => &self.cold,
            }
            .with_advisory_lock(LockKey::id(key), async |_| Ok::<_, distlock::Error>(()))
            .await?
            .is_some(),
            Cycle::XactCaller => {
                let mut tx = self.pool.begin().await?;
                let got = distlock::try_lock_xact(&mut tx, LockKey::id(key)).await?;
                tx.commit().await?;
                got
            }
            Cycle::Semaphore => {
                let attempt = self.semaphore.try_acquire().await?;
                taken = Some(start.elapsed());
                match attempt {
                    Some(permit) => {
                        permit.release().await?;
                        true
                    }
                    None => false,
                }
            }
            Cycle::SessionRaw => {
                let mut conn = self.pool.acquire().await?;
                let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                    .bind(key)
                    .fetch_one(&mut *conn)
                    .await?;
                taken = Some(start.elapsed());
                if got {
                    let _: bool = sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
                        .bind(key)
                        .fetch_one(&mut *conn)
                        .await?;
                }
                got
            }
            Cycle::SessionSqlx => {
                let lock = PgAdvisoryLock::with_key(PgAdvisoryLockKey::BigInt(key));
                let attempt = lock.try_acquire(self.pool.acquire().await?).await?;
                taken = Some(start.elapsed());
                match attempt {
                    Either::Left(guard) => {
                        guard.release_now().await?;
                        true
                    }
                    Either::Right(_) => false,
                }
            }
            Cycle::SessionDistlockShared => {
                let attempt = self.locker.try_lock_shared(LockKey::id(key)).await?;
                taken = Some(start.elapsed());
                match attempt {
                    Some(lock) => {
                        lock.release().await?;
                        true
                    }
                    None => false,
                }
            }
            Cycle::Multi1 | Cycle::Multi4 | Cycle::Multi16 => {
                let n = match cycle {
                    Cycle::Multi1 => 1,
                    Cycle::Multi4 => 4,
                    _ => 16,
                };
                let keys = (0..n).map(|i| LockKey::id(key * 100 + i));
                let attempt = self.locker.try_lock_all(keys).await?;
                taken = Some(start.elapsed());
                match attempt {
                    Some(all) => {
                        all.release().await?;
                        true
                    }
                    None => false,
                }
            }
            Cycle::TableDistlock => {
                let attempt = self.table.try_lock(LockKey::id(key)).await?;
                taken = Some(start.elapsed());
                match attempt {
                    Some(lease) => {
                        lease.release().await?;
                        true
                    }
                    None => false,
                }
            }
            Cycle::TableRaw => {
                let owner = format!("{:032x}", rand::random::<u128>());
                let got: Option<bool> = sqlx::query_scalar(
                    "INSERT INTO bench_leases AS l (key, owner, expires_at) \
                     VALUES ($1, $2::uuid, clock_timestamp() + interval '30 s') \
                     ON CONFLICT (key) DO UPDATE SET owner = EXCLUDED.owner, \
                     expires_at = EXCLUDED.expires_at WHERE l.expires_at <= clock_timestamp() \
                     RETURNING true",
                )
                .bind(key)
                .bind(&owner)
                .fetch_optional(&self.pool)
                .await?;
                taken = Some(start.elapsed());
                if got.is_some() {
                    sqlx::query("DELETE FROM bench_leases WHERE key = $1 AND owner = $2::uuid")
                        .bind(key)
                        .bind(&owner)
                        .execute(&self.pool)
                        .await?;
                }
                got.is_some()
            }
            Cycle::SessionDistlock
            | Cycle::SessionDistlockCold
            | Cycle::SessionDistlockMux
            | Cycle::SessionDistlockFenced => {
                let locker = match cycle {
                    Cycle::SessionDistlockCold => &self.cold,
                    Cycle::SessionDistlockMux => &self.mux,
                    Cycle::SessionDistlockFenced => &self.fenced,
                    _ => &self.locker,
                };
                let attempt = locker.try_lock(LockKey::id(key)).await?;
                taken = Some(start.elapsed());
                match attempt {
                    Some(lock) => {
                        lock.release().await?;
                        true
                    }
                    None => false,
                }
            }
        };
        if got == cycle.busy() {
            bail!(
                "{}: key {key} was not as expected (taken: {got})",
                cycle.label()
            );
        }
        let total = start.elapsed();
        Ok((taken.unwrap_or(total), total))
    }
}

/// Measured cost of one alternative.
#[derive(Debug, Clone)]
pub struct CycleResult {
    pub cycle: Cycle,
    pub samples: Vec<Duration>,
    /// Time until the lock was held (session locks), per cycle.
    pub take: Vec<Duration>,
    /// Median of each round, in µs.
    pub round_medians: Vec<f64>,
    pub round_trips: f64,
}

/// The cycles a filter picks (see `filter.rs`), with the references their
/// ratios need; every cycle when it picks none.
pub fn selected(filter: &crate::filter::Filter) -> Vec<Cycle> {
    let picked: Vec<Cycle> = ALL.into_iter().filter(|c| filter.row(c.short())).collect();
    if picked.is_empty() {
        return ALL.to_vec();
    }
    ALL.into_iter()
        .filter(|c| picked.contains(c) || picked.iter().any(|p| p.baseline() == *c))
        .collect()
}

/// Runs `rounds` rounds; in each, every alternative of `cycles` does
/// `per_round` timed cycles (alternatives interleaved, so drift in machine
/// load hits all).
pub async fn measure(
    opts: &PgConnectOptions,
    cycles: &[Cycle],
    rounds: usize,
    per_round: usize,
) -> anyhow::Result<Vec<CycleResult>> {
    let ctx = Ctx::new(opts).await?;
    let mut results: Vec<CycleResult> = cycles
        .iter()
        .map(|&cycle| CycleResult {
            cycle,
            samples: Vec::new(),
            take: Vec::new(),
            round_medians: Vec::new(),
            round_trips: f64::NAN,
        })
        .collect();
    for &cycle in cycles {
        for _ in 0..50 {
            ctx.once(cycle).await?; // warm up: prepared statements, probes
        }
    }
    for round in 0..rounds {
        // Rotate the order each round so no alternative always runs first.
        for i in 0..cycles.len() {
            let slot = (i + round) % cycles.len();
            let cycle = cycles[slot];
            let mut samples = Vec::with_capacity(per_round);
            for _ in 0..per_round {
                let (take, total) = ctx.timed(cycle).await?;
                results[slot].take.push(take);
                samples.push(total);
            }
            let mut sorted: Vec<f64> = samples.iter().map(|d| us(*d)).collect();
            sorted.sort_by(f64::total_cmp);
            results[slot].round_medians.push(median_f64(&sorted));
            results[slot].samples.extend(samples);
        }
    }
    ctx.close().await;
    Ok(results)
}

/// Round trips per cycle of each alternative, counted through a proxy.
pub async fn count_round_trips(
    opts: &PgConnectOptions,
    results: &mut [CycleResult],
) -> anyhow::Result<()> {
    let proxy = CountingProxy::start(opts.get_host(), opts.get_port(), Duration::ZERO)?;
    let proxied = opts.clone().host("127.0.0.1").port(proxy.port());
    let ctx = Ctx::new(&proxied).await?;
    const OPS: u64 = 200;
    for result in results.iter_mut() {
        for _ in 0..20 {
            ctx.once(result.cycle).await?;
        }
        let before = proxy.turns();
        for _ in 0..OPS {
            ctx.once(result.cycle).await?;
        }
        result.round_trips = (proxy.turns() - before) as f64 / OPS as f64;
    }
    ctx.close().await;
    Ok(())
}
