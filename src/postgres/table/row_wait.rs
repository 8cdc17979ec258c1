//! A lease-table statement whose waits for rows that other transactions
//! locked end when its client gives up on it.

use std::time::Duration;

use sqlx::AssertSqlSafe;
use sqlx::postgres::PgRow;
use tokio::time::Instant;

use crate::Error;
use crate::postgres::conn::held::HeldConn;
use crate::postgres::sqlstate::lock_not_available;

/// Runs `sql(wait)` on `conn`, `wait` being what is left until `give_up`
/// once the connection is in hand (the statement's `lock_timeout`, see
/// `sql::after_lock_timeout`); its one row, or `None` if a row another
/// transaction locked held it up that long. 1 round trip. `conn` is
/// disarmed on a row or on that timeout (the server answered: the
/// connection is sound); any other error leaves it armed, so it is closed.
///
/// The client's own timer at `give_up`, started before the send, usually
/// fires first; the server's timeout is the fallback that ends the
/// statement there too.
///
/// The server does not notice a closed socket while a statement waits: a
/// statement given up on at `give_up` would stay behind as a backend
/// waiting on the row, and write once the row was freed.
pub(super) async fn answered_by(
    conn: &mut HeldConn,
    give_up: Instant,
    sql: impl FnOnce(Duration) -> String,
) -> Result<Option<PgRow>, Error> {
    let wait = give_up.saturating_duration_since(Instant::now());
    let row = sqlx::raw_sql(AssertSqlSafe(sql(wait)))
        .fetch_one(conn.conn())
        .await;
    match row {
        Ok(row) => {
            conn.disarm();
            Ok(Some(row))
        }
        Err(err) if lock_not_available(&err) => {
            conn.disarm();
            Ok(None)
        }
        Err(err) => Err(err.into()),
    }
}
