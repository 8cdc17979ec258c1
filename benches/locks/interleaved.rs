//! Interleaved cycles: the alternatives take turns cycle by cycle, each lock
//! preceded by other work on the same pool, as in an application that does
//! something between two locks. Back to back (see `cycle.rs`) a background
//! task woken by one cycle is still awake for the next; here it has gone
//! idle, so whatever waits on it shows up in the cost.
//!
//! Besides the time, a separate counting pass reads what the runtime and the
//! kernel saw per cycle: worker parks (tokio's stable `worker_park_count`),
//! worker busy time, live tasks, voluntary context switches of all the
//! process's threads, and round trips (its pool connects through the
//! counting proxy, so the lock cycles run on connections of their own
//! there, warmed up the same way). The counting pass is not timed, because
//! reading `/proc` between cycles is work of its own.

use std::time::{Duration, Instant};

use anyhow::bail;
use distlock::{LockKey, PgLocker};
use sqlx::Either;
use sqlx::PgPool;
use sqlx::postgres::{PgAdvisoryLock, PgAdvisoryLockKey, PgConnectOptions, PgPoolOptions};

use crate::counting::CountingProxy;
use crate::stats::{median_f64, us};

/// One alternative in the interleaving, in the order they take turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alt {
    /// `pool.begin()`, `SELECT pg_try_advisory_xact_lock($1)`, `COMMIT`.
    XactRaw,
    /// `locker.with_advisory_lock(key, async |_| Ok(()))`.
    XactDistlock,
    /// The same with `.try_with_begin(true)`.
    XactDistlockBegin,
    /// `pool.acquire()`, `pg_try_advisory_lock($1)`, `pg_advisory_unlock($1)`.
    SessionRaw,
    /// sqlx's `PgAdvisoryLock::try_acquire(pool.acquire())` + `release_now()`.
    SessionSqlx,
    /// `locker.try_lock(key)` + `release()`.
    SessionDistlock,
    /// The same with `.fencing(true)`.
    SessionDistlockFenced,
}

pub const ALL: [Alt; 7] = [
    Alt::XactRaw,
    Alt::XactDistlock,
    Alt::XactDistlockBegin,
    Alt::SessionRaw,
    Alt::SessionSqlx,
    Alt::SessionDistlock,
    Alt::SessionDistlockFenced,
];

impl Alt {
    pub fn label(self) -> &'static str {
        match self {
            Alt::XactRaw => "sqlx hand-written BEGIN / try / COMMIT",
            Alt::XactDistlock => "distlock with_advisory_lock",
            Alt::XactDistlockBegin => "distlock with_advisory_lock, try_with_begin",
            Alt::SessionRaw => "sqlx hand-written try/unlock",
            Alt::SessionSqlx => "sqlx PgAdvisoryLock",
            Alt::SessionDistlock => "distlock try_lock+release",
            Alt::SessionDistlockFenced => "distlock try_lock+release, fencing on",
        }
    }

    pub fn short(self) -> &'static str {
        match self {
            Alt::XactRaw => "xact: sqlx BEGIN/try/COMMIT",
            Alt::XactDistlock => "xact: distlock",
            Alt::XactDistlockBegin => "xact: distlock, try with BEGIN",
            Alt::SessionRaw => "session: sqlx raw",
            Alt::SessionSqlx => "session: PgAdvisoryLock",
            Alt::SessionDistlock => "session: distlock",
            Alt::SessionDistlockFenced => "session: distlock fenced",
        }
    }

    /// The hand-written alternative of the same scope.
    pub fn hand_written(self) -> Alt {
        match self {
            Alt::XactRaw | Alt::XactDistlock | Alt::XactDistlockBegin => Alt::XactRaw,
            _ => Alt::SessionRaw,
        }
    }

    fn index(self) -> usize {
        ALL.iter().position(|a| *a == self).unwrap_or(0)
    }
}

