//! The fragments every lock statement shares (the session marker, the
//! standby check, keepalives, the client check, the fencing token's draw),
//! which the statement builder in `request/` composes, and the three-shape
//! [`keyed`] form that the guard's unlock and the holders lookup still use.
//!
//! Keys are always bound as parameters, never formatted into SQL.
//!
//! Every function, type and operator is named by its `pg_catalog` name
//! (`OPERATOR(pg_catalog.=)`, not `=`; no `IN`, `BETWEEN`, `NULLIF` or
//! simple `CASE`, which look `=` up by name): a session whose `search_path`
//! puts another schema first must not swap in look-alikes that take another
//! lock or skip a check (`tests/integration/search_path.rs`).

use sqlx::postgres::{PgArguments, Postgres};
use sqlx::query::Query;

use crate::postgres::request::key_args::KeyArgs;

/// Builds a `match` over the key shape yielding a `&'static str` for each.
/// `$a` and `$b` are the placeholders the key's one or two values bind to.
macro_rules! keyed {
    ($args:expr; $pre:expr, $post:expr; $a:literal, $b:literal) => {
        match $args {
            $crate::postgres::request::key_args::KeyArgs::Text(_) => {
                concat!($pre, "pg_catalog.hashtext(", $a, ")", $post)
            }
            $crate::postgres::request::key_args::KeyArgs::BigInt(_) => {
                concat!($pre, $a, "::pg_catalog.int8", $post)
            }
            $crate::postgres::request::key_args::KeyArgs::Pair(..) => {
                concat!(
                    $pre,
                    $a,
                    "::pg_catalog.int4, pg_catalog.hashtext(",
                    $b,
                    ")",
                    $post
                )
            }
        }
    };
}
pub(crate) use keyed;

/// One of the settings in which `distlock.next_token_and_cache()` keeps
/// the epoch this backend last issued a token in (migration
/// `token_draw_in_statement`), as a number. Read only once the counter's
/// oid matched (`token_draw`), so only where the function wrote it.
macro_rules! token_cached {
    ($name:literal) => {
        concat!(
            "pg_catalog.current_setting('distlock.token_",
            $name,
            "', true)::pg_catalog.int8"
        )
    };
}

/// A fencing token drawn by the statement itself. Where this backend
/// remembers an epoch of this counter, a draw that falls inside it
/// (`0 < draw - base < 2^32`) is issued in it: the token
/// `distlock.next_token()` would issue for that draw. Otherwise
/// `distlock.next_token_and_cache()` issues it (and remembers the epoch):
/// a backend's first token, a counter run out. No function call and no
/// table read on the common path; why a remembered epoch stays valid for
/// the backend's life is in the migration. Left to right, and `AND` stops
/// at the first `false`: a backend that remembers nothing draws nothing
/// here (its tokens stay gapless), and `currval` is the draw just made. A
/// sequence draw, no durable write.
///
/// Guarded by `fencing::a_backend_draws_tokens_without_the_token_function`
/// (the common path is taken) and
/// `fencing::a_stale_or_foreign_remembered_epoch_is_not_used` (each
/// condition, seen failing with it removed).
macro_rules! token_draw {
    () => {
        concat!(
            // Compared as text: never NULL (`coalesce`, not `NULLIF`: see
            // the module's opening), and no number parsed before it matched
            // (PostgreSQL 16 and later read an oid with a leading 0 as octal).
            "CASE WHEN coalesce(pg_catalog.current_setting('distlock.token_seq', true), '') \
             OPERATOR(pg_catalog.=) 'distlock.token_counter'::pg_catalog.regclass::pg_catalog.oid::pg_catalog.text \
             AND pg_catalog.nextval('distlock.token_counter'::pg_catalog.regclass) OPERATOR(pg_catalog.-) ",
            $crate::postgres::request::fragments::token_cached!("base"),
            " OPERATOR(pg_catalog.>) 0 AND pg_catalog.currval('distlock.token_counter'::pg_catalog.regclass) OPERATOR(pg_catalog.-) ",
            $crate::postgres::request::fragments::token_cached!("base"),
            " OPERATOR(pg_catalog.<) 4294967296 THEN ",
            $crate::postgres::request::fragments::token_cached!("high"),
            " OPERATOR(pg_catalog.+) (pg_catalog.currval('distlock.token_counter'::pg_catalog.regclass) OPERATOR(pg_catalog.-) ",
            $crate::postgres::request::fragments::token_cached!("base"),
            ") ELSE distlock.next_token_and_cache() END"
        )
    };
}
pub(crate) use {token_cached, token_draw};

