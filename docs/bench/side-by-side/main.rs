//! Side by side: the lock cycles of distlock at two commits, in one binary
//! and one run, interleaved cycle by cycle (see README.md beside this file).
//!
//! `distlock_old` and `distlock_new` are the package `distlock` at the two
//! commits (the old one's version set to 0.0.1 so that Cargo takes both).
//! Each has a database of its own (`sbs_old`, `sbs_new`: their schema
//! migrations differ), migrated with its own `migrate`, and pools of its own
//! (max 4 connections each). The hand-written baselines run on the new
//! side's pool.
//!
//! Interleaved: in every round the 13 alternatives take turns cycle by cycle
//! (in an order that changes every cycle, so none always follows the same
//! one); before each
//! lock, `SELECT 1` on the alternative's own pool and one
//! `tokio::task::yield_now()`. A fresh key for every cycle.
//!
//! Back to back: blocks of consecutive cycles of one alternative, no other
//! work between them; the alternatives' blocks alternate, in a shuffled
//! order in every round of blocks.
//!
//! Both on a multi-thread runtime (2 workers) and on a current-thread
//! runtime. Options: `--rounds N` (20), `--per-round N` (300), `--warmup N`
//! (200), `--blocks N` (60), `--block N` (100), `--quick`, `--keep-dbs`,
//! `--detail` (every back-to-back block's median), `--only ALT` with
//! `--cycles N` (5000): one alternative back to back on the current-thread
//! runtime only, e.g. `--only NewSession`, to run under `strace -c` or
//! `perf`.
//! The server: `SBS_DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`); the two databases are
//! created on it (dropped first if they exist) and dropped at the end.

use std::fmt::Write as _;
use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use sqlx::postgres::{PgAdvisoryLock, PgAdvisoryLockKey, PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Either, PgPool};

const OLD_DB: &str = "sbs_old";
const NEW_DB: &str = "sbs_new";
const POOL_MAX: u32 = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Alt {
    XactRaw,
    SessionRaw,
    SessionSqlx,
    OldSession,
    NewSession,
    OldFenced,
    NewFenced,
    OldXact,
    NewXact,
    OldMulti4,
    NewMulti4,
    OldTable,
    NewTable,
}

const ALL: [Alt; 13] = [
    Alt::XactRaw,
    Alt::OldSession,
    Alt::NewXact,
    Alt::SessionRaw,
    Alt::OldFenced,
    Alt::NewMulti4,
    Alt::OldTable,
    Alt::SessionSqlx,
    Alt::NewSession,
    Alt::OldXact,
    Alt::NewFenced,
    Alt::OldMulti4,
    Alt::NewTable,
];

/// Back to back: cycles a and c, with the baselines of their scope.
const BACK_TO_BACK: [Alt; 6] = [
    Alt::SessionSqlx,
    Alt::OldSession,
    Alt::NewSession,
    Alt::XactRaw,
    Alt::OldXact,
    Alt::NewXact,
];

/// The compared cycles: (name, old, new).
const PAIRS: [(&str, Alt, Alt); 5] = [
    (
        "a. session try_lock + release",
        Alt::OldSession,
        Alt::NewSession,
    ),
    ("b. a with fencing on", Alt::OldFenced, Alt::NewFenced),
    (
        "c. with_advisory_lock, empty closure",
        Alt::OldXact,
        Alt::NewXact,
    ),
    (
        "d. try_lock_all(4 keys) + release",
        Alt::OldMulti4,
        Alt::NewMulti4,
    ),
    (
        "e. TableLocker try_lock + release",
        Alt::OldTable,
        Alt::NewTable,
    ),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Base,
    Old,
    New,
}

impl Alt {
    fn label(self) -> &'static str {
        match self {
            Alt::XactRaw => "baseline: sqlx BEGIN / pg_try_advisory_xact_lock / COMMIT",
            Alt::SessionRaw => "baseline: sqlx pg_try_advisory_lock / pg_advisory_unlock",
            Alt::SessionSqlx => "baseline: sqlx PgAdvisoryLock try_acquire + release_now",
            Alt::OldSession => "old: try_lock + release",
            Alt::NewSession => "new: try_lock + release",
            Alt::OldFenced => "old: try_lock + release, fencing on",
            Alt::NewFenced => "new: try_lock + release, fencing on",
            Alt::OldXact => "old: with_advisory_lock",
            Alt::NewXact => "new: with_advisory_lock",
            Alt::OldMulti4 => "old: try_lock_all(4 keys) + release",
            Alt::NewMulti4 => "new: try_lock_all(4 keys) + release",
            Alt::OldTable => "old: TableLocker try_lock + release",
            Alt::NewTable => "new: TableLocker try_lock + release",
        }
    }

    fn side(self) -> Side {
        match self {
            Alt::XactRaw | Alt::SessionRaw | Alt::SessionSqlx => Side::Base,
            Alt::OldSession | Alt::OldFenced | Alt::OldXact | Alt::OldMulti4 | Alt::OldTable => {
                Side::Old
            }
            _ => Side::New,
        }
    }

    fn index(self) -> usize {
        ALL.iter().position(|a| *a == self).expect("in ALL")
    }
}

