//! How cost grows: each row one run at one scale, on a private cluster (see
//! `server.rs`) whose lock table holds about 150,000 locks
//! (`max_locks_per_transaction = 1000` × `max_connections = 150`), so the
//! shared server's lock table is never filled. Two more rows go past that
//! limit on purpose (raw `pg_advisory_lock`, then distlock's `lock_all`), to
//! record what a user sees when it is reached; the server is let settle
//! after each. A row that fails is recorded as failed and the rest still run.

use std::fmt::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock::{LockKey, PgLocker, SessionLock};
use sqlx::postgres::{PgConnectOptions, PgDatabaseError, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

use crate::counting::CountingProxy;
use crate::filter::Filter;
use crate::server::Server;
use crate::stats::median_f64;

const MAX_LOCKS_PER_TRANSACTION: usize = 1000;
const MAX_CONNECTIONS: usize = 150;
/// The keys the past-the-limit rows ask for: twice what the table holds.
const PAST_THE_LIMIT: usize = MAX_LOCKS_PER_TRANSACTION * MAX_CONNECTIONS * 2;
/// How long [`settle`] waits for the server before it gives up.
const SETTLE_LIMIT: Duration = Duration::from_secs(60);
/// How long a session still holding advisory locks may take to end by
/// itself before [`settle`] terminates it.
const SETTLE_GRACE: Duration = Duration::from_secs(5);

/// One row of the table: what was measured, at what scale, the figures
/// (or why there are none).
struct Row {
    what: &'static str,
    scale: String,
    figures: String,
}

/// The section for the report. `quick` runs the small scales only;
/// `filter` picks row groups by name (see `filter.rs`).
pub async fn table(quick: bool, filter: &Filter) -> anyhow::Result<String> {
    let mut out = String::from(
        "\n### How cost grows (one run per row, private cluster)\n\n\
         | measured | scale | figures |\n|---|---:|---|\n",
    );
    let conf = [
        format!("max_locks_per_transaction = {MAX_LOCKS_PER_TRANSACTION}"),
        format!("max_connections = {MAX_CONNECTIONS}"),
        "shared_buffers = 64MB".to_owned(),
    ];
    let started = Instant::now();
    let server = match tokio::task::spawn_blocking(move || {
        let conf: Vec<&str> = conf.iter().map(String::as_str).collect();
        Server::start(&conf)
    })
    .await?
    {
        Ok(server) => server,
        Err(err) => {
            let _ = writeln!(
                out,
                "| all rows | – | not run: no private cluster ({}) |",
                one_line(&err.to_string())
            );
            return Ok(out);
        }
    };
    let opts = server.options();
    let mut rows = Vec::new();
    let result = rows_on(&opts, &server, (quick, filter), &mut rows).await;
    for row in &rows {
        let _ = writeln!(out, "| {} | {} | {} |", row.what, row.scale, row.figures);
    }
    if let Err(err) = result {
        let _ = writeln!(out, "| (stopped) | – | {} |", one_line(&format!("{err:#}")));
    }
    let _ = writeln!(
        out,
        "\nThe private cluster's lock table: `max_locks_per_transaction` {MAX_LOCKS_PER_TRANSACTION} × \
         `max_connections` {MAX_CONNECTIONS} ≈ {} locks (PostgreSQL's default is 64 × 100 = 6,400). \
         Section took {:.0} s.",
        MAX_LOCKS_PER_TRANSACTION * MAX_CONNECTIONS,
        started.elapsed().as_secs_f64()
    );
    drop(server);
    Ok(out)
}

async fn rows_on(
    opts: &PgConnectOptions,
    server: &Server,
    (quick, filter): (bool, &Filter),
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect_with(opts.clone())
        .await?;
    distlock::migrate(&pool).await?;

    for n in [100usize, 10_000, 100_000] {
        if !filter.scale_row("holders") {
            break;
        }
        if quick && n > 10_000 {
            rows.push(skipped("holders()", n, "not run with --quick"));
            continue;
        }
        let row = holders(opts, &pool, n).await;
        rows.push(or_failed(opts, ("holders()", n), row).await);
    }
    if filter.scale_row("past the limit") {
        let row = past_the_limit(opts).await;
        rows.push(or_failed(opts, (RAW_PAST, PAST_THE_LIMIT), row).await);
        // The sessions that filled the lock table end asynchronously; the
        // next rows need their slots back.
        rows.extend(settled(opts).await);
        let row = lock_all_past_the_limit(&pool).await;
        rows.push(or_failed(opts, (DISTLOCK_PAST, PAST_THE_LIMIT), row).await);
        rows.extend(settled(opts).await);
    }

    for n in [1usize, 16, 256, 4_096] {
        if !filter.scale_row("lock_all") {
            break;
        }
        if quick && n > 256 {
            rows.push(skipped("lock_all + release", n, "not run with --quick"));
            continue;
        }
        let row = lock_all(&pool, n).await;
        rows.push(or_failed(opts, ("lock_all + release", n), row).await);
    }

    for n in [1_000usize, 10_000, 100_000] {
        if !filter.scale_row("multiplex") {
            break;
        }
        if quick && n > 1_000 {
            rows.push(skipped(
                "multiplex(4) holding keys",
                n,
                "not run with --quick",
            ));
            continue;
        }
        let row = multiplexed(opts, server, n, quick).await;
        rows.push(or_failed(opts, ("multiplex(4) holding keys", n), row).await);
        // What each of its 4 sessions does, without distlock: the cost of
        // one more lock grows with the locks the session already holds.
        let row = raw_one_by_one(opts, n / 4).await;
        rows.push(or_failed(opts, (RAW_ONE_BY_ONE, n / 4), row).await);
    }

    for waiters in [10usize, 100, 1_000] {
        if !filter.scale_row("semaphore") {
            break;
        }
        if quick && waiters > 100 {
            rows.push(skipped(
                "Semaphore(10), waiters",
                waiters,
                "not run with --quick",
            ));
            continue;
        }
        let row = semaphore(opts, waiters, quick).await;
        rows.push(or_failed(opts, ("Semaphore(10), waiters", waiters), row).await);
    }

    for n in [1_000usize, 100_000] {
        if !filter.scale_row("TableLocker") {
            break;
        }
        if quick && n > 1_000 {
            rows.push(skipped(
                "TableLocker, live leases",
                n,
                "not run with --quick",
            ));
            continue;
        }
        let row = table_leases(&pool, n).await;
        rows.push(or_failed(opts, ("TableLocker, live leases", n), row).await);
    }
    pool.close().await;
    Ok(())
}

fn skipped(what: &'static str, n: usize, why: &str) -> Row {
    Row {
        what,
        scale: thousands(n),
        figures: why.to_owned(),
    }
}

/// The row, or why it failed: one failing row does not hide the rows after
/// it. A failed row may have left locks behind, so the server is let settle
/// before the next one.
async fn or_failed(
    opts: &PgConnectOptions,
    (what, n): (&'static str, usize),
    row: anyhow::Result<Row>,
) -> Row {
    let err = match row {
        Ok(row) => return row,
        Err(err) => err,
    };
    let mut why = format!("failed: {}", one_line(&format!("{err:#}")));
    if let Err(err) = settle(opts).await {
        let _ = write!(why, "; then {}", one_line(&format!("{err:#}")));
    }
    skipped(what, n, &why)
}

/// [`settle`] as a row when it fails, so the rows after it are read with
/// that in mind.
async fn settled(opts: &PgConnectOptions) -> Option<Row> {
    let err = settle(opts).await.err()?;
    Some(Row {
        what: "(waiting for the lock table to empty)",
        scale: "–".to_owned(),
        figures: format!("failed: {}", one_line(&format!("{err:#}"))),
    })
}

fn thousands(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn one_line(s: &str) -> String {
    s.replace(['\n', '|'], " ")
}

/// Waits (up to [`SETTLE_LIMIT`]) until the server holds no advisory lock.
/// While the lock table is full even a new connection fails to start (it
/// takes locks too), so failures are retried; a session still holding
/// advisory locks after [`SETTLE_GRACE`] (a dropped connection whose end the
/// server has not noticed) is terminated.
async fn settle(opts: &PgConnectOptions) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        let terminate = started.elapsed() > SETTLE_GRACE;
        let last = match advisory_held(opts, terminate).await {
            Ok(0) => return Ok(()),
            Ok(held) => format!("{held} advisory locks still held"),
            Err(err) => one_line(&format!("{err:#}")),
        };
        anyhow::ensure!(
            started.elapsed() < SETTLE_LIMIT,
            "the server did not settle in {} s: {last}",
            SETTLE_LIMIT.as_secs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The advisory locks other sessions hold, on a connection of its own;
/// with `terminate`, the sessions holding them are ended first.
async fn advisory_held(opts: &PgConnectOptions, terminate: bool) -> anyhow::Result<i64> {
    let mut conn = opts.connect().await?;
    let held = advisory_held_on(&mut conn, terminate).await;
    // Closed whatever the query gave: a dropped connection lingers.
    let _ = conn.close().await;
    held
}

async fn advisory_held_on(conn: &mut PgConnection, terminate: bool) -> anyhow::Result<i64> {
    if terminate {
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM (SELECT DISTINCT pid FROM pg_locks \
             WHERE locktype = 'advisory' AND pid <> pg_backend_pid()) p",
        )
        .execute(&mut *conn)
        .await?;
    }
    let held = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid <> pg_backend_pid()",
    )
    .fetch_one(&mut *conn)
    .await?;
    Ok(held)
}

/// Takes `n` session advisory locks on one raw connection, in one statement.
/// On failure the connection is closed, which frees what it took.
async fn hold_raw(opts: &PgConnectOptions, base: i64, n: usize) -> anyhow::Result<PgConnection> {
    let mut conn = opts.connect().await?;
    match take_raw(&mut conn, base, n).await {
        Ok(()) => Ok(conn),
        Err(err) => {
            let _ = conn.close().await;
            Err(err)
        }
    }
}

/// Locks `base..base + n` on `conn` in one statement. Locks taken before an
/// error stay held: session advisory locks ignore the rollback.
async fn take_raw(conn: &mut PgConnection, base: i64, n: usize) -> anyhow::Result<()> {
    let last = base + i64::try_from(n)? - 1;
    let _: i64 = sqlx::query_scalar(
        "SELECT count(pg_advisory_lock(k)) FROM generate_series($1::bigint, $2::bigint) k",
    )
    .bind(base)
    .bind(last)
    .fetch_one(conn)
    .await?;
    Ok(())
}

/// PostgreSQL's HINT of `err`, if it has one ("You might need to increase
/// max_locks_per_transaction." is what tells a user which setting to raise).
fn pg_hint(err: &anyhow::Error) -> Option<String> {
    let db = err.downcast_ref::<sqlx::Error>()?.as_database_error()?;
    let hint = db.try_downcast_ref::<PgDatabaseError>()?.hint()?;
    Some(one_line(hint))
}

/// `holders()` while `n` advisory locks are held on the server: the cost is
/// the server's scan of its lock table joined with `pg_stat_activity`, and
/// the rows crossing the wire.
async fn holders(opts: &PgConnectOptions, pool: &PgPool, n: usize) -> anyhow::Result<Row> {
    let started = Instant::now();
    let mut conn = match hold_raw(opts, 1_000_000, n).await {
        Ok(conn) => conn,
        Err(err) => {
            return Ok(skipped(
                "holders()",
                n,
                &format!("could not hold the locks: {}", one_line(&err.to_string())),
            ));
        }
    };
    let hold = started.elapsed();
    let locker = PgLocker::new(pool.clone());
    let mut times = Vec::new();
    let mut seen = 0;
    for _ in 0..3 {
        let t = Instant::now();
        seen = locker.holders().await?.len();
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    sqlx::query("SELECT pg_advisory_unlock_all()")
        .execute(&mut conn)
        .await?;
    conn.close().await?;
    Ok(Row {
        what: "holders()",
        scale: thousands(n),
        figures: format!(
            "{:.1} ms (median of 3), {seen} rows; taking the {n} locks in one statement took {:.0} ms",
            median_f64(&times),
            hold.as_secs_f64() * 1e3
        ),
    })
}

const RAW_PAST: &str = "past the lock table's limit (raw pg_advisory_lock)";
const DISTLOCK_PAST: &str = "past the lock table's limit (distlock lock_all)";

/// More locks than the lock table holds: the error a user gets.
async fn past_the_limit(opts: &PgConnectOptions) -> anyhow::Result<Row> {
    let mut conn = opts.connect().await?;
    let taken = take_raw(&mut conn, 10_000_000, PAST_THE_LIMIT).await;
    // The locks go back on the session that took them, and the session is
    // closed rather than dropped: a dropped connection's backend keeps the
    // table full until the server notices, and the next connection then
    // fails to start with the same error.
    let _ = sqlx::query("SELECT pg_advisory_unlock_all()")
        .execute(&mut conn)
        .await;
    let _ = conn.close().await;
    let figures = match taken {
        Ok(()) => {
            "the server took them all (its lock table has slack beyond the formula)".to_owned()
        }
        Err(err) => format!(
            "refused: `{}`{}; the session keeps the locks it took before the error until it \
             releases them or ends (here it releases them)",
            one_line(&err.to_string()),
            pg_hint(&err).map_or(String::new(), |hint| format!(", hint: `{hint}`"))
        ),
    };
    Ok(Row {
        what: RAW_PAST,
        scale: thousands(PAST_THE_LIMIT),
        figures,
    })
}

/// The same limit through distlock: the error its user gets from
/// `lock_all` over more keys than the table holds.
async fn lock_all_past_the_limit(pool: &PgPool) -> anyhow::Result<Row> {
    let locker = PgLocker::new(pool.clone());
    let keys = (0..i64::try_from(PAST_THE_LIMIT)?).map(|k| LockKey::id(60_000_000 + k));
    let t = Instant::now();
    let figures = match locker.lock_all(keys, Duration::from_secs(10)).await {
        Ok(all) => {
            all.release().await?;
            "took them all (the lock table has slack beyond the formula)".to_owned()
        }
        Err(err) => {
            let variant = format!("{err:?}");
            format!(
                "refused after {:.0} ms: `{}`{}",
                t.elapsed().as_secs_f64() * 1e3,
                one_line(&err.to_string()),
                // The variant only when it is short enough to read in a cell.
                if variant.len() <= 100 {
                    format!(" (`{}`)", one_line(&variant))
                } else {
                    String::new()
                }
            )
        }
    };
    Ok(Row {
        what: DISTLOCK_PAST,
        scale: thousands(PAST_THE_LIMIT),
        figures,
    })
}

/// `lock_all` over `n` free keys, then release: median of 5.
async fn lock_all(pool: &PgPool, n: usize) -> anyhow::Result<Row> {
    let locker = PgLocker::new(pool.clone());
    let mut take = Vec::new();
    let mut give = Vec::new();
    for run in 0..5_i64 {
        let base = 20_000_000 + run * 10_000;
        let keys: Vec<LockKey> = (0..i64::try_from(n)?)
            .map(|k| LockKey::id(base + k))
            .collect();
        let t = Instant::now();
        let all = match locker.lock_all(keys, Duration::from_secs(10)).await {
            Ok(all) => all,
            Err(err) => {
                return Ok(skipped(
                    "lock_all + release",
                    n,
                    &format!("failed: {}", one_line(&err.to_string())),
                ));
            }
        };
        take.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        all.release().await?;
        give.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let per_key = median_f64(&take) * 1e3 / n as f64;
    Ok(Row {
        what: "lock_all + release",
        scale: thousands(n),
        figures: format!(
            "take {:.2} ms ({per_key:.1} µs per key), release {:.2} ms (medians of 5)",
            median_f64(&take),
            median_f64(&give)
        ),
    })
}

/// Resident set size of this process, in MiB.
fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<f64>().ok())
        .map_or(f64::NAN, |pages| pages * 4096.0 / 1024.0 / 1024.0)
}

/// CPU time (user + system) of this process so far, in seconds.
fn cpu_seconds() -> f64 {
    // Fields 14 and 15 of /proc/self/stat, after the parenthesised name.
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let rest = s.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            let utime: f64 = f.get(11)?.parse().ok()?;
            let stime: f64 = f.get(12)?.parse().ok()?;
            Some((utime + stime) / 100.0)
        })
        .unwrap_or(f64::NAN)
}