/// `set_config` calls (a select-list fragment) that ask the server to probe
/// the client with TCP keepalives: idle 10 s, then 3 probes 5 s apart, and
/// give up on 30 s of unacknowledged data. A holder cut off by a partition
/// then has its session, and its locks, ended by the server within about
/// 25 s instead of the operating system's default of about two hours. Part
/// of every lock statement, so the bound holds from the grant on. Set for
/// the session (a transaction-scoped lock's too: a transaction that commits
/// keeps them), so that the connection's next lock statement only reads
/// them; harmless for the connection's later users.
macro_rules! keepalives {
    // Set only where they are not set yet (a connection keeps them): the
    // set_config calls cost more than reading the settings. All four are
    // read: a connection whose application set one of them itself (say
    // `-c tcp_user_timeout=30000` in its connect options) would otherwise
    // keep the operating system's keepalive idle time of two hours.
    () => {
        "CASE WHEN pg_catalog.current_setting('tcp_user_timeout') OPERATOR(pg_catalog.<>) '30000' \
         OR pg_catalog.current_setting('tcp_keepalives_idle') OPERATOR(pg_catalog.<>) '10' \
         OR pg_catalog.current_setting('tcp_keepalives_interval') OPERATOR(pg_catalog.<>) '5' \
         OR pg_catalog.current_setting('tcp_keepalives_count') OPERATOR(pg_catalog.<>) '3' THEN \
         pg_catalog.set_config('tcp_keepalives_idle', '10', false) OPERATOR(pg_catalog.||) \
         pg_catalog.set_config('tcp_keepalives_interval', '5', false) OPERATOR(pg_catalog.||) \
         pg_catalog.set_config('tcp_keepalives_count', '3', false) OPERATOR(pg_catalog.||) \
         pg_catalog.set_config('tcp_user_timeout', '30000', false) END"
    };
}
pub(crate) use keepalives;

