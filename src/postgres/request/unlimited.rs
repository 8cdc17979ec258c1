//! Lock waits that a session `statement_timeout` (or, on PostgreSQL 17
//! and later, `transaction_timeout`) cannot cut short.
//!
//! A role, a database, the connect options or an `after_connect` hook may
//! give every session a `statement_timeout`. PostgreSQL arms that timer
//! when a statement starts, so a lock wait under it fails with SQLSTATE
//! 57014 at the session's limit, before the caller's own timeout, and a
//! statement cannot lift the limit for itself. A `transaction_timeout`
//! does the same to a wait outside a transaction block (an implicit
//! transaction of its own), and ends the session with it (SQLSTATE 25P04).
//! So the statement *before* a wait lifts them, only where one is set
//! (each try statement, and the semaphore head's `LISTEN`, returns the
//! session's limit, so a session without one pays nothing):
//!
//! - outside a transaction block, the wait runs in one of its own,
//!   `BEGIN; SET LOCAL statement_timeout = 0` (and `transaction_timeout` where
//!   the server has it), wait, `COMMIT`: 2 round trips more. Session locks and
//!   the session marker outlive the `COMMIT`; the lifted limit does not, so the
//!   connection goes back to its later users as it was. A wait that fails
//!   leaves the transaction open, and its connection must be closed, which
//!   every caller does anyway (a failed wait may have been granted).
//! - inside a transaction (the transaction-scoped paths), the try
//!   statement lifts it `SET LOCAL`-style when the key was busy, and the
//!   wait statement puts the caller's value back, so the caller's own
//!   statements keep their limit; no round trip more. A failed wait aborts
//!   the transaction (or savepoint), which restores it as well.

use sqlx::postgres::PgConnection;

/// `statement_timeout` as `current_setting` shows it when there is none.
const NONE: &str = "0";

/// Opens the wait's own transaction with both limits lifted for it: the
/// server arms `transaction_timeout` at `BEGIN`, and setting it to 0 in the
/// transaction disarms it. Before PostgreSQL 17 there is no such setting
/// (`current_setting(.., true)` is NULL), and nothing to lift.
const LIFT: &str = "BEGIN; SET LOCAL statement_timeout = 0; \
    SELECT CASE WHEN pg_catalog.current_setting('transaction_timeout', true) IS NOT NULL \
    THEN pg_catalog.set_config('transaction_timeout', '0', true) END";

/// Whether `setting` (the session's limit on a wait, as a statement
/// returned it: its `statement_timeout`, else its `transaction_timeout`)
/// would cut a lock wait short.
pub(crate) fn limited(setting: Option<&str>) -> bool {
    setting.is_some_and(|s| s != NONE)
}

/// Runs the wait `wait` on `conn`, outside any transaction block; in a
/// transaction of its own with both limits lifted if `limited`.
/// On an error the connection may be inside that transaction: close it.
///
/// # Cancel safety
///
/// Dropped at any `.await`, the connection is mid-statement or mid-block:
/// the caller's armed connection is closed, which ends both.
pub(crate) async fn session_wait<T, F>(
    conn: &mut PgConnection,
    limited: bool,
    wait: F,
) -> Result<T, sqlx::Error>
where
    F: AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
{
    if !limited {
        return wait(conn).await;
    }
    sqlx::raw_sql(LIFT).execute(&mut *conn).await?;
    let outcome = wait(&mut *conn).await?;
    sqlx::raw_sql("COMMIT").execute(&mut *conn).await?;
    Ok(outcome)
}
