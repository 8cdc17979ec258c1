//! `cargo bench --bench locks`: distlock against hand-written sqlx SQL and
//! sqlx's `PgAdvisoryLock`, in one run, on one machine. Writes the tables to
//! `docs/bench/results.md` and the charts to `docs/bench/*.svg`; BENCHMARKS.md
//! explains them. Nothing here asserts timings.
//!
//! Options (after `--`): `--quick` (a short run), `--rounds N`, `--idle-us N`
//! (the sleep after the other work in the interleaved cycles; 0 yields once
//! instead; default 1000), words that pick what runs
//! (`cargo bench --bench locks -- table`: see `filter.rs`), `--only
//! redis-handoff` (only the Redis rows of the hand-off table, printed,
//! nothing written; needs `--features redis`), `--only semaphore-scale` (only
//! the semaphore at scale, printed), `--help`.

mod chart;
mod cold;
mod counting;
mod cycle;
mod filter;
mod handoff;
mod hops;
mod interleaved;
mod kinds;
mod many;
mod pgbench;
#[cfg(feature = "redis")]
mod redis_handoff;
mod scale;
mod server;
mod stats;

use std::fmt::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection};

use stats::{median_f64, spread, summarize, us};

/// The benchmark's database, unless `DISTLOCK_BENCH_DATABASE` names another
/// (a server shared by checkouts whose migrations differ needs one each).
fn database() -> String {
    std::env::var("DISTLOCK_BENCH_DATABASE")
        .ok()
        .filter(|name| {
            !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        })
        .unwrap_or_else(|| "distlock_bench".to_owned())
}

struct Settings {
    rounds: usize,
    cycles_per_round: usize,
    handoffs: usize,
    handoff_limit: Duration,
    waiters: Vec<usize>,
    many_keys: Vec<usize>,
    pgbench_seconds: u64,
    interleaved_cycles: usize,
    other_work: interleaved::OtherWork,
    quick: bool,
}

