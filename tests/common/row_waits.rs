//! Backends waiting on a row lock: how a test holds rows locked, counts
//! the backends still waiting in a statement after their client gave up,
//! and checks that the client did wait until its deadline.

use std::time::{Duration, Instant};

use sqlx::PgPool;

/// A call that gave up on a locked row did wait for it until about its
/// `deadline` (not, say, a `lock_timeout` of a millisecond).
pub fn waited_at_least(started: Instant, deadline: Duration) {
    let waited = started.elapsed();
    assert!(
        waited + Duration::from_millis(50) >= deadline,
        "gave up after {waited:?}, before its deadline of {deadline:?}"
    );
}

/// A transaction, left open, that has locked every row of `table`.
pub async fn rows_locked(pool: &PgPool, table: &str) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut blocker = pool.begin().await.expect("begin");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM {table} FOR UPDATE"
    )))
    .execute(&mut *blocker)
    .await
    .expect("lock the rows");
    blocker
}

/// [`waiting_on_locks`] in `function` once its caller gave up: polled
/// for up to a second, until none waits (the server's wait started a
/// moment after the client's timer, and ends that much later). A
/// statement that waits on regardless stays counted while the row is
/// locked.
pub async fn waiting_a_moment_later(pool: &PgPool, function: &str) -> i64 {
    let until = Instant::now() + Duration::from_secs(1);
    loop {
        let waiting = waiting_on_locks(pool, function).await;
        if waiting == 0 || Instant::now() >= until {
            return waiting;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How many backends of this test's database wait for a lock in a
/// statement that calls `function`, a distlock SQL function (not, say, a
/// lost lease's delete).
pub async fn waiting_on_locks(pool: &PgPool, function: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_catalog.pg_stat_activity \
         WHERE datname = current_database() AND wait_event_type = 'Lock' \
         AND strpos(query, $1) > 0",
    )
    .bind(format!("distlock.{function}("))
    .fetch_one(pool)
    .await
    .expect("count waiting backends")
}

/// The pid of a backend of this test's database that waits for a lock in
/// a statement calling `function` (as [`waiting_on_locks`]), once there is
/// one; panics after 5 s.
pub async fn waiting_pid(pool: &PgPool, function: &str) -> i32 {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let pid: Option<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_catalog.pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock' \
             AND strpos(query, $1) > 0",
        )
        .bind(format!("distlock.{function}("))
        .fetch_optional(pool)
        .await
        .expect("find the waiting backend");
        match pid {
            Some(pid) => return pid,
            None if Instant::now() < until => tokio::time::sleep(Duration::from_millis(10)).await,
            None => panic!("no backend waits in distlock.{function} after 5 s"),
        }
    }
}

/// Whether the backend `pid` is still there.
pub async fn backend_alive(pool: &PgPool, pid: i32) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_activity WHERE pid = $1)")
        .bind(pid)
        .fetch_one(pool)
        .await
        .expect("look the backend up")
}
