//! Which transaction-scoped locks each Tokio task of this process holds, so
//! that a nested call on the same key is named ([`Error::NestedLock`])
//! instead of reported as another holder.
//!
//! An inner `with_advisory_lock("k")` inside an outer one on `"k"` runs on
//! a second connection: the server sees two sessions, and the inner one
//! can never get the lock, because the outer one ends only after the inner
//! one returns. Two shared calls too: a writer that queues for the key
//! between them waits for the outer one, and PostgreSQL queues the inner
//! one behind the writer. The server cannot tell that apart from real
//! contention (nor see the cycle, whose last link is in the client); the
//! process can, as far as it sees its own holds. A hold is recorded in a
//! task-local scope around the closure's future only, keyed by the database
//! (host, port, name), since the same key on another database is another
//! lock. Futures polled beside the closure (`tokio::join!`, `select!`) are
//! outside that scope, so two independent calls in one task are not taken
//! for nesting; a call made from a task the closure spawned is not seen.

use std::future::Future;

use sqlx::PgPool;

use crate::{Error, LockKey};

tokio::task_local! {
    /// The (database, key) pairs held by the enclosing closures of the
    /// future being polled.
    static HELD: Vec<(String, LockKey)>;
}

/// The database `pool` connects to, as far as its options show: where they
/// name none, the server takes the user's name (two users' pools without
/// a database name reach two databases; one user's with and without its
/// own name, the same one). Host names are not resolved: two names of one
/// server count as two.
pub(crate) fn database_of(pool: &PgPool) -> String {
    let options = pool.connect_options();
    let database = options
        .get_database()
        .unwrap_or_else(|| options.get_username());
    format!("{}:{}/{}", options.get_host(), options.get_port(), database)
}

/// `Err(NestedLock)` when an enclosing call already holds `key` on
/// `database`, under this spelling or another of the same server lock
/// that the client can tell (`LockKey::hashed64(name)` and the id of its
/// value; a name and the id of its `hashtext` only the server knows).
pub(crate) fn refuse_nested(database: &str, key: &LockKey) -> Result<(), Error> {
    let nested = HELD
        .try_with(|held| {
            held.iter()
                .any(|(d, k)| d == database && same_server_lock(k, key))
        })
        .unwrap_or(false);
    if nested {
        return Err(Error::NestedLock { key: key.clone() });
    }
    Ok(())
}

/// Whether `a` and `b` bind the same server lock: the same arguments.
fn same_server_lock(a: &LockKey, b: &LockKey) -> bool {
    match (a.args(), b.args()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// Runs `f` with `key` on `database` recorded as held by it (and by what it
/// awaits).
pub(crate) async fn holding<F: Future>(database: String, key: &LockKey, f: F) -> F::Output {
    let mut held = HELD.try_with(Clone::clone).unwrap_or_default();
    held.push((database, key.clone()));
    HELD.scope(held, f).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(url: &str) -> PgPool {
        sqlx::postgres::PgPoolOptions::new()
            .connect_lazy(url)
            .expect("a valid URL")
    }

    #[tokio::test]
    async fn a_database_left_out_is_the_users_own() {
        let alice = database_of(&pool("postgres://alice@db:5432"));
        assert_eq!(alice, database_of(&pool("postgres://alice@db:5432/alice")));
        assert_ne!(alice, database_of(&pool("postgres://bob@db:5432")));
        assert_ne!(alice, database_of(&pool("postgres://alice@db:5432/other")));
    }
}
