//! `TableLocker`: leases as rows of `distlock.leases`, on a real PostgreSQL
//! (each test in a database of its own), through a real PgBouncer in
//! transaction mode, and behind a proxy that stalls.
//!
//! Where a test guards a safety property, it also runs a broken variant
//! (a holder that trusts its lease too long, SQL functions without the
//! owner or expiry check, a history with an overlap) and shows that the
//! same check catches it.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::pgbouncer::PgBouncer;
use common::proxy::Proxy;
use common::row_waits::{
    backend_alive, rows_locked, waited_at_least, waiting_a_moment_later, waiting_on_locks,
    waiting_pid,
};
use common::{bounded, eventually, init_tracing};
use distlock::postgres::TableLocker;
use distlock::{Error, JobOutcome, LockKey, LossReason, SingletonJob};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Row};

async fn migrated(pool: &PgPool) {
    distlock::migrate(pool).await.expect("migrate");
}

/// A pool of its own (another "process") on `options`.
async fn pool_on(options: PgConnectOptions) -> PgPool {
    PgPoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
        .expect("pool")
}

fn locker(pool: &PgPool, ttl: Duration) -> TableLocker {
    TableLocker::builder(pool.clone())
        .ttl(ttl)
        .build()
        .expect("valid settings")
}

async fn rows(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM distlock.leases")
        .fetch_one(pool)
        .await
        .expect("count")
}

// ---- mutual exclusion and tokens ------------------------------------------

/// One critical section: its token, as the holder saw it, in the order the
/// sections were entered.
#[derive(Debug, Clone, Copy)]
struct Section {
    token: i64,
    overlapped: bool,
}

/// Fails on two holders at once or on a token that does not increase.
fn check_sections(sections: &[Section]) -> Result<(), String> {
    if let Some(s) = sections.iter().find(|s| s.overlapped) {
        return Err(format!("two holders at once (token {})", s.token));
    }
    for pair in sections.windows(2) {
        if pair[1].token <= pair[0].token {
            return Err(format!(
                "token {} after {}: not increasing",
                pair[1].token, pair[0].token
            ));
        }
    }
    Ok(())
}

#[test]
fn the_section_check_catches_overlaps_and_repeated_tokens() {
    let ok = |token| Section {
        token,
        overlapped: false,
    };
    assert!(check_sections(&[ok(1), ok(2), ok(5)]).is_ok());
    assert!(check_sections(&[ok(1), ok(1)]).is_err());
    assert!(check_sections(&[ok(3), ok(2)]).is_err());
    let overlap = Section {
        token: 4,
        overlapped: true,
    };
    assert!(check_sections(&[ok(1), overlap]).is_err());
}

#[sqlx::test(migrations = false)]
async fn many_tasks_on_three_lockers_never_overlap_and_tokens_increase(pool: PgPool) {
    init_tracing();
    migrated(&pool).await;
    let mut lockers = Vec::new();
    for _ in 0..3 {
        let own = pool_on(pool.connect_options().as_ref().clone()).await;
        lockers.push(locker(&own, Duration::from_secs(2)));
    }
    let inside = Arc::new(AtomicUsize::new(0));
    let sections = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..12 {
        let locker = lockers[task % 3].clone();
        let (inside, sections) = (Arc::clone(&inside), Arc::clone(&sections));
        tasks.spawn(async move {
            for _ in 0..8 {
                let lease = locker
                    .lock("table:exclusive", Duration::from_secs(60))
                    .await?;
                let overlapped = inside.fetch_add(1, Ordering::SeqCst) != 0;
                let token = lease.fencing_token().expect("always a token").value();
                sections
                    .lock()
                    .expect("sections")
                    .push(Section { token, overlapped });
                tokio::time::sleep(Duration::from_millis(1)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                lease.release().await?;
            }
            Ok::<_, Error>(())
        });
    }
    let started = Instant::now();
    while let Some(done) = tasks.join_next().await {
        done.expect("task").expect("lock and release");
    }
    let sections = sections.lock().expect("sections").clone();
    println!(
        "{} sections in {:?}, tokens {}..{}",
        sections.len(),
        started.elapsed(),
        sections[0].token,
        sections[sections.len() - 1].token
    );
    assert_eq!(sections.len(), 96);
    check_sections(&sections).unwrap();
    assert_eq!(rows(&pool).await, 0, "every release deleted its row");
}

/// A taker that draws its token and is then delayed before its row lands
/// must not be granted with that token after a later taker was granted (and
/// released) with a higher one: tokens follow the order of grants. The delay
/// is a trigger that sleeps before inserting the slow taker's row.
#[sqlx::test(migrations = false)]
async fn tokens_follow_the_order_of_grants_when_a_taker_is_delayed(pool: PgPool) {
    migrated(&pool).await;
    sqlx::raw_sql(
        "CREATE FUNCTION public.slow_insert() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF current_setting('application_name') = 'slow-taker' THEN
                 PERFORM pg_sleep(1);
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER slow_insert BEFORE INSERT ON distlock.leases
             FOR EACH ROW EXECUTE FUNCTION public.slow_insert();",
    )
    .execute(&pool)
    .await
    .unwrap();
    let slow_pool = pool_on(
        pool.connect_options()
            .as_ref()
            .clone()
            .application_name("slow-taker"),
    )
    .await;
    let slow = locker(&slow_pool, Duration::from_secs(10));
    let fast = locker(&pool, Duration::from_secs(10));
    // The first token of a new database writes the epoch, which would hold
    // every other taker until its transaction ends: get that done first.
    let first = fast.try_lock("table:warm-up").await.unwrap().expect("free");
    first.release().await.unwrap();
    let delayed = tokio::spawn(async move {
        let lease = slow.try_lock("table:order").await.unwrap().expect("free");
        let token = lease.fencing_token().expect("token").value();
        lease.release().await.unwrap();
        token
    });
    // While the slow taker sleeps before its insert, the key is free.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let lease = fast.try_lock("table:order").await.unwrap().expect("free");
    let earlier = lease.fencing_token().expect("token").value();
    lease.release().await.unwrap();
    let later = delayed.await.unwrap();
    assert!(
        later > earlier,
        "granted with {later} after a grant with {earlier}"
    );
}

#[sqlx::test(migrations = false)]
async fn a_lease_outlives_its_ttl_while_renewed(pool: PgPool) {
    migrated(&pool).await;
    // A TTL long enough that a loaded 2-core machine still renews in time.
    let ttl = Duration::from_secs(1);
    let (a, b) = (locker(&pool, ttl), locker(&pool, ttl));
    let lease = a.try_lock("table:renewed").await.unwrap().expect("free");
    for _ in 0..5 {
        tokio::time::sleep(ttl / 2).await;
        assert!(!lease.is_lost(), "renewed every ttl/4");
        assert!(b.try_lock("table:renewed").await.unwrap().is_none());
    }
    lease.release().await.unwrap();
    let next = b
        .try_lock("table:renewed")
        .await
        .unwrap()
        .expect("released");
    next.release().await.unwrap();
}

/// A holder whose runtime ran nothing past the renewal deadline (a long
/// blocking call, a process stopped and continued) sees its lease lost at
/// its first look, before the renewal task has run again: the guard reads
/// its own clock as well as the task's reports. `sqlx::test` runs on a
/// current-thread runtime, so a blocking sleep starves the renewal task.
#[sqlx::test(migrations = false)]
async fn a_starved_holder_sees_its_lease_lost_at_its_first_look(pool: PgPool) {
    migrated(&pool).await;
    let ttl = Duration::from_millis(600);
    let deadline = ttl * 2 / 3;
    let (a, b) = (locker(&pool, ttl), locker(&pool, ttl));
    let lease = a.try_lock("table:starved").await.unwrap().expect("free");
    assert!(!lease.is_lost());
    let validity = lease.validity();
    assert!(
        validity > Duration::ZERO && validity <= deadline,
        "{validity:?}"
    );
    std::thread::sleep(deadline + Duration::from_millis(50));
    assert_eq!(lease.validity(), Duration::ZERO);
    assert_eq!(
        lease.loss(),
        Some(LossReason::HeartbeatTimedOut(deadline)),
        "lost by the clock before the renewal task ran"
    );
    assert!(lease.is_lost());
    let reason = bounded("lost()", Duration::from_millis(100), lease.lost()).await;
    let err = lease.release().await.expect_err("lost");
    let timed_out = |reason: &LossReason| matches!(reason, LossReason::HeartbeatTimedOut(_));
    let released_lost = matches!(&err, Error::LockLost { reason, .. } if timed_out(reason));
    assert!(timed_out(&reason) && released_lost, "{reason:?}, {err:?}");
    // The row is left to expire (or to the renewal task's delete at expiry).
    let next = bounded("the key is free after a TTL", ttl * 3, async {
        loop {
            if let Some(next) = b.try_lock("table:starved").await.unwrap() {
                return next;
            }
            tokio::time::sleep(ttl / 10).await;
        }
    })
    .await;
    next.release().await.unwrap();
}

/// A renewal the server confirmed in time, but whose answer the holder read
/// only past the renewal deadline, does not bring a lease back: the guard
/// may have reported it lost by the clock meanwhile, and a loss is never
/// taken back. Another connection holds the lease's row locked, so the
/// renewal waits on the server; it is released while the holder's runtime
/// is starved, so the answer is there, unread, when the runtime runs again.
#[sqlx::test(migrations = false)]
async fn a_renewal_read_past_the_deadline_does_not_undo_a_loss(pool: PgPool) {
    migrated(&pool).await;
    let ttl = Duration::from_millis(2400);
    let deadline = ttl * 2 / 3;
    let locker = locker(&pool, ttl);
    let blocker = RowBlocker::connect(&pool, "table:late").await;
    let lease = locker.try_lock("table:late").await.unwrap().expect("free");
    let granted = Instant::now();
    let ms = Duration::from_millis;
    // Renewal sent at ttl/4 (600 ms), given up at 1,100 ms; the row is
    // freed at 900 ms, while the runtime is starved (700 to 1,750 ms).
    let blocker = blocker.lock_until(granted + ttl / 4 + ms(300)).await;
    assert!(
        granted.elapsed() < ttl / 4,
        "the row was locked before the renewal"
    );
    tokio::time::sleep_until((granted + ttl / 4 + ms(100)).into()).await;
    assert!(!lease.is_lost(), "{:?}", lease.loss());
    std::thread::sleep((granted + deadline + ms(150)).saturating_duration_since(Instant::now()));
    assert!(lease.is_lost(), "past the deadline by the clock");
    // The renewal task reads its answer now.
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(lease.is_lost(), "a loss was taken back: {:?}", lease.loss());
    }
    blocker.join().expect("blocker");
    let renewed: bool = sqlx::query_scalar(
        "SELECT renewed_at > acquired_at FROM distlock.leases WHERE key_text = 'table:late'",
    )
    .fetch_one(&pool)
    .await
    .expect("the lease's row");
    assert!(renewed, "the renewal ran on the server");
    let released = lease.release().await;
    assert!(
        matches!(released, Err(Error::LockLost { .. })),
        "the late renewal was counted: release answered {released:?}"
    );
}