impl Settings {
    fn from_args(args: &[String]) -> Self {
        let quick = args.iter().any(|a| a == "--quick");
        let rounds = args
            .iter()
            .position(|a| a == "--rounds")
            .and_then(|i| args.get(i + 1))
            .and_then(|n| n.parse().ok());
        let idle = args
            .iter()
            .position(|a| a == "--idle-us")
            .and_then(|i| args.get(i + 1))
            .and_then(|n| n.parse().ok())
            .map_or(Duration::from_millis(1), Duration::from_micros);
        let other_work = interleaved::OtherWork { idle };
        if quick {
            Self {
                rounds: rounds.unwrap_or(2),
                cycles_per_round: 100,
                handoffs: 300,
                handoff_limit: Duration::from_secs(5),
                waiters: vec![2, 8, 32],
                many_keys: vec![1_000],
                pgbench_seconds: 2,
                interleaved_cycles: 40,
                other_work,
                quick,
            }
        } else {
            Self {
                rounds: rounds.unwrap_or(5),
                cycles_per_round: 400,
                handoffs: 2_000,
                handoff_limit: Duration::from_secs(15),
                waiters: vec![2, 8, 32],
                many_keys: vec![1_000, 10_000],
                pgbench_seconds: 5,
                interleaved_cycles: 200,
                other_work,
                quick,
            }
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return Ok(());
    }
    // `cargo bench` passes `--bench`; `cargo test --benches` does not, and a
    // minutes-long benchmark has no place in a test run.
    if !args.iter().any(|a| a == "--bench") {
        println!("locks benchmark: run it with `cargo bench --bench locks`");
        return Ok(());
    }
    let settings = Settings::from_args(&args);
    let filter = filter::Filter::from_args(&args);
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@localhost:5432/postgres".into());
    let admin: PgConnectOptions = url.parse()?;
    if let Some(only) = option(&args, "--only") {
        return only_section(&admin, &settings, only).await;
    }
    let opts = prepare_database(&admin).await?;
    let mut report = String::new();
    let started = Instant::now();
    let load_before = loadavg();

    let _ = writeln!(report, "{}", machine(&opts).await?);
    if filter.is_set() {
        let _ = writeln!(report, "Filtered run: `{}`.", filter.describe());
    }

    let mut interleaved_multi = Vec::new();
    if filter.section("interleaved") {
        eprintln!("== interleaved cycles");
        let (multi, table) = interleaved_tables(&opts, &settings).await?;
        interleaved_multi = multi;
        report.push_str(&table);
    }

    // Where the interleaved cycle's time goes, on a current-thread runtime
    // (no hops between threads).
    if filter.section("cold") {
        eprintln!("== cold and warm round trips");
        let (opts, rounds) = (opts.clone(), if settings.quick { 100 } else { 400 });
        let steps = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?
                .block_on(cold::measure(&opts, rounds))
        })
        .join()
        .map_err(|_| anyhow::anyhow!("cold run panicked"))??;
        report.push_str(&cold::table(&steps));
    }

    let selected = cycle::selected(&filter);
    let mut cycles = Vec::new();
    if filter.section("cycles") {
        eprintln!("== uncontended cycles");
        cycles =
            cycle::measure(&opts, &selected, settings.rounds, settings.cycles_per_round).await?;
        cycle::count_round_trips(&opts, &mut cycles).await?;
        report.push_str(&cycle_table(&mut cycles));
    }
    // The same on a single-threaded runtime: a task hop there is a queue
    // push, not a wake-up of another thread, so the difference between the
    // two tables is what distlock's background tasks cost in hops.
    if filter.section("current-thread") {
        eprintln!("== uncontended cycles, current-thread runtime");
        let mut single = {
            let (opts, rounds, per_round) =
                (opts.clone(), settings.rounds, settings.cycles_per_round);
            let selected = selected.clone();
            std::thread::spawn(move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?
                    .block_on(cycle::measure(&opts, &selected, rounds, per_round))
            })
            .join()
            .map_err(|_| anyhow::anyhow!("current-thread run panicked"))??
        };
        for (one, many) in single.iter_mut().zip(&cycles) {
            one.round_trips = many.round_trips;
        }
        report.push_str("\n#### The same cycles on a current-thread tokio runtime\n");
        report.push_str(&cycle_table(&mut single)[1..].replacen(
            "### Uncontended cycle (one task, one free key)\n",
            "",
            1,
        ));
    }

    if filter.section("hops") {
        report.push_str(&hops_table().await?);
    }

    // Loopback hides what a round trip costs on a network: run the cycles
    // again through a proxy adding 250 µs each way (0.5 ms round trips, as
    // between two hosts in one data centre).
    let mut far = Vec::new();
    if filter.section("0.5ms") {
        eprintln!("== uncontended cycles over 0.5 ms round trips");
        let delay = std::time::Duration::from_micros(250);
        let proxy = counting::CountingProxy::start(opts.get_host(), opts.get_port(), delay)?;
        let slow = opts.clone().host("127.0.0.1").port(proxy.port());
        far = cycle::measure(
            &slow,
            &selected,
            settings.rounds.min(3),
            settings.cycles_per_round / 4,
        )
        .await?;
        for (one, many) in far.iter_mut().zip(&cycles) {
            one.round_trips = many.round_trips;
        }
        report.push_str("\n#### The same cycles over a 0.5 ms round-trip link (delaying proxy)\n");
        report.push_str(&cycle_table(&mut far)[1..].replacen(
            "### Uncontended cycle (one task, one free key)\n",
            "",
            1,
        ));
    }

    let mut handoffs = Vec::new();
    if filter.section("handoff") {
        eprintln!("== contended hand-offs");
        handoffs = measure_handoffs(&opts, &settings, &handoff::all()).await?;
        let pgbench_rates = run_pgbench(&admin, &settings);
        report.push_str(&handoff_tables(&settings, &handoffs, Some(&pgbench_rates)));
    }

    if filter.section("kinds") {
        eprintln!("== lock kinds");
        let trials = if settings.rounds <= 2 { 30 } else { 200 };
        report.push_str(&kinds::table(&[
            kinds::permit_handoff(&opts, trials).await?,
            kinds::leader_takeover(&opts, trials / 2, true).await?,
            kinds::leader_takeover(&opts, trials / 2, false).await?,
        ]));
        report.push_str(&semaphore_scale_table(&opts, &settings).await?);
    }

    if filter.section("many") {
        eprintln!("== many keys");
        report.push_str(&many_table(&opts, &settings).await?);
    }

    if filter.section("scale") {
        eprintln!("== how cost grows");
        report.push_str(&scale::table(settings.quick, &filter).await?);
    }

    let _ = writeln!(
        report,
        "\nRun took {:.0} s. Load average (1 min) before: {load_before}, after: {}.",
        started.elapsed().as_secs_f64(),
        loadavg()
    );

    if filter.is_set() {
        println!("{report}");
        eprintln!("filtered run: nothing written");
        return Ok(());
    }
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docs/bench");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("results.md"), &report)?;
    std::fs::write(
        dir.join("interleaved.svg"),
        interleaved::chart(
            "Cost per interleaved cycle, multi-thread runtime (median)",
            &interleaved_multi,
        ),
    )?;
    std::fs::write(
        dir.join("cycle.svg"),
        cycle_chart("Cost per uncontended cycle, loopback (median)", &cycles),
    )?;
    std::fs::write(
        dir.join("cycle-0.5ms.svg"),
        cycle_chart(
            "Cost per uncontended cycle, 0.5 ms round trips (median)",
            &far,
        ),
    )?;
    std::fs::write(dir.join("handoff.svg"), handoff_chart(&settings, &handoffs))?;
    println!("{report}");
    eprintln!("wrote {}", dir.display());
    Ok(())
}