const RAW_ONE_BY_ONE: &str = "one raw session, one pg_advisory_lock per statement";

/// One connection taking `n` session advisory locks, one statement (one
/// transaction) each, as a multiplexed connection takes its share. At
/// every transaction's end PostgreSQL walks the session's whole local lock
/// table, session locks included, so the n-th lock costs O(n) and the
/// whole run O(n²).
async fn raw_one_by_one(opts: &PgConnectOptions, n: usize) -> anyhow::Result<Row> {
    let mut conn = opts.connect().await?;
    let base = 40_000_000_i64;
    let t = Instant::now();
    let mut last_tenth = Duration::ZERO;
    for k in 0..i64::try_from(n)? {
        let one = Instant::now();
        sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(base + k)
            .execute(&mut conn)
            .await?;
        if k >= i64::try_from(n - n / 10)? {
            last_tenth += one.elapsed();
        }
    }
    let took = t.elapsed();
    sqlx::query("SELECT pg_advisory_unlock_all()")
        .execute(&mut conn)
        .await?;
    conn.close().await?;
    let per_last = last_tenth.as_secs_f64() * 1e6 / (n / 10).max(1) as f64;
    Ok(Row {
        what: RAW_ONE_BY_ONE,
        scale: thousands(n),
        figures: format!(
            "took {} ms ({:.0} µs per lock on average, {per_last:.0} µs per lock for the last tenth)",
            took.as_millis(),
            took.as_secs_f64() * 1e6 / n as f64
        ),
    })
}

