//! The configuration rule: every builder's `build()` refuses a setting
//! outside its documented range with `Error::InvalidSetting` naming the
//! setting, accepts the bounds themselves, and a locker built at the bounds
//! locks on the real server. Nothing is clamped, lowered or left to fail at
//! the first acquisition.

use crate::common;

use std::time::Duration;

use common::init_tracing;
use distlock::postgres::TableLocker;
use distlock::{Error, PgLocker};
use sqlx::PgPool;

/// The setting a refusal names, or a panic naming what came instead.
fn refused<T: std::fmt::Debug>(what: &str, built: Result<T, Error>) -> &'static str {
    match built {
        Err(Error::InvalidSetting { setting, .. }) => setting,
        other => panic!("{what}: expected InvalidSetting, got {other:?}"),
    }
}

#[sqlx::test(migrations = false)]
async fn pg_locker_build_refuses_each_setting_out_of_range(pool: PgPool) {
    init_tracing();
    let b = || PgLocker::builder(pool.clone());
    let ms = Duration::from_millis;
    let cases: Vec<(&str, Result<PgLocker, Error>, &str)> = vec![
        (
            "heartbeat zero",
            b().heartbeat(Duration::ZERO).build(),
            "heartbeat",
        ),
        (
            "heartbeat below 10 ms",
            b().heartbeat(ms(9)).build(),
            "heartbeat",
        ),
        (
            "heartbeat_timeout zero",
            b().heartbeat_timeout(Duration::ZERO).build(),
            "heartbeat_timeout",
        ),
        (
            "heartbeat_timeout below 10 ms",
            b().heartbeat_timeout(ms(9)).build(),
            "heartbeat_timeout",
        ),
        (
            // The deadline follows the interval: 2 × 10.001 s > 20 s.
            "heartbeat above 10 s with its default deadline",
            b().heartbeat(ms(10_001)).build(),
            "heartbeat + heartbeat_timeout",
        ),
        (
            "heartbeat MAX",
            b().heartbeat(Duration::MAX).build(),
            "heartbeat + heartbeat_timeout",
        ),
        (
            "sum above 20 s",
            b().heartbeat(ms(100)).heartbeat_timeout(ms(19_901)).build(),
            "heartbeat + heartbeat_timeout",
        ),
        (
            "release_timeout zero",
            b().release_timeout(Duration::ZERO).build(),
            "release_timeout",
        ),
        (
            "multiplex above MAX_MULTIPLEX",
            b().multiplex(distlock::postgres::MAX_MULTIPLEX + 1).build(),
            "multiplex",
        ),
        (
            "multiplex MAX",
            b().multiplex(usize::MAX).build(),
            "multiplex",
        ),
        (
            "max_locks zero",
            b().multiplex(1).max_locks(0).build(),
            "max_locks",
        ),
        (
            "max_locks without multiplex",
            b().max_locks(10).build(),
            "max_locks",
        ),
    ];
    for (what, built, setting) in cases {
        assert_eq!(refused(what, built), setting, "{what}");
    }
}

#[sqlx::test(migrations = false)]
async fn refusals_name_the_value_and_the_range(pool: PgPool) {
    let err = PgLocker::builder(pool.clone())
        .heartbeat(Duration::from_millis(5))
        .build()
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid setting heartbeat = 5ms: must be at least 10ms"
    );
    let err = PgLocker::builder(pool.clone())
        .heartbeat(Duration::from_secs(15))
        .build()
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid setting heartbeat + heartbeat_timeout = 30s: must be at most 20s \
         (a holder must notice a cut-off before the server frees its lock)"
    );
    let err = TableLocker::builder(pool)
        .ttl(Duration::ZERO)
        .build()
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid setting ttl = 0ns: must be between 100ms and 86400s"
    );
}

