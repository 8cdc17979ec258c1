//! `with_advisory_lock`'s try in the round trip of its `BEGIN`.
//!
//! The driver opens a transaction with one simple query of our choosing
//! (`begin_with`), and reads nothing of that query's answer but whether it
//! failed and whether a transaction is open after it. So the query is
//! `BEGIN; EXECUTE <the try>(<key>)`: the try is [`xact_try_raising`], a
//! statement prepared once per server session (a simple query has no
//! parameters, and planning the try on every call costs more than the
//! round trip it saves), which fails when the lock is not taken. An open
//! transaction then means the lock is held; a failure says why not
//! ([`answer`]). A busy key costs an `ERROR` line in the server's log,
//! whose value reads "distlock: lock busy, not an error of the
//! application".
//!
//! The statement is prepared by `PREPARE` the first time a session lacks
//! it (SQLSTATE 26000 names the missing statement): that call rolls back,
//! prepares, and takes the lock in the two round trips of the plain path.
//! Its name carries a hash of its text, so a session prepared by another
//! version of this crate is never handed a statement of other semantics.
//!
//! [`xact_try_raising`]: super::sql::xact_try_raising

use std::sync::LazyLock;

use sqlx::postgres::PgDatabaseError;

use crate::postgres::request::key::Bound;
use crate::postgres::request::sql::{prepared_try_busy, prepared_try_marker, xact_try_raising};
use crate::postgres::request::{Lock, NotTaken};
use crate::postgres::sqlstate::INVALID_STATEMENT_NAME;

/// SQLSTATE 22P02: a value that does not parse as its type, which the try
/// raises on purpose.
const INVALID_TEXT_REPRESENTATION: &str = "22P02";

/// One lock mode's prepared try: its name and its `PREPARE`.
struct Prepared {
    name: String,
    prepare: String,
}

impl Prepared {
    fn new(lock: Lock) -> Self {
        let text = xact_try_raising(lock);
        let name = format!("distlock_xact_try_{:016x}", fnv1a(text.as_bytes()));
        let prepare =
            format!("PREPARE {name}(pg_catalog.int4, pg_catalog.int8, pg_catalog.text) AS {text}");
        Self { name, prepare }
    }
}

static EXCLUSIVE: LazyLock<Prepared> = LazyLock::new(|| Prepared::new(Lock::Exclusive));
static SHARED: LazyLock<Prepared> = LazyLock::new(|| Prepared::new(Lock::Shared));

fn prepared(lock: Lock) -> &'static Prepared {
    match lock {
        Lock::Exclusive => &EXCLUSIVE,
        Lock::Shared => &SHARED,
    }
}

/// 64-bit FNV-1a: a stable hash of the statement's text for its name.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The simple query that begins the transaction and tries `lock` on `key`.
///
/// The key's values are written into the text: numbers as quoted
/// literals, the name as its UTF-8 bytes in hex, decoded by the server.
/// Nothing the caller chose is ever read as SQL, whatever the session's
/// `standard_conforming_strings`.
pub(crate) fn begin_and_try(lock: Lock, key: Bound<'_>) -> String {
    let [space, value, name] = crate::postgres::request::literal::key_literals(key);
    format!(
        "BEGIN; EXECUTE {}({space}, {value}, {name})",
        prepared(lock).name
    )
}

/// The query that ends the failed transaction of a session that lacked
/// the statement, and prepares it there.
pub(crate) fn rollback_and_prepare(lock: Lock) -> String {
    format!("ROLLBACK; {}", prepared(lock).prepare)
}

/// Reads a failure of [`begin_and_try`]: why the lock was not taken, or
/// `None` where the session lacks the prepared statement.
pub(crate) fn answer(err: sqlx::Error) -> Option<NotTaken> {
    let Some(db) = err
        .as_database_error()
        .and_then(|db| db.try_downcast_ref::<PgDatabaseError>())
    else {
        return Some(NotTaken::Failed(err));
    };
    match db.code() {
        INVALID_STATEMENT_NAME => None,
        INVALID_TEXT_REPRESENTATION => Some(raised(db.message()).unwrap_or(NotTaken::Failed(err))),
        _ => Some(NotTaken::Failed(err)),
    }
}

/// The answer a cast error of the try carries: its value is quoted
/// verbatim in the message, whatever language the server speaks.
fn raised(message: &str) -> Option<NotTaken> {
    let pid = |prefix: &str| {
        let at = message.find(prefix)? + prefix.len();
        let digits = message[at..].split(|c: char| !c.is_ascii_digit()).next()?;
        digits.parse::<i32>().ok()
    };
    if let Some(pid) = pid(prepared_try_marker!()) {
        return Some(NotTaken::MarkerSeen(pid));
    }
    pid(prepared_try_busy!()).map(|_| NotTaken::Busy)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LockKey;

    #[test]
    fn a_name_is_written_as_hex_and_numbers_as_quoted_literals() {
        let key = LockKey::from("it's; DROP TABLE x; --");
        let sql = begin_and_try(Lock::Exclusive, key.args().expect("a valid key").into());
        assert!(!sql.contains("DROP"), "{sql}");
        assert!(
            sql.contains(&hex::encode("it's; DROP TABLE x; --")),
            "{sql}"
        );
        assert!(
            sql.starts_with("BEGIN; EXECUTE distlock_xact_try_"),
            "{sql}"
        );
        let tail = format!(
            "('1', NULL, pg_catalog.convert_from(pg_catalog.decode('{}', 'hex'), 'UTF8'))",
            hex::encode("it's; DROP TABLE x; --")
        );
        assert!(sql.ends_with(&tail), "{sql}");
        let id = LockKey::id(i64::MIN);
        let sql = begin_and_try(Lock::Shared, id.args().expect("a valid key").into());
        assert!(
            sql.ends_with("('1', '-9223372036854775808', NULL)"),
            "{sql}"
        );
    }

    #[test]
    fn the_two_modes_are_two_statements_named_by_their_text() {
        assert_ne!(prepared(Lock::Exclusive).name, prepared(Lock::Shared).name);
        assert!(
            prepared(Lock::Shared)
                .prepare
                .contains("pg_try_advisory_xact_lock_shared(")
        );
        assert!(rollback_and_prepare(Lock::Exclusive).starts_with("ROLLBACK; PREPARE distlock_"));
    }

    #[test]
    fn the_raised_values_are_read_back_in_any_language() {
        let busy = format!(
            "invalid input syntax for type integer: \"{}4242\"",
            prepared_try_busy!()
        );
        assert!(matches!(raised(&busy), Some(NotTaken::Busy)));
        let marker = format!(
            "ungültige Eingabesyntax für Typ integer: »{}4242«",
            prepared_try_marker!()
        );
        assert!(matches!(raised(&marker), Some(NotTaken::MarkerSeen(4242))));
        assert!(raised("invalid input syntax for type integer: \"x\"").is_none());
    }
}
