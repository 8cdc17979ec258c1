//! Idempotency keys: one successful claim per (scope, key).

use std::time::Duration;

use crate::common::drop_after::drop_after;
use distlock::Error;
use distlock::idempotency::{self, Once};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};

#[sqlx::test(migrations = false)]
async fn claim_is_true_exactly_once(pool: PgPool) {
    distlock::migrate(&pool).await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    assert!(
        idempotency::claim(&mut conn, "charge", "order-1")
            .await
            .unwrap()
    );
    assert!(
        !idempotency::claim(&mut conn, "charge", "order-1")
            .await
            .unwrap()
    );
    assert!(
        idempotency::claim(&mut conn, "charge", "order-2")
            .await
            .unwrap()
    );
    assert!(
        idempotency::claim(&mut conn, "refund", "order-1")
            .await
            .unwrap(),
        "scopes are separate"
    );
    assert!(matches!(
        idempotency::claim(&mut conn, "charge", "a\0b").await,
        Err(Error::InvalidKey { .. })
    ));
}

#[sqlx::test(migrations = false)]
async fn sixteen_concurrent_claims_produce_one_true(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let pool = pool_opts
        .max_connections(17)
        .connect_with(connect_opts)
        .await
        .unwrap();
    distlock::migrate(&pool).await.unwrap();
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(16));
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (pool, start) = (pool.clone(), start.clone());
        tasks.push(tokio::spawn(async move {
            let mut conn = pool.acquire().await.unwrap();
            let mut tx = conn.begin().await.unwrap();
            start.wait().await;
            let won = idempotency::claim(&mut tx, "race", "k").await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
            tx.commit().await.unwrap();
            won
        }));
    }
    let mut wins = 0;
    for task in tasks {
        wins += usize::from(task.await.unwrap());
    }
    assert_eq!(wins, 1);
}

#[sqlx::test(migrations = false)]
async fn rolled_back_claim_can_be_claimed_again(pool: PgPool) {
    distlock::migrate(&pool).await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    assert!(idempotency::claim(&mut tx, "s", "k").await.unwrap());
    tx.rollback().await.unwrap();
    assert!(idempotency::claim(&mut conn, "s", "k").await.unwrap());
}

#[sqlx::test(migrations = false)]
async fn once_runs_the_effect_once_and_returns_the_stored_result(pool: PgPool) {
    distlock::migrate(&pool).await.unwrap();
    sqlx::query("CREATE TABLE charges (n int)")
        .execute(&pool)
        .await
        .unwrap();
    let charge = async |conn: &mut sqlx::PgConnection| {
        sqlx::query("INSERT INTO charges VALUES (1)")
            .execute(&mut *conn)
            .await
            .map_err(Error::from)?;
        Ok::<_, Error>("{\"charged\":true}".to_owned())
    };
    let first = idempotency::once(&pool, "pay", "o1", charge).await.unwrap();
    assert_eq!(first, Once::Ran("{\"charged\":true}".into()));
    let second = idempotency::once(&pool, "pay", "o1", charge).await.unwrap();
    match second {
        Once::AlreadyDone { result, .. } => {
            assert_eq!(result.as_deref(), Some("{\"charged\":true}"))
        }
        other => panic!("expected AlreadyDone, got {other:?}"),
    }
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 1);
}

/// A result PostgreSQL text cannot hold (a NUL byte) is refused by name,
/// not as a database error, and rolls back like an `Err` from the closure.
#[sqlx::test(migrations = false)]
async fn a_result_with_a_nul_byte_is_refused_by_name(pool: PgPool) {
    distlock::migrate(&pool).await.unwrap();
    let refused = idempotency::once(&pool, "pay", "nul", async |_: &mut sqlx::PgConnection| {
        Ok::<_, Error>("a\0b".to_owned())
    })
    .await;
    assert!(
        matches!(
            refused,
            Err(Error::InvalidArgument {
                argument: "result",
                ..
            })
        ),
        "{refused:?}"
    );
    let claimed: i64 = sqlx::query_scalar("SELECT count(*) FROM distlock.idempotency_keys")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(claimed, 0, "the claim rolled back");
}

