//! Fencing tokens: issued with session locks, checked by the resource.

use std::time::Duration;

use crate::common;

use distlock::{Error, FencingToken, LockKey, PgLocker};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgPool};

async fn fenced(pool: &PgPool) -> PgLocker {
    distlock::migrate(pool).await.expect("migrate");
    PgLocker::builder(pool.clone())
        .fencing(true)
        .build()
        .expect("valid settings")
}

async fn token_of(locker: &PgLocker, key: impl Into<LockKey>) -> i64 {
    let lock = locker.try_lock(key).await.expect("try_lock").expect("free");
    let token = lock.fencing_token().expect("fencing on").value();
    lock.release().await.expect("release");
    token
}

#[sqlx::test(migrations = false)]
async fn tokens_strictly_increase_per_key(pool: PgPool) {
    let locker = fenced(&pool).await;
    let mut last = 0;
    for _ in 0..20 {
        let token = token_of(&locker, "fence:a").await;
        assert!(token > last, "{token} after {last}");
        last = token;
    }
    // Another key draws from the same counter: its tokens go on increasing.
    let other = token_of(&locker, "fence:b").await;
    assert_eq!(other, last + 1);
    // The waiting path issues tokens too.
    let lock = locker
        .lock("fence:a", Duration::from_secs(5))
        .await
        .expect("lock");
    assert_eq!(
        lock.fencing_token().map(FencingToken::value),
        Some(other + 1)
    );
    lock.release().await.expect("release");
}

/// The layout: the epoch (the server's timeline << 16, plus restarts) in
/// bits 62..32, the counter in bits 31..0.
#[sqlx::test(migrations = false)]
async fn tokens_carry_the_timeline_in_their_epoch(pool: PgPool) {
    let locker = fenced(&pool).await;
    let token = token_of(&locker, "fence:layout").await;
    let timeline: i64 = sqlx::query_scalar("SELECT distlock.current_timeline()")
        .fetch_one(&pool)
        .await
        .expect("timeline");
    assert!(token > 0);
    assert_eq!(token >> 48, timeline, "{token:#x}");
    assert_eq!(
        token & 0xffff_ffff,
        1,
        "the first token of an epoch: {token:#x}"
    );
}

/// Tokens of every lock come from one counter, so they increase across
/// locks too: locks that share a spelling ("42") never share a token.
#[sqlx::test(migrations = false)]
async fn tokens_of_every_lock_increase_together(pool: PgPool) {
    let locker = fenced(&pool).await;
    let mut last = 0;
    for key in [
        LockKey::id(42),
        LockKey::from("42"),
        LockKey::hashed64("42"),
        LockKey::id(42),
        LockKey::namespaced(3, "x"),
        LockKey::namespaced(4, "x"),
        LockKey::namespaced(3, "x"),
    ] {
        let token = token_of(&locker, key.clone()).await;
        assert!(token > last, "{key:?}: {token} after {last}");
        last = token;
    }
}

/// `from("x")` and `id(hashtext('x'))` are one PostgreSQL lock, so they
/// share one counter: two holders of that lock never get equal tokens,
/// whichever spelling each used.
#[sqlx::test(migrations = false)]
async fn spellings_of_one_server_lock_share_its_counter(pool: PgPool) {
    let locker = fenced(&pool).await;
    let hashed: i32 = sqlx::query_scalar("SELECT hashtext('fence:x')")
        .fetch_one(&pool)
        .await
        .unwrap();
    let spellings = [LockKey::from("fence:x"), LockKey::id(i64::from(hashed))];
    let mut last = 0;
    for round in 0..3 {
        for key in &spellings {
            let token = token_of(&locker, key.clone()).await;
            assert!(token > last, "round {round}, {key:?}: {token} after {last}");
            last = token;
        }
    }
    // The multiplexed mode and the waiting path count on the same counter.
    let mux = PgLocker::builder(pool.clone())
        .fencing(true)
        .multiplex(1)
        .build()
        .expect("valid settings");
    let token = token_of(&mux, spellings[1].clone()).await;
    assert!(token > last);
    let lock = locker
        .lock(spellings[0].clone(), Duration::from_secs(5))
        .await
        .unwrap();
    assert!(lock.fencing_token().unwrap().value() > token);
    lock.release().await.unwrap();
}

