//! Taking a connection from the pool: boxed ([`acquire`], for every call
//! that goes to the pool), within a waiting call's deadline, or an error
//! that says why there was none (shared by every waiting lock path).

use std::future::Future;
use std::pin::Pin;
use std::time::Instant;

use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};

use crate::postgres::conn::watched::WatchedConn;
use crate::{Error, LockKey};

/// How long a waiting call may take to get a connection however short its
/// timeout: a timeout of zero means "try the lock once", and handing out a
/// pooled connection costs a round trip (the pool's ping) that a deadline
/// already due would otherwise never allow.
pub(crate) const ACQUIRE_FLOOR: std::time::Duration = std::time::Duration::from_millis(250);

/// `pool.acquire()`, boxed. sqlx's acquisition future is about 17 KB; kept
/// inline it would make every lock call's future that size (a `try_lock`'s
/// was 18 KB), copied whole each time a caller moves it, even when the call
/// takes a warm connection and never awaits the pool. Boxed, the common
/// path's future stays small and this allocation happens only when the
/// pool is asked, beside that call's ping round trip.
pub(crate) fn acquire(
    pool: &PgPool,
) -> Pin<Box<dyn Future<Output = Result<PoolConnection<Postgres>, sqlx::Error>> + Send + '_>> {
    Box::pin(pool.acquire())
}

/// A connection from `pool` before `deadline`.
///
/// A deadline that passes while the pool has no connection to give is not a
/// lock timeout (nothing was asked of the server, nobody need hold `key`):
/// it is [`Error::NoConnection`], with what the pool looked like then.
pub(crate) async fn pooled_before(
    pool: &PgPool,
    key: &LockKey,
    started: Instant,
    deadline: tokio::time::Instant,
) -> Result<PoolConnection<Postgres>, Error> {
    before(pool, key, (started, deadline), acquire(pool)).await
}

/// A connection from `pool` that can be read while idle (see
/// [`WatchedConn`]), before `deadline`; errors as [`pooled_before`].
pub(crate) async fn watched_before(
    pool: &PgPool,
    key: &LockKey,
    started: Instant,
    deadline: tokio::time::Instant,
) -> Result<WatchedConn, Error> {
    before(pool, key, (started, deadline), WatchedConn::acquire(pool)).await
}

/// A connection from `pool` that can be read while idle, within the pool's
/// own acquire timeout; errors as [`pool_error`].
pub(crate) async fn watched(pool: &PgPool, key: &LockKey) -> Result<WatchedConn, Error> {
    let acquired = WatchedConn::acquire(pool).await;
    acquired.map_err(|err| pool_error(pool, key, err))
}

async fn before<T>(
    pool: &PgPool,
    key: &LockKey,
    (started, deadline): (Instant, tokio::time::Instant),
    acquire: impl Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, Error> {
    let floor = tokio::time::Instant::from_std(started) + ACQUIRE_FLOOR;
    match tokio::time::timeout_at(deadline.max(floor), acquire).await {
        Ok(acquired) => Ok(acquired?),
        Err(_) => Err(no_connection(pool, key, started)),
    }
}

/// [`Error::NoConnection`] for `key`, its cause read from `pool`'s state.
pub(crate) fn no_connection(pool: &PgPool, key: &LockKey, started: Instant) -> Error {
    let cause = if pool.is_closed() {
        "the pool is closed"
    } else if pool.size() >= pool.options().get_max_connections() && pool.num_idle() == 0 {
        "every connection of the pool is in use (each held session lock, waiting lock() and \
         open with_advisory_lock transaction keeps one)"
    } else {
        "the pool was still opening or checking a connection (a slow or stalled network, \
         a server down or unreachable, or a connection limit reached)"
    };
    Error::NoConnection {
        key: key.clone(),
        waited: started.elapsed(),
        cause,
    }
}

/// Maps a failed `pool.acquire()` of a call that does not wait: the pool's
/// own timeout with every connection in use is [`Error::PoolExhausted`]
/// (the pool belongs to this process, so its own holds fill it).
pub(crate) fn pool_error(pool: &PgPool, key: &LockKey, err: sqlx::Error) -> Error {
    let size = pool.options().get_max_connections();
    match err {
        sqlx::Error::PoolTimedOut if pool.size() >= size && pool.num_idle() == 0 => {
            Error::PoolExhausted {
                key: key.clone(),
                size,
            }
        }
        err => Error::from(err),
    }
}
