//! When a process's turn at a semaphore begins, its waiters lined up and
//! slots free, the first fill tries as many slots at once as the process has
//! waiters, up to the permits: the free permits are taken in one round trip,
//! not in rounds of a few tries (which left permits idle for several round
//! trips while waiters queued).
//!
//! How the test sees the tries at once: with fencing on, a try that takes a
//! slot draws its token in the same statement, from the sequence
//! `distlock.token_counter`. While a transaction of the test holds that
//! sequence in SHARE ROW EXCLUSIVE mode (a no-op `ALTER SEQUENCE`), every
//! try that took a slot waits there, so the backends waiting for the
//! sequence are the tries under way. A fill in rounds
//! shows only its first round: the next starts when the first has answered.

use crate::common;
use crate::semaphore_relay::{pool_of, queue_lock};

use std::time::Duration;

use distlock::{PgLocker, Semaphore, SemaphorePermit};
use sqlx::{Connection, PgPool};

const NAME: &str = "fill:turn";
const PERMITS: u32 = 10;
const WAITERS: usize = 12;

/// Backends of this database waiting for a lock on `token_counter`.
async fn waiting_for_tokens(obs: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'relation' AND NOT granted \
         AND relation = 'distlock.token_counter'::regclass",
    )
    .fetch_one(obs)
    .await
    .expect("pg_locks")
}

/// Runs `statement` (`$1` the namespace, `$2` the name) on the queue lock
/// of [`NAME`], as another process's head would.
async fn on_queue(conn: &mut sqlx::PgConnection, statement: &'static str) {
    sqlx::query(statement)
        .bind(Semaphore::SLOT_NAMESPACE)
        .bind(format!("{NAME}#queue"))
        .execute(conn)
        .await
        .expect("the queue lock");
}

#[sqlx::test(migrations = false)]
async fn a_turn_begins_by_trying_every_free_slot_at_once(pool: PgPool) {
    distlock::migrate(&pool).await.expect("migrate");
    let opts = pool.connect_options().as_ref().clone();
    // 12 connections: the head's, and room for a try on every slot.
    let locker = PgLocker::builder(pool_of(&opts, 12).await)
        .fencing(true)
        .build()
        .expect("valid settings");
    let semaphore = locker.semaphore(NAME, PERMITS).expect("valid");
    let mut obs = common::observer_for(&pool).await;

    // Another process's head holds the queue: this process's waiters line
    // up behind it, and every slot stays free.
    let mut other = common::observer_for(&pool).await;
    on_queue(&mut other, "SELECT pg_advisory_lock($1, hashtext($2))").await;
    let (served, mut permits) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..WAITERS {
        let (semaphore, served) = (semaphore.clone(), served.clone());
        tokio::spawn(async move {
            let permit = semaphore.acquire(Duration::from_secs(30)).await;
            served
                .send(permit.expect("a permit"))
                .expect("the test waits");
        });
    }
    common::eventually(
        "the head waits for the queue",
        Duration::from_secs(10),
        async || queue_lock(&pool, NAME, false).await,
    )
    .await;
    // The other waiters only register in the process; give them time to.
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Every try that takes a slot now waits for its token.
    let mut tokens = common::observer_for(&pool).await;
    let mut held = tokens.begin().await.expect("begin");
    sqlx::query("ALTER SEQUENCE distlock.token_counter NO CYCLE")
        .execute(&mut *held)
        .await
        .expect("lock the token counter");
    on_queue(&mut other, "SELECT pg_advisory_unlock($1, hashtext($2))").await;

    // A fill in rounds stays at its first round's size: give it time to
    // show more, then count (never more tries than permits).
    let wanted = i64::from(PERMITS);
    let limit = std::time::Instant::now() + Duration::from_secs(10);
    while waiting_for_tokens(&mut obs).await < wanted && std::time::Instant::now() < limit {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        waiting_for_tokens(&mut obs).await,
        wanted,
        "tries under way once the turn began"
    );

    held.rollback().await.expect("let the tokens go");
    let mut first: Vec<SemaphorePermit> = Vec::new();
    for _ in 0..PERMITS {
        first.push(permits.recv().await.expect("a waiter served"));
    }
    let tokens: std::collections::BTreeSet<_> = first.iter().map(|p| p.fencing_token()).collect();
    assert_eq!(tokens.len(), PERMITS as usize, "every holder its own token");
    for permit in first {
        permit.release().await.expect("release");
    }
    for _ in PERMITS as usize..WAITERS {
        let permit = permits.recv().await.expect("a waiter served");
        permit.release().await.expect("release");
    }
}