#[sqlx::test(migrations = false)]
async fn once_rolls_back_claim_and_effect_on_error(pool: PgPool) {
    distlock::migrate(&pool).await.unwrap();
    sqlx::query("CREATE TABLE charges (n int)")
        .execute(&pool)
        .await
        .unwrap();
    #[derive(Debug)]
    enum AppError {
        Declined,
        #[allow(dead_code)]
        Lock(Error),
    }
    impl From<Error> for AppError {
        fn from(e: Error) -> Self {
            AppError::Lock(e)
        }
    }
    let failed = idempotency::once(&pool, "pay", "o2", async |conn: &mut sqlx::PgConnection| {
        sqlx::query("INSERT INTO charges VALUES (1)")
            .execute(&mut *conn)
            .await
            .map_err(Error::from)?;
        Err::<String, _>(AppError::Declined)
    })
    .await;
    assert!(matches!(failed, Err(AppError::Declined)));
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 0, "the effect rolled back");
    let retry = idempotency::once(&pool, "pay", "o2", async |_: &mut sqlx::PgConnection| {
        Ok::<_, AppError>("ok".to_owned())
    })
    .await;
    assert!(
        matches!(retry, Ok(Once::Ran(_))),
        "the key can be claimed again"
    );
}

#[sqlx::test(migrations = false)]
async fn purge_deletes_only_old_claims(pool: PgPool) {
    distlock::migrate(&pool).await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    idempotency::claim(&mut conn, "s", "old").await.unwrap();
    idempotency::claim(&mut conn, "s", "new").await.unwrap();
    sqlx::query("UPDATE distlock.idempotency_keys SET claimed_at = now() - interval '10 days' WHERE key = 'old'")
        .execute(&pool)
        .await
        .unwrap();
    let deleted = idempotency::purge(&pool, Duration::from_secs(7 * 86400))
        .await
        .unwrap();
    assert_eq!(deleted, 1);
    assert!(
        idempotency::claim(&mut conn, "s", "old").await.unwrap(),
        "purged key is free again"
    );
    assert!(!idempotency::claim(&mut conn, "s", "new").await.unwrap());
}

/// A refusal names the argument and its limit, instead of a raw database
/// error ("timestamp out of range", "index row requires 1048592 bytes").
fn assert_argument_error<T: std::fmt::Debug>(
    result: Result<T, Error>,
    argument: &str,
    limit: &str,
) {
    let err = result.expect_err("refused");
    let (debug, text) = (format!("{err:?}"), err.to_string());
    assert!(debug.starts_with("InvalidArgument"), "{debug}");
    assert!(text.contains(argument) && text.contains(limit), "{text}");
}

#[sqlx::test(migrations = false)]
async fn oversized_keys_and_purge_ages_are_refused_with_the_limit(pool: PgPool) {
    distlock::migrate(&pool).await.unwrap();
    let huge = "k".repeat(1 << 20);
    let mut conn = pool.acquire().await.unwrap();
    assert_argument_error(
        idempotency::claim(&mut conn, "charge", &huge).await,
        "key",
        "1024 bytes",
    );
    assert_argument_error(
        idempotency::claim(&mut conn, &huge, "order-1").await,
        "scope",
        "1024 bytes",
    );
    assert_argument_error(
        idempotency::stored(&mut conn, "charge", &huge).await,
        "key",
        "1024 bytes",
    );
    let once = idempotency::once(&pool, &huge, "order-1", async |_| {
        Ok::<_, Error>("x".into())
    })
    .await;
    assert_argument_error(once, "scope", "1024 bytes");
    // At the limit is fine.
    let longest = "k".repeat(1024);
    assert!(
        idempotency::claim(&mut conn, &longest, &longest)
            .await
            .unwrap()
    );
    drop(conn);
    assert_argument_error(
        idempotency::purge(&pool, Duration::MAX).await,
        "older_than",
        "100 years",
    );
    let century = Duration::from_secs(100 * 365 * 24 * 3600);
    assert_eq!(idempotency::purge(&pool, century).await.unwrap(), 0);
}

#[sqlx::test(migrations = false)]
async fn a_stored_result_comes_back_and_an_unclaimed_pair_is_refused(pool: PgPool) {
    distlock::migrate(&pool).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    assert!(idempotency::claim(&mut tx, "charge", "o-1").await.unwrap());
    idempotency::store(&mut tx, "charge", "o-1", "charge #7")
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    match idempotency::stored(&mut conn, "charge", "o-1")
        .await
        .unwrap()
    {
        Some(Once::AlreadyDone { result, .. }) => assert_eq!(result.as_deref(), Some("charge #7")),
        other => panic!("expected the stored result, got {other:?}"),
    }
    let err = idempotency::store(&mut conn, "charge", "never", "x")
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidArgument {
                argument: "key",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("never claimed"), "{err}");
}

