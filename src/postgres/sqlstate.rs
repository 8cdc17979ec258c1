//! SQLSTATE codes distlock reacts to, and mapping driver errors to the
//! crate's [`Error`] variants.

use sqlx::postgres::PgDatabaseError;

use crate::{Error, LockKey};

/// SQLSTATE of "out of shared memory", raised when the lock table is full.
pub(crate) const OUT_OF_SHARED_MEMORY: &str = "53200";
/// SQLSTATE of "lock_not_available", raised when `lock_timeout` expires.
pub(crate) const LOCK_NOT_AVAILABLE: &str = "55P03";

/// SQLSTATE 53300: too_many_connections, a new connection refused by
/// `max_connections` or a role's or database's `CONNECTION LIMIT`.
pub(crate) const TOO_MANY_CONNECTIONS: &str = "53300";

/// SQLSTATE 25P02: "current transaction is aborted, commands ignored until
/// end of transaction block".
pub(crate) const IN_FAILED_TRANSACTION: &str = "25P02";
/// SQLSTATE 42704: an object (here: a setting) that does not exist.
pub(crate) const UNDEFINED_OBJECT: &str = "42704";

/// SQLSTATE 26000: a prepared statement vanished between two statements,
/// which is what a transaction pooler without prepared-statement support
/// produces.
pub(crate) const INVALID_STATEMENT_NAME: &str = "26000";

/// SQLSTATE 42P05: a prepared statement of that name already exists. sqlx
/// numbers the statements it prepares per connection and never reuses a
/// name, so on a real session this cannot happen: another client prepared
/// it on the same server session.
pub(crate) const DUPLICATE_PREPARED_STATEMENT: &str = "42P05";

/// SQLSTATE 3F000: invalid_schema_name, `schema "distlock" does not exist`.
const INVALID_SCHEMA_NAME: &str = "3F000";
/// SQLSTATE 42P01: undefined_table.
const UNDEFINED_TABLE: &str = "42P01";
/// SQLSTATE 42883: undefined_function (a schema from an older migration).
const UNDEFINED_FUNCTION: &str = "42883";
/// SQLSTATE 42501: insufficient_privilege, a missing grant.
const INSUFFICIENT_PRIVILEGE: &str = "42501";

/// Returns the SQLSTATE of a database error, if it is one.
pub(crate) fn sqlstate(err: &sqlx::Error) -> Option<String> {
    err.as_database_error()
        .and_then(|db| db.code())
        .map(|code| code.into_owned())
}

/// Whether `err` is the server's `lock_timeout` expiring
/// ([`LOCK_NOT_AVAILABLE`]): a wait for a lock that ran out of time.
pub(crate) fn lock_not_available(err: &sqlx::Error) -> bool {
    sqlstate(err).as_deref() == Some(LOCK_NOT_AVAILABLE)
}

/// SQLSTATE 55000, raised among others by WAL functions during recovery.
pub(crate) const OBJECT_NOT_IN_PREREQUISITE_STATE: &str = "55000";

/// Maps any driver error (what `From<sqlx::Error>` does): a missing
/// `distlock` schema, table or function becomes [`Error::NotMigrated`], so
/// that forgetting `migrate` is named wherever a statement hits it, and a
/// missing grant [`Error::PermissionDenied`].
pub(crate) fn driver_error(err: sqlx::Error) -> Error {
    if let Some(message) = not_migrated(&err) {
        return Error::NotMigrated { message };
    }
    match err.as_database_error() {
        Some(db) if db.code().as_deref() == Some(INSUFFICIENT_PRIVILEGE) => {
            Error::PermissionDenied {
                message: db.message().to_owned(),
            }
        }
        _ => Error::Database(err),
    }
}

/// The server's message, when `err` says that an object of the `distlock`
/// schema (or the schema itself) does not exist.
fn not_migrated(err: &sqlx::Error) -> Option<String> {
    let db = err.as_database_error()?;
    let code = db.code()?;
    // Only the crate's own objects, which its statements always name with
    // their schema: a user's missing table stays a driver error, even one
    // called `distlock`.
    let ours = match code.as_ref() {
        INVALID_SCHEMA_NAME => names_our_schema(db.message()),
        UNDEFINED_TABLE | UNDEFINED_FUNCTION => names_our_object(db.message()),
        _ => false,
    };
    ours.then(|| db.message().to_owned())
}

/// Whether a server message names the schema `distlock`: quoted (3F000:
/// `"distlock"`, or `»distlock«`, `« distlock »` and the like where
/// `lc_messages` is not English) or as the prefix of an object's name
/// (`distlock.leases`).
fn names_our_schema(message: &str) -> bool {
    mentions(message, |head, tail| {
        // A quote may stand apart from the name (French puts spaces inside
        // « »); an unquoted word around it is not a quote.
        let before = head.trim_end().chars().next_back();
        let after = tail.trim_start().chars().next();
        qualified(head, tail) || (quote(before) && quote(after))
    })
}

