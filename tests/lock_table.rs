//! Exhausting PostgreSQL's shared lock table (SQLSTATE 53200, "out of shared
//! memory"): every way of taking a lock reports the typed
//! `Error::LockTableFull`, nothing a failed attempt took stays held, a
//! multiplexed connection's other locks survive its failed try (fenced or
//! not), and the server and the locker recover once the table drains.
//!
//! The lock table is shared by the whole cluster, every database included,
//! so this test has a test binary of its own (no other test of this suite
//! runs at the same time) and keeps the table full for as short a time as
//! it can: it fills the table, makes its checks, and lets go at once. A
//! panic in between drops the filling connection, which frees its locks.

mod common;

use std::time::{Duration, Instant};

use common::*;
use distlock::{Error, PgLocker};
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};
use sqlx::{ConnectOptions, Connection};

const OUT_OF_SHARED_MEMORY: &str = "53200";

fn is_full(err: &sqlx::Error) -> bool {
    err.as_database_error()
        .and_then(|e| e.code())
        .is_some_and(|code| code == OUT_OF_SHARED_MEMORY)
}

/// Takes session-level advisory locks `(7353, n)` on `conn` until the lock
/// table is full; returns how many it holds. Batches shrink as the table
/// fills, down to single locks, so the table ends up full to the last slot.
async fn fill(conn: &mut PgConnection, next: &mut i32) -> usize {
    let mut batch = 4096;
    loop {
        let taken: Result<i64, _> = sqlx::query_scalar(
            "SELECT count(pg_advisory_lock(7353, g)) FROM generate_series($1::int4, $2::int4) g",
        )
        .bind(*next)
        .bind(*next + batch - 1)
        .fetch_one(&mut *conn)
        .await;
        // Session locks taken before an error stay held: skip past them.
        *next += batch;
        match taken {
            Ok(_) => {}
            Err(err) if is_full(&err) && batch == 1 => break,
            Err(err) if is_full(&err) => batch = (batch / 8).max(1),
            Err(err) => panic!("filling the lock table: {err}"),
        }
    }
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()",
    )
    .fetch_one(&mut *conn)
    .await
    .expect("count own locks");
    usize::try_from(held).expect("count")
}

/// Advisory locks of database `db` held by anyone but `filler`. Reads no
/// shared catalog (`pg_database` would need a slot in the full table).
async fn others(obs: &mut PgConnection, db: u32, filler: i32) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid <> $1 \
         AND database = $2::oid",
    )
    .bind(filler)
    .bind(i64::from(db))
    .fetch_one(obs)
    .await
    .expect("pg_locks")
}