/// A renewal still in flight at the deadline is the reason the holder
/// reads, not an earlier renewal's failure: the renewals first fail (the
/// renewal function renamed away), then get no answer (the function back,
/// the lease's row locked by another transaction) until past the
/// deadline. Both the guard's clock and the renewal task then give
/// `HeartbeatTimedOut`; without the note of the renewal in flight, the
/// earlier failure (`ConnectionFailed`).
#[sqlx::test(migrations = false)]
async fn a_renewal_in_flight_at_the_deadline_outranks_an_earlier_failure(pool: PgPool) {
    migrated(&pool).await;
    let ttl = Duration::from_secs(3);
    let locker = locker(&pool, ttl);
    let lease = locker
        .try_lock("table:in-flight")
        .await
        .unwrap()
        .expect("free");
    let granted = Instant::now();
    sqlx::query("ALTER FUNCTION distlock.lease_renew RENAME TO lease_renew_away")
        .execute(&pool)
        .await
        .expect("rename the renewal function away");
    // The first renewal (a quarter of a TTL in) fails, and its retries.
    tokio::time::sleep_until((granted + ttl / 3).into()).await;
    // The row locked first, then the function back: every later renewal
    // waits on the row.
    let mut blocker = pool.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM distlock.leases FOR UPDATE")
        .execute(&mut *blocker)
        .await
        .expect("lock the lease's row");
    sqlx::query("ALTER FUNCTION distlock.lease_renew_away RENAME TO lease_renew")
        .execute(&pool)
        .await
        .expect("rename the renewal function back");
    assert!(!lease.is_lost(), "{:?}", lease.loss());
    let reason = bounded("lost()", ttl, lease.lost()).await;
    blocker.rollback().await.expect("rollback");
    assert!(
        matches!(reason, LossReason::HeartbeatTimedOut(_)),
        "the renewal in flight, not the earlier failure: {reason:?}"
    );
    assert!(lease.release().await.is_err(), "released after its loss");
}

/// A renewal the holder gave up on ends on the server too: it waits for the
/// lease's row under a `lock_timeout` of what is left of its attempt's
/// budget, so it neither stays behind as a backend waiting on the row (one
/// more for every attempt, each on a connection the holder closed) nor
/// extends, once the row is freed, a lease its holder was told is lost.
/// Another transaction holds the row from before the first renewal until
/// past the loss.
#[sqlx::test(migrations = false)]
async fn a_renewal_given_up_ends_on_the_server_too(pool: PgPool) {
    migrated(&pool).await;
    let ttl = Duration::from_secs(3);
    let locker = locker(&pool, ttl);
    let lease = locker.try_lock("table:gone").await.unwrap().expect("free");
    let mut blocker = pool.begin().await.expect("begin");
    let granted_expiry: i64 = sqlx::query_scalar(
        "SELECT (extract(epoch FROM expires_at) * 1000000)::int8 FROM distlock.leases FOR UPDATE",
    )
    .fetch_one(&mut *blocker)
    .await
    .expect("lock the lease's row");
    let reason = bounded("lost()", ttl, lease.lost()).await;
    assert!(
        matches!(reason, LossReason::HeartbeatTimedOut(_)),
        "{reason:?}"
    );
    // Every attempt was given up by the deadline, and ended on the server
    // a moment after: none waits on the row any more.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let waiting = waiting_on_locks(&pool, "lease_renew").await;
    blocker.rollback().await.expect("rollback");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let expiry: Option<i64> = sqlx::query_scalar(
        "SELECT (extract(epoch FROM expires_at) * 1000000)::int8 FROM distlock.leases",
    )
    .fetch_optional(&pool)
    .await
    .expect("the lease's row");
    assert_eq!(waiting, 0, "renewals given up still wait on the server");
    assert!(
        expiry.is_none_or(|expiry| expiry <= granted_expiry),
        "a renewal given up extended the lost lease by {} µs",
        expiry.unwrap_or(0) - granted_expiry
    );
    assert!(lease.release().await.is_err(), "released after its loss");
}

/// A grant given up on ends on the server too: a try held up by an expired
/// lease's row (locked by another transaction) fails with
/// `CommandTimedOut`, and its statement waits for the row only until about
/// when its task gives up on the answer (a TTL from the send), so it
/// neither stays behind as a backend waiting on the row nor grants, once
/// the row is freed, a lease nobody holds (which would keep the key from
/// everyone for a TTL).
#[sqlx::test(migrations = false)]
async fn a_grant_given_up_ends_on_the_server_too(pool: PgPool) {
    migrated(&pool).await;
    let ttl = Duration::from_millis(1500);
    let locker = locker(&pool, ttl);
    let key = "table:late-grant";
    let (expired, blocker) = expired_and_blocked(&pool, &locker, key).await;
    // The attempt's task gave up a TTL after the send, and its statement
    // ended on the server then: none waits on the row any more.
    let (waiting, live) = a_grant_given_up(&pool, &locker, key, blocker).await;
    assert_eq!(waiting, 0, "a grant given up still waits on the server");
    assert_eq!(live, 0, "a grant given up was made once the row was freed");
    let taken = locker
        .try_lock(key)
        .await
        .unwrap()
        .expect("the key is free");
    taken.release().await.unwrap();
    assert!(expired.release().await.is_err(), "released after its loss");
}

/// A grant that reaches the server late still waits only until its task
/// gives up: the try runs on a kept connection the server had ended, so
/// its statement runs once more on a connection from a pool that takes
/// 0.6 TTL to open one, and is sent then. Its wait for the expired lease's
/// locked row ends with the rest of the task's TTL (0.4 TTL), not a whole
/// TTL from its late send, so it is not left waiting and grants nothing
/// once the row is freed.
#[sqlx::test(migrations = false)]
async fn a_grant_sent_late_waits_only_until_its_task_gives_up(pool: PgPool) {
    migrated(&pool).await;
    let ttl = Duration::from_millis(1500);
    let slow = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let slow_pool = slow_to_connect(&pool, Arc::clone(&slow), ttl * 3 / 5).await;
    let locker = TableLocker::builder(slow_pool)
        .ttl(ttl)
        .listen(false)
        .keep_warm(2, Duration::from_secs(3600))
        .build()
        .expect("valid settings");
    let key = "table:late-send";
    let (_expired, blocker) = expired_and_blocked(&pool, &locker, key).await;
    // The kept connection (and any idle one) is ended; new ones are slow.
    slow.store(true, Ordering::SeqCst);
    sqlx::query(
        "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = $1",
    )
    .bind(SLOW_APP)
    .execute(&pool)
    .await
    .expect("end the slow pool's sessions");
    let (waiting, live) = a_grant_given_up(&pool, &locker, key, blocker).await;
    assert_eq!(
        (waiting, live),
        (0, 0),
        "a grant sent late: (backends still waiting past its task, live leases \
         granted once the row was freed)"
    );
}

/// A release given up on ends on the server too: held up by the lease's
/// row (locked by another transaction), `release()` fails with
/// `ReleaseTimedOut` at its deadline, and its statement's wait for the row
/// ends then as well, so it does not stay behind as a backend waiting on
/// the row (the row expires after a TTL).
#[sqlx::test(migrations = false)]
async fn a_release_given_up_ends_on_the_server_too(pool: PgPool) {
    let (lease, blocker) = held_behind_a_locked_row(&pool, "table:late-release").await;
    let started = Instant::now();
    let released = lease.release().await;
    given_up_at_the_deadline(&released);
    waited_at_least(started, RELEASE_DEADLINE);
    let waiting = waiting_a_moment_later(&pool, "lease_release").await;
    blocker.rollback().await.expect("rollback");
    assert_eq!(waiting, 0, "a release given up still waits on the server");
}

