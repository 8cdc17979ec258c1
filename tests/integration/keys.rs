//! Each `LockKey` form locks exactly the PostgreSQL key it documents, and
//! interoperates with hand-written SQL (and sqlx's `PgAdvisoryLock`) in both
//! directions, for the session and the transaction-scoped API.

use crate::common;

use std::time::Duration;

use common::*;
use distlock::{Error, LockKey, PgLocker};
use sqlx::postgres::{
    PgAdvisoryLock, PgAdvisoryLockKey, PgConnectOptions, PgConnection, PgPoolOptions,
};
use sqlx::{Either, PgPool};

/// Checks one key form end to end:
///
/// 1. distlock's session lock shows up in `pg_locks` as exactly `expected`;
/// 2. while distlock holds it, `raw` cannot be taken from another session,
///    while every key in `unrelated` can;
/// 3. while another session holds `raw`, distlock's try_lock/lock/
///    with_advisory_lock cannot take `key` (and `lock` names that session);
/// 4. inside `with_advisory_lock` the transaction lock is `expected` and
///    conflicts with `raw` too.
async fn check_key_form(
    locker: &PgLocker,
    obs: &mut PgConnection,
    key: LockKey,
    expected: (i64, i64, i32),
    raw: Raw,
    unrelated: &[Raw],
) {
    let obs_pid = backend_pid(obs).await;

    // distlock holds (session) -> pg_locks shows exactly `expected`, raw conflicts.
    let guard = locker
        .try_lock(key.clone())
        .await
        .expect("try_lock")
        .expect("key is free");
    let rows = advisory_locks(obs).await;
    assert_eq!(
        rows.len(),
        1,
        "{key}: exactly one advisory lock expected, got {rows:?}"
    );
    assert_eq!(
        rows[0].triple(),
        expected,
        "{key}: wrong PostgreSQL key in pg_locks"
    );
    assert_eq!(
        rows[0].pid,
        guard.backend_pid(),
        "{key}: held by the guard's backend"
    );
    assert!(rows[0].granted);
    assert_eq!(rows[0].mode, "ExclusiveLock");
    assert!(
        !raw_try_lock(obs, &raw).await,
        "{key}: raw {raw:?} must conflict with distlock's lock"
    );
    for other in unrelated {
        assert!(
            raw_can_take(obs, other).await,
            "{key}: {other:?} must NOT conflict with distlock's lock"
        );
    }
    guard.release().await.expect("release");
    assert!(
        advisory_locks(obs).await.is_empty(),
        "{key}: nothing held after release"
    );

    // Raw SQL holds -> distlock cannot take it, on any API.
    assert!(
        raw_try_lock(obs, &raw).await,
        "{key}: raw lock free after release"
    );
    assert!(
        locker
            .try_lock(key.clone())
            .await
            .expect("try_lock")
            .is_none(),
        "{key}: try_lock must see the raw lock"
    );
    match locker.lock(key.clone(), Duration::from_millis(200)).await {
        Err(Error::Timeout { holder_pid, .. }) => {
            assert_eq!(
                holder_pid,
                Some(obs_pid),
                "{key}: timeout names the raw holder"
            )
        }
        other => panic!("{key}: lock() against a raw holder: expected Timeout, got {other:?}"),
    }
    let ran = locker
        .with_advisory_lock(key.clone(), async |_conn| Ok::<_, Error>(()))
        .await
        .expect("with_advisory_lock");
    assert!(
        ran.is_none(),
        "{key}: with_advisory_lock must see the raw lock"
    );
    assert!(raw_unlock(obs, &raw).await);

    // distlock holds (transaction) -> same key, raw conflicts both ways.
    let ran = locker
        .with_advisory_lock(key.clone(), async |conn| {
            let rows = advisory_locks(obs).await;
            assert_eq!(rows.len(), 1, "{key}: one xact lock expected, got {rows:?}");
            assert_eq!(
                rows[0].triple(),
                expected,
                "{key}: xact lock on the wrong key"
            );
            assert_eq!(rows[0].pid, backend_pid(conn).await);
            assert!(
                !raw_try_lock(obs, &raw).await,
                "{key}: raw session lock must conflict with the xact lock"
            );
            // The transaction-scoped form of the raw SQL, too.
            let mut tx = sqlx::Connection::begin(&mut *obs).await.expect("begin");
            let got = match &raw {
                Raw::Text(name) => {
                    sqlx::query_scalar::<_, bool>("SELECT pg_try_advisory_xact_lock(hashtext($1))")
                        .bind(name.clone())
                        .fetch_one(&mut *tx)
                        .await
                        .expect("raw xact")
                }
                Raw::BigInt(k) => {
                    sqlx::query_scalar::<_, bool>("SELECT pg_try_advisory_xact_lock($1)")
                        .bind(*k)
                        .fetch_one(&mut *tx)
                        .await
                        .expect("raw xact")
                }
                Raw::Pair(ns, name) => sqlx::query_scalar::<_, bool>(
                    "SELECT pg_try_advisory_xact_lock($1, hashtext($2))",
                )
                .bind(*ns)
                .bind(name.clone())
                .fetch_one(&mut *tx)
                .await
                .expect("raw xact"),
                Raw::IntPair(a, b) => {
                    sqlx::query_scalar::<_, bool>("SELECT pg_try_advisory_xact_lock($1, $2)")
                        .bind(*a)
                        .bind(*b)
                        .fetch_one(&mut *tx)
                        .await
                        .expect("raw xact")
                }
            };
            tx.rollback().await.expect("rollback");
            assert!(
                !got,
                "{key}: raw xact lock must conflict with the xact lock"
            );
            Ok::<_, Error>(())
        })
        .await
        .expect("with_advisory_lock");
    assert!(
        ran.is_some(),
        "{key}: with_advisory_lock must run when the key is free"
    );
    assert!(raw_can_take(obs, &raw).await, "{key}: free after commit");

    // Raw xact lock held in an open transaction -> distlock is excluded too.
    {
        let mut tx = sqlx::Connection::begin(&mut *obs).await.expect("begin");
        let got = match &raw {
            Raw::Text(name) => {
                sqlx::query_scalar::<_, bool>("SELECT pg_try_advisory_xact_lock(hashtext($1))")
                    .bind(name.clone())
                    .fetch_one(&mut *tx)
                    .await
            }
            Raw::BigInt(k) => {
                sqlx::query_scalar::<_, bool>("SELECT pg_try_advisory_xact_lock($1)")
                    .bind(*k)
                    .fetch_one(&mut *tx)
                    .await
            }
            Raw::Pair(ns, name) => {
                sqlx::query_scalar::<_, bool>("SELECT pg_try_advisory_xact_lock($1, hashtext($2))")
                    .bind(*ns)
                    .bind(name.clone())
                    .fetch_one(&mut *tx)
                    .await
            }
            Raw::IntPair(a, b) => {
                sqlx::query_scalar::<_, bool>("SELECT pg_try_advisory_xact_lock($1, $2)")
                    .bind(*a)
                    .bind(*b)
                    .fetch_one(&mut *tx)
                    .await
            }
        }
        .expect("raw xact");
        assert!(got);
        let ran = locker
            .with_advisory_lock(key.clone(), async |_conn| Ok::<_, Error>(()))
            .await
            .expect("with_advisory_lock");
        assert!(
            ran.is_none(),
            "{key}: with_advisory_lock must see the raw xact lock"
        );
        assert!(
            locker
                .try_lock(key.clone())
                .await
                .expect("try_lock")
                .is_none(),
            "{key}: try_lock must see the raw xact lock"
        );
        tx.rollback().await.expect("rollback");
    }
    assert!(advisory_locks(obs).await.is_empty(), "{key}: nothing left");
}