/// A multiplexed locker (4 shared connections) holding `n` keys: client
/// memory, connections, and what its heartbeats cost while it only holds.
/// Its pool goes through a counting proxy, so statements are counted as
/// round trips.
async fn multiplexed(
    opts: &PgConnectOptions,
    server: &Server,
    n: usize,
    quick: bool,
) -> anyhow::Result<Row> {
    let proxy = CountingProxy::start("127.0.0.1", server.port(), Duration::ZERO)?;
    let proxied = opts.clone().port(proxy.port());
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(proxied)
        .await?;
    let locker = PgLocker::builder(pool.clone()).multiplex(4).build()?;
    let rss_before = rss_mib();
    let base = 30_000_000_i64;
    let n_i64 = i64::try_from(n)?;
    let t = Instant::now();
    // 32 tasks, as many.rs takes them.
    let mut set = tokio::task::JoinSet::new();
    for task in 0..32_i64 {
        let locker = locker.clone();
        set.spawn(async move {
            let mut held: Vec<SessionLock> = Vec::new();
            let mut k = task;
            while k < n_i64 {
                match locker.try_lock(LockKey::id(base + k)).await {
                    Ok(Some(lock)) => held.push(lock),
                    Ok(None) => return (held, Some(format!("key {} busy", base + k))),
                    Err(err) => return (held, Some(one_line(&err.to_string()))),
                }
                k += 32;
            }
            (held, None)
        });
    }
    let mut locks = Vec::with_capacity(n);
    let mut failure = None;
    while let Some(part) = set.join_next().await {
        let (held, err) = part?;
        locks.extend(held);
        failure = failure.or(err);
    }
    let acquire = t.elapsed();
    let rss_after = rss_mib();
    let mut obs = opts.connect().await?;
    let connections: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT pid) FROM pg_locks WHERE locktype = 'advisory' AND granted",
    )
    .fetch_one(&mut obs)
    .await?;
    // Holding only: statements and CPU over a window.
    let window = if quick {
        Duration::from_secs(2)
    } else {
        Duration::from_secs(5)
    };
    let (turns, cpu) = (proxy.turns(), cpu_seconds());
    tokio::time::sleep(window).await;
    let statements = (proxy.turns() - turns) as f64 / window.as_secs_f64();
    let cpu_ms = (cpu_seconds() - cpu) * 1e3 / window.as_secs_f64();
    let held = locks.len();
    let t = Instant::now();
    release_all(locks).await?;
    let release = t.elapsed();
    obs.close().await?;
    drop(locker);
    pool.close().await;
    Ok(Row {
        what: "multiplex(4) holding keys",
        scale: thousands(n),
        figures: format!(
            "held {held} in {:.0} ms (32 tasks), released in {:.0} ms; client RSS +{:.1} MiB \
             ({rss_before:.0} → {rss_after:.0}); {connections} connections holding; while holding: \
             {statements:.1} round trips/s, {cpu_ms:.1} ms CPU/s (whole process){}",
            acquire.as_secs_f64() * 1e3,
            release.as_secs_f64() * 1e3,
            rss_after - rss_before,
            failure.map_or(String::new(), |e| format!("; stopped early: {e}")),
        ),
    })
}