/// A deployment upgrading from the name-keyed counters must never see a
/// token at or below one issued before: not at the upgrade, and not from a
/// process of the old version still issuing tokens during a rolling upgrade.
#[sqlx::test(migrations = false)]
async fn upgrading_from_name_keyed_counters_never_reissues_a_token(pool: PgPool) {
    // The first version of the schema, as an old deployment has it.
    let first = std::env::temp_dir().join(format!("distlock-mig-{}", std::process::id()));
    std::fs::create_dir_all(&first).unwrap();
    std::fs::copy(
        "migrations/20261130000001_distlock_core.sql",
        first.join("20261130000001_distlock_core.sql"),
    )
    .unwrap();
    let mut old = sqlx::migrate::Migrator::new(first.as_path()).await.unwrap();
    old.dangerous_set_table_name("distlock._sqlx_migrations");
    sqlx::query("CREATE SCHEMA distlock")
        .execute(&pool)
        .await
        .unwrap();
    old.run(&pool).await.unwrap();
    std::fs::remove_dir_all(&first).unwrap();
    // Tokens the old version issued, by name.
    sqlx::query("INSERT INTO distlock.fencing_tokens (lock_key, token) VALUES ('fence:up', 40), ('other', 90)")
        .execute(&pool)
        .await
        .unwrap();
    let locker = fenced(&pool).await; // applies the rest
    let first_new = token_of(&locker, "fence:up").await;
    assert!(first_new > 90, "first token after the upgrade: {first_new}");
    // An old-version process, still running, issues a higher token by name.
    sqlx::query("UPDATE distlock.fencing_tokens SET token = 500 WHERE lock_key = 'fence:up'")
        .execute(&pool)
        .await
        .unwrap();
    let next = token_of(&locker, "fence:up").await;
    assert!(next > 500, "token after an old process issued 500: {next}");
    let fresh = token_of(&locker, "fence:never-used").await;
    assert!(
        fresh > 500,
        "a new counter starts above every old token: {fresh}"
    );
}

#[sqlx::test(migrations = false)]
async fn busy_try_issues_no_token(pool: PgPool) {
    let locker = fenced(&pool).await;
    let held = locker.try_lock("fence:busy").await.unwrap().unwrap();
    let first = held.fencing_token().map(FencingToken::value).unwrap();
    assert!(locker.try_lock("fence:busy").await.unwrap().is_none());
    held.release().await.unwrap();
    assert_eq!(token_of(&locker, "fence:busy").await, first + 1);
}

/// A try refused on a connection whose last try was granted draws no
/// token either: what told that grant's token column to draw lasted for
/// that one statement, not for the connection.
#[sqlx::test(migrations = false)]
async fn busy_try_on_a_connection_that_granted_before_issues_no_token(pool: PgPool) {
    let locker = fenced(&pool).await;
    // Leaves its connection in `locker`'s warm stash, where the next try
    // takes it from.
    let first = token_of(&locker, "fence:again").await;
    let other = PgLocker::builder(pool.clone())
        .fencing(true)
        .build()
        .expect("valid settings");
    let held = other.try_lock("fence:again").await.unwrap().unwrap();
    assert_eq!(
        held.fencing_token().map(FencingToken::value),
        Some(first + 1)
    );
    assert!(locker.try_lock("fence:again").await.unwrap().is_none());
    held.release().await.unwrap();
    assert_eq!(token_of(&locker, "fence:again").await, first + 2);
}

#[sqlx::test(migrations = false)]
async fn no_token_without_fencing(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let lock = locker.try_lock("plain").await.unwrap().unwrap();
    assert_eq!(lock.fencing_token(), None);
    lock.release().await.unwrap();
    let lock = locker.lock("plain", Duration::from_secs(1)).await.unwrap();
    assert_eq!(lock.fencing_token(), None);
    lock.release().await.unwrap();
}