#[sqlx::test(migrations = false)]
async fn pg_locker_built_at_the_bounds_keeps_them_and_locks(pool: PgPool) {
    init_tracing();
    let ms = Duration::from_millis;
    let lower = PgLocker::builder(pool.clone())
        .heartbeat(ms(10))
        .heartbeat_timeout(ms(10))
        .release_timeout(ms(1))
        .build()
        .expect("the lower bounds are valid");
    assert_eq!(
        (lower.heartbeat(), lower.heartbeat_timeout()),
        (ms(10), ms(10)),
        "kept as given, not raised"
    );
    // A 10 ms heartbeat deadline is valid, but on a loaded machine it
    // rightly declares the lock lost; lock with the 10 ms interval and a
    // deadline the machine can meet.
    let lower = PgLocker::builder(pool.clone())
        .heartbeat(ms(10))
        .heartbeat_timeout(Duration::from_secs(1))
        .release_timeout(ms(1))
        .build()
        .expect("valid");
    let upper = PgLocker::builder(pool.clone())
        .heartbeat(Duration::from_secs(10))
        .build()
        .expect("10 s + its default 10 s deadline is the upper bound");
    assert_eq!(
        (upper.heartbeat(), upper.heartbeat_timeout()),
        (Duration::from_secs(10), Duration::from_secs(10)),
        "kept as given, not lowered"
    );
    let skewed = PgLocker::builder(pool.clone())
        .heartbeat(ms(10))
        .heartbeat_timeout(ms(19_990))
        .release_timeout(Duration::MAX)
        .build()
        .expect("a sum of exactly 20 s and a release deadline as long as possible");
    let mux = PgLocker::builder(pool.clone())
        .multiplex(distlock::postgres::MAX_MULTIPLEX)
        .max_locks(1)
        .build()
        .expect("MAX_MULTIPLEX connections and a cap of 1 are valid");
    for (what, locker) in [
        ("lower", lower),
        ("upper", upper),
        ("skewed", skewed),
        ("mux", mux),
    ] {
        let lock = locker
            .try_lock("config:edge")
            .await
            .unwrap_or_else(|e| panic!("{what}: {e:?}"))
            .unwrap_or_else(|| panic!("{what}: the key is free"));
        assert!(
            PgLocker::new(pool.clone())
                .try_lock("config:edge")
                .await
                .expect("try")
                .is_none(),
            "{what}: held on the server"
        );
        // The lower bounds run a 10 ms heartbeat: let a few pass.
        tokio::time::sleep(ms(50)).await;
        assert!(!lock.is_lost(), "{what}: still held");
        // A 1 ms release deadline may pass on a loaded machine; then the
        // connection is closed, which frees the lock too.
        match lock.release().await {
            Ok(()) => {}
            Err(Error::ReleaseTimedOut { .. }) if what == "lower" => {}
            Err(err) => panic!("{what}: release: {err:?}"),
        }
        common::eventually(
            &format!("{what}: freed"),
            Duration::from_secs(5),
            async || {
                // Released, not dropped: a dropped probe's background unlock
                // could still be on its way when the next case tries.
                match PgLocker::new(pool.clone())
                    .try_lock("config:edge")
                    .await
                    .expect("try")
                {
                    Some(probe) => probe.release().await.is_ok(),
                    None => false,
                }
            },
        )
        .await;
    }
}

#[sqlx::test(migrations = false)]
async fn table_locker_build_refuses_each_setting_out_of_range(pool: PgPool) {
    use distlock::postgres::{MAX_TTL, MIN_TTL};
    let b = || TableLocker::builder(pool.clone());
    let ns = Duration::from_nanos;
    let cases: Vec<(&str, Result<TableLocker, Error>, &str)> = vec![
        ("ttl zero", b().ttl(Duration::ZERO).build(), "ttl"),
        ("ttl below MIN_TTL", b().ttl(MIN_TTL - ns(1)).build(), "ttl"),
        ("ttl above MAX_TTL", b().ttl(MAX_TTL + ns(1)).build(), "ttl"),
        ("ttl MAX", b().ttl(Duration::MAX).build(), "ttl"),
        (
            "poll_interval zero",
            b().poll_interval(Duration::ZERO).build(),
            "poll_interval",
        ),
        (
            "poll_interval above 1 h",
            b().poll_interval(Duration::from_secs(3600) + ns(1)).build(),
            "poll_interval",
        ),
        (
            "release_timeout zero",
            b().release_timeout(Duration::ZERO).build(),
            "release_timeout",
        ),
    ];
    for (what, built, setting) in cases {
        assert_eq!(refused(what, built), setting, "{what}");
    }
}