/// What runs between two locks.
#[derive(Debug, Clone, Copy)]
pub struct OtherWork {
    /// After the query, sleep this long (zero: one `yield_now` instead),
    /// long enough for background tasks to go idle. Tokio's timer rounds
    /// up to whole milliseconds.
    pub idle: Duration,
}

impl OtherWork {
    pub fn describe(self) -> String {
        let idle = if self.idle.is_zero() {
            "one `tokio::task::yield_now()`".to_owned()
        } else {
            format!("`tokio::time::sleep({} µs)`", self.idle.as_micros())
        };
        format!(
            "before every lock, `SELECT n FROM bench_interleave WHERE id = $1` on the same pool, then {idle}"
        )
    }
}

/// Measured cost of one alternative in the interleaving.
#[derive(Debug, Clone)]
pub struct AltResult {
    pub alt: Alt,
    /// Median of each round, in µs.
    pub round_medians: Vec<f64>,
    /// Per cycle, from the counting pass.
    pub counts: Counts,
}

/// Per-cycle averages from the counting pass (lock cycle only, not the
/// other work).
#[derive(Debug, Clone, Copy, Default)]
pub struct Counts {
    pub parks: f64,
    pub busy_us: f64,
    pub context_switches: f64,
    pub max_alive_tasks: usize,
    /// Client→server bursts answered by the server (see `counting.rs`).
    pub round_trips: f64,
}

/// Pool, lockers and the table the other work reads.
struct Ctx {
    pool: PgPool,
    locker: PgLocker,
    fenced: PgLocker,
    /// `with_advisory_lock`'s try in the `BEGIN`'s round trip.
    begin: PgLocker,
}

impl Ctx {
    async fn new(opts: &PgConnectOptions) -> anyhow::Result<Self> {
        // Default pool options, as users have them (max 4, like cycle.rs).
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect_with(opts.clone())
            .await?;
        distlock::migrate(&pool).await?;
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS bench_interleave (id int PRIMARY KEY, n bigint NOT NULL);
             INSERT INTO bench_interleave SELECT g, 0 FROM generate_series(0, 15) g
             ON CONFLICT DO NOTHING",
        )
        .execute(&pool)
        .await?;
        Ok(Self {
            locker: PgLocker::new(pool.clone()),
            fenced: PgLocker::builder(pool.clone()).fencing(true).build()?,
            begin: PgLocker::builder(pool.clone())
                .try_with_begin(true)
                .build()?,
            pool,
        })
    }

    async fn close(self) {
        drop((self.locker, self.fenced, self.begin));
        self.pool.close().await;
    }

    async fn other_work(&self, alt: Alt, work: OtherWork) -> anyhow::Result<()> {
        let id = i32::try_from(alt.index())?;
        let _: i64 = sqlx::query_scalar("SELECT n FROM bench_interleave WHERE id = $1")
            .bind(id)
            .fetch_one(&self.pool)
            .await?;
        if work.idle.is_zero() {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(work.idle).await;
        }
        Ok(())
    }

    /// One lock cycle on `key`; fails if the key was not free.
    async fn cycle(&self, alt: Alt, key: i64) -> anyhow::Result<Duration> {
        let start = Instant::now();
        let got = match alt {
            Alt::XactRaw => {
                let mut tx = self.pool.begin().await?;
                let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
                    .bind(key)
                    .fetch_one(&mut *tx)
                    .await?;
                tx.commit().await?;
                got
            }
            Alt::XactDistlock | Alt::XactDistlockBegin => match alt {
                Alt::XactDistlock => &self.locker,
                _ => &self.begin,
            }
            .with_advisory_lock(LockKey::id(key), async |_| Ok::<_, distlock::Error>(()))
            .await?
            .is_some(),
            Alt::SessionRaw => {
                let mut conn = self.pool.acquire().await?;
                let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                    .bind(key)
                    .fetch_one(&mut *conn)
                    .await?;
                if got {
                    let _: bool = sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
                        .bind(key)
                        .fetch_one(&mut *conn)
                        .await?;
                }
                got
            }
            Alt::SessionSqlx => {
                let lock = PgAdvisoryLock::with_key(PgAdvisoryLockKey::BigInt(key));
                match lock.try_acquire(self.pool.acquire().await?).await? {
                    Either::Left(guard) => {
                        guard.release_now().await?;
                        true
                    }
                    Either::Right(_) => false,
                }
            }
            Alt::SessionDistlock | Alt::SessionDistlockFenced => {
                let locker = if alt == Alt::SessionDistlock {
                    &self.locker
                } else {
                    &self.fenced
                };
                match locker.try_lock(LockKey::id(key)).await? {
                    Some(lock) => {
                        lock.release().await?;
                        true
                    }
                    None => false,
                }
            }
        };
        if !got {
            bail!("{}: key {key} was not free", alt.label());
        }
        Ok(start.elapsed())
    }
}