/// The session marker: how many distlock session locks the server session
/// holds, in the session setting `distlock.locks` ('' or '0' when none).
///
/// Advisory locks are re-entrant, so on a server session that a
/// transaction-pooling proxy shares between clients (PgBouncer with one
/// server connection, which renames prepared statements and so shows none
/// of the other signals), a second client's lock attempt would be granted
/// to the backend that already holds the key: two holders. Every lock
/// statement therefore attempts the lock only if the marker is what this
/// connection expects, and counts the lock in the marker when it is taken;
/// every unlock counts it out. A marker someone else set means the session
/// is shared, and the attempt takes nothing (the statement's "taken" column
/// is NULL). Costs nothing extra: it rides in the lock statement.
///
/// `unmarked` opens a `CASE WHEN <no lock held> THEN ...`, which the
/// statement closes after the lock call; `mark` counts the taken lock in
/// (column `l.ok` of the statement's CTE `l`). `held` opens the same `CASE`
/// for a statement on the session of a lock this connection holds, which
/// changes what that one lock holds (an upgrade) but not the count.
macro_rules! session_marker {
    (unmarked) => {
        concat!(
            "CASE WHEN ",
            $crate::postgres::request::fragments::standby_check!(),
            " THEN NULL WHEN coalesce(pg_catalog.current_setting('distlock.locks', true), '') \
             OPERATOR(pg_catalog.=) ANY ('{\"\",0}'::pg_catalog.text[])"
        )
    };
    (mark) => {
        "CASE WHEN l.ok THEN pg_catalog.set_config('distlock.locks', '1', false) END"
    };
    (free) => {
        concat!(
            "(CASE WHEN ",
            $crate::postgres::request::fragments::standby_check!(),
            " THEN false ELSE coalesce(pg_catalog.current_setting('distlock.locks', true), '') \
             OPERATOR(pg_catalog.=) ANY ('{\"\",0}'::pg_catalog.text[]) END)"
        )
    };
    // The session of a lock this connection already holds (an upgrade, a
    // downgrade): the marker counts that one lock, and the backend is the
    // one that took it (`$pid`), so a statement that a pooler moved to
    // another session takes (or gives back) nothing there.
    (held, $pid:literal) => {
        concat!(
            "CASE WHEN ",
            $crate::postgres::request::fragments::standby_check!(),
            " THEN NULL WHEN coalesce(pg_catalog.current_setting('distlock.locks', true), '') OPERATOR(pg_catalog.=) '1' \
             AND pg_catalog.pg_backend_pid() OPERATOR(pg_catalog.=) ",
            $pid
        )
    };
    (held_free, $pid:literal) => {
        concat!(
            "(CASE WHEN ",
            $crate::postgres::request::fragments::standby_check!(),
            " THEN false ELSE coalesce(pg_catalog.current_setting('distlock.locks', true), '') OPERATOR(pg_catalog.=) '1' \
             AND pg_catalog.pg_backend_pid() OPERATOR(pg_catalog.=) ",
            $pid,
            " END)"
        )
    };
    (unmark) => {
        "pg_catalog.set_config('distlock.locks', '0', false)"
    };
    // The session of the lock this connection holds, as a bare condition
    // (no standby check: nothing is taken): the marker counts that one lock
    // and the backend is the one that took it (`$pid`). An unlock runs only
    // there: on a session a pooler moved the connection to, it would give
    // back another client's locks and reset that client's marker.
    (ours, $pid:literal) => {
        concat!(
            "coalesce(pg_catalog.current_setting('distlock.locks', true), '') OPERATOR(pg_catalog.=) '1' \
             AND pg_catalog.pg_backend_pid() OPERATOR(pg_catalog.=) ",
            $pid
        )
    };
    (read) => {
        "pg_catalog.current_setting('distlock.locks', true)"
    };
    // No lock counted on the session (a bare condition, no standby check):
    // a transaction-scoped lock's, which takes nothing for the session but
    // would be granted re-entrantly on a session that holds the key.
    (none) => {
        "coalesce(pg_catalog.current_setting('distlock.locks', true), '') \
         OPERATOR(pg_catalog.=) ANY ('{\"\",0}'::pg_catalog.text[])"
    };
}
pub(crate) use session_marker;

/// The channel on which a semaphore permit's unlock announces the freed
/// slot (payload: the slot's name), and to which a process's waiting
/// connection for that semaphore listens.
macro_rules! permit_channel {
    () => {
        "distlock_semaphore"
    };
}
pub(crate) use permit_channel;

/// A condition that fails the statement on a hot standby, before any lock
/// call that follows it in a `CASE`: a standby grants advisory locks of its
/// own, apart from its primary's, so a locker pointed at one (a read-only
/// URL, a name that still points at a demoted node) would take a second
/// copy of a lock the primary holds. `pg_current_wal_lsn()` answers on a
/// primary (never NULL: the condition is false) and raises SQLSTATE 55000
/// ("recovery is in progress") during recovery, which
/// [`locking_error`](crate::postgres::sqlstate::locking_error) reports as
/// [`Error::HotStandby`](crate::Error::HotStandby). It writes nothing and
/// costs a read of shared memory.
macro_rules! standby_check {
    () => {
        "pg_catalog.pg_current_wal_lsn() IS NULL"
    };
}
pub(crate) use standby_check;

/// How long after the last answered heartbeat the server ends a cut-off
/// holder's session at the earliest ([`keepalives`]: 10 s idle + 3 × 5 s).
pub(crate) const SERVER_CUTOFF: std::time::Duration = std::time::Duration::from_secs(25);