#[sqlx::test(migrations = false)]
async fn lock_table_exhaustion_is_typed_leaves_nothing_held_and_recovers(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let opts = connect_opts.host("127.0.0.1");
    let pool = PgPoolOptions::new()
        .max_connections(3)
        .min_connections(3)
        .connect_with(opts.clone().application_name("distlock-lock-table"))
        .await
        .expect("pool");
    distlock::migrate(&pool).await.expect("migrate");
    let locker = PgLocker::new(pool.clone());
    let mux = PgLocker::builder(pool.clone())
        .multiplex(1)
        .build()
        .expect("valid settings");
    let fenced_mux = PgLocker::builder(pool.clone())
        .multiplex(1)
        .fencing(true)
        .build()
        .expect("valid settings");
    // Every connection this test needs is open before the table fills:
    // the pool's three, the multiplexed one, the observer.
    for l in [&locker, &mux, &fenced_mux] {
        l.try_lock("lt:warm")
            .await
            .expect("warm-up")
            .expect("free")
            .release()
            .await
            .expect("release");
    }
    // Held through the full table on the fenced multiplexed connection: a
    // failed try on that connection that took nothing must not cost it.
    let kept = fenced_mux
        .try_lock("lt:kept")
        .await
        .expect("try_lock")
        .expect("lt:kept is free");
    let mut obs = observer(&opts).await;
    let mut filler = opts
        .clone()
        .application_name("distlock-lock-table-filler")
        .connect()
        .await
        .expect("filler");
    let filler_pid = backend_pid(&mut filler).await;
    let db: i64 =
        sqlx::query_scalar("SELECT oid::int8 FROM pg_database WHERE datname = current_database()")
            .fetch_one(&mut obs)
            .await
            .expect("database oid");
    let db = u32::try_from(db).expect("oid");

    let mut next = 0;
    let started = Instant::now();
    let mut held = fill(&mut filler, &mut next).await;
    let mut outcomes = Vec::new();
    let mut refills = 0;
    // Other clusters' sessions may free a slot meanwhile: an attempt that
    // succeeds is released, the table topped up, and the attempt repeated
    // (bounded).
    for what in [
        "try_lock",
        "lock",
        "with_advisory_lock",
        "multiplexed try_lock",
        "fenced multiplexed try_lock",
    ] {
        let mut outcome = None;
        for _ in 0..5 {
            let attempt: Result<bool, Error> = match what {
                "try_lock" => match locker.try_lock("lt:try").await {
                    Ok(Some(lock)) => lock.release().await.map(|()| true),
                    Ok(None) => panic!("lt:try is free"),
                    Err(err) => Err(err),
                },
                "lock" => match locker.lock("lt:wait", Duration::from_secs(1)).await {
                    Ok(lock) => lock.release().await.map(|()| true),
                    Err(err) => Err(err),
                },
                "with_advisory_lock" => locker
                    .with_advisory_lock("lt:xact", async |_| Ok::<_, Error>(()))
                    .await
                    .map(|done| done.is_some()),
                "multiplexed try_lock" => match mux.try_lock("lt:mux").await {
                    Ok(Some(lock)) => lock.release().await.map(|()| true),
                    Ok(None) => panic!("lt:mux is free"),
                    Err(err) => Err(err),
                },
                _ => match fenced_mux.try_lock("lt:muxf").await {
                    Ok(Some(lock)) => lock.release().await.map(|()| true),
                    Ok(None) => panic!("lt:muxf is free"),
                    Err(err) => Err(err),
                },
            };
            match attempt {
                Ok(_) => {
                    refills += 1;
                    held = fill(&mut filler, &mut next).await;
                }
                Err(err) => {
                    outcome = Some(err);
                    break;
                }
            }
        }
        outcomes.push((what, outcome));
    }
    // Less the one lock held on purpose (`lt:kept`).
    let partial = others(&mut obs, db, filler_pid).await - 1;
    let new_connection = tokio::time::timeout(Duration::from_secs(5), opts.connect()).await;
    let connects_while_full = matches!(new_connection, Ok(Ok(_)));
    if let Ok(Ok(conn)) = new_connection {
        let _ = conn.close().await;
    }
    // Let go at once: the rest of the cluster needs its lock table back.
    sqlx::query("SELECT pg_advisory_unlock_all()")
        .execute(&mut filler)
        .await
        .expect("unlock all");
    let window = started.elapsed();
    let _ = filler.close().await;

    println!(
        "lock table: full with {held} advisory locks for {window:?} ({refills} top-ups); a new connection while full: {}",
        if connects_while_full {
            "accepted"
        } else {
            "refused"
        }
    );
    for (what, outcome) in &outcomes {
        println!("  {what}: {outcome:?}");
        match outcome {
            Some(Error::LockTableFull { key }) => {
                assert!(key.to_string().starts_with("lt:"), "{key}")
            }
            other => panic!("{what} with a full lock table: {other:?}"),
        }
    }
    assert_eq!(
        kept.loss(),
        None,
        "a failed try on the multiplexed connection cost the lock it held"
    );
    assert_eq!(partial, 0, "a failed attempt left a lock behind");
    kept.release().await.expect("release the kept lock");

    // The server accepts connections again, and the lockers work.
    let mut fresh = opts
        .clone()
        .connect()
        .await
        .expect("connect after the table drained");
    sqlx::query("SELECT 1")
        .execute(&mut fresh)
        .await
        .expect("query");
    let _ = fresh.close().await;
    for l in [&locker, &mux, &fenced_mux] {
        bounded(
            "lock after the table drained",
            Duration::from_secs(10),
            async {
                l.try_lock("lt:after")
                    .await
                    .expect("try_lock after the table drained")
                    .expect("free")
                    .release()
                    .await
                    .expect("release");
            },
        )
        .await;
    }
    assert!(
        locker
            .with_advisory_lock("lt:after", async |_| Ok::<_, Error>(()))
            .await
            .expect("with_advisory_lock after the table drained")
            .is_some()
    );
    assert_no_advisory_locks_eventually(&mut obs, Duration::from_secs(5)).await;
    close(obs).await;
    pool.close().await;
}
