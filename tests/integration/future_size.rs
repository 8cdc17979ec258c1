//! The futures of the PostgreSQL backend's lock calls stay small.
//!
//! A caller moves a lock call's future at least once (into `.await`, a
//! `select!`, a span, a task), and Rust copies a future whole when it is
//! moved: an 18 KB `try_lock` future cost a short lock a copy of 18 KB each
//! time, and more cache misses when the lock is taken between other work.
//! sqlx's pool acquisition future (about 17 KB) and `PgListener`'s receive
//! future (about 9 KB) made them that size while inline; they are boxed
//! (`postgres::conn::pooled::acquire`, `WatchedConn`): only a call that
//! goes to the pool pays that allocation (and a semaphore's waiting
//! connection one per `LISTEN` and per notification read).
//!
//! Nothing here is timed: the bound is on the futures' sizes, which the
//! compiler fixes. Before the boxing it failed for 16 of the 17 calls:
//! `try_lock` was 8,992 bytes in this (test) build and 18,016 in a release
//! build, `LockWaiter::lock` 22,928 and 45,440; now they are 1,712 and
//! 3,920 in both.

use std::time::Duration;

use distlock::postgres::{LockWaiter, TableLocker};
use distlock::{LockKey, PgLocker};
use sqlx::PgPool;

/// The most a lock call's future may take. The largest today is about
/// 3.9 KB (`LockWaiter::lock`); a pool acquisition held inline again would
/// more than quadruple it.
const MAX_FUTURE: usize = 4096;

/// Asserts the size of `$call`'s future, which is dropped unpolled (nothing
/// is sent to the server).
macro_rules! small {
    ($sizes:ident, $name:literal, $call:expr) => {{
        let future = $call;
        $sizes.push(($name, std::mem::size_of_val(&future)));
        drop(future);
    }};
}

#[sqlx::test(migrations = false)]
async fn lock_calls_have_small_futures(pool: PgPool) {
    let locker = PgLocker::new(pool.clone());
    let table = TableLocker::new(pool.clone());
    let semaphore = locker.semaphore("size", 2).expect("a valid semaphore");
    let key = || LockKey::id(1);
    let wait = Duration::from_secs(1);
    let mut sizes: Vec<(&str, usize)> = Vec::new();
    small!(sizes, "try_lock", locker.try_lock(key()));
    small!(sizes, "try_lock_shared", locker.try_lock_shared(key()));
    small!(sizes, "lock", locker.lock(key(), wait));
    small!(sizes, "lock_shared", locker.lock_shared(key(), wait));
    small!(
        sizes,
        "try_lock_upgradeable",
        locker.try_lock_upgradeable(key())
    );
    small!(
        sizes,
        "lock_upgradeable",
        locker.lock_upgradeable(key(), wait)
    );
    small!(
        sizes,
        "try_lock_all",
        locker.try_lock_all([key(), LockKey::id(2)])
    );
    small!(
        sizes,
        "lock_all",
        locker.lock_all([key(), LockKey::id(2)], wait)
    );
    small!(
        sizes,
        "with_advisory_lock",
        locker.with_advisory_lock(key(), async |_| Ok::<_, distlock::Error>(()))
    );
    small!(
        sizes,
        "with_advisory_lock_wait",
        locker.with_advisory_lock_wait(key(), wait, async |_| Ok::<_, distlock::Error>(()))
    );
    small!(sizes, "holders_of", locker.holders_of(key()));
    let waiter = LockWaiter::new(&locker, key(), wait);
    small!(sizes, "LockWaiter::lock", waiter.lock());
    small!(sizes, "TableLocker::try_lock", table.try_lock(key()));
    small!(sizes, "TableLocker::lock", table.lock(key(), wait));
    small!(sizes, "Semaphore::try_acquire", semaphore.try_acquire());
    small!(sizes, "Semaphore::acquire", semaphore.acquire(wait));

    let lock = locker
        .try_lock(key())
        .await
        .expect("try_lock")
        .expect("free");
    small!(sizes, "SessionLock::release", lock.release());

    let large: Vec<_> = sizes
        .iter()
        .filter(|(_, size)| *size > MAX_FUTURE)
        .collect();
    assert!(
        large.is_empty(),
        "futures over {MAX_FUTURE} bytes: {large:?} (all: {sizes:?})"
    );
}