/// Binds the key's values, in order, to `query`.
pub(crate) fn bind_key<'q>(
    query: Query<'q, Postgres, PgArguments>,
    args: KeyArgs<'q>,
) -> Query<'q, Postgres, PgArguments> {
    match args {
        KeyArgs::Text(name) => query.bind(name),
        KeyArgs::BigInt(id) => query.bind(id),
        KeyArgs::Pair(ns, name) => query.bind(ns).bind(name),
    }
}

/// `lock_timeout` and friends take milliseconds as text; `0` means "forever",
/// so a wait always gets at least one millisecond and at most `i32::MAX`.
pub(crate) fn millis_setting(d: std::time::Duration) -> String {
    let ms = d.as_millis().clamp(1, i32::MAX as u128);
    format!("{ms}ms")
}

/// A query with bound arguments, as every statement here is built.
pub(crate) type PgQuery<'q> = Query<'q, Postgres, PgArguments>;

/// `set_config` (a select-list fragment) asking the server to check every
/// 100 ms, while a statement runs, that its client is still there
/// (`client_connection_check_interval`, PostgreSQL 14+): a lock wait or a
/// closure's statement whose caller went away (a dropped future closes the
/// connection) is then aborted within 100 ms and its locks freed, instead
/// of running to its end. The server reads the setting when a statement
/// starts, so it is set before a wait, by the statement before it. Kept for
/// the session, as [`keepalives`] are (harmless for its later users).
macro_rules! client_check {
    () => {
        "CASE WHEN pg_catalog.current_setting('client_connection_check_interval') OPERATOR(pg_catalog.<>) '100ms' THEN \
         pg_catalog.set_config('client_connection_check_interval', '100ms', false) END"
    };
}
pub(crate) use client_check;

/// The limit a session puts on a lock wait (column 4 of the statements of
/// a wait, column 1 of the semaphore head's `LISTEN`): its
/// `statement_timeout`, or where that is `0` its `transaction_timeout`
/// (PostgreSQL 17 and later; a wait outside a transaction block is a
/// transaction of its own, which the server ends with the session at that
/// limit). `'0'` when neither would cut a wait short;
/// [`unlimited`](super::unlimited) lifts both.
macro_rules! wait_limit {
    () => {
        "CASE WHEN pg_catalog.current_setting('statement_timeout') OPERATOR(pg_catalog.=) '0' \
         THEN coalesce(pg_catalog.current_setting('transaction_timeout', true), '0') \
         ELSE pg_catalog.current_setting('statement_timeout') END"
    };
}
pub(crate) use wait_limit;

/// The transaction-scoped lock's marker: `set` (a select-list fragment)
/// names the marker setting `distlock.xact_lock` in itself, for the
/// transaction; `check` (a statement) asks for the setting the marker
/// names. Inside the lock's transaction that is the marker; once that
/// transaction has ended, the marker is empty, and asking for the setting
/// `""` raises SQLSTATE 42704 (`unrecognized configuration parameter ""`;
/// naming `distlock.xact_lock` where a `DISCARD ALL` removed the marker
/// itself). So the check fails, like every statement of an aborted
/// transaction, unless the lock's transaction is the open one and healthy,
/// and costs two setting reads: no `CASE`, nothing to plan beyond them.
macro_rules! xact_marker {
    (set) => {
        "pg_catalog.set_config('distlock.xact_lock', 'distlock.xact_lock', true)"
    };
    (check) => {
        "SELECT pg_catalog.current_setting(pg_catalog.current_setting('distlock.xact_lock'))"
    };
}
pub(crate) use xact_marker;

#[cfg(test)]
mod tests {
    #[test]
    fn keepalives_and_the_client_check_are_kept_for_the_session() {
        for fragment in [keepalives!(), client_check!()] {
            assert!(fragment.contains(", false)"), "{fragment}");
            assert!(!fragment.contains(", true)"), "{fragment}");
        }
        assert_eq!(keepalives!().matches("', false)").count(), 4);
        assert!(
            keepalives!().starts_with("CASE WHEN pg_catalog.current_setting('tcp_user_timeout')")
        );
    }
}