/// A fresh key: `seq` counts cycles, each alternative has its own slot.
/// try_lock_all takes `key * 4 + i`, clear of the single keys.
fn key(seq: u64, alt: Alt) -> i64 {
    600_000_000 + (seq as i64) * ALL.len() as i64 + alt.index() as i64
}

struct Ctx {
    old_pool: PgPool,
    new_pool: PgPool,
    old: distlock_old::PgLocker,
    old_fenced: distlock_old::PgLocker,
    old_table: distlock_old::TableLocker,
    new: distlock_new::PgLocker,
    new_fenced: distlock_new::PgLocker,
    new_table: distlock_new::postgres::TableLocker,
}

impl Ctx {
    async fn new(base: &PgConnectOptions) -> anyhow::Result<Self> {
        let old_pool = PgPoolOptions::new()
            .max_connections(POOL_MAX)
            .connect_with(base.clone().database(OLD_DB))
            .await?;
        let new_pool = PgPoolOptions::new()
            .max_connections(POOL_MAX)
            .connect_with(base.clone().database(NEW_DB))
            .await?;
        distlock_old::migrate(&old_pool)
            .await
            .context("old migrate")?;
        distlock_new::migrate(&new_pool)
            .await
            .context("new migrate")?;
        Ok(Self {
            old: distlock_old::PgLocker::new(old_pool.clone()),
            // The old builder's build() cannot fail; the new one's returns
            // a Result.
            old_fenced: distlock_old::PgLocker::builder(old_pool.clone())
                .fencing(true)
                .build(),
            old_table: distlock_old::TableLocker::new(old_pool.clone()),
            new: distlock_new::PgLocker::new(new_pool.clone()),
            new_fenced: distlock_new::PgLocker::builder(new_pool.clone())
                .fencing(true)
                .build()?,
            new_table: distlock_new::postgres::TableLocker::new(new_pool.clone()),
            old_pool,
            new_pool,
        })
    }

    async fn close(self) {
        drop((
            self.old,
            self.old_fenced,
            self.old_table,
            self.new,
            self.new_fenced,
            self.new_table,
        ));
        self.old_pool.close().await;
        self.new_pool.close().await;
    }

    fn pool(&self, alt: Alt) -> &PgPool {
        match alt.side() {
            Side::Old => &self.old_pool,
            Side::New | Side::Base => &self.new_pool,
        }
    }

    /// Other work on the alternative's own pool before its lock.
    async fn other_work(&self, alt: Alt) -> anyhow::Result<()> {
        let _: i32 = sqlx::query_scalar("SELECT 1")
            .fetch_one(self.pool(alt))
            .await?;
        tokio::task::yield_now().await;
        Ok(())
    }

