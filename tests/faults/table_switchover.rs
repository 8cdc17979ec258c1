//! A planned switchover behind a proxy, as HAProxy in front of Patroni does
//! it: for a moment the proxy answers nothing (it retries the stopped node),
//! then it routes every new connection to the promoted standby, while the
//! connections it had open to the old node hang until they are given up. A
//! `TableLocker` lease whose TTL is at least three times that moment must
//! live through it, renewed on the new primary.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::proxy::Proxy;
use distlock::LossReason;
use distlock::postgres::TableLocker;
use sqlx::postgres::PgPoolOptions;

/// The switchover: from the first stalled byte to the first new connection
/// routed to the promoted standby.
const SWITCHOVER: Duration = Duration::from_secs(2);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_lease_survives_a_planned_switchover_behind_a_stalling_proxy() {
    common::init_tracing();
    let primary = Cluster::primary("switch-primary", &[]).await;
    distlock::migrate(&primary.pool().await)
        .await
        .expect("migrate");
    let standby = Cluster::standby_of(&primary, "switch_standby", &[]).await;
    // Synchronous: every grant and renewal is on the standby when its
    // commit returns, so what the holder was told holds after the promotion.
    primary
        .reconfigure(&[
            "synchronous_standby_names = 'switch_standby'",
            "synchronous_commit = remote_apply",
        ])
        .await;
    primary
        .wait_until(
            "SELECT sync_state = 'sync' FROM pg_stat_replication \
             WHERE application_name = 'switch_standby'",
            Duration::from_secs(30),
        )
        .await;
    let proxy = Proxy::start("127.0.0.1", primary.port())
        .await
        .expect("proxy");
    // An application's pool: sqlx's defaults (a 30 s acquire timeout, a
    // ping before each pooled connection is handed out).
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_lazy_with(primary.options().port(proxy.port()));
    let ttl = SWITCHOVER * 3;
    let locker = TableLocker::builder(pool)
        .ttl(ttl)
        .listen(false)
        .build()
        .expect("valid settings");
    let granted = Instant::now();
    let lease = Arc::new(
        locker
            .try_lock("switchover")
            .await
            .expect("try")
            .expect("free"),
    );
    let token = lease.fencing_token().expect("token").value();
    let watch = Arc::clone(&lease);
    let lost = tokio::spawn(async move {
        let reason = watch.lost().await;
        (reason, granted.elapsed())
    });

    // The switchover begins just before the first renewal is due (a
    // quarter of a TTL after the grant), the worst moment: the renewal
    // meets the stall, and so does every retry until the standby takes
    // over.
    tokio::time::sleep_until((granted + ttl / 4 - Duration::from_millis(100)).into()).await;
    let began = Instant::now();
    // Open connections hang for good (the proxy still waits on the stopped
    // node); new ones wait until the standby is promoted.
    proxy.hold_new(true);
    proxy.freeze_open();
    primary.stop().await;
    standby.promote().await;
    proxy.set_upstream(standby.port());
    let promoted = began.elapsed();
    tokio::time::sleep_until((began + SWITCHOVER).into()).await;
    // New connections reach the promoted standby; the frozen ones still
    // hang.
    proxy.hold_new(false);
    let switchover = began.elapsed();
    println!(
        "switchover from {:?} after the grant: {switchover:?} (stop and promote took {promoted:?})",
        began - granted
    );

    // Past the deadline the holder would have given up at without a
    // renewal, and past the TTL itself.
    tokio::time::sleep(ttl + ttl / 2).await;
    if lost.is_finished() {
        let (reason, at) = lost.await.expect("watcher");
        panic!(
            "the lease was lost {at:?} after the grant ({reason}) across a switchover of \
             {switchover:?} with a TTL of {ttl:?}"
        );
    }
    let renewed: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM clock_timestamp() - renewed_at)::float8 FROM distlock.leases",
    )
    .fetch_one(&standby.pool().await)
    .await
    .expect("lease row on the new primary");
    println!("last renewal on the new primary {renewed:.3} s ago");
    assert!(
        renewed < ttl.as_secs_f64() / 2.0,
        "the lease was not renewed on the promoted server ({renewed} s ago)"
    );
    let other = TableLocker::builder(standby.pool().await)
        .listen(false)
        .build()
        .expect("valid settings");
    assert!(
        other.try_lock("switchover").await.expect("try").is_none(),
        "someone else was granted a lease that is held"
    );
    lost.abort();
    let _ = lost.await;
    let lease = Arc::into_inner(lease).expect("the watcher is gone");
    lease.release().await.expect("release");
    let next = other
        .try_lock("switchover")
        .await
        .expect("try")
        .expect("free");
    assert!(next.fencing_token().expect("token").value() > token);
    next.release().await.expect("release");
}

/// The check above catches a lost lease: the same switchover, lasting
/// longer than the holder's loss budget allows (two thirds of a TTL after
/// the grant), must be reported as a loss, and before the TTL has run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switchover_longer_than_the_loss_budget_is_reported_before_expiry() {
    common::init_tracing();
    let primary = Cluster::primary("switch-long", &[]).await;
    distlock::migrate(&primary.pool().await)
        .await
        .expect("migrate");
    let proxy = Proxy::start("127.0.0.1", primary.port())
        .await
        .expect("proxy");
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_lazy_with(primary.options().port(proxy.port()));
    let ttl = SWITCHOVER * 3;
    let locker = TableLocker::builder(pool)
        .ttl(ttl)
        .listen(false)
        .build()
        .expect("valid settings");
    let granted = Instant::now();
    let lease = locker
        .try_lock("switchover")
        .await
        .expect("try")
        .expect("free");
    tokio::time::sleep_until((granted + ttl / 4 - Duration::from_millis(100)).into()).await;
    proxy.hold_new(true);
    proxy.freeze_open();
    let reason = common::bounded("loss reported", ttl * 2, lease.lost()).await;
    let at = granted.elapsed();
    println!("lost {at:?} after the grant: {reason}");
    assert!(
        matches!(
            reason,
            LossReason::HeartbeatTimedOut(_) | LossReason::ConnectionFailed(_)
        ),
        "{reason:?}"
    );
    assert!(
        at < ttl,
        "loss reported {at:?} after the grant, TTL {ttl:?}"
    );
    proxy.hold_new(false);
}
