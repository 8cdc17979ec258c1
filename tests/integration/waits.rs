//! Waiting calls wait on the server, whatever the holder's mode, and end
//! with errors that say why they ended.

use crate::common::*;

use std::time::Duration;

use distlock::{Error, PgLocker};
use sqlx::PgPool;

/// Transactions committed or rolled back in the current database so far,
/// as the statistics system has them (fresh: no cached snapshot).
async fn transactions(obs: &mut sqlx::PgConnection) -> i64 {
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut *obs)
        .await
        .expect("clear the statistics snapshot");
    sqlx::query_scalar(
        "SELECT (xact_commit + xact_rollback)::int8 FROM pg_stat_database \
         WHERE datname = current_database()",
    )
    .fetch_one(&mut *obs)
    .await
    .expect("pg_stat_database")
}

/// Transactions the server ran for a 2 s `lock()` that times out, while an
/// outside session holds the key with `hold` ("shared" or "exclusive").
async fn transactions_during_a_wait(pool: &PgPool, locker: PgLocker, hold: &str) -> i64 {
    // Connections and the pooler probe before counting.
    drop(locker.try_lock("warm-up").await.expect("warm-up"));
    let ran = transactions_while(pool, hold, async || {
        let outcome = locker.lock("k", Duration::from_secs(2)).await;
        assert!(
            matches!(outcome, Err(Error::Timeout { .. })),
            "{hold} holder: expected a timeout, got {outcome:?}"
        );
    })
    .await;
    drop(locker);
    ran
}

/// Transactions the server ran while `wait` waited 2 s for key `k` and
/// timed out, with an outside session holding it `hold` ("shared" or
/// "exclusive"). The locker's backends report their statistics when they
/// exit: drop what `wait` used before it returns.
async fn transactions_while(pool: &PgPool, hold: &str, wait: impl AsyncFnOnce()) -> i64 {
    let mut holder = observer_for(pool).await;
    let take = if hold == "shared" {
        "SELECT pg_advisory_lock_shared(hashtext('k'))"
    } else {
        "SELECT pg_advisory_lock(hashtext('k'))"
    };
    sqlx::query(take)
        .execute(&mut holder)
        .await
        .expect("hold the key");
    let mut obs = observer_for(pool).await;
    let before = transactions(&mut obs).await;
    wait().await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after = transactions(&mut obs).await;
    close(holder).await;
    close(obs).await;
    after - before
}

/// Every waiting call of the default mode waits on the server, whatever the
/// holder's mode: a 2 s wait costs a handful of transactions, not a poll
/// loop's thousands (the multiplexed case is below).
#[sqlx::test(migrations = false)]
async fn every_waiting_call_waits_on_the_server_whatever_the_holders_mode(pool: PgPool) {
    let two = Duration::from_secs(2);
    for hold in ["exclusive", "shared"] {
        let fresh = async || {
            let own = sqlx::postgres::PgPoolOptions::new()
                .max_connections(4)
                .connect_with((*pool.connect_options()).clone())
                .await
                .expect("pool");
            let locker = PgLocker::new(own.clone());
            drop(locker.try_lock("warm-up").await.expect("warm-up"));
            (own, locker)
        };
        let timed_out = |what: &str, outcome: Result<(), Error>| {
            assert!(
                matches!(outcome, Err(Error::Timeout { .. })),
                "{what} behind a {hold} holder: expected a timeout, got {outcome:?}"
            );
        };
        let mut counts = Vec::new();
        let (own, locker) = fresh().await;
        counts.push((
            "lock",
            transactions_while(&pool, hold, async || {
                timed_out("lock", locker.lock("k", two).await.map(drop));
                own.close().await;
            })
            .await,
        ));
        let (own, locker) = fresh().await;
        counts.push((
            "lock_all",
            transactions_while(&pool, hold, async || {
                timed_out("lock_all", locker.lock_all(["j", "k"], two).await.map(drop));
                own.close().await;
            })
            .await,
        ));
        let (own, locker) = fresh().await;
        counts.push((
            "with_advisory_lock_wait",
            transactions_while(&pool, hold, async || {
                let outcome = locker
                    .with_advisory_lock_wait("k", two, async |_| Ok::<_, Error>(()))
                    .await;
                timed_out("with_advisory_lock_wait", outcome);
                own.close().await;
            })
            .await,
        ));
        let (own, _locker) = fresh().await;
        counts.push((
            "lock_xact",
            transactions_while(&pool, hold, async || {
                let mut tx = own.begin().await.expect("begin");
                timed_out("lock_xact", distlock::lock_xact(&mut tx, "k", two).await);
                drop(tx);
                own.close().await;
            })
            .await,
        ));
        if hold == "exclusive" {
            // Readers wait only behind a writer.
            let (own, locker) = fresh().await;
            counts.push((
                "lock_shared",
                transactions_while(&pool, hold, async || {
                    timed_out("lock_shared", locker.lock_shared("k", two).await.map(drop));
                    own.close().await;
                })
                .await,
            ));
        }
        for (what, ran) in counts {
            println!("{what} for 2 s behind a {hold} holder: {ran} transactions");
            assert!(
                ran < 100,
                "{what} behind a {hold} holder ran {ran} transactions in 2 s"
            );
        }
    }
}