    /// One lock cycle on a fresh key; fails if the key was not free.
    async fn cycle(&self, alt: Alt, key: i64) -> anyhow::Result<Duration> {
        use distlock_new::LockKey as NewKey;
        use distlock_old::LockKey as OldKey;
        let start = Instant::now();
        let got = match alt {
            Alt::XactRaw => {
                let mut tx = self.new_pool.begin().await?;
                let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
                    .bind(key)
                    .fetch_one(&mut *tx)
                    .await?;
                tx.commit().await?;
                got
            }
            Alt::SessionRaw => {
                let mut conn = self.new_pool.acquire().await?;
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
                match lock.try_acquire(self.new_pool.acquire().await?).await? {
                    Either::Left(guard) => {
                        guard.release_now().await?;
                        true
                    }
                    Either::Right(_) => false,
                }
            }
            Alt::OldSession | Alt::OldFenced => {
                let locker = if alt == Alt::OldSession {
                    &self.old
                } else {
                    &self.old_fenced
                };
                match locker.try_lock(OldKey::id(key)).await? {
                    Some(lock) => {
                        lock.release().await?;
                        true
                    }
                    None => false,
                }
            }
            Alt::NewSession | Alt::NewFenced => {
                let locker = if alt == Alt::NewSession {
                    &self.new
                } else {
                    &self.new_fenced
                };
                match locker.try_lock(NewKey::id(key)).await? {
                    Some(lock) => {
                        lock.release().await?;
                        true
                    }
                    None => false,
                }
            }
            Alt::OldXact => self
                .old
                .with_advisory_lock(OldKey::id(key), async |_| Ok::<_, distlock_old::Error>(()))
                .await?
                .is_some(),
            Alt::NewXact => self
                .new
                .with_advisory_lock(NewKey::id(key), async |_| Ok::<_, distlock_new::Error>(()))
                .await?
                .is_some(),
            Alt::OldMulti4 => {
                let keys = (0..4).map(|i| OldKey::id(key * 4 + i));
                match self.old.try_lock_all(keys).await? {
                    Some(all) => {
                        all.release().await?;
                        true
                    }
                    None => false,
                }
            }
            Alt::NewMulti4 => {
                let keys = (0..4).map(|i| NewKey::id(key * 4 + i));
                match self.new.try_lock_all(keys).await? {
                    Some(all) => {
                        all.release().await?;
                        true
                    }
                    None => false,
                }
            }
            Alt::OldTable => match self.old_table.try_lock(OldKey::id(key)).await? {
                Some(lease) => {
                    lease.release().await?;
                    true
                }
                None => false,
            },
            Alt::NewTable => match self.new_table.try_lock(NewKey::id(key)).await? {
                Some(lease) => {
                    lease.release().await?;
                    true
                }
                None => false,
            },
        };
        if !got {
            bail!("{}: key {key} was not free", alt.label());
        }
        Ok(start.elapsed())
    }
}

/// The samples of one alternative, in µs.
#[derive(Debug, Clone, Default)]
struct Samples {
    all: Vec<f64>,
    /// Median of each round (interleaved) or block (back to back).
    rounds: Vec<f64>,
}

fn sorted(v: &[f64]) -> Vec<f64> {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v
}

fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let v = sorted(v);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

/// Nearest-rank percentile.
fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let v = sorted(v);
    let idx = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[idx]
}

fn spread(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x), hi.max(x))
        })
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

struct Opts {
    rounds: usize,
    per_round: usize,
    warmup: usize,
    blocks: usize,
    block: usize,
    keep_dbs: bool,
    /// Also print every back-to-back block's median, in order.
    detail: bool,
    /// Only this alternative (its `Debug` name, e.g. `NewSession`), back to
    /// back, `cycles` times, on the current-thread runtime: a loop to run
    /// under `strace -c` or `perf`.
    only: Option<String>,
    cycles: usize,
}

impl Opts {
    fn parse() -> anyhow::Result<Self> {
        let mut o = Opts {
            rounds: 20,
            per_round: 300,
            warmup: 200,
            blocks: 60,
            block: 100,
            keep_dbs: false,
            detail: false,
            only: None,
            cycles: 5000,
        };
        let mut args = std::env::args().skip(1);
        while let Some(a) = args.next() {
            let mut num = |name: &str| -> anyhow::Result<usize> {
                args.next()
                    .with_context(|| format!("{name} needs a number"))?
                    .parse()
                    .with_context(|| format!("{name} needs a number"))
            };
            match a.as_str() {
                "--rounds" => o.rounds = num("--rounds")?,
                "--per-round" => o.per_round = num("--per-round")?,
                "--warmup" => o.warmup = num("--warmup")?,
                "--blocks" => o.blocks = num("--blocks")?,
                "--block" => o.block = num("--block")?,
                "--keep-dbs" => o.keep_dbs = true,
                "--detail" => o.detail = true,
                "--cycles" => o.cycles = num("--cycles")?,
                "--only" => o.only = Some(args.next().context("--only needs an alternative")?),
                "--quick" => {
                    o.rounds = 2;
                    o.per_round = 50;
                    o.warmup = 20;
                    o.blocks = 2;
                    o.block = 50;
                }
                "--bench" => {} // passed by `cargo bench`-style runners
                other => bail!("unknown option {other}"),
            }
        }
        Ok(o)
    }
}

/// `--only`: `warmup` cycles, then `cycles` timed cycles of one
/// alternative, back to back.
async fn only_one(ctx: &Ctx, o: &Opts, only: &str, seq: &mut u64) -> anyhow::Result<String> {
    let alt = ALL
        .into_iter()
        .find(|alt| format!("{alt:?}") == only)
        .with_context(|| format!("no alternative {only}"))?;
    for _ in 0..o.warmup {
        ctx.cycle(alt, key(*seq, alt)).await?;
        *seq += 1;
    }
    let started = Instant::now();
    let mut t = Vec::with_capacity(o.cycles);
    for _ in 0..o.cycles {
        t.push(us(ctx.cycle(alt, key(*seq, alt)).await?));
        *seq += 1;
    }
    let per_cycle = started.elapsed().as_secs_f64() * 1e6 / o.cycles.max(1) as f64;
    Ok(format!(
        "{only}: {} cycles back to back, {per_cycle:.1} µs per cycle, median {:.1} µs",
        o.cycles,
        median(&t)
    ))
}

