//! A lock kept by a prepared transaction (`PREPARE TRANSACTION`), which
//! `pg_locks` shows without a session: `holders()` lists it (pid 0, as
//! `pg_blocking_pids` names it) beside the other locks, instead of failing
//! on the missing pid. The shared server allows no prepared transactions,
//! so this runs on a private cluster.

use crate::common;

use common::cluster::Cluster;
use distlock::PgLocker;

#[tokio::test]
async fn holders_lists_a_lock_kept_by_a_prepared_transaction() {
    let cluster = Cluster::primary("prepared", &["max_prepared_transactions = 2"]).await;
    let pool = cluster.pool().await;
    let locker = PgLocker::new(pool.clone());
    let held = locker
        .try_lock("prepared:session")
        .await
        .expect("try_lock")
        .expect("free");
    let mut conn = pool.acquire().await.expect("a connection");
    sqlx::raw_sql(
        "BEGIN; SELECT pg_advisory_xact_lock(hashtext('prepared:xact')); \
         PREPARE TRANSACTION 'distlock-prepared'",
    )
    .execute(&mut *conn)
    .await
    .expect("prepare a transaction that holds a lock");
    let holders = locker
        .holders()
        .await
        .expect("holders() with a prepared transaction");
    assert!(
        holders.iter().any(|h| h.pid == 0 && h.granted),
        "the prepared transaction's lock, as pid 0: {holders:?}"
    );
    assert!(
        holders.iter().any(|h| h.pid == held.backend_pid()),
        "the session lock beside it: {holders:?}"
    );
    // A wait behind it times out as any wait does, its holder unnamed.
    let waited = locker
        .lock("prepared:xact", std::time::Duration::from_millis(300))
        .await;
    assert!(
        matches!(waited, Err(distlock::Error::Timeout { .. })),
        "{waited:?}"
    );
    sqlx::raw_sql("ROLLBACK PREPARED 'distlock-prepared'")
        .execute(&mut *conn)
        .await
        .expect("end the prepared transaction");
    held.release().await.expect("release");
}