/// A locker's listening connection (which wakes its waiters when a key is
/// released) is a task spawned on the runtime of its first wait. When that
/// runtime shuts down, the task is gone; a wait on another runtime must
/// still be woken by the release, not by its poll interval (10 s here: it
/// slept that long, the listener believed listening).
#[sqlx::test(migrations = false)]
async fn a_wait_is_woken_after_the_first_runtime_shut_down(
    _opts: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = common::pool_for_runtimes(&connect);
    migrated(&pool).await;
    let locker = TableLocker::builder(pool)
        .ttl(Duration::from_secs(30))
        .poll_interval(Duration::from_secs(10))
        .keep_warm(0, Duration::ZERO)
        .build()
        .expect("valid settings");
    let key = "table:listener-rt";
    let first = locker.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let held = first.try_lock(key).await.unwrap().expect("free");
            let waited = first.lock(key, Duration::from_secs(1)).await;
            assert!(matches!(waited, Err(Error::Timeout { .. })), "{waited:?}");
            held.release().await.unwrap();
        });
    })
    .join()
    .unwrap();
    let held = locker.try_lock(key).await.unwrap().expect("free");
    let waiter = locker.clone();
    let waiting = tokio::spawn(async move { waiter.lock(key, Duration::from_secs(20)).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let released = Instant::now();
    held.release().await.unwrap();
    let granted = bounded("the wait", Duration::from_secs(25), waiting)
        .await
        .unwrap()
        .expect("granted");
    let after = released.elapsed();
    granted.release().await.unwrap();
    assert!(
        after < Duration::from_secs(3),
        "granted {after:?} after the release"
    );
}

/// The release deadline of [`held_behind_a_locked_row`]'s locker.
const RELEASE_DEADLINE: Duration = Duration::from_millis(400);

/// A lease on `key` (TTL 30 s, release deadline [`RELEASE_DEADLINE`]),
/// its row locked by another transaction, left open.
async fn held_behind_a_locked_row(
    pool: &PgPool,
    key: &str,
) -> (
    distlock::postgres::TableLease,
    sqlx::Transaction<'static, sqlx::Postgres>,
) {
    migrated(pool).await;
    let locker = TableLocker::builder(pool.clone())
        .ttl(Duration::from_secs(30))
        .release_timeout(RELEASE_DEADLINE)
        .build()
        .expect("valid settings");
    let lease = locker.try_lock(key).await.unwrap().expect("free");
    let blocker = rows_locked(pool, "distlock.leases").await;
    (lease, blocker)
}

/// `release()` gave up at [`RELEASE_DEADLINE`].
fn given_up_at_the_deadline(released: &Result<(), Error>) {
    assert!(
        matches!(released, Err(Error::ReleaseTimedOut { after, .. }) if *after == RELEASE_DEADLINE),
        "{released:?}"
    );
}

/// A release whose wait for a locked row the *server* gives up first (its
/// statement-local `lock_timeout`, SQLSTATE 55P03) is reported as the
/// client's own give-up would be, `ReleaseTimedOut`, not as a database
/// error, and its connection, which the server answered, is kept rather
/// than closed. The client's timer usually fires first; here the runtime
/// is starved (a long blocking call) while the release waits, so that the
/// server's answer is there before the timer is looked at.
#[sqlx::test(migrations = false)]
async fn a_release_the_server_gives_up_first_is_release_timed_out(pool: PgPool) {
    let (lease, blocker) = held_behind_a_locked_row(&pool, "table:server-gives-up").await;
    let release = tokio::spawn(lease.release());
    let pid = waiting_pid(&pool, "lease_release").await;
    // The server's lock_timeout (what was left of the deadline) passes
    // while no task of this runtime runs.
    drop(common::starve_runtime(
        RELEASE_DEADLINE + Duration::from_millis(300),
    ));
    let released = bounded("release()", Duration::from_secs(5), release)
        .await
        .expect("the release task");
    given_up_at_the_deadline(&released);
    let alive = backend_alive(&pool, pid).await;
    blocker.rollback().await.expect("rollback");
    assert!(
        alive,
        "the release's connection was closed though the server answered"
    );
}

/// A grant whose wait for a locked row the *server* gives up first (its
/// statement-local `lock_timeout`, SQLSTATE 55P03, a TTL from the send) is
/// reported as the task's own give-up would be, `CommandTimedOut`, not as a
/// database error; nothing is granted once the row is freed, and the
/// connection, which the server answered, is kept rather than closed. The
/// task's timer usually fires first; here the runtime is starved while the
/// grant waits, so that the server's answer is there before the timer is
/// looked at.
#[sqlx::test(migrations = false)]
async fn a_grant_the_server_gives_up_first_is_command_timed_out(pool: PgPool) {
    migrated(&pool).await;
    let ttl = Duration::from_millis(1500);
    let locker = locker(&pool, ttl);
    let key = "table:grant-server-gives-up";
    let (_expired, blocker) = expired_and_blocked(&pool, &locker, key).await;
    let trying = tokio::spawn({
        let locker = locker.clone();
        async move { locker.try_lock(key).await.map(|lease| lease.is_some()) }
    });
    let pid = waiting_pid(&pool, "lease_acquire").await;
    // The server's lock_timeout (a TTL from the send) passes while no task
    // of this runtime runs.
    drop(common::starve_runtime(ttl + Duration::from_millis(300)));
    let tried = bounded("try_lock()", Duration::from_secs(5), trying)
        .await
        .expect("the try's task");
    assert!(
        matches!(tried, Err(Error::CommandTimedOut { .. })),
        "{tried:?}"
    );
    let alive = backend_alive(&pool, pid).await;
    blocker.commit().await.expect("commit");
    assert!(
        alive,
        "the grant's connection was closed though the server answered"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let live: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM distlock.leases WHERE expires_at > clock_timestamp()",
    )
    .fetch_one(&pool)
    .await
    .expect("count live leases");
    assert_eq!(live, 0, "a grant the server gave up on was made later");
}

/// A renewal whose wait for its locked row the *server* gives up first
/// (55P03 at the attempt's budget) counts as an attempt that got no answer
/// in time, as the task's own give-up would: past the deadline the lease
/// is lost with `HeartbeatTimedOut`, not the server's error as a
/// `ConnectionFailed`, and the connection, which the server answered, is
/// kept rather than closed. The runtime is starved while the renewal
/// waits, past the lease's deadline, so that the server's answer is there
/// before the task's timer is looked at.
#[sqlx::test(migrations = false)]
async fn a_renewal_the_server_gives_up_first_is_no_answer_in_time(pool: PgPool) {
    migrated(&pool).await;
    let ttl = Duration::from_millis(1500);
    let locker = locker(&pool, ttl);
    let lease = locker
        .try_lock("table:renewal-server-gives-up")
        .await
        .unwrap()
        .expect("free");
    let granted = Instant::now();
    let blocker = rows_locked(&pool, "distlock.leases").await;
    let pid = waiting_pid(&pool, "lease_renew").await;
    // Past the deadline (2/3 of a TTL from the grant) with no task of this
    // runtime running: the server's lock_timeout ends the renewal first.
    drop(common::starve_runtime(
        (granted + ttl + Duration::from_millis(300)).saturating_duration_since(Instant::now()),
    ));
    let reason = bounded("lost()", ttl, lease.lost()).await;
    let alive = backend_alive(&pool, pid).await;
    blocker.rollback().await.expect("rollback");
    assert!(
        matches!(reason, LossReason::HeartbeatTimedOut(_)),
        "{reason:?}"
    );
    assert!(
        alive,
        "the renewal's connection was closed though the server answered"
    );
}

/// A grant the server made in time, but whose answer the caller read only
/// past the renewal deadline (its future not polled meanwhile, as on a
/// starved runtime), is no lease: it is lost by the clock already, and
/// from a TTL on the row may be another holder's. The try reports no answer
/// in time, and the grant is released in the background at once, long
/// before it would expire.
#[sqlx::test(migrations = false)]
async fn a_grant_read_past_the_renewal_deadline_is_refused_and_released(pool: PgPool) {
    migrated(&pool).await;
    let ttl = Duration::from_millis(1500);
    let locker = locker(&pool, ttl);
    let key = "table:read-late";
    let (_expired, blocker) = expired_and_blocked(&pool, &locker, key).await;
    let sent = Instant::now();
    let mut trying = std::pin::pin!(locker.try_lock(key));
    tokio::select! {
        biased;
        tried = &mut trying => panic!("answered while the row was locked: {tried:?}"),
        () = tokio::time::sleep(Duration::from_millis(200)) => {}
    }
    // The statement's own task takes the row and answers; the try is not
    // polled again until past its renewal deadline (2/3 of a TTL from the
    // send, 1,000 ms), long before the grant would expire (1,700 ms).
    blocker.commit().await.expect("commit");
    tokio::time::sleep_until((sent + ttl * 2 / 3 + Duration::from_millis(200)).into()).await;
    match trying.await {
        Err(Error::CommandTimedOut { key: named, .. }) => assert_eq!(named, LockKey::from(key)),
        Ok(Some(lease)) => panic!(
            "a lease past its renewal deadline was handed out (lost: {:?})",
            lease.loss()
        ),
        other => panic!("expected CommandTimedOut, got {other:?}"),
    }
    eventually(
        "the late grant released",
        Duration::from_millis(300),
        async || {
            let live: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM distlock.leases WHERE expires_at > clock_timestamp()",
            )
            .fetch_one(&pool)
            .await
            .expect("count live leases");
            live == 0
        },
    )
    .await;
}

/// Takes `key` on `locker`, expires its lease, waits for its loss, and
/// locks the row with a write in a transaction left open. A write, not a
/// bare `FOR UPDATE`: a statement waiting on the row then evaluates it
/// again once the row is freed, its clock included, as after any taker's
/// write (after a bare row lock it would use the times it computed before
/// its wait, and a late grant would already be expired).
async fn expired_and_blocked(
    pool: &PgPool,
    locker: &TableLocker,
    key: &str,
) -> (
    distlock::postgres::TableLease,
    sqlx::Transaction<'static, sqlx::Postgres>,
) {
    let expired = locker.try_lock(key).await.unwrap().expect("free");
    sqlx::query("UPDATE distlock.leases SET expires_at = clock_timestamp() - interval '1 hour'")
        .execute(pool)
        .await
        .expect("expire the lease");
    let reason = bounded("lost()", locker.ttl(), expired.lost()).await;
    assert_eq!(reason, LossReason::Expired);
    let mut blocker = pool.begin().await.expect("begin");
    sqlx::query("UPDATE distlock.leases SET key_text = key_text")
        .execute(&mut *blocker)
        .await
        .expect("lock the expired lease's row");
    (expired, blocker)
}

/// Tries `key` on `locker` while `blocker` holds the row: the try gives up
/// with `CommandTimedOut`. Returns the backends still waiting in
/// `lease_acquire` a moment after the attempt's task gave up (a TTL from
/// the send), and the live leases (a late grant's) a moment after
/// `blocker` then commits.
async fn a_grant_given_up(
    pool: &PgPool,
    locker: &TableLocker,
    key: &str,
    blocker: sqlx::Transaction<'static, sqlx::Postgres>,
) -> (i64, i64) {
    let sent = Instant::now();
    let tried = locker.try_lock(key).await;
    assert!(
        matches!(tried, Err(Error::CommandTimedOut { .. })),
        "{tried:?}"
    );
    let given_up = sent + locker.ttl();
    tokio::time::sleep_until((given_up + Duration::from_millis(300)).into()).await;
    let waiting = waiting_on_locks(pool, "lease_acquire").await;
    blocker.commit().await.expect("commit");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let live: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM distlock.leases WHERE expires_at > clock_timestamp()",
    )
    .fetch_one(pool)
    .await
    .expect("count live leases");
    (waiting, live)
}

