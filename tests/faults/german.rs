//! A server that answers in another language (`lc_messages` German): the
//! errors distlock names from the server's (a hot standby, a missing
//! schema) do not depend on the message's wording.

use crate::common;

use common::cluster::Cluster;
use distlock::{Error, FencingToken, PgLocker};

use crate::standby::every_lock_path_refuses;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_lock_path_refuses_a_hot_standby_that_answers_in_german() {
    let primary = Cluster::primary("standby_german", &[]).await;
    let standby = Cluster::german_standby_of(&primary, "standby_german_s").await;
    let pool = standby.pool().await;
    let err = sqlx::query("SELECT pg_current_wal_lsn()")
        .execute(&pool)
        .await
        .expect_err("recovery is in progress");
    assert_in_german(&err);
    pool.close().await;
    every_lock_path_refuses(&primary, &standby).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_schema_is_named_in_german_too() {
    let cluster = Cluster::german_primary("not_migrated_german").await;
    let pool = cluster.pool().await;
    let err = sqlx::query("SELECT 1 FROM distlock.leases")
        .execute(&pool)
        .await
        .expect_err("no schema");
    assert_in_german(&err);
    let locker = PgLocker::builder(pool.clone())
        .fencing(true)
        .build()
        .expect("valid settings");
    let fenced = locker.try_lock("fenced").await.map(drop);
    assert!(
        matches!(fenced, Err(Error::NotMigrated { .. })),
        "{fenced:?}"
    );
    let mut conn = pool.acquire().await.expect("conn");
    let checked = distlock::fence::check(&mut conn, "invoice:7", FencingToken::new(1)).await;
    assert!(
        matches!(checked, Err(Error::NotMigrated { .. })),
        "{checked:?}"
    );
    let claimed = distlock::idempotency::claim(&mut conn, "payments", "order-1").await;
    assert!(
        matches!(claimed, Err(Error::NotMigrated { .. })),
        "{claimed:?}"
    );
    drop(conn);
    pool.close().await;
}

/// The server's message is not the English one: the test runs where
/// distlock cannot read the wording.
fn assert_in_german(err: &sqlx::Error) {
    let message = err.as_database_error().expect("a server error").message();
    assert!(
        !message.contains("recovery is in progress") && !message.contains("does not exist"),
        "the server answers in German: {message}"
    );
}
