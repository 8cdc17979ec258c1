//! Wait chains: `holders()` says whom each waiter waits behind, a
//! `Timeout` carries the chain up to its root holder on every waiting path,
//! and a cycle shows as a cycle.

use crate::common;

use std::time::{Duration, SystemTime};

use common::cycle::ring;
use common::*;
use distlock::postgres::WaitChain;
use distlock::postgres::wait_chain;
use distlock::postgres::{AdvisoryKey, Holder, LockWaiter};
use distlock::{Error, LockKey, PgLocker};
use sqlx::postgres::PgConnection;
use sqlx::{ConnectOptions, PgPool};
use tokio::task::JoinHandle;

/// A connection of its own named `app`, and its backend pid.
async fn session(pool: &PgPool, app: &str) -> (PgConnection, i32) {
    let mut conn = (*pool.connect_options())
        .clone()
        .application_name(app)
        .connect()
        .await
        .expect("connect");
    let pid = backend_pid(&mut conn).await;
    (conn, pid)
}

/// `conn` waits for the bigint advisory lock `key` in a task of its own
/// (until granted, or until the connection ends).
fn waits_for(mut conn: PgConnection, key: i64) -> JoinHandle<PgConnection> {
    tokio::spawn(async move {
        let _ = sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(key)
            .execute(&mut conn)
            .await;
        conn
    })
}