#[sqlx::test(migrations = false)]
async fn table_locker_built_at_the_bounds_locks(pool: PgPool) {
    use distlock::postgres::{MAX_TTL, MIN_TTL};
    init_tracing();
    distlock::migrate(&pool).await.expect("migrate");
    for (what, ttl, poll, release) in [
        (
            "lower",
            MIN_TTL,
            Duration::from_millis(1),
            Duration::from_millis(1),
        ),
        ("upper", MAX_TTL, Duration::from_secs(3600), Duration::MAX),
    ] {
        let locker = TableLocker::builder(pool.clone())
            .ttl(ttl)
            .poll_interval(poll)
            .release_timeout(release)
            .build()
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let lease = locker
            .try_lock(format!("config:table:{what}"))
            .await
            .unwrap_or_else(|e| panic!("{what}: {e:?}"))
            .unwrap_or_else(|| panic!("{what}: the key is free"));
        // A 100 ms lease may expire on a loaded machine; then its holder
        // must have reported the loss before anyone else got the key.
        let other = TableLocker::new(pool.clone())
            .try_lock(format!("config:table:{what}"))
            .await
            .expect("try");
        assert!(
            other.is_none() || (what == "lower" && lease.is_lost()),
            "{what}: held, or lost before anyone else got it"
        );
        drop(other);
        // A 1 ms release deadline may leave the row to expire, and a 100 ms
        // lease may be lost on a loaded machine: both are documented
        // answers at the lower bounds, not panics.
        let released = lease.release().await;
        if what == "upper" {
            released.expect("release");
        } else {
            assert!(
                matches!(
                    released,
                    Ok(()) | Err(Error::LockLost { .. } | Error::ReleaseTimedOut { .. })
                ),
                "{what}: {released:?}"
            );
        }
    }
}

#[cfg(feature = "redis")]
mod redis_builders {
    use super::*;
    use crate::common::redis::{RedisServer, servers, urls};
    use distlock::redis::{RedisLocker, Redlock};

    /// No server listens here: a refusal must come before any connection.
    const NOWHERE: &str = "redis://127.0.0.1:1";

    #[tokio::test]
    async fn redis_builders_refuse_each_setting_out_of_range_before_connecting() {
        let ms = Duration::from_millis;
        let single = || RedisLocker::builder(NOWHERE);
        let cases: Vec<(&str, Result<RedisLocker, Error>, &str)> = vec![
            (
                "ttl zero",
                single().ttl(Duration::ZERO).build().await,
                "ttl",
            ),
            (
                "ttl below 100 ms",
                single().ttl(ms(99)).build().await,
                "ttl",
            ),
            (
                "ttl above 30 days",
                single()
                    .ttl(Duration::from_secs(30 * 24 * 3600 + 1))
                    .build()
                    .await,
                "ttl",
            ),
            (
                "command_timeout zero",
                single().command_timeout(Duration::ZERO).build().await,
                "command_timeout",
            ),
            (
                "poll_interval zero",
                single().poll_interval(Duration::ZERO).build().await,
                "poll_interval",
            ),
            (
                "poll_interval below 1 ms",
                single()
                    .poll_interval(Duration::from_micros(999))
                    .build()
                    .await,
                "poll_interval",
            ),
        ];
        for (what, built, setting) in cases {
            assert_eq!(refused(what, built), setting, "RedisLocker {what}");
        }
        let quorum = || Redlock::builder([NOWHERE, "redis://127.0.0.1:2", "redis://127.0.0.1:3"]);
        let cases: Vec<(&str, Result<Redlock, Error>, &str)> = vec![
            (
                "ttl zero",
                quorum().ttl(Duration::ZERO).build().await,
                "ttl",
            ),
            ("ttl MAX", quorum().ttl(Duration::MAX).build().await, "ttl"),
            (
                "node_timeout zero",
                quorum().node_timeout(Duration::ZERO).build().await,
                "node_timeout",
            ),
            (
                "poll_interval zero",
                quorum().poll_interval(Duration::ZERO).build().await,
                "poll_interval",
            ),
        ];
        for (what, built, setting) in cases {
            assert_eq!(refused(what, built), setting, "Redlock {what}");
        }
    }