/// A fresh key per cycle and alternative ("then the next key"), clear of
/// the keys the other benchmarks use.
fn key(round: usize, cycle: usize, alt: Alt) -> i64 {
    90_000_000 + ((round * 100_000 + cycle) * ALL.len() + alt.index()) as i64
}

/// Runs `rounds` timed rounds of `per_round` interleaved cycles each, then
/// one counting round, on the runtime it is called from.
pub async fn measure(
    opts: &PgConnectOptions,
    rounds: usize,
    per_round: usize,
    work: OtherWork,
) -> anyhow::Result<Vec<AltResult>> {
    let ctx = Ctx::new(opts).await?;
    let mut results: Vec<AltResult> = ALL
        .iter()
        .map(|&alt| AltResult {
            alt,
            round_medians: Vec::new(),
            counts: Counts::default(),
        })
        .collect();
    warm_up(&ctx, work, rounds + 1).await?;
    for round in 0..rounds {
        let mut samples: Vec<Vec<f64>> = vec![Vec::with_capacity(per_round); ALL.len()];
        for c in 0..per_round {
            // Rotate who follows whom, so no alternative always runs after
            // the same one.
            for i in 0..ALL.len() {
                let alt = ALL[(i + c + round) % ALL.len()];
                ctx.other_work(alt, work).await?;
                let took = ctx.cycle(alt, key(round, c, alt)).await?;
                samples[alt.index()].push(us(took));
            }
        }
        for (result, s) in results.iter_mut().zip(&samples) {
            result.round_medians.push(median_f64(s));
        }
    }
    ctx.close().await;
    // The counting pass, on a pool through the counting proxy.
    let proxy = CountingProxy::start(opts.get_host(), opts.get_port(), Duration::ZERO)?;
    let ctx = Ctx::new(&opts.clone().host("127.0.0.1").port(proxy.port())).await?;
    warm_up(&ctx, work, rounds + 2).await?;
    let mut totals = [Counts::default(); ALL.len()];
    for c in 0..per_round {
        for i in 0..ALL.len() {
            let alt = ALL[(i + c) % ALL.len()];
            ctx.other_work(alt, work).await?;
            let (before, turns) = (Snapshot::take(), proxy.turns());
            ctx.cycle(alt, key(rounds, c, alt)).await?;
            let (after, turns) = (Snapshot::take(), proxy.turns() - turns);
            let t = &mut totals[alt.index()];
            t.round_trips += turns as f64;
            t.parks += after.parks.saturating_sub(before.parks) as f64;
            t.busy_us += us(after.busy.saturating_sub(before.busy));
            t.context_switches += after
                .context_switches
                .saturating_sub(before.context_switches) as f64;
            t.max_alive_tasks = t.max_alive_tasks.max(before.alive).max(after.alive);
        }
    }
    let n = per_round.max(1) as f64;
    for (result, t) in results.iter_mut().zip(totals) {
        result.counts = Counts {
            parks: t.parks / n,
            busy_us: t.busy_us / n,
            context_switches: t.context_switches / n,
            max_alive_tasks: t.max_alive_tasks,
            round_trips: t.round_trips / n,
        };
    }
    ctx.close().await;
    Ok(results)
}