/// The snapshot once `n` sessions wait.
async fn with_waiters(locker: &PgLocker, n: usize) -> Vec<Holder> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let holders = locker.holders().await.expect("holders");
        if holders.iter().filter(|h| !h.granted).count() >= n {
            return holders;
        }
        assert!(tokio::time::Instant::now() < deadline, "{holders:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waiters say whom they wait behind, resolved to sessions, keys,
/// applications and since-when, and `wait_chain` follows a chain that
/// crosses keys to its root: C waits for key 2, held by B, which waits for
/// key 1, held by A.
#[sqlx::test(migrations = false)]
async fn waiters_name_whom_they_wait_for_and_the_chain_reaches_the_root(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let before = SystemTime::now() - Duration::from_secs(1);
    let (mut conn_a, a) = session(&pool, "chain-a").await;
    let (mut conn_b, b) = session(&pool, "chain-b").await;
    let (conn_c, c) = session(&pool, "chain-c").await;
    assert!(raw_try_lock(&mut conn_a, &Raw::BigInt(1)).await);
    assert!(raw_try_lock(&mut conn_b, &Raw::BigInt(2)).await);
    let b_waits = waits_for(conn_b, 1);
    with_waiters(&locker, 1).await;
    let c_waits = waits_for(conn_c, 2);
    let holders = with_waiters(&locker, 2).await;

    let waiting = |pid: i32| {
        holders
            .iter()
            .find(|h| h.pid == pid && !h.granted)
            .unwrap_or_else(|| panic!("no waiting row for {pid}: {holders:?}"))
    };
    assert_eq!(waiting(b).blocked_by, [a]);
    assert_eq!(waiting(c).blocked_by, [b]);
    let behind_b = &waiting(b).waits_for;
    assert_eq!(behind_b.len(), 1, "{behind_b:?}");
    assert_eq!(
        (behind_b[0].pid, behind_b[0].key, behind_b[0].granted),
        (a, AdvisoryKey::BigInt(1), true)
    );
    assert_eq!(behind_b[0].application_name.as_deref(), Some("chain-a"));
    let since = behind_b[0].since.expect("since is known");
    assert!(since >= before && since <= SystemTime::now(), "{since:?}");
    let behind_c = &waiting(c).waits_for;
    assert_eq!(
        (behind_c[0].pid, behind_c[0].key, behind_c[0].granted),
        (b, AdvisoryKey::BigInt(2), true),
        "C waits behind B's hold on key 2, not B's wait for key 1"
    );
    assert_eq!(behind_c[0].application_name.as_deref(), Some("chain-b"));
    assert!(
        holders
            .iter()
            .filter(|h| h.granted)
            .all(|h| h.blocked_by.is_empty() && h.waits_for.is_empty())
    );

    let chain = wait_chain(&holders, c);
    assert_eq!(chain.pids(), [c, b, a]);
    assert_eq!(chain.cycle, None);
    let steps: Vec<_> = chain.links.iter().map(|l| (l.key, l.granted)).collect();
    assert_eq!(
        steps,
        [
            (AdvisoryKey::BigInt(2), false),
            (AdvisoryKey::BigInt(2), true),
            (AdvisoryKey::BigInt(1), true),
        ]
    );
    assert_eq!(chain.root().map(|l| l.pid), Some(a));
    assert_eq!(wait_chain(&holders, a).pids(), [a]);

    // holders_of resolves its waiters too.
    let of_two = locker.holders_of(LockKey::id(2)).await.expect("holders_of");
    let c_row = of_two.iter().find(|h| !h.granted).expect("C waits");
    assert_eq!(c_row.waits_for.first().map(|l| l.pid), Some(b));

    assert!(raw_unlock(&mut conn_a, &Raw::BigInt(1)).await);
    let mut conn_b = bounded("B gets key 1", Duration::from_secs(10), b_waits)
        .await
        .expect("B");
    sqlx::query("SELECT pg_advisory_unlock_all()")
        .execute(&mut conn_b)
        .await
        .expect("unlock B");
    let conn_c = bounded("C gets key 2", Duration::from_secs(10), c_waits)
        .await
        .expect("C");
    for conn in [conn_a, conn_b, conn_c] {
        close(conn).await;
    }
}

/// The holder of `chain:k` (B) waits for key 1, held by A: every waiting
/// call that times out on `chain:k` carries the chain B → A, and
/// `holder_pid` is its first link.
#[sqlx::test(migrations = false)]
async fn every_waiting_path_times_out_with_the_chain_to_the_root(pool: PgPool) {
    let (mut conn_a, a) = session(&pool, "chain-root").await;
    let (mut conn_b, b) = session(&pool, "chain-middle").await;
    let k_hash = hashtext(&mut conn_a, "chain:k").await;
    assert!(raw_try_lock(&mut conn_a, &Raw::BigInt(1)).await);
    assert!(raw_try_lock(&mut conn_b, &Raw::text("chain:k")).await);
    let locker = PgLocker::new(pool.clone());
    let b_waits = waits_for(conn_b, 1);
    with_waiters(&locker, 1).await;

    let check = |what: &str, result: Result<(), Error>| {
        let Err(Error::Timeout {
            key,
            holder_pid,
            holder_application,
            chain,
            ..
        }) = result
        else {
            panic!("{what}: expected a timeout, got {result:?}");
        };
        assert_eq!(key, LockKey::from("chain:k"), "{what}");
        assert_eq!(chain.pids(), [b, a], "{what}: {chain:?}");
        assert_eq!(chain.cycle, None, "{what}");
        assert_eq!(holder_pid, Some(b), "{what}");
        assert_eq!(
            holder_application.as_deref(),
            Some("chain-middle"),
            "{what}"
        );
        let holder = &chain.links[0];
        assert_eq!(
            (holder.key, holder.granted),
            (AdvisoryKey::BigInt(i64::from(k_hash)), true),
            "{what}"
        );
        let root = chain.root().expect("a root");
        assert_eq!(
            (root.pid, root.key, root.granted),
            (a, AdvisoryKey::BigInt(1), true),
            "{what}"
        );
        assert_eq!(root.application_name.as_deref(), Some("chain-root"));
        assert!(root.since.is_some(), "{what}");
    };
    let t = Duration::from_millis(300);
    let lock = locker.lock("chain:k", t).await.map(drop);
    check("lock", lock);
    check(
        "lock, no wait",
        locker.lock("chain:k", Duration::ZERO).await.map(drop),
    );
    let shared = locker.lock_shared("chain:k", t).await.map(drop);
    check("lock_shared", shared);
    let all = locker.lock_all(["chain:free", "chain:k"], t).await;
    check("lock_all", all.map(drop));
    let xact = locker
        .with_advisory_lock_wait("chain:k", t, async |_| Ok::<_, Error>(()))
        .await;
    check("with_advisory_lock_wait", xact);
    let shared_xact = locker
        .with_shared_advisory_lock_wait("chain:k", t, async |_| Ok::<_, Error>(()))
        .await;
    check("with_shared_advisory_lock_wait", shared_xact);
    let muxed = PgLocker::builder(pool.clone())
        .multiplex(1)
        .build()
        .expect("valid settings");
    check("multiplexed lock", muxed.lock("chain:k", t).await.map(drop));
    let waiter = LockWaiter::new(&locker, "chain:k", t).lock().await;
    check("LockWaiter", waiter.map(drop));

    // lock_xact's timeout aborts the caller's transaction, its only
    // connection: no chain.
    let mut tx = pool.begin().await.expect("begin");
    match distlock::lock_xact(&mut tx, "chain:k", t).await {
        Err(Error::Timeout {
            holder_pid, chain, ..
        }) => assert!(holder_pid.is_none() && chain == WaitChain::default()),
        other => panic!("lock_xact: expected a timeout, got {other:?}"),
    }
    tx.rollback().await.expect("rollback");

    assert!(raw_unlock(&mut conn_a, &Raw::BigInt(1)).await);
    let conn_b = bounded("B gets key 1", Duration::from_secs(10), b_waits)
        .await
        .expect("B");
    for conn in [conn_a, conn_b] {
        close(conn).await;
    }
    muxed.pool().close().await;
}

/// A reader R holds `rw:k` shared and a writer W waits for it: a shared
/// wait queues behind W, so one that times out names W (its chain leads to
/// R), never R, whose read it would share.
#[sqlx::test(migrations = false)]
async fn a_shared_wait_names_the_writer_ahead_not_a_reader(pool: PgPool) {
    let (mut conn_r, r) = session(&pool, "reader").await;
    let (conn_w, w) = session(&pool, "writer").await;
    let read: bool =
        sqlx::query_scalar("SELECT pg_try_advisory_lock_shared(hashtext('rw:k')::int8)")
            .fetch_one(&mut conn_r)
            .await
            .expect("read");
    assert!(read);
    let k = i64::from(hashtext(&mut conn_r, "rw:k").await);
    let locker = PgLocker::new(pool.clone());
    let w_waits = waits_for(conn_w, k);
    with_waiters(&locker, 1).await;
    let t = Duration::from_millis(300);
    let shared = locker.lock_shared("rw:k", t).await.map(drop);
    let shared_xact = locker
        .with_shared_advisory_lock_wait("rw:k", t, async |_| Ok::<_, Error>(()))
        .await;
    for (what, result) in [
        ("lock_shared", shared),
        ("with_shared_advisory_lock_wait", shared_xact),
    ] {
        let Err(Error::Timeout {
            holder_pid, chain, ..
        }) = result
        else {
            panic!("{what}: expected a timeout, got {result:?}");
        };
        assert_eq!(holder_pid, Some(w), "{what}: {chain:?}");
        assert_eq!(chain.pids(), [w, r], "{what}: {chain:?}");
        assert!(!chain.links[0].granted, "{what}: W waits: {chain:?}");
    }
    sqlx::query("SELECT pg_advisory_unlock_shared(hashtext('rw:k')::int8)")
        .execute(&mut conn_r)
        .await
        .expect("unlock");
    let conn_w = bounded("W gets the key", Duration::from_secs(10), w_waits)
        .await
        .expect("W");
    for conn in [conn_r, conn_w] {
        close(conn).await;
    }
}

/// Two sessions that wait for each other, as in a deadlock the server has
/// not broken yet: `wait_chain` goes round once and marks the cycle, and a
/// timeout behind it carries the cycle too.
#[sqlx::test(migrations = false)]
async fn a_cycle_shows_as_a_cycle(pool: PgPool) {
    let ring = ring(&pool, &[1, 2]).await;
    let (p0, p1) = (ring.pids[0], ring.pids[1]);
    let locker = PgLocker::new(pool.clone());
    let holders = with_waiters(&locker, 2).await;
    let chain = wait_chain(&holders, p0);
    assert_eq!(chain.pids(), [p0, p1], "{chain:?}");
    assert_eq!(chain.cycle, Some(p0), "p1 waits behind p0 again");
    assert!(chain.root().is_none());
    assert_eq!(chain.links[0].key, AdvisoryKey::BigInt(2));
    assert!(!chain.links[0].granted, "p0's own wait comes first");
    assert_eq!(
        (chain.links[1].key, chain.links[1].granted),
        (AdvisoryKey::BigInt(2), true)
    );
    assert_eq!(wait_chain(&holders, p1).cycle, Some(p1));

    match locker
        .lock(LockKey::id(1), Duration::from_millis(300))
        .await
    {
        Err(err @ Error::Timeout { .. }) => {
            let message = err.to_string();
            let Error::Timeout {
                holder_pid, chain, ..
            } = err
            else {
                unreachable!()
            };
            assert_eq!(holder_pid, Some(p0));
            assert_eq!(chain.pids(), [p0, p1], "{chain:?}");
            assert_eq!(chain.cycle, Some(p0));
            assert!(message.contains("a cycle"), "{message}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    ring.end(&pool).await;
}