#[sqlx::test(migrations = false)]
async fn text_key_locks_hashtext_of_its_name(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    for name in ["x", "invoice:process", "jobs:nightly-report"] {
        let h = hashtext(&mut obs, name).await;
        let unrelated = [
            Raw::text(&format!("{name}-other")),
            Raw::IntPair(0, h),
            Raw::BigInt(i64::from(h) + 1),
        ];
        check_key_form(
            &locker,
            &mut obs,
            LockKey::from(name),
            bigint_triple(i64::from(h)),
            Raw::text(name),
            &unrelated,
        )
        .await;
        // From<String> and From<&String> are the same key.
        assert_eq!(LockKey::from(name.to_owned()), LockKey::from(name));
        assert_eq!(LockKey::from(&name.to_owned()), LockKey::from(name));
    }
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn text_key_with_negative_hashtext_is_sign_extended(pool: PgPool) {
    // hashtext is an int4; pg_advisory_lock(hashtext(..)) widens it to bigint
    // with sign extension. Find a name whose hash is negative and one whose
    // hash is positive and check both.
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    let mut negative = None;
    let mut positive = None;
    for i in 0..64 {
        let name = format!("sign-probe-{i}");
        let h = hashtext(&mut obs, &name).await;
        if h < 0 && negative.is_none() {
            negative = Some((name, h));
        } else if h >= 0 && positive.is_none() {
            positive = Some((name, h));
        }
    }
    for (name, h) in [
        negative.expect("a negative hashtext"),
        positive.expect("a positive hashtext"),
    ] {
        check_key_form(
            &locker,
            &mut obs,
            LockKey::from(name.as_str()),
            bigint_triple(i64::from(h)),
            Raw::Text(name.clone()),
            &[],
        )
        .await;
    }
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn id_key_locks_the_raw_bigint(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    for n in [
        0_i64,
        1,
        42,
        -1,
        -42,
        i64::MAX,
        i64::MIN,
        0x1_0000_0001,
        -0x1_0000_0001,
    ] {
        let lo = i32::from_ne_bytes((n as u64 as u32).to_ne_bytes());
        let hi = i32::from_ne_bytes(((n as u64 >> 32) as u32).to_ne_bytes());
        // The same 32-bit halves in the two-int keyspace are a different lock.
        let unrelated = [Raw::BigInt(n.wrapping_add(1)), Raw::IntPair(hi, lo)];
        check_key_form(
            &locker,
            &mut obs,
            LockKey::id(n),
            bigint_triple(n),
            Raw::BigInt(n),
            &unrelated,
        )
        .await;
        assert_eq!(LockKey::id(n).pg_bigint(), Some(n));
    }
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn namespaced_key_locks_the_int_pair_and_not_the_bigint_keyspace(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    for (ns, name) in [
        (7, "x"),
        (-3, "invoice:process"),
        (0, "x"),
        (i32::MAX, "y"),
        (i32::MIN, "z"),
    ] {
        let h = hashtext(&mut obs, name).await;
        let ns64 = i64::from(u32::from_ne_bytes(ns.to_ne_bytes()));
        let h64 = i64::from(u32::from_ne_bytes(h.to_ne_bytes()));
        let unrelated = [
            // The bigint keyspace: neither hashtext(name) ...
            Raw::text(name),
            // ... nor the bigint whose halves are (ns, hashtext(name)) ...
            Raw::BigInt((ns64 << 32) | h64),
            Raw::BigInt(i64::from(h)),
            // ... nor another namespace or name.
            Raw::pair(ns.wrapping_add(1), name),
            Raw::pair(ns, &format!("{name}-other")),
        ];
        check_key_form(
            &locker,
            &mut obs,
            LockKey::namespaced(ns, name),
            pair_triple(ns, h),
            Raw::pair(ns, name),
            &unrelated,
        )
        .await;
    }
    // And a text key does not conflict with the namespaced key of the same name.
    let text = locker.try_lock("shared-name").await.unwrap().expect("free");
    let ns = locker
        .try_lock(LockKey::namespaced(1, "shared-name"))
        .await
        .unwrap();
    assert!(
        ns.is_some(),
        "namespaced and text keys of one name are separate locks"
    );
    ns.unwrap().release().await.unwrap();
    text.release().await.unwrap();
    close(obs).await;
}

fn sqlx_key(name: &str) -> i64 {
    match PgAdvisoryLock::new(name).key() {
        PgAdvisoryLockKey::BigInt(k) => *k,
        other => panic!("unexpected sqlx key {other:?}"),
    }
}

#[sqlx::test(migrations = false)]
async fn hashed64_key_equals_sqlx_pg_advisory_lock_and_conflicts_with_it(pool: PgPool) {
    // Golden value from sqlx's own documentation.
    assert_eq!(
        LockKey::hashed64("my first Postgres advisory lock!").pg_bigint(),
        Some(-5560419505042474287)
    );
    assert_eq!(
        sqlx_key("my first Postgres advisory lock!"),
        -5560419505042474287
    );

    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    for name in [
        "my first Postgres advisory lock!",
        "invoice:process",
        "é",
        "x",
        "日本語 🔒",
    ] {
        let k = sqlx_key(name);
        assert_eq!(
            LockKey::hashed64(name).pg_bigint(),
            Some(k),
            "{name}: same derivation as sqlx"
        );
        let h = hashtext(&mut obs, name).await;
        let unrelated = [Raw::text(name), Raw::BigInt(i64::from(h))];
        check_key_form(
            &locker,
            &mut obs,
            LockKey::hashed64(name),
            bigint_triple(k),
            Raw::BigInt(k),
            &unrelated,
        )
        .await;

        // Interop with sqlx's own PgAdvisoryLock API, both directions.
        let sqlx_lock = PgAdvisoryLock::new(name);
        let guard = locker
            .try_lock(LockKey::hashed64(name))
            .await
            .unwrap()
            .expect("free");
        match sqlx_lock
            .try_acquire(&mut obs)
            .await
            .expect("sqlx try_acquire")
        {
            Either::Left(_) => panic!("{name}: sqlx PgAdvisoryLock acquired a key distlock holds"),
            Either::Right(_) => {}
        }
        guard.release().await.unwrap();
        let sqlx_guard = match sqlx_lock
            .try_acquire(&mut obs)
            .await
            .expect("sqlx try_acquire")
        {
            Either::Left(g) => g,
            Either::Right(_) => panic!("{name}: sqlx could not take a free key"),
        };
        assert!(
            locker
                .try_lock(LockKey::hashed64(name))
                .await
                .unwrap()
                .is_none(),
            "{name}: distlock must see sqlx's lock"
        );
        sqlx_guard.release_now().await.expect("sqlx release");
        assert!(advisory_locks(&mut obs).await.is_empty());
    }
    close(obs).await;
}

/// Names that must be rejected, in every key form that takes a name.
fn invalid_keys() -> Vec<LockKey> {
    vec![
        LockKey::from(""),
        LockKey::from(String::new()),
        LockKey::from("a\0b"),
        LockKey::from("\0"),
        LockKey::from("trailing\0"),
        LockKey::namespaced(1, ""),
        LockKey::namespaced(1, "x\0y"),
        LockKey::hashed64(""),
        LockKey::hashed64("nul\0inside"),
    ]
}

#[sqlx::test(migrations = false)]
async fn nul_and_empty_names_are_invalid_keys_and_never_reach_the_database(
    _pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    // A lazy pool opens no connection until asked: if any call below went to
    // the database, the pool's size would show it.
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_lazy_with(connect_opts.clone());
    let locker = PgLocker::new(pool.clone());
    for key in invalid_keys() {
        assert!(
            matches!(key.validate(), Err(Error::InvalidKey { .. })),
            "{key:?}: validate"
        );

        let mut ran = false;
        let res = locker
            .with_advisory_lock(key.clone(), async |_conn| {
                ran = true;
                Ok::<_, Error>(())
            })
            .await;
        assert!(
            matches!(res, Err(Error::InvalidKey { .. })),
            "{key:?}: with_advisory_lock gave {res:?}"
        );
        assert!(!ran, "{key:?}: closure must not run");

        let res = locker
            .with_shared_advisory_lock(key.clone(), async |_conn| Ok::<_, Error>(()))
            .await;
        assert!(
            matches!(res, Err(Error::InvalidKey { .. })),
            "{key:?}: with_shared_advisory_lock gave {res:?}"
        );

        let res = locker
            .with_advisory_lock_wait(key.clone(), Duration::from_secs(1), async |_conn| {
                Ok::<_, Error>(())
            })
            .await;
        assert!(
            matches!(res, Err(Error::InvalidKey { .. })),
            "{key:?}: with_advisory_lock_wait gave {res:?}"
        );

        let res = locker.try_lock(key.clone()).await;
        assert!(
            matches!(res, Err(Error::InvalidKey { .. })),
            "{key:?}: try_lock gave {res:?}"
        );

        let res = locker.lock(key.clone(), Duration::from_secs(1)).await;
        assert!(
            matches!(res, Err(Error::InvalidKey { .. })),
            "{key:?}: lock gave {res:?}"
        );
    }
    assert_eq!(
        pool.size(),
        0,
        "invalid keys must be rejected before any connection is used"
    );

    // holders_of rejects them too (it may borrow a connection, but takes no lock).
    for key in invalid_keys() {
        let res = locker.holders_of(key.clone()).await;
        assert!(
            matches!(res, Err(Error::InvalidKey { .. })),
            "{key:?}: holders_of gave {res:?}"
        );
    }
    let mut obs = observer(&connect_opts).await;
    assert!(
        advisory_locks(&mut obs).await.is_empty(),
        "no lock was ever taken"
    );
    close(obs).await;
    pool.close().await;
}

#[sqlx::test(migrations = false)]
async fn invalid_key_error_names_the_key_truncated(pool: PgPool) {
    let locker = PgLocker::new(pool);
    let long = format!("{}\0", "n".repeat(1000));
    match locker.try_lock(long.as_str()).await {
        Err(err @ Error::InvalidKey { .. }) => {
            let Error::InvalidKey { key, reason } = &err else {
                unreachable!()
            };
            assert_eq!(key, &LockKey::from(long.as_str()), "the key as given");
            let text = err.to_string();
            assert!(text.starts_with("invalid lock key \"nnnn"), "{text}");
            assert!(
                text.len() < 200,
                "the name in the message is truncated, got {} chars",
                text.len()
            );
            assert!(reason.contains("NUL"), "reason: {reason}");
        }
        other => panic!("expected InvalidKey, got {other:?}"),
    }
    match locker.try_lock("").await {
        Err(Error::InvalidKey { reason, .. }) => {
            assert!(reason.contains("empty"), "reason: {reason}")
        }
        other => panic!("expected InvalidKey, got {other:?}"),
    }
}

#[sqlx::test(migrations = false)]
async fn odd_names_are_ordinary_keys_locking_exactly_hashtext(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let mut obs = observer_for(&pool).await;
    sqlx::query("CREATE TABLE victims (id int)")
        .execute(&pool)
        .await
        .unwrap();
    let big: String = (0..100 * 1024)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    let names: Vec<String> = vec![
        "it's".into(),
        "''".into(),
        "\"double quoted\"".into(),
        "back\\slash\\".into(),
        "\\x00".into(),
        "ünïcødé 🔒 日本語 עברית".into(),
        "'; DROP TABLE victims; --".into(),
        "x')); SELECT pg_advisory_lock(1); --".into(),
        "$1 $2 ? %s {}".into(),
        " ".into(),
        "tab\tand\nnewline\r".into(),
        "\u{feff}bom".into(),
        big,
    ];
    for name in &names {
        let h = hashtext(&mut obs, name).await;
        let short: String = name.chars().take(40).collect();
        let guard = locker
            .try_lock(name.as_str())
            .await
            .unwrap_or_else(|e| panic!("{short:?}: {e}"))
            .expect("free");
        let rows = advisory_locks(&mut obs).await;
        assert_eq!(rows.len(), 1, "{short:?}: {rows:?}");
        assert_eq!(
            rows[0].triple(),
            bigint_triple(i64::from(h)),
            "{short:?}: must lock hashtext(name)"
        );
        assert!(
            !raw_try_lock(&mut obs, &Raw::Text(name.clone())).await,
            "{short:?}: raw conflicts"
        );
        // The holders view finds it by name as well.
        let holders = locker.holders_of(name.as_str()).await.unwrap();
        assert_eq!(holders.len(), 1, "{short:?}");
        assert_eq!(holders[0].pid, guard.backend_pid());
        guard.release().await.unwrap();

        assert!(raw_try_lock(&mut obs, &Raw::Text(name.clone())).await);
        assert!(
            locker.try_lock(name.as_str()).await.unwrap().is_none(),
            "{short:?}: distlock sees raw lock"
        );
        assert!(raw_unlock(&mut obs, &Raw::Text(name.clone())).await);

        let ran = locker
            .with_advisory_lock(name.as_str(), async |_conn| {
                let rows = advisory_locks(&mut obs).await;
                assert_eq!(rows.len(), 1);
                assert_eq!(rows[0].triple(), bigint_triple(i64::from(h)));
                Ok::<_, Error>(())
            })
            .await
            .unwrap();
        assert!(ran.is_some());
        assert!(
            advisory_locks(&mut obs).await.is_empty(),
            "{short:?}: nothing left"
        );
    }
    // The injection attempts were data, not SQL.
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM victims")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 0);
    close(obs).await;
}

#[sqlx::test(migrations = false)]
async fn key_display_and_equality(pool: PgPool) {
    let _ = pool;
    assert_eq!(
        LockKey::from("invoice:process").to_string(),
        "invoice:process"
    );
    assert_eq!(LockKey::id(-42).to_string(), "-42");
    assert_eq!(LockKey::namespaced(3, "n").to_string(), "n");
    assert_eq!(LockKey::hashed64("h").to_string(), "h");
    assert_ne!(LockKey::from("a"), LockKey::namespaced(0, "a"));
    assert_ne!(LockKey::from("a"), LockKey::hashed64("a"));
    assert_eq!(LockKey::from("a").name(), Some("a"));
    assert_eq!(LockKey::id(1).name(), None);
    assert_eq!(LockKey::from("a").pg_bigint(), None);
    assert_eq!(LockKey::namespaced(1, "a").pg_bigint(), None);
}