async fn release_all(locks: Vec<SessionLock>) -> anyhow::Result<()> {
    let mut chunks: Vec<Vec<SessionLock>> = (0..32).map(|_| Vec::new()).collect();
    for (i, lock) in locks.into_iter().enumerate() {
        chunks[i % 32].push(lock);
    }
    let mut set = tokio::task::JoinSet::new();
    for chunk in chunks {
        set.spawn(async move {
            for lock in chunk {
                lock.release().await?;
            }
            Ok::<_, distlock::Error>(())
        });
    }
    while let Some(done) = set.join_next().await {
        done??;
    }
    Ok(())
}

/// `Semaphore` with 10 permits, all held, and `waiters` tasks in
/// `acquire`; the holders give their permits back and every waiter takes one
/// and gives it back at once. Measures how long until all waiters were
/// served. Kept in one function: the semaphore's API is in flux.
async fn semaphore(opts: &PgConnectOptions, waiters: usize, quick: bool) -> anyhow::Result<Row> {
    let pool = PgPoolOptions::new()
        .max_connections(64)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(opts.clone())
        .await?;
    // The PostgreSQL semaphore: one waiting connection per process.
    let semaphore =
        Arc::new(PgLocker::new(pool.clone()).semaphore(&format!("bench-scale-{waiters}"), 10)?);
    let mut held = Vec::new();
    for _ in 0..10 {
        if let Some(permit) = semaphore.try_acquire().await? {
            held.push(permit);
        }
    }
    let deadline = if quick {
        Duration::from_secs(5)
    } else {
        Duration::from_secs(20)
    };
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..waiters {
        let semaphore = semaphore.clone();
        set.spawn(async move {
            let permit = semaphore.acquire(deadline).await?;
            permit.release().await
        });
    }
    // Let the waiters reach the server before the permits come free.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut obs = opts.connect().await?;
    let waiting: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
    )
    .fetch_one(&mut obs)
    .await?;
    let t = Instant::now();
    for permit in held {
        permit.release().await?;
    }
    let (mut served, mut failed, mut first_error) = (0usize, 0usize, None);
    let all = tokio::time::timeout(deadline + Duration::from_secs(5), async {
        while let Some(done) = set.join_next().await {
            match done {
                Ok(Ok(())) => served += 1,
                Ok(Err(err)) => {
                    failed += 1;
                    first_error.get_or_insert_with(|| one_line(&err.to_string()));
                }
                Err(err) => {
                    failed += 1;
                    first_error.get_or_insert_with(|| one_line(&err.to_string()));
                }
            }
        }
    })
    .await;
    let took = t.elapsed();
    set.abort_all();
    obs.close().await?;
    pool.close().await;
    Ok(Row {
        what: "Semaphore(10), waiters",
        scale: thousands(waiters),
        figures: format!(
            "{served} served, {failed} failed in {:.0} ms ({:.0} µs per permit hand-out); \
             {waiting} lock requests waiting on the server before the release{}{}",
            took.as_secs_f64() * 1e3,
            took.as_secs_f64() * 1e6 / served.max(1) as f64,
            first_error.map_or(String::new(), |e| format!("; first error: {e}")),
            if all.is_err() {
                "; gave up waiting"
            } else {
                ""
            },
        ),
    })
}