/// The `application_name` of [`slow_to_connect`]'s connections.
const SLOW_APP: &str = "distlock-test-slow-pool";

/// A pool on `pool`'s database whose new connections take `delay` more to
/// open while `slow` is set.
async fn slow_to_connect(
    pool: &PgPool,
    slow: Arc<std::sync::atomic::AtomicBool>,
    delay: Duration,
) -> PgPool {
    let options = pool.connect_options().as_ref().clone();
    PgPoolOptions::new()
        .max_connections(4)
        .after_connect(move |_conn, _meta| {
            let slow = slow.load(Ordering::SeqCst);
            Box::pin(async move {
                if slow {
                    tokio::time::sleep(delay).await;
                }
                Ok(())
            })
        })
        .connect_with(options.application_name(SLOW_APP))
        .await
        .expect("slow pool")
}

/// A connection on a thread of its own (with its own runtime, so it runs
/// while the test's runtime is starved), opened before the lease is taken,
/// that locks a lease's row on request and commits at a given instant.
struct RowBlocker {
    thread: std::thread::JoinHandle<()>,
    lock: std::sync::mpsc::Sender<Instant>,
    locked: tokio::sync::oneshot::Receiver<()>,
}

impl RowBlocker {
    async fn connect(pool: &PgPool, key: &str) -> Self {
        let options = pool.connect_options().as_ref().clone();
        let key = key.to_owned();
        let (lock, requests) = std::sync::mpsc::channel::<Instant>();
        let (connected_tx, connected) = tokio::sync::oneshot::channel();
        let (locked_tx, locked) = tokio::sync::oneshot::channel();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                use sqlx::Connection;
                let mut conn = sqlx::PgConnection::connect_with(&options)
                    .await
                    .expect("connect");
                let mut tx = conn.begin().await.expect("begin");
                let _ = connected_tx.send(());
                let until = requests.recv().expect("a lock request");
                sqlx::query("SELECT 1 FROM distlock.leases WHERE key_text = $1 FOR UPDATE")
                    .bind(&key)
                    .fetch_one(&mut *tx)
                    .await
                    .expect("lock the row");
                let _ = locked_tx.send(());
                tokio::time::sleep(until.saturating_duration_since(Instant::now())).await;
                tx.commit().await.expect("commit");
            });
        });
        connected.await.expect("the blocker connected");
        Self {
            thread,
            lock,
            locked,
        }
    }

    /// Locks the row now, until `until`; returns once it is locked.
    async fn lock_until(self, until: Instant) -> std::thread::JoinHandle<()> {
        self.lock.send(until).expect("the blocker is waiting");
        self.locked.await.expect("the row is locked");
        self.thread
    }
}

// ---- through PgBouncer -------------------------------------------------------