/// `once_in` inside `with_advisory_lock`: the effect runs once, its result is
/// stored with the claim, and the lock's transaction commits both.
#[sqlx::test(migrations = false)]
async fn once_in_joins_the_lock_transaction(pool: PgPool) {
    distlock::migrate(&pool).await.unwrap();
    sqlx::query("CREATE TABLE effects (n int)")
        .execute(&pool)
        .await
        .unwrap();
    let locker = distlock::PgLocker::new(pool.clone());
    for round in 0..2 {
        let outcome = locker
            .with_advisory_lock("order:1", async |conn| {
                idempotency::once_in(conn, "charge", "order-1", async |conn| {
                    sqlx::query("INSERT INTO effects VALUES (1)")
                        .execute(&mut *conn)
                        .await?;
                    Ok::<_, Error>(format!("charged in round {round}"))
                })
                .await
            })
            .await
            .unwrap()
            .expect("the lock is free");
        match (round, outcome) {
            (0, Once::Ran(result)) => assert_eq!(result, "charged in round 0"),
            (1, Once::AlreadyDone { result, .. }) => {
                assert_eq!(result.as_deref(), Some("charged in round 0"));
            }
            (round, other) => panic!("round {round}: {other:?}"),
        }
    }
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(effects, 1);
}

/// An `Err` from the closure rolls back the claim and the closure's writes
/// (a savepoint), not the caller's transaction; a rolled-back caller's
/// transaction takes the claim with it.
#[sqlx::test(migrations = false)]
async fn once_in_rolls_back_only_its_savepoint_on_error(pool: PgPool) {
    distlock::migrate(&pool).await.unwrap();
    sqlx::query("CREATE TABLE effects (what text)")
        .execute(&pool)
        .await
        .unwrap();
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO effects VALUES ('caller')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let failed = idempotency::once_in(&mut tx, "charge", "k", async |conn| {
        sqlx::query("INSERT INTO effects VALUES ('closure')")
            .execute(&mut *conn)
            .await?;
        Err::<String, Error>(Error::InvalidArgument {
            argument: "test",
            reason: "the closure fails".into(),
        })
    })
    .await;
    assert!(failed.is_err());
    // The caller's transaction is usable and the key is free again in it.
    assert!(idempotency::claim(&mut tx, "charge", "k").await.unwrap());
    tx.commit().await.unwrap();
    let effects: Vec<String> = sqlx::query_scalar("SELECT what FROM effects")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(effects, ["caller"]);

    let mut tx = pool.begin().await.unwrap();
    let ran = idempotency::once_in(&mut tx, "charge", "k2", async |_| {
        Ok::<_, Error>("x".into())
    })
    .await
    .unwrap();
    assert_eq!(ran, Once::Ran("x".into()));
    tx.rollback().await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    assert!(
        idempotency::claim(&mut conn, "charge", "k2").await.unwrap(),
        "the claim rolled back with the caller's transaction"
    );
}

/// A transaction opened by sending `BEGIN` as SQL is one sqlx does not
/// track: `once_in` refuses it, before any write, instead of committing
/// (or rolling back) the caller's whole transaction as its own.
#[sqlx::test(migrations = false)]
async fn once_in_refuses_a_transaction_begun_as_sql(pool: PgPool) {
    distlock::migrate(&pool).await.unwrap();
    sqlx::query("CREATE TABLE effects (what text)")
        .execute(&pool)
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    sqlx::raw_sql("BEGIN").execute(&mut *conn).await.unwrap();
    sqlx::query("INSERT INTO effects VALUES ('caller')")
        .execute(&mut *conn)
        .await
        .unwrap();
    let ran = idempotency::once_in(&mut conn, "charge", "k", async |_| {
        Ok::<_, Error>("x".into())
    })
    .await;
    assert!(
        matches!(
            &ran,
            Err(Error::InvalidArgument {
                argument: "conn",
                ..
            })
        ),
        "{ran:?}"
    );
    // The caller's transaction is still open and whole: rolled back, it
    // takes its own write with it, and nothing was claimed.
    sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.unwrap();
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(effects, 0, "the caller's write was committed by once_in");
    assert!(idempotency::claim(&mut conn, "charge", "k").await.unwrap());
    // Outside any transaction it still makes its own.
    let ran = idempotency::once_in(&mut conn, "charge", "k2", async |_| {
        Ok::<_, Error>("y".into())
    })
    .await
    .unwrap();
    assert_eq!(ran, Once::Ran("y".into()));
}