/// The semaphore target's scale: 200 waiters, 10 permits, a pool of 20,
/// each holder keeping its permit 10 ms; 3 runs (1 with `--quick`), each a
/// burst on a new pool and a second burst on the same pool.
async fn semaphore_scale_table(
    opts: &PgConnectOptions,
    settings: &Settings,
) -> anyhow::Result<String> {
    let mut runs = Vec::new();
    for _ in 0..if settings.quick { 1 } else { 3 } {
        let scale = (200, 10, 20);
        runs.extend(kinds::semaphore_scale(opts, scale, Duration::from_millis(10)).await?);
    }
    Ok(kinds::scale_table(&runs))
}

/// Task hops without a database, on both runtimes.
async fn hops_table() -> anyhow::Result<String> {
    let multi = hops::measure(2_000).await;
    let single = std::thread::spawn(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map(|rt| rt.block_on(hops::measure(2_000)))
    })
    .join()
    .map_err(|_| anyhow::anyhow!("hop measurement panicked"))??;
    Ok(format!(
        "\n#### Task hops (no database)\n\n\
         | runtime | request/reply to a parked task µs (median) | spawn + join µs (median) |\n\
         |---|---:|---:|\n\
         | multi-thread | {:.1} | {:.1} |\n| current-thread | {:.1} | {:.1} |\n",
        multi.request_reply, multi.spawn_join, single.request_reply, single.spawn_join
    ))
}

const USAGE: &str = "\
cargo bench --bench locks [-- OPTIONS]

Runs every measurement, writes docs/bench/results.md and the charts.

  --quick               a short run
  --rounds N            rounds per measurement
  --idle-us N           sleep after the other work in the interleaved cycles (0: yield)
  --only redis-handoff  only the Redis rows of the hand-off table (needs
                        --features redis; DISTLOCK_BENCH_REDIS_URL, default
                        redis://127.0.0.1:6379); printed, nothing written
  --only semaphore-scale  only the semaphore at scale (200 waiters, 10
                        permits, a pool of 20); printed, nothing written
  --help                this text";

/// The value after `name` in `args`.
fn option<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let at = args.iter().position(|a| a == name)?;
    args.get(at + 1).map(String::as_str)
}

/// Runs one section alone and prints it.
async fn only_section(
    opts: &PgConnectOptions,
    settings: &Settings,
    only: &str,
) -> anyhow::Result<()> {
    match only {
        "redis-handoff" if cfg!(feature = "redis") => {
            eprintln!("== contended hand-offs, Redis only");
            let handoffs = measure_handoffs(opts, settings, &handoff::REDIS).await?;
            println!("{}", handoff_tables(settings, &handoffs, None));
            Ok(())
        }
        "redis-handoff" => anyhow::bail!("--only redis-handoff needs --features redis"),
        "semaphore-scale" => {
            eprintln!("== semaphore at scale only");
            println!("{}", semaphore_scale_table(opts, settings).await?);
            Ok(())
        }
        other => anyhow::bail!("unknown section {other:?}; see --help"),
    }
}