/// Prepared statements, the lockers' probes, warm connections: 20 cycles
/// of each alternative, on keys of round `round`.
async fn warm_up(ctx: &Ctx, work: OtherWork, round: usize) -> anyhow::Result<()> {
    for c in 0..20 {
        for alt in ALL {
            ctx.other_work(alt, work).await?;
            ctx.cycle(alt, key(round, c, alt)).await?;
        }
    }
    Ok(())
}

/// Counters of the current runtime and of the process at one instant.
struct Snapshot {
    parks: u64,
    busy: Duration,
    alive: usize,
    context_switches: u64,
}

impl Snapshot {
    fn take() -> Self {
        let metrics = tokio::runtime::Handle::current().metrics();
        let workers = metrics.num_workers();
        Self {
            parks: (0..workers).map(|w| metrics.worker_park_count(w)).sum(),
            busy: (0..workers)
                .map(|w| metrics.worker_total_busy_duration(w))
                .sum(),
            alive: metrics.num_alive_tasks(),
            context_switches: voluntary_context_switches(),
        }
    }
}

/// Voluntary context switches (a thread blocked: a park, a futex wait, an
/// `epoll_wait` with nothing ready) summed over all threads of the process.
/// `/proc/self/status` alone counts only the main thread.
fn voluntary_context_switches() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
        .filter_map(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .sum()
}

/// The interleaved table for one runtime.
pub fn table(runtime: &str, results: &[AltResult]) -> String {
    use std::fmt::Write;
    let median_of = |alt: Alt| {
        results
            .iter()
            .find(|r| r.alt == alt)
            .map_or(f64::NAN, |r| median_f64(&r.round_medians))
    };
    let sqlx = median_of(Alt::SessionSqlx);
    let mut out = format!(
        "\n#### {runtime} runtime\n\n\
         | alternative | median µs per cycle | spread of round medians µs | vs PgAdvisoryLock | vs hand-written | worker parks per cycle | worker busy µs per cycle | voluntary context switches per cycle | live tasks (max) | round trips per cycle |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    );
    for r in results {
        let median = median_f64(&r.round_medians);
        let (lo, hi) = crate::stats::spread(&r.round_medians);
        let _ = writeln!(
            out,
            "| {} | {median:.0} | {lo:.0}–{hi:.0} | {:.2}× | {:.2}× | {:.2} | {:.0} | {:.2} | {} | {:.2} |",
            r.alt.label(),
            median / sqlx,
            median / median_of(r.alt.hand_written()),
            r.counts.parks,
            r.counts.busy_us,
            r.counts.context_switches,
            r.counts.max_alive_tasks,
            r.counts.round_trips,
        );
    }
    let _ = writeln!(
        out,
        "\nFenced vs unfenced try_lock+release: {:.2}×.",
        median_of(Alt::SessionDistlockFenced) / median_of(Alt::SessionDistlock)
    );
    out
}

/// A bar per alternative (multi-thread runtime).
pub fn chart(title: &str, results: &[AltResult]) -> String {
    let sqlx = results
        .iter()
        .find(|r| r.alt == Alt::SessionSqlx)
        .map_or(f64::NAN, |r| median_f64(&r.round_medians));
    let rows: Vec<(String, f64, String)> = results
        .iter()
        .map(|r| {
            let m = median_f64(&r.round_medians);
            (
                r.alt.short().to_owned(),
                m,
                format!("{:.2}× PgAdvisoryLock", m / sqlx),
            )
        })
        .collect();
    crate::chart::hbars(title, "µs", &rows)
}