/// Whether a server message names an object of the schema `distlock`
/// (42P01, 42883: `"distlock.leases"`, `distlock.fence_check(...)`), not an
/// object that is itself called `distlock`.
fn names_our_object(message: &str) -> bool {
    mentions(message, qualified)
}

/// Whether `distlock` occurs in `message` as a word for which `fits`
/// holds of the text before and after it.
fn mentions(message: &str, fits: impl Fn(&str, &str) -> bool) -> bool {
    message
        .match_indices("distlock")
        .any(|(at, name)| fits(&message[..at], &message[at + name.len()..]))
}

/// `distlock` (between `head` and `tail`) as a schema's name in a
/// qualified name: followed by a dot, not the end of another word.
fn qualified(head: &str, tail: &str) -> bool {
    tail.starts_with('.') && !head.chars().next_back().is_some_and(identifier)
}

/// A character of an unquoted name.
fn identifier(c: char) -> bool {
    c.is_alphanumeric() || matches!(c, '_' | '$')
}

/// A quotation mark of any language: not part of a name, not space.
fn quote(c: Option<char>) -> bool {
    c.is_some_and(|c| !identifier(c) && !c.is_whitespace() && !matches!(c, '(' | '.'))
}

/// Maps a driver error raised while locking `key` to the crate's variants.
pub(crate) fn locking_error(err: sqlx::Error, key: &LockKey) -> Error {
    match sqlstate(&err).as_deref() {
        Some(OUT_OF_SHARED_MEMORY) => Error::LockTableFull { key: key.clone() },
        // The lock statements' standby check (`standby_check` in `sql`).
        Some(OBJECT_NOT_IN_PREREQUISITE_STATE) if in_recovery(&err) => {
            Error::HotStandby { key: key.clone() }
        }
        _ => Error::from(err),
    }
}

/// Whether `err` is the standby check's "recovery is in progress": raised
/// by `pg_current_wal_lsn` (the error's routine field, which names the
/// server function and, unlike the message, is not translated where
/// `lc_messages` is not English). Another 55000 in a lock statement
/// (`currval` before any `nextval`, say) names another routine.
fn in_recovery(err: &sqlx::Error) -> bool {
    err.as_database_error()
        .and_then(|db| db.try_downcast_ref::<PgDatabaseError>())
        .is_some_and(|db| db.routine() == Some("pg_current_wal_lsn"))
}

/// Maps a failure to open a connection: a refusal for too many connections
/// becomes [`Error::TooManyConnections`].
pub(crate) fn connect_error(err: sqlx::Error) -> Error {
    match err.as_database_error() {
        Some(db) if db.code().as_deref() == Some(TOO_MANY_CONNECTIONS) => {
            Error::TooManyConnections {
                message: db.message().to_owned(),
            }
        }
        _ => Error::from(err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schema_is_recognised_in_any_language_and_only_as_a_name() {
        for ours in [
            "schema \"distlock\" does not exist",
            "Schema »distlock« existiert nicht",
            "le schéma « distlock » n'existe pas",
            "relation \"distlock.leases\" does not exist",
            "Relation »distlock.leases« existiert nicht",
            "function distlock.next_token_and_cache() does not exist",
        ] {
            assert!(names_our_schema(ours), "{ours}");
        }
        for theirs in [
            "relation \"mydistlock\" does not exist",
            "relation \"distlock_jobs\" does not exist",
            "relation \"app.distlock\" does not exist",
            "function distlock(integer) does not exist",
            "relation \"leases\" does not exist",
        ] {
            assert!(!names_our_schema(theirs), "{theirs}");
        }
        // An object called `distlock` is not one of the schema's.
        for theirs in [
            "relation \"distlock\" does not exist",
            "Relation »distlock« existiert nicht",
        ] {
            assert!(!names_our_object(theirs), "{theirs}");
        }
        assert!(names_our_object(
            "relation \"distlock.leases\" does not exist"
        ));
    }

    #[test]
    fn errors_without_sqlstate_53200_stay_database_errors() {
        let plain = locking_error(sqlx::Error::RowNotFound, &LockKey::from("k"));
        assert!(matches!(plain, Error::Database(sqlx::Error::RowNotFound)));
        let plain = connect_error(sqlx::Error::PoolTimedOut);
        assert!(matches!(plain, Error::Database(sqlx::Error::PoolTimedOut)));
    }
}