/// The interleaved cycles on the multi-thread runtime and on a
/// current-thread one (as for the uncontended cycles below: the difference
/// is what hops between threads cost).
async fn interleaved_tables(
    opts: &PgConnectOptions,
    settings: &Settings,
) -> anyhow::Result<(Vec<interleaved::AltResult>, String)> {
    let (rounds, per_round, work) = (
        settings.rounds,
        settings.interleaved_cycles,
        settings.other_work,
    );
    let multi = interleaved::measure(opts, rounds, per_round, work).await?;
    let single = {
        let opts = opts.clone();
        std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?
                .block_on(interleaved::measure(&opts, rounds, per_round, work))
        })
        .join()
        .map_err(|_| anyhow::anyhow!("current-thread interleaved run panicked"))??
    };
    let mut out = format!(
        "\n### Interleaved cycle (the alternatives take turns, other work between two locks)\n\n\
         Other work: {}. {rounds} rounds of {per_round} turns of each alternative, a fresh key \
         per cycle; counts from one more untimed round, lock cycle only.\n",
        work.describe()
    );
    out.push_str(&interleaved::table("Multi-thread", &multi));
    out.push_str(&interleaved::table("Current-thread", &single));
    Ok((multi, out))
}

/// Creates the benchmark's own database (advisory locks are per database, so
/// other users of the server cannot collide with its keys).
async fn prepare_database(admin: &PgConnectOptions) -> anyhow::Result<PgConnectOptions> {
    let mut conn = admin.connect().await?;
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(database())
            .fetch_one(&mut conn)
            .await?;
    if !exists {
        // The name is ASCII letters, digits and underscores only (see `database`).
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE DATABASE {}",
            database()
        )))
        .execute(&mut conn)
        .await?;
    }
    conn.close().await?;
    Ok(admin
        .clone()
        .database(&database())
        .application_name("distlock-bench"))
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

async fn machine(opts: &PgConnectOptions) -> anyhow::Result<String> {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        })
        .unwrap_or_else(|| "?".into());
    let ram_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            let kb: f64 = s.lines().next()?.split_whitespace().nth(1)?.parse().ok()?;
            Some(kb / 1024.0 / 1024.0)
        })
        .unwrap_or(f64::NAN);
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let mut conn = opts.connect().await?;
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(&mut conn)
        .await?;
    let others: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' \
         AND pid <> pg_backend_pid()",
    )
    .fetch_one(&mut conn)
    .await?;
    conn.close().await?;
    Ok(format!(
        "Machine: {cores} cores ({cpu}), {ram_gib:.0} GiB RAM; PostgreSQL {version} on \
         {}:{} (loopback TCP); {others} other client sessions on the server at start.\n",
        opts.get_host(),
        opts.get_port()
    ))
}

fn cycle_table(results: &mut [cycle::CycleResult]) -> String {
    let mut out = String::from(
        "\n### Uncontended cycle (one task, one free key)\n\n\
         The rows marked \"key busy\" find their key held by another connection (`Ok(None)`).\n\n\
         | alternative | median µs | spread of round medians µs | p99 µs | of which taking µs (median) | round trips (incl. pool pings) | ratio |\n\
         |---|---:|---:|---:|---:|---:|---:|\n",
    );
    let medians: Vec<(cycle::Cycle, f64)> = results
        .iter()
        .map(|r| (r.cycle, median_f64(&r.round_medians)))
        .collect();
    for r in results.iter_mut() {
        let median = median_f64(&r.round_medians);
        let (lo, hi) = spread(&r.round_medians);
        let summary = summarize(&mut r.samples);
        let take = summarize(&mut r.take);
        let base = medians
            .iter()
            .find(|(c, _)| *c == r.cycle.baseline())
            .map_or(f64::NAN, |(_, m)| *m);
        let _ = writeln!(
            out,
            "| {} | {median:.0} | {lo:.0}–{hi:.0} | {:.0} | {} | {:.2} | {:.2}× {} |",
            r.cycle.label(),
            us(summary.p99),
            if r.cycle.is_xact() {
                "–".to_owned()
            } else {
                format!("{:.0}", us(take.p50))
            },
            r.round_trips,
            median / base,
            if r.cycle.is_xact() {
                "hand-written"
            } else {
                "PgAdvisoryLock"
            },
        );
    }
    let median_of = |cycle| medians.iter().find(|(c, _)| *c == cycle).map(|(_, m)| *m);
    if let (Some(table), Some(raw)) = (
        median_of(cycle::Cycle::TableDistlock),
        median_of(cycle::Cycle::TableRaw),
    ) {
        let _ = writeln!(
            out,
            "\n`TableLocker` try + release against the hand-written lease: {:.2}×.",
            table / raw
        );
    }
    out
}

