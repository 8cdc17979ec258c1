//! What the parts of `with_advisory_lock`'s try statement cost on a cold
//! backend: one connection runs `SELECT 1` and sleeps 1 ms, another then
//! times, inside `BEGIN`, each variant of the try statement (prepared, as
//! sqlx sends it) and the commit that follows (the checked commit where the
//! variant sets the transaction marker, a bare `COMMIT; BEGIN` elsewhere).
//! The variants take turns, in an order that changes every round; medians
//! of the rounds after 20 warm-up rounds.
//!
//! The statement texts are copied from the fragments in
//! `src/postgres/request/` as of `c7aab98`; this file is not built by
//! the crate or by CI. To run it:
//!
//! ```text
//! cp docs/bench/probes/xact-try-parts.rs examples/zz_probe.rs
//! cargo run --release --example zz_probe -- 400; rm examples/zz_probe.rs
//! ```
//!
//! Results: `docs/bench/runs/side-by-side-aa-bb56718.md`.

use std::time::{Duration, Instant};
use sqlx::{Connection, PgConnection};

const CC: &str = "CASE WHEN pg_catalog.current_setting('client_connection_check_interval') OPERATOR(pg_catalog.<>) '100ms' THEN pg_catalog.set_config('client_connection_check_interval', '100ms', false) END";
const MARK: &str = "pg_catalog.set_config('distlock.xact_lock', 'distlock.xact_lock', true)";
const KA: &str = "CASE WHEN pg_catalog.current_setting('tcp_user_timeout') OPERATOR(pg_catalog.<>) '30000' OR pg_catalog.current_setting('tcp_keepalives_idle') OPERATOR(pg_catalog.<>) '10' OR pg_catalog.current_setting('tcp_keepalives_interval') OPERATOR(pg_catalog.<>) '5' OR pg_catalog.current_setting('tcp_keepalives_count') OPERATOR(pg_catalog.<>) '3' THEN pg_catalog.set_config('tcp_keepalives_idle', '10', false) OPERATOR(pg_catalog.||) pg_catalog.set_config('tcp_keepalives_interval', '5', false) OPERATOR(pg_catalog.||) pg_catalog.set_config('tcp_keepalives_count', '3', false) OPERATOR(pg_catalog.||) pg_catalog.set_config('tcp_user_timeout', '30000', false) END";
const STANDBY: &str = "pg_catalog.pg_current_wal_lsn() IS NULL";
const CASE3: &str = "CASE WHEN $1::pg_catalog.int4 OPERATOR(pg_catalog.=) 1 THEN pg_catalog.pg_try_advisory_xact_lock(coalesce($2::pg_catalog.int8, pg_catalog.hashtext($3::pg_catalog.text)::pg_catalog.int8)) ELSE pg_catalog.pg_try_advisory_xact_lock(($2::pg_catalog.int8)::pg_catalog.int4, pg_catalog.hashtext($3::pg_catalog.text)) END";
const CHECK: &str = "SELECT pg_catalog.current_setting(pg_catalog.current_setting('distlock.xact_lock')); COMMIT; BEGIN";

#[derive(Clone, Copy)]
enum Bind { One, Three }

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let url = "postgres://postgres@127.0.0.1:5432/postgres";
    let mut a = PgConnection::connect(url).await?;
    let mut b = PgConnection::connect(url).await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("SELECT {CC}, {KA}"))).execute(&mut a).await?;
    let g = format!("{CC}, {MARK}, {KA}, {STANDBY}");
    let g_ns = format!("{CC}, {MARK}, {KA}");
    let variants: Vec<(&str, String, Bind)> = vec![
        ("bare", "SELECT pg_catalog.pg_try_advisory_xact_lock($1::pg_catalog.int8)".into(), Bind::One),
        ("bare+3 params", "SELECT pg_catalog.pg_try_advisory_xact_lock($2::pg_catalog.int8), $1::pg_catalog.int4, $3::pg_catalog.text".into(), Bind::Three),
        ("case3 alone", format!("SELECT {CASE3}"), Bind::Three),
        ("new (case3+guards)", format!("SELECT {CASE3}, {g}"), Bind::Three),
        ("new no standby", format!("SELECT {CASE3}, {g_ns}"), Bind::Three),
        ("1 param + guards", format!("SELECT pg_catalog.pg_try_advisory_xact_lock($1::pg_catalog.int8), {g}"), Bind::One),
        ("1 param + guards no standby", format!("SELECT pg_catalog.pg_try_advisory_xact_lock($1::pg_catalog.int8), {g_ns}"), Bind::One),
        ("1 param + marker only", format!("SELECT pg_catalog.pg_try_advisory_xact_lock($1::pg_catalog.int8), {MARK}"), Bind::One),
    ];
    let rounds: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(400);
    let mut times: Vec<(Vec<f64>, Vec<f64>)> = vec![(vec![], vec![]); variants.len()];
    let mut key: i64 = 720_000_000;
    let mut order: Vec<usize> = (0..variants.len()).collect();
    for r in 0..rounds {
        // rotate the order each round
        order.rotate_left(1);
        if r % 2 == 0 { order.reverse(); }
        for &i in &order {
            key += 1;
            let (_, sql, bind) = &variants[i];
            let _: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&mut b).await?;
            tokio::time::sleep(Duration::from_millis(1)).await;
            let mut tx = a.begin().await?;
            let t0 = Instant::now();
            let q = sqlx::query(sqlx::AssertSqlSafe(sql.as_str()));
            let q = match bind {
                Bind::One => q.bind(key),
                Bind::Three => q.bind(1_i32).bind(key).bind(None::<String>),
            };
            q.fetch_one(&mut *tx).await?;
            let t1 = Instant::now();
            let marked = sql.contains("distlock.xact_lock");
            if marked {
                sqlx::raw_sql(CHECK).execute(&mut *tx).await?;
            } else {
                sqlx::raw_sql("COMMIT; BEGIN").execute(&mut *tx).await?;
            }
            let t2 = Instant::now();
            drop(tx);
            if r >= 20 {
                times[i].0.push((t1 - t0).as_secs_f64() * 1e6);
                times[i].1.push((t2 - t1).as_secs_f64() * 1e6);
            }
        }
    }
    for (i, (name, _, _)) in variants.iter().enumerate() {
        let med = |v: &mut Vec<f64>| { v.sort_by(|a, b| a.total_cmp(b)); v[v.len() / 2] };
        let (t, c) = &mut times[i];
        println!("{name:32} try {:7.1}  commit {:7.1}", med(t), med(c));
    }
    Ok(())
}