    #[tokio::test]
    async fn redis_lockers_built_at_the_bounds_lock() -> anyhow::Result<()> {
        init_tracing();
        let server = RedisServer::start().await;
        for ttl in [ms(100), Duration::from_secs(30 * 24 * 3600)] {
            let locker = RedisLocker::builder(server.url())
                .ttl(ttl)
                .command_timeout(ms(1_000))
                .fencing(false)
                .build()
                .await?;
            assert_eq!(locker.ttl(), ttl);
            let lease = locker.try_lock("config:redis").await?.expect("free");
            assert!(locker.try_lock("config:redis").await?.is_none(), "held");
            assert_eq!(lease.fencing_token(), None, "fencing(false) kept");
            lease.release().await?;
        }
        // The fallback poll at both ends: every millisecond, and never.
        for poll in [ms(1), Duration::MAX] {
            let locker = RedisLocker::builder(server.url())
                .poll_interval(poll)
                .build()
                .await?;
            let held = locker.try_lock("config:poll").await?.expect("free");
            let err = locker.lock("config:poll", ms(50)).await.expect_err("held");
            assert!(matches!(err, Error::Timeout { .. }), "{poll:?}: {err}");
            held.release().await?;
            let lease = locker.lock("config:poll", ms(1_000)).await?;
            lease.release().await?;
        }
        let nodes = servers(3).await;
        let urls = urls(&nodes);
        let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
        Redlock::builder(urls.clone())
            .node_timeout(ms(1))
            .build()
            .await
            .expect("a 1 ms node deadline is the lower bound");
        let redlock = Redlock::builder(urls)
            .ttl(ms(100))
            .node_timeout(ms(200))
            .retry_count(0)
            .retry_delay(Duration::ZERO)
            .retry_jitter(Duration::ZERO)
            .build()
            .await?;
        let lease = redlock.try_lock("config:redlock").await?.expect("free");
        assert!(redlock.try_lock("config:redlock").await?.is_none(), "held");
        lease.release().await?;
        Ok(())
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }
}

/// `LockWaiter::report_every` below its minimum is refused before any
/// round trip (it used to be raised to 10 ms silently), and the minimum
/// itself is kept.
#[sqlx::test(migrations = false)]
async fn lock_waiter_refuses_a_report_interval_below_its_minimum(pool: PgPool) {
    use distlock::postgres::{LockWaiter, MIN_REPORT_EVERY};
    let locker = PgLocker::new(pool.clone());
    let err = LockWaiter::new(&locker, "config:waiter", Duration::from_secs(1))
        .report_every(MIN_REPORT_EVERY - Duration::from_nanos(1))
        .lock()
        .await
        .expect_err("below the minimum");
    assert!(
        matches!(
            err,
            Error::InvalidSetting {
                setting: "report_every",
                ..
            }
        ),
        "{err:?}"
    );
    let lock = LockWaiter::new(&locker, "config:waiter", Duration::from_secs(1))
        .report_every(MIN_REPORT_EVERY)
        .lock()
        .await
        .expect("at the minimum");
    lock.release().await.expect("release");
}