fn cycle_chart(title: &str, results: &[cycle::CycleResult]) -> String {
    let rows: Vec<(String, f64, String)> = results
        .iter()
        .map(|r| {
            (
                r.cycle.short().to_owned(),
                median_f64(&r.round_medians),
                format!("{:.1} RT", r.round_trips),
            )
        })
        .collect();
    chart::hbars(title, "µs", &rows)
}

/// Per (waiters, alternative): the runs of every round.
type Handoffs = Vec<(usize, handoff::Handoff, Vec<handoff::Run>)>;

async fn measure_handoffs(
    opts: &PgConnectOptions,
    settings: &Settings,
    variants: &[handoff::Handoff],
) -> anyhow::Result<Handoffs> {
    let mut all: Handoffs = Vec::new();
    for &n in &settings.waiters {
        for &variant in variants {
            all.push((n, variant, Vec::new()));
        }
    }
    for round in 0..settings.rounds.min(3) {
        for entry in all.iter_mut() {
            let (n, variant, runs) = entry;
            eprintln!("   round {round}: {} waiters, {}", n, variant.label());
            let run = handoff::run(
                opts,
                *variant,
                *n,
                settings.handoffs,
                settings.handoff_limit,
            )
            .await?;
            runs.push(run);
        }
    }
    Ok(all)
}

fn run_pgbench(admin: &PgConnectOptions, settings: &Settings) -> Vec<(usize, Result<f64, String>)> {
    let Some(pgbench) = pgbench::find() else {
        eprintln!("   pgbench not found; skipped");
        return Vec::new();
    };
    settings
        .waiters
        .iter()
        .map(|&n| {
            eprintln!("   pgbench, {n} clients");
            (
                n,
                pgbench::run(&pgbench, admin, &database(), n, settings.pgbench_seconds),
            )
        })
        .collect()
}

/// The hand-off table; `pgbench`: its reference rates, if it ran.
fn handoff_tables(
    settings: &Settings,
    handoffs: &Handoffs,
    pgbench: Option<&[(usize, Result<f64, String>)]>,
) -> String {
    let mut out = String::from(
        "\n### Contended hand-off (release → next holder), one hot key\n\n\
         | waiters | alternative | p50 µs | p99 µs | max µs | spread of round p50s µs | hand-offs/s (median of rounds) | vs pgbench |\n\
         |---:|---|---:|---:|---:|---:|---:|---:|\n",
    );
    for (n, variant, runs) in handoffs {
        let mut all: Vec<Duration> = runs.iter().flat_map(|r| r.latencies.clone()).collect();
        let summary = summarize(&mut all);
        let round_p50: Vec<f64> = runs
            .iter()
            .map(|r| us(summarize(&mut r.latencies.clone()).p50))
            .collect();
        let (lo, hi) = spread(&round_p50);
        let rate = median_f64(&runs.iter().map(|r| r.per_second).collect::<Vec<_>>());
        let vs = pgbench
            .unwrap_or_default()
            .iter()
            .find(|(c, _)| c == n && !variant.is_redis())
            .and_then(|(_, r)| r.as_ref().ok())
            .map_or("–".into(), |tps| format!("{:.2}×", rate / tps));
        let _ = writeln!(
            out,
            "| {n} | {} | {:.0} | {:.0} | {:.0} | {lo:.0}–{hi:.0} | {rate:.0} | {vs} |",
            variant.label(),
            us(summary.p50),
            us(summary.p99),
            us(summary.max),
        );
    }
    out.push_str(&format!(
        "\nEach row: {} rounds of up to {} hand-offs (or {} s).\n",
        settings.rounds.min(3),
        settings.handoffs,
        settings.handoff_limit.as_secs()
    ));
    if handoffs.iter().any(|(_, v, _)| v.is_redis()) {
        out.push_str(
            "\nRedis rows: one `RedisLocker` shared by the tasks, on the Redis server of \
             `DISTLOCK_BENCH_REDIS_URL` (loopback); no pgbench ratio.\n",
        );
    }
    match pgbench {
        // Not run (a section alone): nothing to say.
        None => {}
        Some([]) => out.push_str("\npgbench was not found; no reference rate.\n"),
        Some(pgbench) => {
            out.push_str(
            "\n#### pgbench reference: `SELECT pg_advisory_lock(k); SELECT pg_advisory_unlock(k);`, `-M prepared`\n\n\
             | clients | lock/unlock pairs per second |\n|---:|---:|\n",
            );
            for (n, rate) in pgbench {
                match rate {
                    Ok(tps) => {
                        let _ = writeln!(out, "| {n} | {tps:.0} |");
                    }
                    Err(err) => {
                        let _ = writeln!(out, "| {n} | failed: {err} |");
                    }
                }
            }
        }
    }
    out
}