#[sqlx::test(migrations = false)]
async fn works_through_pgbouncer_in_transaction_mode(pool: PgPool) {
    init_tracing();
    migrated(&pool).await;
    let direct = pool.connect_options().as_ref().clone();
    let bouncer = PgBouncer::start(direct.get_port()).await;
    let through = |_: ()| async {
        PgPoolOptions::new()
            .max_connections(4)
            .connect_with(bouncer.options(&direct))
            .await
            .expect("pool through pgbouncer")
    };
    let (pool_a, pool_b) = (through(()).await, through(()).await);

    // The pooler really moves a client between server sessions: pin every
    // server session that `pool_b` can get with an open transaction (the
    // pooler hands out idle sessions before opening new ones, so the one
    // `pool_a` just used is among them), and `pool_a`'s next statement must
    // run on another one.
    let backend = "SELECT pg_backend_pid()";
    let first: i32 = sqlx::raw_sql(backend)
        .fetch_one(&pool_a)
        .await
        .unwrap()
        .get(0);
    let mut pinned = Vec::new();
    let mut pinned_pids = std::collections::HashSet::new();
    for _ in 0..3 {
        let mut tx = pool_b.begin().await.unwrap();
        let pid: i32 = sqlx::raw_sql(backend)
            .fetch_one(&mut *tx)
            .await
            .unwrap()
            .get(0);
        pinned_pids.insert(pid);
        pinned.push(tx);
    }
    assert!(
        pinned_pids.contains(&first),
        "{first} not pinned: {pinned_pids:?}"
    );
    let moved: i32 = sqlx::raw_sql(backend)
        .fetch_one(&pool_a)
        .await
        .unwrap()
        .get(0);
    assert_ne!(moved, first, "one server session only");
    // Rolled back explicitly: a dropped transaction would keep its server
    // session pinned until its client connection is used again.
    for tx in pinned {
        tx.rollback().await.unwrap();
    }
    // ...which is why the lease statements are simple queries: a statement
    // with bound parameters, outside a transaction, is split in two and
    // fails through this PgBouncer (sqlx 0.9, PgBouncer 1.18).
    let mut failures = 0;
    for _ in 0..10 {
        let bound = sqlx::query_scalar::<_, i64>("SELECT $1::int8 + 1")
            .bind(41_i64)
            .fetch_one(&pool_a)
            .await;
        failures += usize::from(bound.is_err());
    }
    println!("bound-parameter statements failing through pgbouncer: {failures}/10");

    // Waiters listen on a direct connection (LISTEN needs a session).
    let ttl = Duration::from_millis(600);
    let make = |pool: &PgPool, ttl: Duration| {
        TableLocker::builder(pool.clone())
            .ttl(ttl)
            .listen_options(direct.clone())
            .build()
            .expect("valid settings")
    };
    let (a, b) = (make(&pool_a, ttl), make(&pool_b, ttl));

    // Exclusive, renewed past its TTL, released, handed over.
    let lease = a.try_lock("table:bouncer").await.unwrap().expect("free");
    tokio::time::sleep(ttl * 2).await;
    assert!(!lease.is_lost(), "renewed through pgbouncer");
    assert!(b.try_lock("table:bouncer").await.unwrap().is_none());
    let waiter = tokio::spawn({
        let b = b.clone();
        async move { b.lock("table:bouncer", Duration::from_secs(10)).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let released = Instant::now();
    let first_token = lease.fencing_token().unwrap();
    lease.release().await.unwrap();
    let next = bounded("hand-off", Duration::from_secs(10), waiter)
        .await
        .unwrap()
        .expect("handed over");
    println!("hand-off through pgbouncer: {:?}", released.elapsed());
    assert!(next.fencing_token().unwrap() > first_token);
    next.release().await.unwrap();

    // Many tasks through the pooler: no overlap, increasing tokens. A TTL
    // that a loaded machine cannot outlast between a grant and the section
    // that records it: a stalled holder whose lease expired would enter
    // after its successor (the TTL doing its job, not a defect).
    let ttl = Duration::from_secs(10);
    let (a, b) = (make(&pool_a, ttl), make(&pool_b, ttl));
    let inside = Arc::new(AtomicUsize::new(0));
    let sections = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..8 {
        let locker = if task % 2 == 0 { a.clone() } else { b.clone() };
        let (inside, sections) = (Arc::clone(&inside), Arc::clone(&sections));
        tasks.spawn(async move {
            for _ in 0..6 {
                let lease = locker
                    .lock("table:bouncer:many", Duration::from_secs(60))
                    .await?;
                let overlapped = inside.fetch_add(1, Ordering::SeqCst) != 0;
                let token = lease.fencing_token().unwrap().value();
                sections.lock().unwrap().push(Section { token, overlapped });
                tokio::time::sleep(Duration::from_millis(1)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                lease.release().await?;
            }
            Ok::<_, Error>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap().unwrap();
    }
    check_sections(&sections.lock().unwrap()).unwrap();
    assert_eq!(rows(&pool).await, 0);
    drop((a, b));
    pool_a.close().await;
    pool_b.close().await;
    assert!(!bouncer.log().contains("FATAL"), "{}", bouncer.log());
}

// ---- a cut-off holder gives up first -----------------------------------------

/// A holder written by hand on the SQL functions, that renews every TTL/3
/// and trusts its lease until `trust` after the last renewal it *sent*
/// successfully: the library uses 2/3 of the TTL; a broken holder trusts it
/// longer than the TTL. Returns when it stopped trusting the lease.
async fn hand_written_holder(
    conn_options: PgConnectOptions,
    key: &str,
    ttl: Duration,
    trust: Duration,
) -> tokio::task::JoinHandle<Instant> {
    let pool = pool_on(conn_options).await;
    let owner = format!("{:032x}", rand::random::<u128>());
    let ttl_ms = i64::try_from(ttl.as_millis()).unwrap();
    let granted: bool = sqlx::query_scalar(
        "SELECT granted FROM distlock.lease_acquire(1::int2, hashtext($1)::int8, $1, $2::uuid, $3)",
    )
    .bind(key)
    .bind(&owner)
    .bind(ttl_ms)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(granted);
    let mut last_ok = Instant::now();
    let key = key.to_owned();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep_until((last_ok + ttl / 3).into()).await;
            let sent = Instant::now();
            let renew = sqlx::query_scalar::<_, bool>(
                "SELECT distlock.lease_renew(1::int2, hashtext($1)::int8, $2::uuid, $3)",
            )
            .bind(&key)
            .bind(&owner)
            .bind(ttl_ms)
            .fetch_one(&pool);
            match tokio::time::timeout_at((last_ok + trust).into(), renew).await {
                Ok(Ok(true)) => last_ok = sent,
                _ => return Instant::now(),
            }
        }
    })
}

/// Cuts the holder off (the proxy stalls), lets the other locker wait for
/// the key, and returns (the instant the holder stopped trusting its lease,
/// the instant the other was granted the key).
async fn cut_off(pool: &PgPool, holder: Holder, key: &str, ttl: Duration) -> (Instant, Instant) {
    let proxy = Proxy::start("127.0.0.1", pool.connect_options().get_port())
        .await
        .expect("proxy");
    let via_proxy = proxy.options(&pool.connect_options());
    let other = locker(pool, ttl);
    let (lost, lease) = match holder {
        Holder::Library => {
            let holder_pool = pool_on(via_proxy).await;
            let holder = TableLocker::builder(holder_pool)
                .ttl(ttl)
                .listen(false)
                .build()
                .expect("valid settings");
            let lease = holder.try_lock(key).await.unwrap().expect("free");
            let lease = Arc::new(lease);
            let watch = Arc::clone(&lease);
            let lost = tokio::spawn(async move {
                watch.lost().await;
                Instant::now()
            });
            (lost, Some(lease))
        }
        Holder::HandWritten { trust } => {
            (hand_written_holder(via_proxy, key, ttl, trust).await, None)
        }
    };
    // A few renewals go through, then the network stalls.
    tokio::time::sleep(ttl).await;
    proxy.stall();
    let granted = other
        .lock(key, Duration::from_secs(30))
        .await
        .expect("granted after expiry");
    let granted_at = Instant::now();
    let lost_at = bounded("the holder gives up", Duration::from_secs(30), lost)
        .await
        .unwrap();
    if let Some(lease) = lease {
        // The network comes back: late renewals must not revive anything.
        proxy.pass();
        tokio::time::sleep(ttl).await;
        assert!(lease.is_lost(), "a lost lease stays lost");
        assert!(!granted.is_lost(), "the new holder keeps its lease");
        let lease = Arc::into_inner(lease).expect("the watcher is done");
        assert!(matches!(lease.release().await, Err(Error::LockLost { .. })));
        assert!(!granted.is_lost());
    }
    granted.release().await.unwrap();
    (lost_at, granted_at)
}

#[derive(Debug, Clone, Copy)]
enum Holder {
    Library,
    HandWritten { trust: Duration },
}

#[sqlx::test(migrations = false)]
async fn a_cut_off_holder_reports_loss_before_anyone_is_granted_its_key(pool: PgPool) {
    init_tracing();
    migrated(&pool).await;
    let ttl = Duration::from_millis(900);
    let (lost_at, granted_at) = cut_off(&pool, Holder::Library, "table:cut", ttl).await;
    println!(
        "holder gave up {:?} before the key was granted elsewhere",
        granted_at.saturating_duration_since(lost_at)
    );
    assert!(
        lost_at < granted_at,
        "lost {lost_at:?}, granted {granted_at:?}"
    );

    // Control: a holder that trusts its lease for a TTL and a third after
    // its last renewal is still trusting it when the key is granted.
    let broken = Holder::HandWritten { trust: ttl * 4 / 3 };
    let (lost_at, granted_at) = cut_off(&pool, broken, "table:cut:broken", ttl).await;
    println!(
        "the broken holder trusted its lease {:?} after the key was granted elsewhere",
        lost_at.saturating_duration_since(granted_at)
    );
    assert!(
        lost_at > granted_at,
        "the check would not catch a holder that trusts too long"
    );
}

// ---- renewals and releases never resurrect ----------------------------------

/// Per round: `A` is granted a 40 ms lease and lets it expire; then A's
/// renewals and releases race B's acquisition. Every renewal must fail
/// (the lease had expired), B must be granted, and B's row must survive.
/// `renew` and `release` name the SQL functions under test.
async fn race_expired_lease(
    pool: &PgPool,
    renew: &str,
    release: &str,
    rounds: usize,
) -> Result<(), String> {
    for round in 0..rounds {
        let key = format!("table:race:{renew}:{release}:{round}");
        let (a, b) = (
            format!("{:032x}", rand::random::<u128>()),
            format!("{:032x}", rand::random::<u128>()),
        );
        let acquire = "SELECT granted FROM distlock.lease_acquire(1::int2, hashtext($1)::int8, $1, $2::uuid, $3)";
        let granted: bool = sqlx::query_scalar(acquire)
            .bind(&key)
            .bind(&a)
            .bind(40_i64)
            .fetch_one(pool)
            .await
            .unwrap();
        assert!(granted);
        tokio::time::sleep(Duration::from_millis(70)).await;
        let mut racers = tokio::task::JoinSet::new();
        for i in 0..12 {
            let (pool, key, a, b) = (pool.clone(), key.clone(), a.clone(), b.clone());
            let sql = match i % 3 {
                0 => format!("SELECT {renew}(1::int2, hashtext($1)::int8, $2::uuid, 60000)"),
                1 => format!("SELECT {release}(1::int2, hashtext($1)::int8, $2::uuid)"),
                _ => acquire.replace("$3", "60000"),
            };
            racers.spawn(async move {
                let owner = if i % 3 == 2 { b } else { a };
                let ok: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                    .bind(&key)
                    .bind(&owner)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                (i % 3, ok)
            });
        }
        let mut b_granted = 0;
        while let Some(done) = racers.join_next().await {
            match done.unwrap() {
                (0, true) => return Err(format!("round {round}: an expired lease was renewed")),
                (1, true) => {
                    return Err(format!(
                        "round {round}: an expired lease was released as held"
                    ));
                }
                (2, true) => b_granted += 1,
                _ => {}
            }
        }
        if b_granted != 1 {
            return Err(format!("round {round}: B granted {b_granted} times"));
        }
        let owner: Option<String> = sqlx::query_scalar(
            "SELECT owner::text FROM distlock.leases WHERE lock_id = hashtext($1)::int8",
        )
        .bind(&key)
        .fetch_optional(pool)
        .await
        .unwrap();
        let b_uuid = sqlx::query_scalar::<_, String>("SELECT $1::uuid::text")
            .bind(&b)
            .fetch_one(pool)
            .await
            .unwrap();
        if owner.as_deref() != Some(b_uuid.as_str()) {
            return Err(format!(
                "round {round}: B's row is gone or changed: {owner:?}"
            ));
        }
    }
    Ok(())
}

#[sqlx::test(migrations = false)]
async fn renewals_and_releases_never_resurrect_an_expired_lease(pool: PgPool) {
    migrated(&pool).await;
    race_expired_lease(&pool, "distlock.lease_renew", "distlock.lease_release", 25)
        .await
        .unwrap();

    // Controls: the same functions without the expiry check, or without the
    // owner check, are caught.
    sqlx::raw_sql(
        "CREATE SCHEMA broken;
         CREATE FUNCTION broken.renew_without_expiry(s smallint, id bigint, o uuid, ms bigint)
         RETURNS boolean LANGUAGE sql AS $$
           WITH r AS (UPDATE distlock.leases SET expires_at = clock_timestamp() + ms * interval '1 ms'
                      WHERE space = s AND lock_id = id AND owner = o RETURNING 1)
           SELECT EXISTS (SELECT 1 FROM r) $$;
         CREATE FUNCTION broken.release_without_owner(s smallint, id bigint, o uuid)
         RETURNS boolean LANGUAGE sql AS $$
           WITH r AS (DELETE FROM distlock.leases WHERE space = s AND lock_id = id RETURNING 1)
           SELECT (SELECT count(*) FROM r) < 0 $$;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let caught = race_expired_lease(
        &pool,
        "broken.renew_without_expiry",
        "distlock.lease_release",
        25,
    )
    .await;
    println!("renewal without the expiry check: {caught:?}");
    assert!(
        caught.is_err(),
        "a renewal that ignores expiry went unnoticed"
    );
    let caught = race_expired_lease(
        &pool,
        "distlock.lease_renew",
        "broken.release_without_owner",
        25,
    )
    .await;
    println!("release without the owner check: {caught:?}");
    assert!(
        caught.is_err(),
        "a release that ignores the owner went unnoticed"
    );
}

// ---- hand-off ------------------------------------------------------------------

/// Median latency from `release()` returning to the waiter's `lock()`
/// returning, over `rounds` hand-offs.
async fn hand_off_latency(holder: &TableLocker, waiter: &TableLocker, rounds: usize) -> Duration {
    let mut took = Vec::new();
    for round in 0..rounds {
        let key = format!("table:handoff:{round}");
        let lease = holder.try_lock(key.as_str()).await.unwrap().expect("free");
        let wait = tokio::spawn({
            let (waiter, key) = (waiter.clone(), key.clone());
            async move {
                let lease = waiter.lock(key, Duration::from_secs(30)).await;
                (Instant::now(), lease)
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let released = Instant::now();
        lease.release().await.unwrap();
        let (granted, lease) = wait.await.unwrap();
        lease.unwrap().release().await.unwrap();
        took.push(granted - released);
    }
    took.sort();
    took[took.len() / 2]
}

#[sqlx::test(migrations = false)]
async fn a_release_wakes_the_waiter_without_a_poll_interval(pool: PgPool) {
    migrated(&pool).await;
    let other = pool_on(pool.connect_options().as_ref().clone()).await;
    let ttl = Duration::from_secs(30);
    let poll = Duration::from_secs(3);
    let listening = |pool: &PgPool| {
        TableLocker::builder(pool.clone())
            .ttl(ttl)
            .poll_interval(poll)
            .build()
            .expect("valid settings")
    };
    let median = hand_off_latency(&listening(&pool), &listening(&other), 15).await;
    println!("hand-off, listening (poll {poll:?}): median {median:?}");
    assert!(
        median < Duration::from_millis(300),
        "{median:?}: not woken by NOTIFY"
    );

    let polling = |pool: &PgPool| {
        TableLocker::builder(pool.clone())
            .ttl(ttl)
            .listen(false)
            .poll_interval(Duration::from_millis(100))
            .build()
            .expect("valid settings")
    };
    let median = hand_off_latency(&polling(&pool), &polling(&other), 15).await;
    println!("hand-off, polling every 100 ms: median {median:?}");

    // A holder that vanished without releasing (a row nobody renews): the
    // waiter looks again when its lease runs out, not a poll interval later.
    let granted: bool = sqlx::query_scalar(
        "SELECT granted FROM distlock.lease_acquire(1::int2, hashtext($1)::int8, $1, gen_random_uuid(), 500)",
    )
    .bind("table:vanished")
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(granted);
    let started = Instant::now();
    let lease = listening(&other)
        .lock("table:vanished", Duration::from_secs(30))
        .await
        .unwrap();
    let took = started.elapsed();
    println!(
        "a vanished holder's key granted {took:?} after the wait began (lease 500 ms, poll {poll:?})"
    );
    assert!(
        took < Duration::from_millis(1500),
        "{took:?}: waited for a poll"
    );
    lease.release().await.unwrap();
}

// ---- warm connections ---------------------------------------------------------

/// A locker that keeps connections for an hour, on `pool`, not listening.
fn keeping_locker(pool: &PgPool) -> TableLocker {
    TableLocker::builder(pool.clone())
        .ttl(Duration::from_secs(30))
        .listen(false)
        .keep_warm(2, Duration::from_secs(3600))
        .build()
        .expect("valid settings")
}

/// A grant and its release run on a kept connection: 2 round trips (the
/// two statements), none of them a pool's ping.
#[sqlx::test(migrations = false)]
async fn a_grant_and_its_release_take_two_round_trips(pool: PgPool) {
    migrated(&pool).await;
    let connect = pool.connect_options();
    let proxy = Proxy::start(connect.get_host(), connect.get_port())
        .await
        .expect("proxy");
    let counted = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(proxy.options(&connect))
        .await
        .expect("pool through the proxy");
    let locker = keeping_locker(&counted);
    let warmup = locker.try_lock("table:warm:rt").await.unwrap();
    warmup.expect("free").release().await.unwrap();
    for round in 0..3 {
        let before = proxy.round_trips();
        let lease = locker.try_lock("table:warm:rt").await.unwrap();
        let lease = lease.expect("free");
        assert_eq!(proxy.round_trips() - before, 1, "round {round}: the grant");
        lease.release().await.unwrap();
        assert_eq!(
            proxy.round_trips() - before,
            2,
            "round {round}: and its release"
        );
    }
    assert_eq!(rows(&pool).await, 0);
}

/// Ends every session of this database but `obs`'s own: the kept
/// connections among them.
async fn end_other_sessions(obs: &mut sqlx::PgConnection) {
    sqlx::query(
        "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .execute(obs)
    .await
    .expect("terminate");
}

/// The server ends the kept connections' sessions: a grant runs once more
/// on a pooled connection (under a new owner, so the background release of
/// the failed attempt's owner cannot touch it), and so does a release; no
/// row is left behind.
#[sqlx::test(migrations = false)]
async fn kept_connections_the_server_ended_are_replaced(pool: PgPool) {
    migrated(&pool).await;
    let locker = keeping_locker(&pool);
    let mut obs = common::observer_for(&pool).await;
    for _ in 0..3 {
        let lease = locker.try_lock("table:warm:end").await.unwrap();
        lease.expect("free").release().await.unwrap();
        end_other_sessions(&mut obs).await;
        let lease = locker.try_lock("table:warm:end").await.unwrap();
        let lease = lease.expect("granted on a pooled connection");
        assert!(!lease.is_lost());
        end_other_sessions(&mut obs).await;
        lease
            .release()
            .await
            .expect("released on a pooled connection");
        assert_eq!(rows(&pool).await, 0);
    }
}

// ---- housekeeping -------------------------------------------------------------

/// Expired rows of holders that vanished: about one grant in 16 purges up
/// to 32 of them (migration `20261201000012`), so a stream of grants
/// clears them; `purge_expired` clears any number on request; a refused
/// attempt purges nothing.
#[sqlx::test(migrations = false)]
async fn expired_rows_are_purged_by_grants_and_on_request(pool: PgPool) {
    migrated(&pool).await;
    let vanished = async |n: i64| {
        sqlx::query(
            "INSERT INTO distlock.leases \
             SELECT 1, i, 'gone:' || i, gen_random_uuid(), i, now(), now(), clock_timestamp() \
             FROM generate_series(1, $1) AS i",
        )
        .bind(n)
        .execute(&pool)
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    vanished(30).await;
    assert_eq!(rows(&pool).await, 30);
    let locker = locker(&pool, Duration::from_secs(5));
    let held = locker.try_lock("table:purge").await.unwrap().expect("free");
    let after_first = rows(&pool).await;
    assert!(after_first == 31 || after_first == 1, "{after_first}");
    // A refused attempt writes nothing, purges nothing.
    assert!(locker.try_lock("table:purge").await.unwrap().is_none());
    assert_eq!(rows(&pool).await, after_first);
    // One grant in 16 purges: 400 grants all miss it with a probability of
    // (15/16)^400, about 6e-12.
    let mut grants = 1;
    while rows(&pool).await > 1 {
        assert!(grants < 400, "{grants} grants purged nothing");
        let lease = locker.try_lock("table:purge:2").await.unwrap();
        lease.expect("free").release().await.unwrap();
        grants += 1;
    }
    vanished(40).await;
    let second = locker
        .try_lock("table:purge:2")
        .await
        .unwrap()
        .expect("free");
    assert!(rows(&pool).await >= 2 + 40 - 32, "at most 32 at once");
    let left = rows(&pool).await - 2;
    assert_eq!(locker.purge_expired(1000).await.unwrap(), left as u64);
    assert_eq!(rows(&pool).await, 2, "only the live leases are left");
    assert_eq!(locker.purge_expired(1000).await.unwrap(), 0);
    // "Every expired row", as a caller would spell it: the server function
    // takes an `integer`, and a larger limit must not read as a missing
    // function (a schema not migrated).
    vanished(3).await;
    assert_eq!(locker.purge_expired(u32::MAX).await.unwrap(), 3);
    held.release().await.unwrap();
    second.release().await.unwrap();
    assert_eq!(rows(&pool).await, 0);
}

// ---- bad input ----------------------------------------------------------------

#[sqlx::test(migrations = false)]
async fn bad_settings_and_huge_timeouts_are_clear_errors_not_panics(pool: PgPool) {
    migrated(&pool).await;
    // A bad setting is refused by build(), naming it (tests/integration/config.rs
    // has every bound), and nothing is written.
    let refused = |built: Result<TableLocker, Error>, setting: &str, what: String| {
        assert!(
            matches!(&built, Err(Error::InvalidSetting { setting: s, .. }) if *s == setting),
            "{what}: {built:?}"
        );
    };
    for ttl in [
        Duration::ZERO,
        Duration::from_millis(99),
        Duration::from_secs(86_401),
        Duration::MAX,
    ] {
        let built = TableLocker::builder(pool.clone()).ttl(ttl).build();
        refused(built, "ttl", format!("ttl {ttl:?}"));
    }
    for poll in [Duration::ZERO, Duration::MAX] {
        let built = TableLocker::builder(pool.clone())
            .poll_interval(poll)
            .build();
        refused(built, "poll_interval", format!("poll {poll:?}"));
    }
    assert_eq!(rows(&pool).await, 0);
    for ttl in [distlock::postgres::MIN_TTL, distlock::postgres::MAX_TTL] {
        let locker = locker(&pool, ttl);
        let lease = locker
            .try_lock("table:bounds")
            .await
            .unwrap()
            .expect("free");
        // A 100 ms lease may already be lost on a loaded machine; either
        // way it is an answer, not a panic.
        let released = lease.release().await;
        assert!(
            matches!(released, Ok(()) | Err(Error::LockLost { .. })),
            "{released:?}"
        );
    }

    let locker = locker(&pool, Duration::from_secs(5));
    // A huge timeout on a free key: granted at once.
    let lease = bounded(
        "lock with Duration::MAX",
        Duration::from_secs(5),
        locker.lock("table:huge", Duration::MAX),
    )
    .await
    .unwrap();
    // On a held key: it waits (no overflow, no spin) and can be dropped.
    let waiting = tokio::time::timeout(
        Duration::from_millis(300),
        locker.lock("table:huge", Duration::MAX),
    )
    .await;
    assert!(waiting.is_err(), "still waiting");
    lease.release().await.unwrap();
    // The dropped wait left nothing behind.
    let again = locker.try_lock("table:huge").await.unwrap().expect("free");
    again.release().await.unwrap();
    // Bad keys.
    assert!(matches!(
        locker.try_lock("").await,
        Err(Error::InvalidKey { .. })
    ));
    // A key of every shape works, and distinct shapes are distinct rows.
    let keys = [
        LockKey::from("shape"),
        LockKey::id(i64::MIN),
        LockKey::namespaced(7, "shape"),
        LockKey::hashed64("shape"),
        LockKey::from("quote ' and \\ and é"),
    ];
    let mut held = Vec::new();
    for key in keys {
        held.push(locker.try_lock(key).await.unwrap().expect("free"));
    }
    assert_eq!(rows(&pool).await, 5);
    let text: String = sqlx::query_scalar("SELECT key_text FROM distlock.leases WHERE space = 1 AND lock_id = hashtext('quote '' and \\ and é')")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(text, "quote ' and \\ and é");
    for lease in held {
        lease.release().await.unwrap();
    }
}

// ---- jobs on the lease table ---------------------------------------------------

#[sqlx::test(migrations = false)]
async fn a_singleton_job_runs_once_and_stops_when_its_lease_is_lost(pool: PgPool) {
    migrated(&pool).await;
    let ttl = Duration::from_millis(600);
    let a: Arc<dyn distlock::Locker> = Arc::new(locker(&pool, ttl));
    let b: Arc<dyn distlock::Locker> = Arc::new(locker(&pool, ttl));
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let running = tokio::spawn(async move {
        SingletonJob::new(a, "table:job")
            .run(async |_ctx| {
                let _ = started_tx.send(());
                // Runs until it is stopped by the loss.
                tokio::time::sleep(Duration::from_secs(60)).await;
                Ok::<_, Error>("done")
            })
            .await
    });
    started_rx.await.unwrap();
    let skipped = SingletonJob::new(Arc::clone(&b), "table:job")
        .run(async |_ctx| Ok::<_, Error>("twice"))
        .await
        .unwrap();
    assert!(skipped.is_skipped(), "{skipped:?}");
    // Someone deletes the row: the next renewal finds it gone.
    sqlx::query("DELETE FROM distlock.leases")
        .execute(&pool)
        .await
        .unwrap();
    let outcome = bounded("the job stops", Duration::from_secs(10), running)
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(outcome, JobOutcome::Lost(LossReason::Expired)),
        "{outcome:?}"
    );
    let ran = SingletonJob::new(b, "table:job")
        .run(async |_ctx| Ok::<_, Error>("again"))
        .await
        .unwrap();
    assert_eq!(ran.ran(), Some("again"));
}

/// `TableLease` is usable as `Box<dyn Lease>` and keeps its token there.
#[sqlx::test(migrations = false)]
async fn the_trait_object_carries_the_token(pool: PgPool) {
    migrated(&pool).await;
    let locker: Arc<dyn distlock::Locker> = Arc::new(locker(&pool, Duration::from_secs(5)));
    assert_eq!(locker.backend(), "table");
    let lease = locker
        .try_lock(LockKey::from("table:dyn"))
        .await
        .unwrap()
        .expect("free");
    assert!(lease.fencing_token().is_some());
    lease.release().await.unwrap();
}

// ---- dropped acquisitions ---------------------------------------------------

/// Rows whose lease has not expired.
async fn live_rows(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM distlock.leases WHERE expires_at > clock_timestamp()")
        .fetch_one(pool)
        .await
        .expect("count live")
}

/// Opens a transaction that inserts the row of text key `name` and leaves it
/// uncommitted: `lease_acquire` for that key then waits for it (the insert's
/// unique check), mid-statement, until the transaction ends.
async fn hold_row_uncommitted(
    pool: &PgPool,
    name: &str,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query(
        "INSERT INTO distlock.leases \
         (space, lock_id, key_text, owner, token, acquired_at, renewed_at, expires_at) \
         VALUES (1, hashtext($1)::int8, $1, gen_random_uuid(), 0, now(), now(), now() + interval '1 hour')",
    )
    .bind(name)
    .execute(&mut *tx)
    .await
    .expect("insert the contended row");
    tx
}

/// Waits (up to `limit`) until no other statement runs in this database
/// (so no acquisition can still grant anything), then until no live row is
/// left (background releases only remove rows); returns how many are left.
async fn settle_live_rows(pool: &PgPool, limit: Duration) -> i64 {
    let until = Instant::now() + limit;
    loop {
        let active: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND state <> 'idle' AND pid <> pg_backend_pid()",
        )
        .fetch_one(pool)
        .await
        .expect("activity");
        if active == 0 || Instant::now() >= until {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    loop {
        let live = live_rows(pool).await;
        if live == 0 || Instant::now() >= until {
            return live;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A `try_lock` dropped while its statement waits behind an uncommitted
/// insert of the same key: once that insert rolls back, the statement goes
/// on and grants the key to the dropped caller's owner. That grant must be
/// released, not left for a TTL.
#[sqlx::test(migrations = false)]
async fn a_try_lock_dropped_mid_statement_leaves_no_lease(pool: PgPool) {
    init_tracing();
    migrated(&pool).await;
    let key = "table:dropped-mid-statement";
    let locker = locker(&pool, Duration::from_secs(30));
    let tx = hold_row_uncommitted(&pool, key).await;
    let dropped = tokio::time::timeout(Duration::from_millis(300), locker.try_lock(key)).await;
    assert!(dropped.is_err(), "the attempt was not stuck: {dropped:?}");
    // Let a background release (if any) run before the statement ends.
    tokio::time::sleep(Duration::from_millis(200)).await;
    tx.rollback().await.expect("rollback");
    let live = settle_live_rows(&pool, Duration::from_secs(5)).await;
    let left: Option<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM expires_at - clock_timestamp())::float8 FROM distlock.leases",
    )
    .fetch_optional(&pool)
    .await
    .expect("left");
    assert_eq!(
        live, 0,
        "a dropped try_lock left a lease nobody holds ({left:?} s left)"
    );
    let again = locker.try_lock(key).await.expect("try");
    assert!(again.is_some(), "the key is still taken");
    again.expect("free").release().await.expect("release");
    // The same with lock(): its first attempt is the one that waits.
    let tx = hold_row_uncommitted(&pool, key).await;
    let dropped = tokio::time::timeout(
        Duration::from_millis(300),
        locker.lock(key, Duration::from_secs(5)),
    )
    .await;
    assert!(dropped.is_err(), "the wait was not stuck: {dropped:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    tx.rollback().await.expect("rollback");
    let live = settle_live_rows(&pool, Duration::from_secs(5)).await;
    assert_eq!(live, 0, "a dropped lock() left a lease nobody holds");
    let lease = bounded(
        "lock after",
        Duration::from_secs(10),
        locker.lock(key, Duration::from_secs(5)),
    )
    .await
    .expect("the key is free again");
    lease.release().await.expect("release");
}

/// Many `try_lock`s and `lock`s on a few keys, each dropped at a random
/// moment, while a blocker keeps inserting the keys' rows in transactions
/// it rolls back (so statements are often mid-wait when dropped). Once
/// everything has settled no live row may be left.
#[sqlx::test(migrations = false)]
async fn many_dropped_acquisitions_leave_no_lease(pool: PgPool) {
    init_tracing();
    migrated(&pool).await;
    let options = pool.connect_options().as_ref().clone();
    let work = PgPoolOptions::new()
        .max_connections(16)
        .connect_with(options.clone())
        .await
        .expect("pool");
    let locker = locker(&work, Duration::from_secs(30));
    let keys: Vec<String> = (0..16).map(|i| format!("table:sweep:{i}")).collect();
    // The drop points below are spread over a few times this.
    let t = Instant::now();
    let lease = locker
        .try_lock("table:sweep:warm")
        .await
        .expect("try")
        .expect("free");
    println!("an uncontended try_lock took {:?}", t.elapsed());
    lease.release().await.expect("release");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let blocker = {
        let pool = pool_on(options).await;
        let keys = keys.clone();
        let stop = Arc::clone(&stop);
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let mut tx = pool.begin().await.expect("begin");
                for key in &keys {
                    // Skips a key someone holds for real (no wait on it).
                    sqlx::query(
                        "INSERT INTO distlock.leases \
                         (space, lock_id, key_text, owner, token, acquired_at, renewed_at, expires_at) \
                         VALUES (1, hashtext($1)::int8, $1, gen_random_uuid(), 0, now(), now(), \
                         now() + interval '1 hour') ON CONFLICT DO NOTHING",
                    )
                    .bind(key)
                    .execute(&mut *tx)
                    .await
                    .expect("blocker insert");
                }
                tokio::time::sleep(Duration::from_millis(rand::random_range(5..30))).await;
                tx.rollback().await.expect("rollback");
                tokio::time::sleep(Duration::from_millis(rand::random_range(2..20))).await;
            }
        })
    };
    let (granted, dropped) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut tasks = Vec::new();
    for i in 0..400 {
        let locker = locker.clone();
        let key = keys[i % keys.len()].clone();
        let (granted, dropped) = (Arc::clone(&granted), Arc::clone(&dropped));
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(rand::random_range(0..1000))).await;
            let budget = Duration::from_micros(rand::random_range(0..250_000));
            let outcome = if i % 2 == 0 {
                tokio::time::timeout(budget, locker.try_lock(key))
                    .await
                    .map(|r| r.expect("try_lock"))
            } else {
                tokio::time::timeout(budget, locker.lock(key, Duration::from_millis(300)))
                    .await
                    .map(|r| r.ok())
            };
            match outcome {
                Ok(Some(lease)) => {
                    granted.fetch_add(1, Ordering::SeqCst);
                    let _ = lease.release().await;
                }
                Ok(None) => {}
                Err(_) => {
                    dropped.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
    stop.store(true, Ordering::SeqCst);
    blocker.await.expect("blocker");
    let live = settle_live_rows(&pool, Duration::from_secs(10)).await;
    println!(
        "granted {}, dropped {}, live rows left {live}",
        granted.load(Ordering::SeqCst),
        dropped.load(Ordering::SeqCst)
    );
    assert!(dropped.load(Ordering::SeqCst) > 0, "nothing was dropped");
    assert_eq!(live, 0, "dropped acquisitions left leases nobody holds");
}

// ---- hostile key names --------------------------------------------------------

/// Names that would break a statement built carelessly from them: quotes,
/// backslashes, dollar quotes, every ASCII control character but NUL,
/// 10 kB names, Unicode that normalises or reorders.
fn hostile_names() -> Vec<String> {
    let every_ascii_but_nul: String = (1u8..=0x7f).map(char::from).collect();
    vec![
        "'".into(),
        "''".into(),
        "x'); DELETE FROM distlock.leases; --".into(),
        "\\".into(),
        "\\'".into(),
        "E'\\x41'".into(),
        "$$".into(),
        "$tag$ $$ ; $tag$".into(),
        "\"quoted\"".into(),
        "%s {} ? $1 :name".into(),
        " ".into(),
        "\t\r\n".into(),
        every_ascii_but_nul,
        "\u{1}\u{1b}[2J\u{7f}".into(),
        "k".repeat(10 * 1024),
        "'\\$$".repeat(10 * 1024 / 4),
        "ключ 🔒 鍵".into(),
        // The same letter composed and decomposed: two keys, not one.
        "caf\u{e9}".into(),
        "cafe\u{301}".into(),
        "\u{202e}desrever\u{feff}".into(),
        "\u{1d518}\u{1d52b}\u{1d526}".into(),
    ]
}

/// Each hostile name, as a text key, a namespaced key and a 64-bit hashed
/// key, locks and releases its own lease, stored under its exact name, and
/// excludes only itself: the locker can hold all of them at once, another
/// locker is refused each, and releasing one frees that one alone.
#[sqlx::test(migrations = false)]
async fn hostile_key_names_lock_and_release_only_their_own_lease(pool: PgPool) {
    init_tracing();
    migrated(&pool).await;
    // Control: the names are hostile. Pasted between quotes into a simple
    // query, as a careless statement builder would, most of them make it
    // fail or name another key than the bound name does.
    let mut broken = 0;
    for name in hostile_names() {
        let bound: i32 = sqlx::query_scalar("SELECT hashtext($1)")
            .bind(&name)
            .fetch_one(&pool)
            .await
            .expect("bound");
        let pasted = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("SELECT hashtext('{name}')")))
            .fetch_one(&pool)
            .await;
        match pasted.and_then(|row| row.try_get::<i32, _>(0)) {
            Ok(id) if id == bound => {}
            _ => broken += 1,
        }
    }
    println!(
        "{broken} of {} names break a pasted statement",
        hostile_names().len()
    );
    assert!(broken >= 5, "only {broken} names break a pasted statement");

    let a = locker(&pool, Duration::from_secs(30));
    let b = locker(&pool, Duration::from_secs(30));
    let mut keys = Vec::new();
    for name in hostile_names() {
        keys.push(LockKey::from(name.as_str()));
        keys.push(LockKey::namespaced(-7, name.as_str()));
        keys.push(LockKey::hashed64(name.as_str()));
    }
    let mut held = Vec::new();
    for key in &keys {
        let lease = a
            .try_lock(key.clone())
            .await
            .unwrap_or_else(|e| panic!("try_lock {key:?}: {e}"));
        held.push(lease.unwrap_or_else(|| panic!("{key:?} was taken by another hostile key")));
    }
    assert_eq!(rows(&pool).await, i64::try_from(keys.len()).unwrap());
    for name in hostile_names() {
        // Bound here, so the comparison itself cannot be fooled.
        let stored: i64 =
            sqlx::query_scalar("SELECT count(*) FROM distlock.leases WHERE key_text = $1")
                .bind(&name)
                .fetch_one(&pool)
                .await
                .expect("count by name");
        assert_eq!(
            stored,
            3,
            "rows stored under {:?}",
            name.chars().take(40).collect::<String>()
        );
    }
    for key in &keys {
        assert!(
            b.try_lock(key.clone()).await.expect("try").is_none(),
            "{key:?} not excluded"
        );
    }
    // Releasing one frees that one alone.
    let mut held: Vec<Option<_>> = held.into_iter().map(Some).collect();
    for i in [0, 2, 4, 12, 14, 16, 18, 19] {
        let lease = held[i].take().expect("held");
        lease
            .release()
            .await
            .unwrap_or_else(|e| panic!("release {:?}: {e}", keys[i]));
        let taken = b
            .try_lock(keys[i].clone())
            .await
            .expect("try")
            .expect("freed");
        for (j, key) in keys.iter().enumerate() {
            if held[j].is_some() && j % 5 == i % 5 {
                assert!(
                    b.try_lock(key.clone()).await.expect("try").is_none(),
                    "{key:?} freed by releasing {:?}",
                    keys[i]
                );
            }
        }
        taken.release().await.expect("release");
    }
    for lease in held.into_iter().flatten() {
        lease.release().await.expect("release");
    }
    assert_eq!(rows(&pool).await, 0, "every lease released");
}

// ---- who holds what ---------------------------------------------------------

/// Sets the row of the lease spelled `key_text` a second in the past, as
/// if its holder had stopped renewing it.
async fn expire_row(pool: &PgPool, key_text: &str) {
    sqlx::query(
        "UPDATE distlock.leases SET expires_at = clock_timestamp() - interval '1 s' \
         WHERE key_text = $1",
    )
    .bind(key_text)
    .execute(pool)
    .await
    .expect("expire the row");
}

/// `holders()` lists the live leases with their tokens and times, and
/// neither an expired row nor a waiter (the table has no trace of waiters).
#[sqlx::test(migrations = false)]
async fn holders_lists_the_live_leases(pool: PgPool) {
    migrated(&pool).await;
    let ttl = Duration::from_secs(30);
    let locker = locker(&pool, ttl);
    assert!(locker.holders().await.expect("holders").is_empty());
    let before = std::time::SystemTime::now() - Duration::from_secs(1);
    let a = locker.try_lock("table:a").await.expect("a").expect("free");
    let id = locker
        .try_lock(LockKey::id(42))
        .await
        .expect("42")
        .expect("free");
    let gone = locker
        .try_lock("table:gone")
        .await
        .expect("gone")
        .expect("free");
    expire_row(&pool, "table:gone").await;
    let waiter = tokio::spawn({
        let locker = locker.clone();
        async move { locker.lock("table:a", Duration::from_millis(500)).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;

    let holders = locker.holders().await.expect("holders");
    let keys: Vec<&str> = holders.iter().map(|h| h.key.as_str()).collect();
    assert_eq!(holders.len(), 2, "{holders:?}");
    assert!(
        keys.contains(&"table:a") && keys.contains(&"42"),
        "{keys:?}"
    );
    for (holder, lease) in [("table:a", &a), ("42", &id)]
        .map(|(k, l)| (holders.iter().find(|h| h.key == k).expect("listed"), l))
    {
        assert_eq!(Some(holder.fencing_token), lease.fencing_token());
        assert!(holder.since >= before, "{holder:?}");
        assert!(holder.since <= holder.renewed && holder.renewed < holder.expires);
        let left = holder
            .expires
            .duration_since(std::time::SystemTime::now())
            .expect("in the future");
        assert!(left <= ttl, "{holder:?}");
    }
    assert!(matches!(
        waiter.await.expect("waiter"),
        Err(Error::Timeout { .. })
    ));
    for lease in [a, id] {
        lease.release().await.expect("release");
    }
    drop(gone);
    assert!(locker.holders().await.expect("holders").is_empty());
}

/// `holder_of(key)` finds the lease a try of `key` would find, by the key's
/// server-side identity: not a lease whose text only reads the same (an id
/// and a name), and the lease of another spelling of the same lock (a
/// client-hashed name and its id), as its holder spelled it; nothing for a
/// free or expired key; a bad key is refused.
#[sqlx::test(migrations = false)]
async fn holder_of_finds_the_lease_a_try_would_find(pool: PgPool) {
    migrated(&pool).await;
    let locker = locker(&pool, Duration::from_secs(30));
    let named = locker.try_lock("42").await.expect("42").expect("free");
    let hashed = LockKey::hashed64("table:hashed");
    let spelled = locker
        .try_lock(hashed.clone())
        .await
        .expect("hashed")
        .expect("free");

    let found = locker.holder_of("42").await.expect("read").expect("held");
    assert_eq!(Some(found.fencing_token), named.fencing_token());
    assert_eq!(found.key, "42");
    // The id 42 is another lock, and free.
    assert_eq!(locker.holder_of(LockKey::id(42)).await.expect("read"), None);
    assert!(
        locker
            .try_lock(LockKey::id(42))
            .await
            .expect("try")
            .is_some()
    );
    // The client-hashed name's id is the same lock: its lease, as spelled.
    let id = LockKey::id(hashed.pg_bigint().expect("client-hashed"));
    let found = locker
        .holder_of(id.clone())
        .await
        .expect("read")
        .expect("held");
    assert_eq!(found.key, "table:hashed");
    assert_eq!(Some(found.fencing_token), spelled.fencing_token());
    assert!(locker.try_lock(id).await.expect("try").is_none());

    assert_eq!(locker.holder_of("table:free").await.expect("read"), None);
    expire_row(&pool, "table:hashed").await;
    assert_eq!(locker.holder_of(hashed).await.expect("read"), None);
    assert!(matches!(
        locker.holder_of("").await,
        Err(Error::InvalidKey { .. })
    ));
    named.release().await.expect("release");
    drop(spelled);
}

/// What the holder does once `lost()` fires.
#[derive(Debug, Clone, Copy)]
enum OnLoss {
    /// Nothing yet: the renewal task cleans up.
    Keep,
    /// Drops the guard at once (as a campaign does when its term ends).
    Drop,
    /// Calls `release()` at once.
    Release,
}

/// A holder whose renewals cannot get through (here: its pool's only
/// connection is busy with its own work) reports the loss two thirds of a
/// TTL after its last renewal, and its key is free to others only a third
/// of a TTL after that, when the lease would expire, whatever the holder
/// does with its guard: the clean-up waits for then instead of deleting the
/// row at once (which handed the key over within milliseconds of `lost()`,
/// before the holder's code could have stopped).
#[sqlx::test(migrations = false)]
async fn a_lost_lease_is_not_handed_over_before_it_would_expire(pool: PgPool) {
    init_tracing();
    migrated(&pool).await;
    for on_loss in [OnLoss::Keep, OnLoss::Drop, OnLoss::Release] {
        lost_lease_handed_over_no_sooner_than_its_expiry(&pool, on_loss).await;
    }
}

async fn lost_lease_handed_over_no_sooner_than_its_expiry(pool: &PgPool, on_loss: OnLoss) {
    let key = format!("table:busy-pool:{on_loss:?}");
    let ttl = Duration::from_millis(900);
    let holder_pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with((*pool.connect_options()).clone())
        .await
        .expect("the holder's pool");
    let holder = TableLocker::builder(holder_pool.clone())
        .ttl(ttl)
        .listen(false)
        .keep_warm(0, Duration::ZERO)
        .build()
        .expect("valid settings");
    let lease = holder.try_lock(key.as_str()).await.unwrap().expect("free");
    // The holder's own work takes the pool's one connection.
    let work = holder_pool.acquire().await.expect("the pool's connection");
    let other = locker(&pool_on((*pool.connect_options()).clone()).await, ttl);
    let waiter = tokio::spawn({
        let key = key.clone();
        async move {
            let granted = other.lock(key, Duration::from_secs(10)).await;
            (Instant::now(), granted)
        }
    });
    let reason = bounded("the holder gives up", Duration::from_secs(5), lease.lost()).await;
    let lost_at = Instant::now();
    assert!(
        matches!(reason, LossReason::HeartbeatTimedOut(_)),
        "{reason:?}"
    );
    // The work ends just after: a clean-up could run now.
    drop(work);
    match on_loss {
        OnLoss::Keep => {}
        OnLoss::Drop => drop(lease),
        OnLoss::Release => assert!(matches!(lease.release().await, Err(Error::LockLost { .. }))),
    }
    let (granted_at, granted) = waiter.await.expect("the waiter");
    let granted = granted.expect("granted once the lease expired");
    let gap = granted_at.saturating_duration_since(lost_at);
    assert!(
        gap >= Duration::from_millis(200),
        "{on_loss:?}: the key was granted elsewhere {gap:?} after the holder's lost()"
    );
    granted.release().await.unwrap();
}
