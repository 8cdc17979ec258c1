//! `Semaphore` on PostgreSQL at the edges of a waiter's life: a head
//! dropped while it waits in the server's queue, and a deadline shorter
//! than the round trips a first connection costs.

use crate::common;

use std::time::{Duration, Instant};

use crate::semaphore::{pool_of, semaphore};
use common::proxy::Proxy;
use distlock::PgLocker;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// A head of one process holds the queue (the only permit is held); a head
/// of another process, on connections its pool has just opened, waits for
/// the queue in the server's lock queue, and its `acquire` is dropped. The
/// dropped head's connection is closed, and the server notices within its
/// client check (100 ms, set before the wait by the `LISTEN` statement):
/// its session leaves the server's queue at once, not at its
/// `lock_timeout` (30 s here).
#[sqlx::test(migrations = false)]
async fn a_head_dropped_in_the_servers_queue_leaves_it(pool: PgPool) {
    const NAME: &str = "sem:dropped-head";
    let opts = pool.connect_options().as_ref().clone();
    let holder = PgLocker::new(pool.clone());
    let held = semaphore(&holder, NAME, 1)
        .try_acquire()
        .await
        .unwrap()
        .expect("free");
    let first = semaphore(&PgLocker::new(pool_of(&opts, 2).await), NAME, 1);
    let first = tokio::spawn(async move { first.acquire(Duration::from_secs(30)).await });
    let mut obs = common::observer_for(&pool).await;
    common::semaphore_head_idle_with_queue(&mut obs, NAME).await;

    for round in 0..3 {
        // Every connection of this pool is used once (closed when given
        // back), so the head's has run no lock statement, whatever the
        // arrival try's set on its own.
        let once = PgPoolOptions::new()
            .max_connections(3)
            .test_before_acquire(false)
            .after_release(|_conn, _meta| Box::pin(async { Ok(false) }))
            .connect_with(opts.clone())
            .await
            .expect("pool");
        let second = semaphore(&PgLocker::new(once), NAME, 1);
        let waiter = tokio::spawn(async move { second.acquire(Duration::from_secs(30)).await });
        common::wait_for_waiters(&mut obs, 1, Duration::from_secs(10)).await;
        waiter.abort();
        let _ = waiter.await;
        let took = common::wait_for_no_waiters(&mut obs, Duration::from_secs(3)).await;
        println!("round {round}: the dropped head left the server's queue after {took:?}");
    }

    held.release().await.unwrap();
    let permit = common::bounded("the first head is served", Duration::from_secs(10), first)
        .await
        .unwrap()
        .expect("the first head gets the freed permit");
    permit.release().await.unwrap();
}

/// An `acquire` whose timeout is shorter than the round trips of the
/// pool's first connection (a server 4 ms away, a timeout of 5 ms) still
/// gets a free permit: a waiting call may take a moment beyond its
/// deadline for a connection, as every lock's does, and a timeout that
/// short means "try once".
#[sqlx::test(migrations = false)]
async fn a_short_acquire_on_a_slow_network_gets_a_free_permit(
    _pool_opts: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let proxy = Proxy::start(opts.get_host(), opts.get_port())
        .await
        .expect("proxy");
    let far = semaphore(
        &PgLocker::new(pool_of(&proxy.options(&opts), 2).await),
        "sem:far",
        1,
    );
    proxy.delay(Duration::from_millis(2));
    for timeout in [Duration::ZERO, Duration::from_millis(5)] {
        let started = Instant::now();
        let permit = far
            .acquire(timeout)
            .await
            .unwrap_or_else(|err| panic!("acquire({timeout:?}) with a permit free: {err}"));
        println!("acquire({timeout:?}) took {:?}", started.elapsed());
        permit.release().await.unwrap();
    }
    proxy.pass();
}