#[sqlx::test(migrations = false)]
async fn tokens_increase_across_lockers_and_pools(
    pool_opts: PgPoolOptions,
    connect_opts: PgConnectOptions,
) {
    let pool_a = pool_opts
        .clone()
        .max_connections(8)
        .connect_with(connect_opts.clone())
        .await
        .unwrap();
    let pool_b = pool_opts
        .max_connections(8)
        .connect_with(connect_opts)
        .await
        .unwrap();
    let a = fenced(&pool_a).await;
    let b = fenced(&pool_b).await;
    let mut tasks = Vec::new();
    for i in 0..8 {
        let locker = if i % 2 == 0 { a.clone() } else { b.clone() };
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            for _ in 0..15 {
                let lock = locker
                    .lock("shared", Duration::from_secs(20))
                    .await
                    .unwrap();
                seen.push(lock.fencing_token().unwrap().value());
                lock.release().await.unwrap();
            }
            seen
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        let seen = task.await.unwrap();
        assert!(
            seen.windows(2).all(|w| w[0] < w[1]),
            "per task increasing: {seen:?}"
        );
        all.extend(seen);
    }
    all.sort_unstable();
    let epoch = all[0] >> 32;
    assert!(all.iter().all(|t| t >> 32 == epoch), "one epoch: {all:?}");
    let counters: Vec<i64> = all.iter().map(|t| t & 0xffff_ffff).collect();
    let expected: Vec<i64> = (1..=120).collect();
    assert_eq!(
        counters, expected,
        "every acquisition got its own, gapless token"
    );
}

#[sqlx::test(migrations = false)]
async fn check_rejects_stale_accepts_equal_and_newer(pool: PgPool) {
    distlock::migrate(&pool).await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let t = FencingToken::new;
    distlock::fence::check(&mut conn, "res", t(5))
        .await
        .unwrap();
    distlock::fence::check(&mut conn, "res", t(5))
        .await
        .expect("equal accepted");
    distlock::fence::check(&mut conn, "res", t(9))
        .await
        .expect("newer accepted");
    match distlock::fence::check(&mut conn, "res", t(6)).await {
        Err(Error::StaleFencingToken {
            resource,
            presented,
            current,
        }) => {
            assert_eq!((resource.as_str(), presented, current), ("res", 6, 9));
        }
        other => panic!("expected StaleFencingToken, got {other:?}"),
    }
    assert_eq!(
        distlock::fence::current(&mut conn, "res").await.unwrap(),
        Some(t(9))
    );
    assert_eq!(
        distlock::fence::current(&mut conn, "other").await.unwrap(),
        None
    );
    // Another resource is independent.
    distlock::fence::check(&mut conn, "other", t(1))
        .await
        .unwrap();
    assert!(matches!(
        distlock::fence::check(&mut conn, "", t(1)).await,
        Err(Error::InvalidKey { .. })
    ));
}