/// `once` dropped at each of its `.await`s leaves the claim and the
/// closure's write both kept or both gone, and gives the pool no connection
/// in a transaction. Before, dropped while its `BEGIN` was in flight, the
/// connection went back to the pool inside a transaction sqlx did not
/// track (sqlx's rollback on drop counts only transactions it saw begin),
/// and the next user's write on it was never committed.
#[sqlx::test(migrations = false)]
async fn once_dropped_at_any_await_leaves_no_open_transaction_in_the_pool(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    // One connection, so the next user gets the one `once` had.
    let pool = pool_opts
        .max_connections(1)
        .connect_with(connect_opts)
        .await
        .unwrap();
    distlock::migrate(&pool).await.unwrap();
    sqlx::query("CREATE TABLE effects (what text)")
        .execute(&pool)
        .await
        .unwrap();
    // Where `once` waits depends on timing (an answer already read is no
    // wait), so a drop after n waits lands at a different `.await` from one
    // sweep to the next: five sweeps, the checks holding in each, and at
    // least one of them must have met 3 awaits or more.
    let mut met = Vec::new();
    for sweep in 0..5 {
        met.push(drop_at_each_await(&pool, sweep).await);
    }
    assert!(
        met.iter().any(|&cancelled| cancelled >= 3),
        "once awaited fewer than 3 times in every sweep: {met:?}"
    );
}

/// Drops `once` after 0, 1, 2, ... waits until it finishes, checking after
/// each that the claim and the closure's write are both kept or both gone
/// and that the pool's next user writes outside any transaction; returns
/// how many times it was dropped.
async fn drop_at_each_await(pool: &PgPool, sweep: usize) -> usize {
    let mut cancelled = 0;
    for budget in 0.. {
        let tag = format!("{sweep}.{budget}");
        let key = format!("k{tag}");
        let call = idempotency::once(pool, "charge", &key, async |conn| {
            sqlx::query("INSERT INTO effects VALUES ($1)")
                .bind(format!("effect {tag}"))
                .execute(&mut *conn)
                .await?;
            Ok::<_, Error>("done".to_owned())
        });
        let finished = drop_after(budget, call).await.is_some();
        // The next user of the pool writes outside any transaction.
        sqlx::query("INSERT INTO effects VALUES ($1)")
            .bind(format!("next {tag}"))
            .execute(pool)
            .await
            .unwrap();
        let mut observer = PgConnection::connect_with(&pool.connect_options())
            .await
            .unwrap();
        // One statement, one snapshot: a closed session whose `COMMIT` was
        // in flight may commit while the observer reads.
        let (effects, claims): (Vec<String>, i64) = sqlx::query_as(
            "SELECT coalesce((SELECT array_agg(what) FROM effects), '{}'), \
             (SELECT count(*) FROM distlock.idempotency_keys WHERE scope = 'charge' AND key = $1)",
        )
        .bind(&key)
        .fetch_one(&mut observer)
        .await
        .unwrap();
        assert!(
            effects.contains(&format!("next {tag}")),
            "dropped after {budget} waits: the next user's write was not committed ({effects:?})"
        );
        let effect = effects.contains(&format!("effect {tag}"));
        assert_eq!(effect, claims == 1, "dropped after {budget} waits");
        if finished {
            assert!(effect, "finished, but the effect is not kept");
            break;
        }
        cancelled += 1;
    }
    cancelled
}

/// A `once` waiting on another transaction's uncommitted claim, dropped
/// (its connection closed), does not leave its backend queued on the row:
/// the claim sets `client_connection_check_interval`, so the server ends the
/// wait of a client that has gone. Without it the backend waits on for as
/// long as the holder's transaction runs.
#[sqlx::test(migrations = false)]
async fn a_waiting_claim_whose_client_went_away_leaves_the_server(pool: PgPool) {
    distlock::migrate(&pool).await.unwrap();
    let mut holder = pool.begin().await.unwrap();
    assert!(
        idempotency::claim(&mut holder, "charge", "gone")
            .await
            .unwrap()
    );
    let waiting = idempotency::once(&pool, "charge", "gone", async |_| {
        Ok::<_, Error>("waiter".to_owned())
    });
    assert!(
        tokio::time::timeout(Duration::from_millis(500), waiting)
            .await
            .is_err(),
        "the second once waits on the uncommitted claim"
    );
    let mut obs = pool.acquire().await.unwrap();
    let queued = async |obs: &mut PgConnection| -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND wait_event_type = 'Lock' AND query LIKE '%idempotency_keys%'",
        )
        .fetch_one(obs)
        .await
        .unwrap()
    };
    let mut left = queued(&mut obs).await;
    for _ in 0..50 {
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        left = queued(&mut obs).await;
    }
    assert_eq!(left, 0, "the dropped once's backend still waits on the row");
    holder.rollback().await.unwrap();
}