/// Interleaved: warm-up, then `rounds` rounds of `per_round` cycles of
/// every alternative, taking turns cycle by cycle.
async fn interleaved(ctx: &Ctx, o: &Opts, seq: &mut u64) -> anyhow::Result<Vec<Samples>> {
    for _ in 0..o.warmup {
        for alt in ALL {
            ctx.other_work(alt).await?;
            ctx.cycle(alt, key(*seq, alt)).await?;
        }
        *seq += 1;
    }
    let mut out = vec![Samples::default(); ALL.len()];
    for round in 0..o.rounds {
        let mut this: Vec<Vec<f64>> = vec![Vec::with_capacity(o.per_round); ALL.len()];
        for c in 0..o.per_round {
            // A different order every cycle: ALL.len() is prime, so every
            // stride from 1 to 12 visits all 13 once, and the stride and
            // start change from cycle to cycle, so no alternative always
            // follows the same one.
            let stride = 1 + (c + round) % (ALL.len() - 1);
            for i in 0..ALL.len() {
                let alt = ALL[(c + round + i * stride) % ALL.len()];
                ctx.other_work(alt).await?;
                let took = ctx.cycle(alt, key(*seq, alt)).await?;
                this[alt.index()].push(us(took));
            }
            *seq += 1;
        }
        for (s, t) in out.iter_mut().zip(this) {
            s.rounds.push(median(&t));
            s.all.extend(t);
        }
    }
    Ok(out)
}

/// Back to back: warm-up, then `blocks` times a block of `block`
/// consecutive cycles of each alternative of [`BACK_TO_BACK`], no other
/// work between cycles, in a shuffled order in every round of blocks (so
/// that no alternative always follows the same one, nor always runs first).
/// `alts` in a pseudo-random order (xorshift64; the same sequence every
/// run).
fn shuffled<const N: usize>(mut alts: [Alt; N], state: &mut u64) -> [Alt; N] {
    for i in (1..N).rev() {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        alts.swap(i, (*state % (i as u64 + 1)) as usize);
    }
    alts
}

async fn back_to_back(ctx: &Ctx, o: &Opts, seq: &mut u64) -> anyhow::Result<Vec<Samples>> {
    for alt in BACK_TO_BACK {
        for _ in 0..o.warmup {
            ctx.cycle(alt, key(*seq, alt)).await?;
            *seq += 1;
        }
    }
    let mut out = vec![Samples::default(); ALL.len()];
    let mut rng = 0x9E37_79B9_7F4A_7C15_u64;
    for _ in 0..o.blocks {
        for alt in shuffled(BACK_TO_BACK, &mut rng) {
            let mut t = Vec::with_capacity(o.block);
            for _ in 0..o.block {
                t.push(us(ctx.cycle(alt, key(*seq, alt)).await?));
                *seq += 1;
            }
            let s = &mut out[alt.index()];
            s.rounds.push(median(&t));
            s.all.extend(t);
        }
    }
    Ok(out)
}

fn table(title: &str, alts: &[Alt], samples: &[Samples], unit: &str) -> String {
    let mut out = format!(
        "\n#### {title}\n\n\
         | alternative | cycles | p10 µs | median µs | p90 µs | {unit} medians µs (min–max) |\n\
         |---|---:|---:|---:|---:|---:|\n"
    );
    for &alt in alts {
        let s = &samples[alt.index()];
        let (lo, hi) = spread(&s.rounds);
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} | {:.0} | {:.0} | {lo:.0}–{hi:.0} |",
            alt.label(),
            s.all.len(),
            percentile(&s.all, 0.1),
            median(&s.all),
            percentile(&s.all, 0.9),
        );
    }
    let _ = write!(
        out,
        "\n| cycle | old median µs | new median µs | new/old median | new/old p90 | new/old per {unit}: median (min–max) |\n\
         |---|---:|---:|---:|---:|---:|\n"
    );
    for (name, old, new) in PAIRS {
        if !alts.contains(&old) {
            continue;
        }
        let (so, sn) = (&samples[old.index()], &samples[new.index()]);
        let (mo, mn) = (median(&so.all), median(&sn.all));
        let per: Vec<f64> = so
            .rounds
            .iter()
            .zip(&sn.rounds)
            .map(|(o, n)| n / o)
            .collect();
        let (lo, hi) = spread(&per);
        let _ = writeln!(
            out,
            "| {name} | {mo:.0} | {mn:.0} | {:.3} | {:.3} | {:.3} ({lo:.2}–{hi:.2}) |",
            mn / mo,
            percentile(&sn.all, 0.9) / percentile(&so.all, 0.9),
            median(&per),
        );
    }
    out
}

