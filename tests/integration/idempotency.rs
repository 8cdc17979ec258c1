//! Idempotency keys: one successful claim per (scope, key).

use std::time::Duration;

use distlock::Error;
use distlock::idempotency::{self, Once};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgPool};

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