#[sqlx::test(migrations = false)]
async fn stale_check_leaves_the_transaction_usable_and_the_write_is_rolled_back(pool: PgPool) {
    distlock::migrate(&pool).await.unwrap();
    sqlx::query("CREATE TABLE doc (id int PRIMARY KEY, body text)")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO doc VALUES (1, 'v0')")
        .execute(&pool)
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    for (token, body) in [(2, "from 2"), (1, "from 1")] {
        let mut tx = conn.begin().await.unwrap();
        let checked = distlock::fence::check(&mut tx, "doc:1", FencingToken::new(token)).await;
        if checked.is_ok() {
            sqlx::query("UPDATE doc SET body = $1 WHERE id = 1")
                .bind(body)
                .execute(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
        } else {
            // The transaction is still usable after a rejected token.
            let one: i32 = sqlx::query_scalar("SELECT 1")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            assert_eq!(one, 1);
            tx.rollback().await.unwrap();
        }
    }
    let body: String = sqlx::query_scalar("SELECT body FROM doc WHERE id = 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(body, "from 2");
}

#[sqlx::test(migrations = false)]
async fn sql_function_gives_the_same_answers(pool: PgPool) {
    distlock::migrate(&pool).await.unwrap();
    let check = |token: i64| {
        let pool = pool.clone();
        async move {
            sqlx::query("SELECT distlock.fence_check('sql-res', $1)")
                .bind(token)
                .execute(&pool)
                .await
        }
    };
    check(3).await.expect("first accepted");
    check(3).await.expect("equal accepted");
    check(4).await.expect("newer accepted");
    let err = check(2).await.expect_err("stale rejected");
    let db = err.as_database_error().expect("database error");
    assert_eq!(db.code().as_deref(), Some("DL001"));
    assert!(db.message().contains("presented 2"), "{}", db.message());
    // The Rust check sees what the SQL function recorded, and vice versa.
    let mut conn = pool.acquire().await.unwrap();
    assert!(
        distlock::fence::check(&mut conn, "sql-res", FencingToken::new(3))
            .await
            .is_err()
    );
    distlock::fence::check(&mut conn, "sql-res", FencingToken::new(10))
        .await
        .unwrap();
    assert!(check(9).await.is_err());
}

#[sqlx::test(migrations = false)]
async fn trigger_enforces_the_fence_on_an_application_table(pool: PgPool) {
    distlock::migrate(&pool).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE ledger (id int PRIMARY KEY, amount int, fence bigint NOT NULL);
         CREATE FUNCTION ledger_fence() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM distlock.fence_check('ledger:' || NEW.id, NEW.fence); RETURN NEW; END $$;
         CREATE TRIGGER ledger_fence BEFORE INSERT OR UPDATE ON ledger
           FOR EACH ROW EXECUTE FUNCTION ledger_fence();",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("INSERT INTO ledger VALUES (1, 10, 5)")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE ledger SET amount = 20, fence = 6 WHERE id = 1")
        .execute(&pool)
        .await
        .unwrap();
    let stale = sqlx::query("UPDATE ledger SET amount = 99, fence = 5 WHERE id = 1")
        .execute(&pool)
        .await;
    assert!(stale.is_err(), "stale write must fail");
    let amount: i32 = sqlx::query_scalar("SELECT amount FROM ledger")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(amount, 20);
}

#[sqlx::test(migrations = false)]
async fn overtaken_holder_is_fenced_off(pool: PgPool) {
    let locker = PgLocker::builder(pool.clone())
        .fencing(true)
        .heartbeat(Duration::from_millis(100))
        .heartbeat_timeout(common::PATIENT)
        .build()
        .expect("valid settings");
    distlock::migrate(&pool).await.unwrap();
    let a = locker.try_lock("job").await.unwrap().unwrap();
    let a_token = a.fencing_token().unwrap();
    // A's session dies (as after a long pause); B takes over and writes.
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(a.backend_pid())
        .execute(&pool)
        .await
        .unwrap();
    let b = locker.lock("job", Duration::from_secs(5)).await.unwrap();
    let b_token = b.fencing_token().unwrap();
    assert!(b_token > a_token);
    let mut conn = pool.acquire().await.unwrap();
    distlock::fence::check(&mut conn, "job-output", b_token)
        .await
        .unwrap();
    // A wakes up: told its lock is gone, and its write is rejected anyway.
    tokio::time::timeout(Duration::from_secs(2), a.lost())
        .await
        .expect("lost fires");
    assert!(matches!(
        distlock::fence::check(&mut conn, "job-output", a_token).await,
        Err(Error::StaleFencingToken { .. })
    ));
    b.release().await.unwrap();
}

/// A pool of one connection to `pool`'s database, its sessions started with
/// the settings `options` (so every lock runs on one backend).
async fn fresh_pool(pool: &PgPool, options: &[(&str, &str)]) -> PgPool {
    let opts = pool
        .connect_options()
        .as_ref()
        .clone()
        .options(options.iter().copied());
    PgPoolOptions::new()
        .max_connections(1)
        .connect_with(opts)
        .await
        .expect("connect")
}

/// The epoch row: (epoch, counter base).
async fn epoch_row(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as("SELECT epoch, counter_base FROM distlock.token_epoch")
        .fetch_one(pool)
        .await
        .expect("the epoch row")
}

/// A backend that has issued a token once issues the next ones in the
/// statement, without calling the token functions (counted by the server's
/// function statistics of that backend, flushed when it exits). The tokens
/// are the ones the function issues: one epoch, one counter, in order.
#[sqlx::test(migrations = false)]
async fn a_backend_draws_tokens_without_the_token_function(pool: PgPool) {
    distlock::migrate(&pool).await.expect("migrate");
    let one = fresh_pool(&pool, &[("track_functions", "pl")]).await;
    let locker = PgLocker::builder(one.clone())
        .fencing(true)
        .build()
        .expect("valid settings");
    let mut tokens = Vec::new();
    for i in 0..20 {
        tokens.push(token_of(&locker, format!("draw:{}", i % 3)).await);
        let lock = locker
            .lock("draw:wait", Duration::from_secs(5))
            .await
            .expect("lock");
        tokens.push(lock.fencing_token().expect("fencing on").value());
        lock.release().await.expect("release");
    }
    let (epoch, _) = epoch_row(&pool).await;
    assert!(tokens.iter().all(|t| t >> 32 == epoch), "{tokens:x?}");
    assert!(
        tokens.windows(2).all(|w| w[1] == w[0] + 1),
        "one counter, no draw wasted: {tokens:x?}"
    );
    drop(locker);
    one.close().await;
    let calls = async || -> (i64, i64) {
        sqlx::query_as(
            "SELECT coalesce(sum(calls) FILTER (WHERE funcname = 'next_token'), 0)::int8, \
                    coalesce(sum(calls) FILTER (WHERE funcname = 'next_token_and_cache'), 0)::int8 \
             FROM pg_stat_user_functions WHERE schemaname = 'distlock'",
        )
        .fetch_one(&pool)
        .await
        .expect("function statistics")
    };
    common::eventually(
        "the backend's statistics",
        Duration::from_secs(10),
        async || calls().await.0 > 0,
    )
    .await;
    assert_eq!(calls().await, (1, 1), "the first token only");
}

/// What a backend remembers is used only for draws inside that epoch of
/// that counter: a base the counter has not reached, a draw 2^32 or more
/// past the base (the epoch ran out), a remembered counter that is not this
/// schema's, each make the statement ask the token function, whose token
/// is of the epoch in force and follows every earlier one.
#[sqlx::test(migrations = false)]
async fn a_stale_or_foreign_remembered_epoch_is_not_used(pool: PgPool) {
    let locker = fenced(&pool).await;
    // A counter past 2^33, so that a base 2^32 behind it is still a number
    // the function could have written (never negative).
    sqlx::query("SELECT setval('distlock.token_counter', 8589934592)")
        .execute(&pool)
        .await
        .unwrap();
    let mut last = token_of(&locker, "stale:first").await;
    let (epoch, base) = epoch_row(&pool).await;
    let seq: i64 = sqlx::query_scalar("SELECT 'distlock.token_counter'::regclass::oid::int8")
        .fetch_one(&pool)
        .await
        .unwrap();
    let (high, seq) = ((epoch << 32).to_string(), seq.to_string());
    let counter: i64 = sqlx::query_scalar("SELECT last_value FROM distlock.token_counter")
        .fetch_one(&pool)
        .await
        .unwrap();
    let ahead = (counter + 1_000_000).to_string();
    let run_out = (counter - (1 << 32)).to_string();
    let base = base.to_string();
    let cases: [(&str, [(&str, &str); 3]); 3] = [
        (
            "a base ahead of the counter",
            [
                ("distlock.token_base", &ahead),
                ("distlock.token_high", &high),
                ("distlock.token_seq", &seq),
            ],
        ),
        (
            "a draw 2^32 past the base",
            [
                ("distlock.token_base", &run_out),
                ("distlock.token_high", &high),
                ("distlock.token_seq", &seq),
            ],
        ),
        (
            "another counter's epoch",
            [
                ("distlock.token_base", &base),
                ("distlock.token_high", &((epoch + 7) << 32).to_string()),
                ("distlock.token_seq", "1"),
            ],
        ),
    ];
    for (case, settings) in cases {
        let one = fresh_pool(&pool, &settings).await;
        let forged = fenced(&one).await;
        // The first statement may have drawn once before it asked the
        // function (the draw showed the epoch was not this one); the
        // second issues the next draw in the epoch the function gave.
        for most in [2, 1] {
            let token = token_of(&forged, "stale:key").await;
            assert_eq!(token >> 32, epoch, "{case}: {token:#x}");
            assert!(
                (1..=most).contains(&(token - last)),
                "{case}: {token:#x} after {last:#x}"
            );
            last = token;
        }
        drop(forged);
        one.close().await;
    }
}

/// A counter that would wrap starts the next epoch; tokens go on
/// increasing. An epoch past its timeline's 65535 is refused (DL002), never
/// reused from the next timeline's numbers.
#[sqlx::test(migrations = false)]
async fn counter_wrap_starts_the_next_epoch_and_exhaustion_is_an_error(pool: PgPool) {
    let locker = fenced(&pool).await;
    let before = token_of(&locker, "fence:wrap").await;
    // Pretend 2^32 - 1 tokens were issued in this epoch: the counter moved
    // on (the locker's backend remembers the epoch; its next draw shows
    // that the epoch ran out).
    sqlx::query(
        "SELECT setval('distlock.token_counter', \
         (SELECT counter_base FROM distlock.token_epoch) + 4294967295)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let after = token_of(&locker, "fence:wrap").await;
    assert!(after > before, "{after:#x} after {before:#x}");
    assert_eq!(after >> 32, (before >> 32) + 1, "the next epoch");
    assert_eq!(after & 0xffff_ffff, 1);

    // The last epoch of this timeline, and a restart-like mismatch.
    sqlx::query(
        "UPDATE distlock.token_epoch SET epoch = (distlock.current_timeline() << 16) + 65535, \
         server_started = '2000-01-01'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let err = sqlx::query_scalar::<_, i64>("SELECT distlock.next_token()")
        .fetch_one(&pool)
        .await
        .unwrap_err();
    let code = err.as_database_error().and_then(|e| e.code()).unwrap();
    assert_eq!(code, "DL002", "{err}");
    // The start time stands for a restart, which ends every backend: a
    // locker on new connections (the old ones remember an epoch that a real
    // restart would have ended with them).
    let restarted = fenced(&fresh_pool(&pool, &[]).await).await;
    let err = restarted.try_lock("fence:wrap").await.unwrap_err();
    assert!(err.to_string().contains("used up"), "{err}");
    assert!(
        distlock::migrate(&pool).await.is_ok(),
        "the schema itself stays usable"
    );
}

#[sqlx::test(migrations = false)]
async fn an_oversized_resource_is_refused_with_the_limit(pool: PgPool) {
    let locker = fenced(&pool).await;
    let token = {
        let lock = locker.try_lock("fence:big").await.unwrap().expect("free");
        let token = lock.fencing_token().expect("fencing on");
        lock.release().await.unwrap();
        token
    };
    let huge = "r".repeat(1 << 20);
    let mut conn = pool.acquire().await.unwrap();
    for result in [
        distlock::fence::check(&mut conn, &huge, token)
            .await
            .map(|()| None),
        distlock::fence::current(&mut conn, &huge).await,
    ] {
        let err = result.expect_err("refused");
        let (debug, text) = (format!("{err:?}"), err.to_string());
        assert!(debug.starts_with("InvalidArgument"), "{debug}");
        assert!(
            text.contains("resource") && text.contains("1024 bytes"),
            "{text}"
        );
    }
    let longest = "r".repeat(1024);
    distlock::fence::check(&mut conn, &longest, token)
        .await
        .unwrap();
}