async fn run(base: &PgConnectOptions, o: &Opts, runtime: &str) -> anyhow::Result<String> {
    let ctx = Ctx::new(base).await?;
    let mut seq = 0;
    if let Some(only) = &o.only {
        let out = only_one(&ctx, o, only, &mut seq).await;
        ctx.close().await;
        return out;
    }
    let started = Instant::now();
    let inter = interleaved(&ctx, o, &mut seq).await?;
    let inter_took = started.elapsed();
    let started = Instant::now();
    let b2b = back_to_back(&ctx, o, &mut seq).await?;
    let b2b_took = started.elapsed();
    ctx.close().await;
    let mut out = table(
        &format!(
            "Interleaved, {runtime} runtime ({:.0} s)",
            inter_took.as_secs_f64()
        ),
        &ALL_BY_LABEL,
        &inter,
        "round",
    );
    out += &table(
        &format!(
            "Back to back, {runtime} runtime ({:.0} s)",
            b2b_took.as_secs_f64()
        ),
        &BACK_TO_BACK,
        &b2b,
        "block",
    );
    if o.detail {
        out += "\nBack-to-back block medians µs, in order:\n\n";
        for alt in BACK_TO_BACK {
            let medians: Vec<String> = b2b[alt.index()]
                .rounds
                .iter()
                .map(|m| format!("{m:.0}"))
                .collect();
            let _ = writeln!(out, "- {}: {}", alt.label(), medians.join(" "));
        }
    }
    Ok(out)
}

/// The alternatives in the order the tables list them.
const ALL_BY_LABEL: [Alt; 13] = [
    Alt::SessionSqlx,
    Alt::SessionRaw,
    Alt::XactRaw,
    Alt::OldSession,
    Alt::NewSession,
    Alt::OldFenced,
    Alt::NewFenced,
    Alt::OldXact,
    Alt::NewXact,
    Alt::OldMulti4,
    Alt::NewMulti4,
    Alt::OldTable,
    Alt::NewTable,
];

async fn admin(base: &PgConnectOptions, statements: &[String]) -> anyhow::Result<()> {
    let mut conn = base.clone().database("postgres").connect().await?;
    for s in statements {
        sqlx::raw_sql(sqlx::AssertSqlSafe(s.clone()))
            .execute(&mut conn)
            .await
            .with_context(|| s.clone())?;
    }
    Ok(())
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_owned()
}

fn main() -> anyhow::Result<()> {
    let o = Opts::parse()?;
    let url = std::env::var("SBS_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let base = PgConnectOptions::from_str(&url)?;
    println!("load before: {}", loadavg());
    println!(
        "interleaved: {} warm-up cycles, then {} rounds x {} cycles per alternative; \
         back to back: {} warm-up cycles, then {} blocks x {} cycles per alternative; \
         pools of {POOL_MAX} connections",
        o.warmup, o.rounds, o.per_round, o.warmup, o.blocks, o.block
    );
    let setup = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let drop_dbs: Vec<String> = [OLD_DB, NEW_DB]
        .iter()
        .map(|db| format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .collect();
    let mut create = drop_dbs.clone();
    create.extend(
        [OLD_DB, NEW_DB]
            .iter()
            .map(|db| format!("CREATE DATABASE {db}")),
    );
    setup.block_on(admin(&base, &create))?;

    let result = (|| -> anyhow::Result<()> {
        let started = Instant::now();
        let multi = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        if o.only.is_none() {
            let out = multi.block_on(run(&base, &o, "multi-thread (2 workers)"))?;
            multi.shutdown_timeout(Duration::from_secs(5));
            println!("{out}");
        }
        let current = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let out = current.block_on(run(&base, &o, "current-thread"))?;
        current.shutdown_timeout(Duration::from_secs(5));
        println!("{out}");
        println!("\ntotal {:.0} s", started.elapsed().as_secs_f64());
        Ok(())
    })();
    if !o.keep_dbs {
        setup.block_on(admin(&base, &drop_dbs))?;
    }
    println!("load after: {}", loadavg());
    result
}