/// `TableLocker` while `n` other live leases are in the table (rows written
/// directly, as other holders would have them): grant + release, a renewal
/// (the statement a lease's task sends, on one of those rows), then grant +
/// release with all of them expired, and `purge_expired` over them.
async fn table_leases(pool: &PgPool, n: usize) -> anyhow::Result<Row> {
    sqlx::query("TRUNCATE distlock.leases")
        .execute(pool)
        .await?;
    sqlx::query(
        "INSERT INTO distlock.leases (space, lock_id, key_text, owner, token, acquired_at, \
         renewed_at, expires_at) \
         SELECT 1, 40000000 + g, (40000000 + g)::text, gen_random_uuid(), g, now(), now(), \
         now() + interval '1 hour' FROM generate_series(1, $1::bigint) g",
    )
    .bind(i64::try_from(n)?)
    .execute(pool)
    .await?;
    sqlx::query("ANALYZE distlock.leases").execute(pool).await?;
    let table = distlock::postgres::TableLocker::new(pool.clone());
    let grant = |base: i64| {
        let table = &table;
        async move {
            let mut times = Vec::new();
            for k in 0..30 {
                let t = Instant::now();
                if let Some(lease) = table.try_lock(LockKey::id(base + k)).await? {
                    lease.release().await?;
                }
                times.push(t.elapsed().as_secs_f64() * 1e6);
            }
            Ok::<_, anyhow::Error>(median_f64(&times))
        }
    };
    let live = grant(50_000_000).await?;
    let renew = renew(pool).await?;
    sqlx::query("UPDATE distlock.leases SET expires_at = now() - interval '1 s'")
        .execute(pool)
        .await?;
    let expired = grant(50_100_000).await?;
    let t = Instant::now();
    let purged = table.purge_expired(10_000).await?;
    let purge = t.elapsed();
    sqlx::query("TRUNCATE distlock.leases")
        .execute(pool)
        .await?;
    drop(table);
    Ok(Row {
        what: "TableLocker, live leases",
        scale: thousands(n),
        figures: format!(
            "try_lock + release {live:.0} µs (median of 30); renewal {renew:.0} µs (median of \
             30); with them all expired, try_lock + release {expired:.0} µs (about one grant in \
             16 purges up to 32); purge_expired(10,000) deleted {purged} in {:.0} ms",
            purge.as_secs_f64() * 1e3
        ),
    })
}

/// A renewal as a lease's task sends it (`distlock.lease_renew` as a simple
/// query on a pooled connection, one commit), on one of the live rows:
/// median µs of 30.
async fn renew(pool: &PgPool) -> anyhow::Result<f64> {
    let (lock_id, owner): (i64, String) =
        sqlx::query_as("SELECT lock_id, owner::text FROM distlock.leases ORDER BY lock_id LIMIT 1")
            .fetch_one(pool)
            .await?;
    // The owner is a UUID the server rendered and the id an integer: nothing
    // in them can change the statement's shape.
    let sql = format!(
        "SELECT distlock.lease_renew(1::pg_catalog.int2, {lock_id}, \
         '{owner}'::pg_catalog.uuid, 30000::pg_catalog.int8)"
    );
    let mut times = Vec::new();
    for _ in 0..30 {
        let t = Instant::now();
        let row = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.clone()))
            .fetch_one(pool)
            .await?;
        times.push(t.elapsed().as_secs_f64() * 1e6);
        anyhow::ensure!(
            sqlx::Row::try_get::<bool, _>(&row, 0)?,
            "the renewal was refused"
        );
    }
    Ok(median_f64(&times))
}