/// A multiplexed `lock()` waits on the server while the key is held
/// *shared*: before, its wake-up wait (a shared lock) was granted at once
/// beside the readers, the exclusive try failed, and the loop went round
/// without a pause until the deadline.
#[sqlx::test(migrations = false)]
async fn a_multiplexed_wait_does_not_poll_while_readers_hold_the_key(pool: PgPool) {
    for hold in ["exclusive", "shared"] {
        let options = (*pool.connect_options()).clone();
        let own = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await
            .expect("pool");
        let locker = PgLocker::builder(own.clone())
            .multiplex(1)
            .build()
            .expect("valid settings");
        let ran = transactions_during_a_wait(&pool, locker, hold).await;
        own.close().await;
        println!("multiplexed lock() for 2 s behind a {hold} holder: {ran} transactions");
        assert!(
            ran < 100,
            "a multiplexed lock() behind a {hold} holder ran {ran} transactions in 2 s"
        );
    }
}

/// Builds a locker on a pool, or refuses its settings.
type Build = Box<dyn Fn(PgPool) -> Result<PgLocker, Error> + Send>;

/// Extreme settings never panic: the builder refuses them naming the
/// setting, or the locker builds, locks and releases.
#[sqlx::test(migrations = false)]
async fn extreme_settings_are_refused_or_build_a_locker_that_locks_and_releases(pool: PgPool) {
    let builds: Vec<(&str, Build, Option<&str>)> = vec![
        (
            "heartbeat MAX",
            Box::new(|p| PgLocker::builder(p).heartbeat(Duration::MAX).build()),
            Some("heartbeat + heartbeat_timeout"),
        ),
        (
            "heartbeat_timeout MAX",
            Box::new(|p| {
                PgLocker::builder(p)
                    .heartbeat_timeout(Duration::MAX)
                    .build()
            }),
            Some("heartbeat + heartbeat_timeout"),
        ),
        (
            "release_timeout MAX",
            Box::new(|p| PgLocker::builder(p).release_timeout(Duration::MAX).build()),
            None,
        ),
        (
            "keep_warm MAX",
            Box::new(|p| {
                PgLocker::builder(p)
                    .keep_warm(usize::MAX, Duration::MAX)
                    .build()
            }),
            None,
        ),
        (
            "multiplex MAX",
            Box::new(|p| PgLocker::builder(p).multiplex(usize::MAX).build()),
            Some("multiplex"),
        ),
    ];
    for (what, build, refused) in builds {
        let outcome = tokio::spawn({
            let pool = pool.clone();
            async move {
                let locker = match (build(pool), refused) {
                    (Err(Error::InvalidSetting { setting, .. }), Some(named)) => {
                        assert_eq!(setting, named, "{what}");
                        return Ok(());
                    }
                    (Ok(locker), None) => locker,
                    (built, _) => panic!("{what}: {built:?}"),
                };
                let lock = locker.try_lock("k").await?.expect("free");
                lock.release().await?;
                let lock = locker.lock("k", Duration::from_secs(1)).await?;
                lock.release().await?;
                // Let a background sweeper or timer run with the setting.
                tokio::time::sleep(Duration::from_millis(100)).await;
                drop(locker.try_lock("k").await?);
                Ok::<_, Error>(())
            }
        })
        .await;
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(err)) => panic!("{what}: {err:?}"),
            Err(panicked) => panic!("{what}: the locker panicked: {panicked:?}"),
        }
    }
}

/// A pool of `max` connections to `port` on loopback, opened lazily.
fn pool_to(pool: &PgPool, port: u16, max: u32) -> PgPool {
    let options = (*pool.connect_options())
        .clone()
        .host("127.0.0.1")
        .port(port);
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(30))
        .connect_lazy_with(options)
}

/// What each waiting call answers when it can get no connection in time.
async fn waiting_calls(locker: &PgLocker) -> Vec<(&'static str, Result<(), Error>)> {
    let t = Duration::from_millis(800);
    vec![
        ("lock", locker.lock("k", t).await.map(drop)),
        ("lock_all", locker.lock_all(["k", "j"], t).await.map(drop)),
        (
            "with_advisory_lock_wait",
            locker
                .with_advisory_lock_wait("k", t, async |_| Ok::<_, Error>(()))
                .await
                .map(drop),
        ),
    ]
}

fn assert_no_connection(what: &str, setup: &str, outcome: Result<(), Error>, cause: &str) {
    match outcome {
        Err(Error::NoConnection {
            key,
            cause: c,
            waited,
        }) => {
            assert_eq!(key, distlock::LockKey::from("k"), "{setup}: {what}");
            assert!(c.contains(cause), "{setup}: {what}: cause {c:?}");
            assert!(
                waited < Duration::from_secs(5),
                "{setup}: {what}: waited {waited:?}"
            );
        }
        other => panic!("{setup}: {what}: expected NoConnection, got {other:?}"),
    }
}

/// With the server unreachable, a wait is not a lock timeout naming no
/// holder: it says that it got no connection.
#[sqlx::test(migrations = false)]
async fn a_wait_without_a_reachable_server_says_so(pool: PgPool) {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    let port = closed.local_addr().expect("addr").port();
    drop(closed);
    let locker = PgLocker::new(pool_to(&pool, port, 2));
    for (what, outcome) in waiting_calls(&locker).await {
        assert_no_connection(what, "server unreachable", outcome, "still opening");
    }
}

/// With every connection of the pool taken, the same, naming that cause.
#[sqlx::test(migrations = false)]
async fn a_wait_on_an_exhausted_pool_says_so(pool: PgPool) {
    let port = pool.connect_options().get_port();
    let small = pool_to(&pool, port, 1);
    let taken = small.acquire().await.expect("the pool's one connection");
    let locker = PgLocker::new(small.clone());
    for (what, outcome) in waiting_calls(&locker).await {
        assert_no_connection(what, "pool exhausted", outcome, "in use");
    }
    drop(taken);
    small.close().await;
}