fn handoff_chart(settings: &Settings, handoffs: &Handoffs) -> String {
    let groups: Vec<String> = settings.waiters.iter().map(|n| n.to_string()).collect();
    let series: Vec<chart::Series> = handoff::all()
        .iter()
        .map(|&variant| chart::Series {
            name: variant.short().to_owned(),
            points: settings
                .waiters
                .iter()
                .map(|&n| {
                    let (_, _, runs) =
                        handoffs.iter().find(|(w, v, _)| *w == n && *v == variant)?;
                    let mut all: Vec<Duration> =
                        runs.iter().flat_map(|r| r.latencies.clone()).collect();
                    let s = summarize(&mut all);
                    (s.n > 0).then(|| (us(s.p50), us(s.p99)))
                })
                .collect(),
        })
        .collect();
    chart::grouped_log(
        "Hand-off latency, release → next holder (log scale)",
        "µs",
        &groups,
        &series,
    )
}

async fn many_table(opts: &PgConnectOptions, settings: &Settings) -> anyhow::Result<String> {
    let mut out = String::from(
        "\n### Many keys held at once by one process\n\n\
         | keys | holding | acquire all ms (median) | µs per lock | release all ms (median) | spread of acquire ms | connections holding | note |\n\
         |---:|---|---:|---:|---:|---:|---:|---|\n",
    );
    let holdings = [
        many::Holding::RawOneConn,
        many::Holding::Distlock,
        many::Holding::MuxSequential(4),
        many::Holding::Mux(1),
        many::Holding::Mux(4),
        many::Holding::Mux(16),
    ];
    for &keys in &settings.many_keys {
        for holding in holdings {
            let mut runs = Vec::new();
            for _ in 0..settings.rounds.min(3) {
                eprintln!("   {keys} keys: {}", holding.label());
                match many::measure(opts, holding, keys).await {
                    Ok(held) => runs.push(held),
                    Err(err) => {
                        let _ = writeln!(
                            out,
                            "| {keys} | {} | – | – | – | – | – | failed: {err} |",
                            holding.label()
                        );
                        break;
                    }
                }
                if holding == many::Holding::Distlock {
                    break; // it stops at its pool's size every time
                }
            }
            let Some(last) = runs.last() else { continue };
            let acquire: Vec<f64> = runs.iter().map(|r| r.acquire.as_secs_f64() * 1e3).collect();
            let release: Vec<f64> = runs.iter().map(|r| r.release.as_secs_f64() * 1e3).collect();
            let (lo, hi) = spread(&acquire);
            let _ = writeln!(
                out,
                "| {} | {} | {:.1} | {:.0} | {:.1} | {lo:.1}–{hi:.1} | {} | {} |",
                last.keys,
                holding.label(),
                median_f64(&acquire),
                median_f64(&acquire) * 1e3 / last.keys.max(1) as f64,
                median_f64(&release),
                last.connections,
                last.note.as_deref().unwrap_or(""),
            );
        }
    }
    Ok(out)
}
