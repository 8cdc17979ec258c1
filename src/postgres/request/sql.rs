//! The statement builder: every lock statement as a `&'static str`,
//! composed from the fragments below by a `match` over the few request
//! shapes, so each guarantee is written once.
//!
//! Parameters: `$1`–`$3` the key (see [`key`](super::key)), then the
//! shape's own (`lock_timeout`, the multiplexed session's lock counts, ...).

use super::{Lock, Step};
use crate::postgres::request::fragments::{
    client_check, keepalives, session_marker, standby_check, token_draw, wait_limit, xact_marker,
};

/// The CTE `k`: one key resolved to `(space, a, b)`, the arguments of the
/// server lock: `pg_advisory_lock(a)` in space 1, `pg_advisory_lock(a, b)`
/// in space 2. `b` is 0 in space 1 (so one lock has one triple).
macro_rules! resolved {
    () => {
        "k AS (SELECT $1::pg_catalog.int4 AS space, \
           coalesce($2::pg_catalog.int8, pg_catalog.hashtext($3::pg_catalog.text)::pg_catalog.int8) AS a, \
           (CASE WHEN $1::pg_catalog.int4 OPERATOR(pg_catalog.=) 2 THEN pg_catalog.hashtext($3::pg_catalog.text) ELSE 0 END) \
           ::pg_catalog.int8 AS b)"
    };
}

/// The advisory-lock function `$f` called on the key `$1`–`$3` resolved in
/// place, as [`resolved`] resolves it (`pg_advisory_lock(a)` in space 1,
/// `pg_advisory_lock(a, b)` in space 2), for a statement that needs no
/// CTE (the first statement of a wait holds it twice, one per branch of a
/// `CASE`, of which one runs): a CTE scan costs the server more than the
/// lock itself on a short try (BENCHMARKS, "The try statements"). Space 2
/// takes `$2` as it is: a two-part key always binds its namespace there
/// ([`key`](super::key)), where [`resolved`] would fall back to the name's
/// hash.
macro_rules! call_in_place {
    ($f:literal) => {
        call_in_place!($f, "")
    };
    // `$as_bool` turns the call into a condition: "" for a try (it answers
    // a `boolean`), [`granted`] for a wait (it answers `void`).
    ($f:literal, $as_bool:expr) => {
        concat!(
            "CASE WHEN $1::pg_catalog.int4 OPERATOR(pg_catalog.=) 1 THEN pg_catalog.",
            $f,
            "(coalesce($2::pg_catalog.int8, pg_catalog.hashtext($3::pg_catalog.text)::pg_catalog.int8))",
            $as_bool,
            " ELSE pg_catalog.",
            $f,
            "(($2::pg_catalog.int8)::pg_catalog.int4, pg_catalog.hashtext($3::pg_catalog.text))",
            $as_bool,
            " END"
        )
    };
}

/// A waiting lock function's `void` answer as `true`: it answers only once
/// the lock is granted (a `lock_timeout` fails the statement), and its
/// `void` is not NULL (it would be only for a NULL argument, for which the
/// strict function takes nothing, and this reads `false`; a key resolves
/// to non-NULL arguments, see [`key`](super::key)).
macro_rules! granted {
    () => {
        " IS NOT NULL"
    };
}

/// The statement-local `lock_timeout` (`$4`), then `$body`: the order of a
/// `CASE` sets the timeout before anything in `$body` starts, a wait (the
/// server reads it then) or the token draw after a grant (which can wait
/// on the token epoch's row). Outside a transaction block the setting
/// lasts for this one statement.
macro_rules! under_lock_timeout {
    ($body:expr) => {
        concat!(
            "CASE WHEN pg_catalog.set_config('lock_timeout', $4, true) IS NULL THEN NULL ELSE ",
            $body,
            " END"
        )
    };
}

/// The CTEs `k` ([`resolved`]) and `e`: the key as `distlock.leaders`
/// keys an election, `(space int2, lock_id int8)`, `lock_id` the one
/// `bigint` of space 1 or the two `int4`s of space 2 as one `bigint` (as
/// `pg_locks` shows them in `classid`/`objid`), computed by `$lock_id`.
/// Followed by the statement that reads `e`.
macro_rules! election_key {
    ($lock_id:expr) => {
        concat!(
            "WITH ",
            resolved!(),
            ", e AS (SELECT k.space::pg_catalog.int2 AS space, ",
            $lock_id,
            " AS lock_id FROM k) "
        )
    };
}

/// `e.lock_id` of [`election_key`].
macro_rules! election_lock_id {
    () => {
        "CASE WHEN k.space OPERATOR(pg_catalog.=) 2 \
         THEN (k.a OPERATOR(pg_catalog.<<) 32) OPERATOR(pg_catalog.|) (k.b OPERATOR(pg_catalog.&) 4294967295) \
         ELSE k.a END"
    };
}

/// The CTEs of [`election_key`], for a statement that only reads the
/// record.
pub(crate) const ELECTION_KEY: &str = election_key!(election_lock_id!());

/// The CTEs of [`election_key`] for a statement that writes the record:
/// `e.lock_id` comes out under the statement-local `lock_timeout` (`$4`,
/// see [`under_lock_timeout`]), and the record's function takes it as an
/// argument, so each of its waits for the record's row (locked by another
/// transaction) lasts at most that. The server does not notice a closed
/// socket while a statement waits: a write given up on would otherwise
/// stay behind as a backend waiting on the row.
pub(crate) const ELECTION_KEY_WRITING: &str =
    election_key!(under_lock_timeout!(election_lock_id!()));

/// The CTEs `given` (each key resolved as [`resolved`] does, with `i` its
/// 1-based place in the caller's list), `k` (the distinct server locks) and
/// `o` (them in canonical order: space, then value), from three arrays.
macro_rules! resolved_all {
    () => {
        "given AS (SELECT x.space, \
           coalesce(x.v, pg_catalog.hashtext(x.n)::pg_catalog.int8) AS a, \
           (CASE WHEN x.space OPERATOR(pg_catalog.=) 2 THEN pg_catalog.hashtext(x.n) ELSE 0 END)::pg_catalog.int8 AS b, x.i \
           FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.int4[]), pg_catalog.unnest($2::pg_catalog.int8[]), \
             pg_catalog.unnest($3::pg_catalog.text[])) WITH ORDINALITY AS x(space, v, n, i)), \
         k AS (SELECT DISTINCT space, a, b FROM given), \
         o AS (SELECT space, a, b FROM k ORDER BY space, a, b OFFSET 0)"
    };
}

/// The advisory-lock function `$f` called on the resolved key `$k`.
macro_rules! call {
    ($k:literal, $f:literal) => {
        concat!(
            "CASE WHEN ",
            $k,
            ".space OPERATOR(pg_catalog.=) 1 THEN pg_catalog.",
            $f,
            "(",
            $k,
            ".a) \
             ELSE pg_catalog.",
            $f,
            "(",
            $k,
            ".a::pg_catalog.int4, ",
            $k,
            ".b::pg_catalog.int4) END"
        )
    };
}

/// A waiting lock function (it returns `void`) as `true` once granted.
macro_rules! wait_call {
    ($k:literal, $f:literal) => {
        concat!(
            "CASE WHEN ",
            $k,
            ".space OPERATOR(pg_catalog.=) 1 THEN (SELECT true FROM pg_catalog.",
            $f,
            "(",
            $k,
            ".a)) \
             ELSE (SELECT true FROM pg_catalog.",
            $f,
            "(",
            $k,
            ".a::pg_catalog.int4, ",
            $k,
            ".b::pg_catalog.int4)) END"
        )
    };
}

/// The fencing token column: issued by the statement that took the lock,
/// only if it took it ([`token_draw`](super::fragments::token_draw)).
macro_rules! token {
    (fenced) => {
        concat!("CASE WHEN l.ok THEN ", token_draw!(), " END")
    };
    (unfenced) => {
        "NULL::pg_catalog.int8"
    };
}

/// The session-marker test of a multiplexed connection: the lock is
/// attempted only if the session holds exactly the locks its driver counts
/// (`$4`, as text); `$5` is the count after a grant.
macro_rules! counted {
    () => {
        concat!(
            "CASE WHEN ",
            standby_check!(),
            " THEN NULL WHEN (CASE WHEN coalesce(pg_catalog.current_setting('distlock.locks', true), '') \
             OPERATOR(pg_catalog.=) '' THEN '0' ELSE pg_catalog.current_setting('distlock.locks', true) END) \
             OPERATOR(pg_catalog.=) $4"
        )
    };
}

/// The key's upgrade intent, with the lock function `$f` called on it: a
/// lock in the reserved namespace
/// [`UpgradeableLock::INTENT_NAMESPACE`](crate::UpgradeableLock::INTENT_NAMESPACE)
/// of the two-`int4` keyspace, which no user key reaches (the namespace is
/// refused in keys). Its second half is the resolved key's own value where
/// that fits an `int4` (every `LockKey::from` name, as `hashtext` gives it,
/// and small ids), else a 32-bit hash of the resolved key.
macro_rules! intent {
    ($f:literal) => {
        concat!("pg_catalog.", $f, "(-2147483647, ", intent_value!("k"), ")")
    };
}

/// The second half of the upgrade intent ([`intent`]) of the resolved key
/// `$k` (with `space`, `a` and `b` as [`resolved`] gives them), an `int4`.
macro_rules! intent_value {
    ($k:literal) => {
        concat!(
            "(CASE WHEN ",
            $k,
            ".space OPERATOR(pg_catalog.=) 1 AND ",
            $k,
            ".a OPERATOR(pg_catalog.>=) -2147483648 \
             AND ",
            $k,
            ".a OPERATOR(pg_catalog.<=) 2147483647 \
             THEN ",
            $k,
            ".a ELSE pg_catalog.hashtext(pg_catalog.concat_ws(':', ",
            $k,
            ".space, ",
            $k,
            ".a, ",
            $k,
            ".b)) END)\
             ::pg_catalog.int4"
        )
    };
}

/// An upgradeable read lock's try: the intent exclusively, then the key
/// shared; a busy key gives the intent back in the same expression. The
/// intent comes first, always: a session that held the key shared while it
/// waited for the intent would keep the intent's holder from upgrading, and
/// the two would deadlock.
macro_rules! upgradeable_try {
    () => {
        concat!(
            "CASE WHEN ",
            intent!("pg_try_advisory_lock"),
            " THEN CASE WHEN ",
            call!("k", "pg_try_advisory_lock_shared"),
            " THEN true ELSE NOT ",
            intent!("pg_advisory_unlock"),
            " END ELSE false END"
        )
    };
}

/// An upgradeable read lock's wait: the intent, then the key shared, both
/// within the statement's one `lock_timeout` (`$4`): the key's wait gets
/// what the intent's left of it, measured from the statement's start (set
/// between the two by the order of a `CASE`).
macro_rules! upgradeable_wait {
    () => {
        concat!(
            "CASE WHEN (SELECT true FROM ",
            intent!("pg_advisory_lock"),
            ") THEN CASE WHEN pg_catalog.set_config('lock_timeout', greatest(1, pg_catalog.ceil( \
             extract(epoch FROM pg_catalog.statement_timestamp() OPERATOR(pg_catalog.+) $4::pg_catalog.interval \
             OPERATOR(pg_catalog.-) pg_catalog.clock_timestamp()) OPERATOR(pg_catalog.*) 1000))::pg_catalog.int8::pg_catalog.text OPERATOR(pg_catalog.||) 'ms', true) \
             IS NULL THEN NULL ELSE ",
            wait_call!("k", "pg_advisory_lock_shared"),
            " END END"
        )
    };
}

/// Which session a lock statement runs on, as the session marker sees it
/// (see `session_marker`): `fresh`, one that holds no distlock lock (the
/// lock is attempted only there and counted in when taken); `held`, the
/// session of the lock this guard holds (an upgrade: attempted only if the
/// marker counts that one lock and the backend, `$5`, is the one that took
/// it; the count stays).
macro_rules! on_session {
    (fresh, test) => {
        session_marker!(unmarked)
    };
    (fresh, free) => {
        session_marker!(free)
    };
    (fresh, mark) => {
        session_marker!(mark)
    };
    (held, test) => {
        session_marker!(held, "$5")
    };
    (held, free) => {
        session_marker!(held_free, "$5")
    };
    (held, mark) => {
        session_marker!(read)
    };
}

/// A session lock statement. The CTE `l` runs once (it calls volatile
/// functions), left to right: `$lead`, the lock (`$ok`), `$tail`; then the
/// marker counts a taken lock in. Columns: 0 taken (NULL: refused, the
/// session is shared), 1 backend pid, 2 token, 3 marker, 4 the session's
/// limit on a wait ([`wait_limit`]), 5–7 the resolved key.
macro_rules! session_sql {
    ($lead:expr, $ok:expr, $tail:expr, $token:expr, $mark:expr) => {
        concat!(
            "WITH ",
            resolved!(),
            ", l AS (SELECT k.space, k.a, k.b, \
             pg_catalog.pg_backend_pid() AS pid, ",
            $lead,
            $ok,
            " AS ok",
            $tail,
            " FROM k) SELECT l.ok, l.pid, ",
            $token,
            ", ",
            $mark,
            ", ",
            wait_limit!(),
            ", l.space, l.a, l.b FROM l"
        )
    };
}

/// What a dedicated connection sets with its first statements: the client
/// check (read when the *next* statement starts) and keepalives.
macro_rules! session_settings {
    () => {
        concat!(", ", client_check!(), ", ", keepalives!())
    };
}

/// The statement-local `lock_timeout` (`$4`) a wait runs under; outside a
/// transaction block it lasts for this one statement.
macro_rules! lock_timeout {
    () => {
        "pg_catalog.set_config('lock_timeout', $4, true), "
    };
}

/// The try, in the CTE form (an upgradeable lock's or an upgrade's, whose
/// intent or held-session test reads the key from `k`): attempted only on a
/// session that holds no distlock lock (see `session_marker`).
macro_rules! session_try {
    ($on:ident, $try:expr, $wait:expr, $token:ident) => {
        session_sql!(
            "",
            concat!(on_session!($on, test), " THEN ", $try, " END"),
            session_settings!(),
            token!($token),
            on_session!($on, mark)
        )
    };
}

/// A session lock statement on a fresh session, in one flat select (no CTE): a
/// CTE scan costs the server more than the lock itself on a short try
/// (BENCHMARKS, "The try statements"), and a hand-off between waiters is bound
/// by the server's work per statement. `$call` is the lock, as a condition on
/// the key resolved in place; the marker is counted in by the expression that
/// took the lock, so "taken" is read once. Columns as [`session_sql`]'s, with
/// the marker and the resolved key NULL (no caller of a session lock reads
/// them), column 4 `$limit` (the session's limit on a wait, [`wait_limit`], in
/// the statements of a wait, NULL from a try, where it reads as "not limited"),
/// then `$settings`. `fenced`: the token is drawn only after this statement's
/// own grant (`distlock.granted`, local to the statement), `unfenced`: NULL.
///
/// Guarded by the suites, each seen failing on a broken variant: without
/// the marker test, `faults` `pooler::two_clients_behind_a_single_connection_*`
/// (two holders through one pooled backend; the `*_waited_*` one through
/// the statements of a wait); without the `lock_timeout` of a wait,
/// `session::lock_timeout_returns_timeout_near_deadline_naming_holder`;
/// with it set in the waiting branch alone,
/// `a_wait_sets_its_lock_timeout_before_any_lock_call` (below); with the pair's arguments
/// swapped in [`call_in_place`], `keys::namespaced_key_locks_the_int_pair_*`
/// and the `holders` tests (here and in [`xact_try_only`]); without the
/// transaction marker in [`xact_try_only`], the `xact` tests of the checked
/// commit (`a_closure_that_ends_the_transaction_itself_is_an_error`, ...);
/// with the token drawn unconditionally, `fencing::busy_try_issues_no_token`;
/// with the grant's flag set for the session rather than the statement,
/// `fencing::busy_try_on_a_connection_that_granted_before_issues_no_token`.
macro_rules! session_in_place {
    ($call:expr, $limit:expr, $settings:expr, unfenced) => {
        session_in_place!($call, $limit, $settings, "", token!(unfenced))
    };
    // The token column cannot read "taken" (that needs the CTE this form
    // saves), so the grant also sets a transaction-local flag, which the
    // token column, evaluated after it (left to right, as in `l`), reads.
    // Outside a transaction block the flag lasts for this one statement; a
    // stray session-wide value could at most draw a token for a refused
    // try, which `SessionRow::decode` never reads.
    ($call:expr, $limit:expr, $settings:expr, fenced) => {
        session_in_place!(
            $call,
            $limit,
            $settings,
            " AND pg_catalog.set_config('distlock.granted', '1', true) IS NOT NULL",
            concat!(
                "CASE WHEN pg_catalog.current_setting('distlock.granted', true) OPERATOR(pg_catalog.=) '1' THEN ",
                token_draw!(),
                " END"
            )
        )
    };
    ($call:expr, $limit:expr, $settings:expr, $granted:expr, $token:expr) => {
        concat!(
            "SELECT ",
            on_session!(fresh, test),
            " THEN CASE WHEN ",
            $call,
            " THEN pg_catalog.set_config('distlock.locks', '1', false) IS NOT NULL",
            $granted,
            " ELSE false END END, pg_catalog.pg_backend_pid(), ",
            $token,
            ", NULL::pg_catalog.text, ",
            $limit,
            ", NULL::pg_catalog.int4, NULL::pg_catalog.int8, NULL::pg_catalog.int8",
            $settings
        )
    };
}

/// Whether the first statement of a wait waits at once: on a connection that
/// already checks for a vanished client (so a dropped caller's wait ends within
/// 100 ms) and has no limit on a wait ([`wait_limit`], which would cut it
/// short). Elsewhere it only tries, and sets the check for the wait that
/// follows a busy key.
macro_rules! waits_at_once {
    () => {
        concat!(
            "pg_catalog.current_setting('client_connection_check_interval') OPERATOR(pg_catalog.=) '100ms' AND ",
            wait_limit!(),
            " OPERATOR(pg_catalog.=) '0'"
        )
    };
}

/// The flat forms of a fresh session's try, first statement of a wait, and
/// wait ([`session_in_place`]) with the try function `$try`, the waiting
/// one `$wait`: as [`session_try_or_wait`] and [`session_wait`] decide, in
/// one select.
macro_rules! session_flat {
    (Try, $try:literal, $wait:literal, $token:ident) => {
        session_in_place!(
            call_in_place!($try),
            "NULL::pg_catalog.text",
            session_settings!(),
            $token
        )
    };
    (TryOrWait, $try:literal, $wait:literal, $token:ident) => {
        session_in_place!(
            under_lock_timeout!(concat!(
                "CASE WHEN ",
                waits_at_once!(),
                " THEN ",
                call_in_place!($wait, granted!()),
                " ELSE ",
                call_in_place!($try),
                " END"
            )),
            wait_limit!(),
            session_settings!(),
            $token
        )
    };
    (Wait, $try:literal, $wait:literal, $token:ident) => {
        session_in_place!(
            under_lock_timeout!(call_in_place!($wait, granted!())),
            wait_limit!(),
            "",
            $token
        )
    };
}

/// The first statement of a wait, in the CTE form (an upgradeable lock's
/// or an upgrade's, as [`session_try`]): waits at once where
/// [`waits_at_once`], tries elsewhere; "taken" is `false` only after a try.
macro_rules! session_try_or_wait {
    ($on:ident, $try:expr, $wait:expr, $token:ident) => {
        session_sql!(
            lock_timeout!(),
            concat!(
                "CASE WHEN NOT ",
                on_session!($on, free),
                " THEN NULL WHEN ",
                waits_at_once!(),
                " THEN ",
                $wait,
                " ELSE ",
                $try,
                " END"
            ),
            session_settings!(),
            token!($token),
            on_session!($on, mark)
        )
    };
}

/// The wait, in the CTE form (an upgradeable lock's or an upgrade's). The
/// marker is checked again: another client sharing the session through a
/// pooler may have taken a lock since the try. With fencing, the token is
/// issued after the grant, under the same `lock_timeout`.
macro_rules! session_wait {
    ($on:ident, $try:expr, $wait:expr, $token:ident) => {
        session_sql!(
            lock_timeout!(),
            concat!(on_session!($on, test), " THEN ", $wait, " END"),
            "",
            token!($token),
            on_session!($on, mark)
        )
    };
}

/// The multiplexed connection's try: the counted marker, and the session's
/// settings are the driver's (set when it connects).
macro_rules! mux_try {
    ($token:ident) => {
        session_sql!(
            "",
            concat!(
                counted!(),
                " THEN ",
                call!("k", "pg_try_advisory_lock"),
                " END"
            ),
            "",
            token!($token),
            "CASE WHEN l.ok THEN pg_catalog.set_config('distlock.locks', $5, false) END"
        )
    };
}

/// [`session_flat`]'s `$step` of a shared lock (which carries no token:
/// readers do not write).
macro_rules! by_shared {
    ($step:ident) => {
        session_flat!(
            $step,
            "pg_try_advisory_lock_shared",
            "pg_advisory_lock_shared",
            unfenced
        )
    };
}

/// [`session_flat`]'s `$step` of an exclusive lock.
macro_rules! by_exclusive {
    ($step:ident, $token:ident) => {
        session_flat!($step, "pg_try_advisory_lock", "pg_advisory_lock", $token)
    };
}

/// A session lock statement on a dedicated connection; columns as
/// [`session_sql`]'s. Binds the key, then (waiting steps) `$4` the
/// `lock_timeout`. Each step is one flat select ([`session_flat`]).
pub(crate) fn session(step: Step, lock: Lock, fencing: bool) -> &'static str {
    match (step, lock, fencing) {
        (Step::Try, Lock::Shared, _) => by_shared!(Try),
        (Step::TryOrWait, Lock::Shared, _) => by_shared!(TryOrWait),
        (Step::Wait, Lock::Shared, _) => by_shared!(Wait),
        (Step::Try, Lock::Exclusive, true) => by_exclusive!(Try, fenced),
        (Step::TryOrWait, Lock::Exclusive, true) => by_exclusive!(TryOrWait, fenced),
        (Step::Wait, Lock::Exclusive, true) => by_exclusive!(Wait, fenced),
        (Step::Try, Lock::Exclusive, false) => by_exclusive!(Try, unfenced),
        (Step::TryOrWait, Lock::Exclusive, false) => by_exclusive!(TryOrWait, unfenced),
        (Step::Wait, Lock::Exclusive, false) => by_exclusive!(Wait, unfenced),
    }
}

/// An upgradeable read lock's statement of `step` on a dedicated
/// connection (the key's intent exclusively, then the key shared; see
/// [`upgradeable_try`]); columns as [`session_sql`]'s, no token. Binds the
/// key, then (waiting steps) `$4` the `lock_timeout` of the whole wait.
pub(crate) fn session_upgradeable(step: Step) -> &'static str {
    match step {
        Step::Try => session_try!(fresh, upgradeable_try!(), upgradeable_wait!(), unfenced),
        Step::TryOrWait => {
            session_try_or_wait!(fresh, upgradeable_try!(), upgradeable_wait!(), unfenced)
        }
        Step::Wait => session_wait!(fresh, upgradeable_try!(), upgradeable_wait!(), unfenced),
    }
}

/// Expands `$shape!` for an upgrade: the exclusive lock on the key, on the
/// session of the upgradeable read lock that holds it shared.
macro_rules! upgrade_shape {
    ($shape:ident, $fencing:expr) => {
        if $fencing {
            $shape!(
                held,
                call!("k", "pg_try_advisory_lock"),
                wait_call!("k", "pg_advisory_lock"),
                fenced
            )
        } else {
            $shape!(
                held,
                call!("k", "pg_try_advisory_lock"),
                wait_call!("k", "pg_advisory_lock"),
                unfenced
            )
        }
    };
}

/// The upgrade of an upgradeable read lock to exclusive, on its own
/// session: PostgreSQL lets a session that holds the key shared take it
/// exclusively ahead of the waiters that wait for that shared lock (a
/// queued writer), once every other reader has gone, and queues readers
/// that come later behind it. Columns as [`session_sql`]'s; the token is
/// fresh. Binds the key, `$4` the `lock_timeout` (unused by a try), `$5`
/// the backend pid that holds the read lock.
pub(crate) fn upgrade(step: Step, fencing: bool) -> &'static str {
    match step {
        Step::Try => upgrade_shape!(session_try, fencing),
        Step::TryOrWait => upgrade_shape!(session_try_or_wait, fencing),
        Step::Wait => upgrade_shape!(session_wait, fencing),
    }
}

/// The downgrade of an upgraded lock: its exclusive mode given back, its
/// shared mode and intent kept (a session counts its advisory locks per
/// mode). Attempted only on the session that took it (`$4`, its backend
/// pid). Columns: unlocked (NULL: not that session; false: it held no
/// exclusive lock on the key), pid.
pub(crate) const DOWNGRADE: &str = concat!(
    "WITH ",
    resolved!(),
    " SELECT ",
    session_marker!(held, "$4"),
    " THEN ",
    call!("k", "pg_advisory_unlock"),
    " END, pg_catalog.pg_backend_pid() FROM k"
);

/// After an upgrade's wait failed: PostgreSQL may have granted the
/// exclusive lock in the instant its `lock_timeout` fired (a lock outlives
/// the error of the statement that waited for it), so it is given back if
/// the session holds it, which leaves the read lock as it was. Attempted
/// only on the session that took it (`$4`). Columns: given back (NULL: not
/// that session), pid.
pub(crate) const UNDO_UPGRADE: &str = concat!(
    "WITH ",
    resolved!(),
    " SELECT ",
    session_marker!(held, "$4"),
    " THEN CASE WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_locks l \
       WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory' AND l.granted AND l.mode OPERATOR(pg_catalog.=) 'ExclusiveLock' \
       AND l.pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid() AND l.objsubid OPERATOR(pg_catalog.=) k.space \
       AND l.database OPERATOR(pg_catalog.=) (SELECT oid FROM pg_catalog.pg_database \
         WHERE datname OPERATOR(pg_catalog.=) pg_catalog.current_database()) \
       AND ((k.space OPERATOR(pg_catalog.=) 1 AND ((l.classid::pg_catalog.int8 OPERATOR(pg_catalog.<<) 32) OPERATOR(pg_catalog.|) l.objid::pg_catalog.int8) OPERATOR(pg_catalog.=) k.a) \
         OR (k.space OPERATOR(pg_catalog.=) 2 AND l.classid::pg_catalog.int8 OPERATOR(pg_catalog.=) (k.a OPERATOR(pg_catalog.&) 4294967295) \
           AND l.objid::pg_catalog.int8 OPERATOR(pg_catalog.=) (k.b OPERATOR(pg_catalog.&) 4294967295)))) THEN ",
    call!("k", "pg_advisory_unlock"),
    " ELSE false END END, pg_catalog.pg_backend_pid() FROM k"
);

/// The multiplexed connection's try (exclusive only); columns as
/// [`session_sql`]'s. Binds the key, `$4` the driver's count of held locks
/// and `$5` that count plus this one.
pub(crate) fn mux_try(fencing: bool) -> &'static str {
    if fencing {
        mux_try!(fenced)
    } else {
        mux_try!(unfenced)
    }
}

/// The multiplexed mode's wake-up wait on a temporary pooled connection:
/// waits (under `lock_timeout` `$4`) until no one holds the key at all, by
/// taking it *exclusively*, and gives it back in the same statement, so a
/// finished statement leaves nothing held. Exclusively, because the lock it
/// wakes up for is exclusive: a shared wait would be granted at once beside
/// readers and the caller would poll. It queues behind earlier waiters.
pub(crate) const MUX_WAIT_UNTIL_FREE: &str = concat!(
    "WITH ",
    resolved!(),
    " SELECT ",
    "pg_catalog.set_config('lock_timeout', $4, true), ",
    wait_call!("k", "pg_advisory_lock"),
    ", ",
    call!("k", "pg_advisory_unlock"),
    " FROM k"
);

/// What a multiplexed connection holds after a failed try, to tell whether
/// the try took anything: session advisory locks survive the error of the
/// statement that took them (a token draw failing after the grant, say).
/// Columns: the try's key `$1`–`$3` as [`resolved`] resolves it (`space`,
/// `a`, `b`), how many advisory locks the session holds (one row per lock in
/// `pg_locks`, whatever its re-entry count) and the backend pid. Reads the
/// lock table without taking a place in it, so it answers when the table
/// is full.
pub(crate) const MUX_HELD_AFTER: &str = concat!(
    "WITH ",
    resolved!(),
    " SELECT k.space, k.a, k.b, (SELECT pg_catalog.count(*) FROM pg_catalog.pg_locks l \
     WHERE l.pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid() \
     AND l.locktype OPERATOR(pg_catalog.=) 'advisory'), pg_catalog.pg_backend_pid() FROM k"
);

/// What a connection about to wait sets first (see
/// [`session_settings`]), returning its limit on a wait ([`wait_limit`]).
pub(crate) const WAIT_SETTINGS: &str = concat!("SELECT ", wait_limit!(), session_settings!());

/// Several keys at once, all or nothing: every key attempted in canonical order
/// on a session that holds no distlock lock; if any was busy, the ones taken
/// are given back in the same statement. Columns: 0 all taken (NULL: refused,
/// the session is shared), 1 pid, 2 distinct server locks, 3 keys given back, 4
/// marker, 5 the session's limit on a wait ([`wait_limit`]).
pub(crate) const TRY_ALL: &str = concat!(
    "WITH ",
    resolved_all!(),
    ", m AS MATERIALIZED (SELECT ",
    session_marker!(unmarked),
    " THEN true END AS free",
    session_settings!(),
    "), t AS (SELECT o.space, o.a, o.b, CASE WHEN m.free THEN ",
    call!("o", "pg_try_advisory_lock"),
    " END AS ok FROM o, m), \
     v AS (SELECT pg_catalog.bool_and(ok) AS all_ok FROM t), \
     undo AS (SELECT pg_catalog.count(",
    call!("t", "pg_advisory_unlock"),
    ") AS n FROM t, v WHERE t.ok AND NOT v.all_ok) \
     SELECT v.all_ok, pg_catalog.pg_backend_pid(), (SELECT pg_catalog.count(*) FROM k), \
       (SELECT n FROM undo), \
       CASE WHEN v.all_ok THEN pg_catalog.set_config('distlock.locks', '1', false) END, ",
    wait_limit!(),
    " FROM v"
);

/// The multi-key wait: every key taken in canonical order, on a session
/// that holds no distlock lock (checked before the first key, as in the
/// single-key wait). Each key waits under a `lock_timeout` of what is left
/// of the `$4` milliseconds, measured from the statement's start (set in
/// the first step of every row, before its lock, by the order of a `CASE`),
/// so the whole wait ends within `$4` however many keys are busy.
/// Columns: all taken (NULL: refused, the session is shared), pid.
pub(crate) const WAIT_ALL: &str = concat!(
    "WITH ",
    resolved_all!(),
    ", m AS MATERIALIZED (SELECT ",
    session_marker!(free),
    " AS free, pg_catalog.clock_timestamp() \
       OPERATOR(pg_catalog.+) pg_catalog.make_interval(secs => $4::pg_catalog.float8 OPERATOR(pg_catalog./) 1000) AS deadline), \
     t AS (SELECT CASE WHEN NOT m.free THEN NULL \
       WHEN pg_catalog.set_config('lock_timeout', greatest(1, pg_catalog.ceil( \
         extract(epoch FROM m.deadline OPERATOR(pg_catalog.-) pg_catalog.clock_timestamp()) OPERATOR(pg_catalog.*) 1000))::pg_catalog.int8 \
         ::pg_catalog.text OPERATOR(pg_catalog.||) 'ms', true) IS NULL THEN NULL \
       ELSE ",
    wait_call!("o", "pg_advisory_lock"),
    " END AS ok FROM o, m) \
     SELECT pg_catalog.bool_and(ok), pg_catalog.pg_backend_pid(), \
       CASE WHEN pg_catalog.bool_and(ok) THEN pg_catalog.set_config('distlock.locks', '1', false) END \
     FROM t"
);

/// The rows of [`KEYS_AS_LOCKED`]'s `w`, one per key of `given`.
macro_rules! given_as_locked {
    () => {
        "SELECT g.i, g.space AS s, \
       CASE WHEN g.space OPERATOR(pg_catalog.=) 1 THEN (g.a OPERATOR(pg_catalog.>>) 32) OPERATOR(pg_catalog.&) 4294967295 ELSE g.a OPERATOR(pg_catalog.&) 4294967295 END AS c, \
       CASE WHEN g.space OPERATOR(pg_catalog.=) 1 THEN g.a OPERATOR(pg_catalog.&) 4294967295 ELSE g.b OPERATOR(pg_catalog.&) 4294967295 END AS o \
       FROM given g"
    };
}

/// The keys `$1`, `$2`, `$3` (three arrays, as [`resolved_all`]) in the
/// shape `pg_locks` shows advisory locks, for statements that look keys up
/// there: CTEs for a `WITH` list (which may be `WITH RECURSIVE`), ending in
/// `w`, one row per key, with `i` its 1-based place in the caller's list,
/// `s` the key space as `objsubid` (1 or 2), `c` and `o` its `classid` and
/// `objid` widened to `int8`.
pub(crate) const KEYS_AS_LOCKED: &str =
    concat!(resolved_all!(), ", w AS (", given_as_locked!(), ")");

/// [`KEYS_AS_LOCKED`] for one key wanted upgradeable: `w` holds the key
/// (`i` 1) and its upgrade intent (`i` 2, in the two-`int4` space), so that
/// a lookup after a missed deadline sees who holds either.
pub(crate) const KEY_AND_INTENT_AS_LOCKED: &str = concat!(
    resolved_all!(),
    ", w AS (",
    given_as_locked!(),
    " UNION ALL SELECT g.i OPERATOR(pg_catalog.+) 1, 2, (-2147483647)::pg_catalog.int8 OPERATOR(pg_catalog.&) 4294967295, \
       ",
    intent_value!("g"),
    "::pg_catalog.int8 OPERATOR(pg_catalog.&) 4294967295 FROM given g)"
);

/// What every transaction-scoped try sets and checks beside its lock call
/// (select-list fragments): the client check and keepalives (kept by the
/// connection, as a session lock's are: its next lock only reads them), the
/// transaction's marker ([`xact_marker`](super::fragments::xact_marker),
/// read by the checked commit), the standby check.
macro_rules! xact_guards {
    () => {
        concat!(
            client_check!(),
            ", ",
            xact_marker!(set),
            ", ",
            keepalives!(),
            ", ",
            standby_check!()
        )
    };
}

/// The transaction-scoped try of `with_advisory_lock_wait*` (a wait follows
/// a busy key; `with_advisory_lock` uses [`xact_try_only`]), inside the
/// transaction it opened: the lock and [`xact_guards`]. A busy key on a session with a
/// `statement_timeout` lifts it for the transaction (`$4` is always bound
/// true); the wait statement puts it back. Columns: taken, the
/// `statement_timeout` before.
macro_rules! xact_try {
    ($try:literal) => {
        concat!(
            "WITH ",
            resolved!(),
            ", l AS (SELECT CASE WHEN ",
            session_marker!(none),
            " THEN ",
            call!("k", $try),
            " END AS ok, ",
            xact_guards!(),
            ", pg_catalog.current_setting('statement_timeout') AS st FROM k) \
             SELECT l.ok, l.st, CASE WHEN NOT l.ok AND $4::pg_catalog.bool AND l.st OPERATOR(pg_catalog.<>) '0' \
             THEN pg_catalog.set_config('statement_timeout', '0', true) END, pg_catalog.pg_backend_pid() FROM l"
        )
    };
}

/// A transaction-scoped wait inside an open transaction: remembers the
/// transaction's `lock_timeout`, waits under `$4`, and puts it back, with
/// the `statement_timeout` `$5` a try lifted (NULL: none was), in one
/// statement (`OFFSET 0` keeps the inner select, which runs first, from
/// being flattened).
macro_rules! xact_wait {
    ($wait:literal) => {
        concat!(
            "WITH ",
            resolved!(),
            " SELECT pg_catalog.set_config('lock_timeout', s.prev, true), \
             CASE WHEN $5::pg_catalog.text IS NOT NULL \
             THEN pg_catalog.set_config('statement_timeout', $5::pg_catalog.text, true) END \
             FROM (SELECT pg_catalog.current_setting('lock_timeout') AS prev, \
             pg_catalog.set_config('lock_timeout', $4, true), ",
            wait_call!("k", $wait),
            " FROM k OFFSET 0) s"
        )
    };
}

/// The transaction-scoped try when no wait follows (`with_advisory_lock`,
/// `with_shared_advisory_lock`): what [`xact_try`] does but the
/// `statement_timeout`, in one flat select with the key resolved in place.
/// Column 0: taken.
macro_rules! xact_try_only {
    ($try:literal) => {
        concat!(
            "SELECT CASE WHEN ",
            session_marker!(none),
            " THEN ",
            call_in_place!($try),
            " END, ",
            xact_guards!(),
            ", pg_catalog.pg_backend_pid()"
        )
    };
}

/// The transaction-scoped try of `with_advisory_lock` as a statement that
/// answers with its outcome alone, for [`prepared_try`](super::prepared_try):
/// it runs in the round trip of the `BEGIN` (one simple query, whose rows
/// the driver does not read), so it raises where [`xact_try_only`]
/// answers: a busy key and a session that carries another client's lock
/// marker each fail the statement with a cast error (22P02) whose value
/// says which, and the failed transaction is rolled back. The value
/// carries the backend's pid, which also keeps the planner from folding
/// the cast (and raising) when it plans the statement. The guards run
/// first (the target list is evaluated in order): unlike the `CASE` of
/// [`xact_try_only`], which comes before its guards and cannot fail the
/// statement, this one fails it for a busy key, so on a standby the
/// standby check must fail the statement first. A standby session has the
/// statement prepared only behind a pooler that keeps server sessions
/// across clients (a refused call closes its own connection); the faults
/// test `standby::a_try_with_begin_prepared_on_a_standby_session_refuses_it`
/// runs that case.
macro_rules! xact_try_raising {
    ($try:literal) => {
        concat!(
            "SELECT ",
            xact_guards!(),
            ", CASE WHEN NOT (",
            session_marker!(none),
            ") THEN ('",
            prepared_try_marker!(),
            "' OPERATOR(pg_catalog.||) pg_catalog.pg_backend_pid())::pg_catalog.int4 WHEN ",
            call_in_place!($try),
            " THEN 0 ELSE ('",
            prepared_try_busy!(),
            "' OPERATOR(pg_catalog.||) pg_catalog.pg_backend_pid())::pg_catalog.int4 END"
        )
    };
}

/// The start of the value a [`xact_try_raising`] statement fails to cast
/// when the session carries another client's lock marker; the backend's
/// pid follows.
macro_rules! prepared_try_marker {
    () => {
        "distlock: session shared with another client, backend "
    };
}
pub(crate) use prepared_try_marker;

/// The start of the value a [`xact_try_raising`] statement fails to cast
/// when the key is busy (what a server log shows for a busy try).
macro_rules! prepared_try_busy {
    () => {
        "distlock: lock busy, not an error of the application, backend "
    };
}
pub(crate) use prepared_try_busy;

/// The text of [`xact_try_raising`] for `lock`; its parameters are the
/// key's (`$1`–`$3`).
pub(crate) fn xact_try_raising(lock: Lock) -> &'static str {
    match lock {
        Lock::Exclusive => xact_try_raising!("pg_try_advisory_xact_lock"),
        Lock::Shared => xact_try_raising!("pg_try_advisory_xact_lock_shared"),
    }
}

/// The try of `with_advisory_lock*`; binds the key, and `$4` (true) if a
/// wait follows a busy key (`waits`), which only that form reads.
pub(crate) fn xact_try(lock: Lock, waits: bool) -> &'static str {
    match (lock, waits) {
        (Lock::Exclusive, false) => xact_try_only!("pg_try_advisory_xact_lock"),
        (Lock::Shared, false) => xact_try_only!("pg_try_advisory_xact_lock_shared"),
        (Lock::Exclusive, true) => xact_try!("pg_try_advisory_xact_lock"),
        (Lock::Shared, true) => xact_try!("pg_try_advisory_xact_lock_shared"),
    }
}

/// A wait inside an open transaction; binds the key, `$4` the
/// `lock_timeout`, `$5` the `statement_timeout` to put back (or NULL).
pub(crate) fn xact_wait(lock: Lock) -> &'static str {
    match lock {
        Lock::Exclusive => xact_wait!("pg_advisory_xact_lock"),
        Lock::Shared => xact_wait!("pg_advisory_xact_lock_shared"),
    }
}

/// Whether a transaction block is open, read by a statement sent alone as
/// a simple query (which sets both timestamps once, for the one message):
/// outside a block the statement's own transaction starts with it, inside
/// one the block began with an earlier message. Under the extended
/// protocol the two differ outside a block too (`Bind` starts the
/// transaction, `Execute` the statement), so only a simple query may read
/// it.
macro_rules! in_transaction_block {
    () => {
        "pg_catalog.transaction_timestamp() OPERATOR(pg_catalog.<) pg_catalog.statement_timestamp()"
    };
}

/// `try_lock_xact` in the caller's transaction, sent as a simple query
/// (so flat, with the key resolved in place: the server plans it on each
/// call): the lock, taken only inside a transaction block
/// (outside one it would end with the statement; the server's view, not
/// sqlx's count of the transactions it began, which a `COMMIT` sent as SQL
/// leaves behind), and the standby check (which fails the statement, and
/// the caller's transaction, on a standby); changes no setting. Columns:
/// taken (NULL: the session marker seen), the standby check, in a block,
/// the backend pid.
pub(crate) const CALLER_XACT_TRY: &str = concat!(
    "SELECT CASE WHEN NOT ",
    in_transaction_block!(),
    " THEN false WHEN ",
    session_marker!(none),
    " THEN ",
    call_in_place!("pg_try_advisory_xact_lock"),
    " END, ",
    standby_check!(),
    ", ",
    in_transaction_block!(),
    ", pg_catalog.pg_backend_pid()"
);

/// The first statement of `lock_xact` in the caller's transaction: waits at
/// once under `lock_timeout` `$4` when the session has no
/// `statement_timeout`, and only tries when it has one, lifting it for the
/// wait that follows a busy key (which puts it back: [`xact_wait`]). The
/// caller's `lock_timeout` is put back in the same statement. Sent as a
/// simple query, and takes nothing outside a transaction block, as
/// [`CALLER_XACT_TRY`]. Columns: taken, the `statement_timeout` before,
/// two settings, in a block, the backend pid.
pub(crate) const CALLER_XACT_FIRST: &str = concat!(
    "WITH ",
    resolved!(),
    ", l AS (SELECT pg_catalog.current_setting('lock_timeout') AS prev, \
       pg_catalog.current_setting('statement_timeout') AS st, \
       pg_catalog.set_config('lock_timeout', $4, true), ",
    standby_check!(),
    ", CASE WHEN NOT ",
    in_transaction_block!(),
    " THEN false WHEN NOT ",
    session_marker!(none),
    " THEN NULL WHEN pg_catalog.current_setting('statement_timeout') OPERATOR(pg_catalog.=) '0' THEN ",
    wait_call!("k", "pg_advisory_xact_lock"),
    " ELSE ",
    call!("k", "pg_try_advisory_xact_lock"),
    " END AS ok FROM k) \
     SELECT l.ok, l.st, pg_catalog.set_config('lock_timeout', l.prev, true), \
       CASE WHEN NOT l.ok THEN pg_catalog.set_config('statement_timeout', '0', true) END, ",
    in_transaction_block!(),
    ", pg_catalog.pg_backend_pid() FROM l"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_statement_calls_qualified_functions_and_binds_the_key_once() {
        let mut all = vec![
            mux_try(true),
            mux_try(false),
            MUX_WAIT_UNTIL_FREE,
            TRY_ALL,
            WAIT_ALL,
            KEYS_AS_LOCKED,
            CALLER_XACT_TRY,
            CALLER_XACT_FIRST,
        ];
        all.extend([DOWNGRADE, UNDO_UPGRADE]);
        for step in [Step::Try, Step::TryOrWait, Step::Wait] {
            for (lock, fencing) in [
                (Lock::Exclusive, true),
                (Lock::Exclusive, false),
                (Lock::Shared, false),
            ] {
                all.push(session(step, lock, fencing));
            }
            all.extend([
                session_upgradeable(step),
                upgrade(step, true),
                upgrade(step, false),
            ]);
        }
        for lock in [Lock::Exclusive, Lock::Shared] {
            all.push(xact_try(lock, false));
            all.push(xact_try(lock, true));
            all.push(xact_try_raising(lock));
            all.push(xact_wait(lock));
        }
        for sql in all {
            assert!(!sql.contains(" pg_advisory"), "{sql}");
            assert!(!sql.contains("(pg_advisory"), "{sql}");
            assert!(!sql.contains(" hashtext"), "{sql}");
            assert!(!sql.contains("(hashtext"), "{sql}");
            // The key is resolved once: in one CTE, or in place where it is
            // locked (twice in the first statement of a wait: one branch of
            // a `CASE` waits, the other tries), never both.
            let in_cte = sql.matches("pg_catalog.int4 AS space").count()
                + sql.matches("x(space, v, n, i)").count();
            let in_place = sql
                .matches("CASE WHEN $1::pg_catalog.int4 OPERATOR(pg_catalog.=) 1 THEN")
                .count();
            let waits_or_tries = sql.contains(waits_at_once!());
            match (in_cte, in_place) {
                (1, 0) | (0, 1) => {}
                (0, 2) if waits_or_tries => {}
                _ => panic!("{in_cte} CTEs and {in_place} in place: {sql}"),
            }
        }
    }

    /// The try sent with the `BEGIN` keeps every guarantee of the one it
    /// stands in for: the same guards and marker check, the same lock call.
    #[test]
    fn the_raising_try_composes_the_parts_of_the_answering_one() {
        for lock in [Lock::Exclusive, Lock::Shared] {
            let answering = xact_try(lock, false);
            let raising = xact_try_raising(lock);
            for part in [xact_guards!(), session_marker!(none)] {
                assert!(answering.contains(part) && raising.contains(part), "{part}");
            }
            let call = match lock {
                Lock::Exclusive => call_in_place!("pg_try_advisory_xact_lock"),
                Lock::Shared => call_in_place!("pg_try_advisory_xact_lock_shared"),
            };
            assert!(answering.contains(call) && raising.contains(call), "{call}");
            // The guards come first: on a standby its check fails the
            // statement before a busy key is reported.
            assert!(raising.starts_with(concat!("SELECT ", xact_guards!(), ", CASE")));
        }
    }

    #[test]
    fn the_intent_is_taken_first_in_the_reserved_namespace() {
        assert_eq!(
            crate::UpgradeableLock::INTENT_NAMESPACE.to_string(),
            "-2147483647"
        );
        for step in [Step::Try, Step::TryOrWait, Step::Wait] {
            let sql = session_upgradeable(step);
            assert!(!sql.contains("next_token"), "{sql}");
            // Every path that takes the key shared takes the intent first.
            for (intent, key) in [
                (
                    "pg_try_advisory_lock(-2147483647",
                    "pg_try_advisory_lock_shared(",
                ),
                ("pg_advisory_lock(-2147483647", "pg_advisory_lock_shared("),
            ] {
                if let Some(shared) = sql.find(key) {
                    let intent = sql.find(intent).expect("the intent");
                    assert!(intent < shared, "{sql}");
                }
            }
            // An upgrade never takes the intent again, and issues a token.
            assert!(!upgrade(step, true).contains("-2147483647"));
            assert!(upgrade(step, true).contains("distlock.next_token_and_cache()"));
            assert!(upgrade(step, true).contains("pg_backend_pid() OPERATOR(pg_catalog.=) $5"));
        }
    }

    #[test]
    fn a_wait_sets_its_lock_timeout_before_any_lock_call() {
        for (lock, fencing) in [
            (Lock::Exclusive, true),
            (Lock::Exclusive, false),
            (Lock::Shared, false),
        ] {
            for step in [Step::TryOrWait, Step::Wait] {
                // Before the wait, and before a try's grant and its token
                // draw (which can wait on the token epoch's row).
                let sql = session(step, lock, fencing);
                let timeout = sql
                    .find("set_config('lock_timeout', $4")
                    .expect("a timeout");
                let wait = sql.find("pg_catalog.pg_advisory_lock").expect("a wait");
                assert!(timeout < wait, "{sql}");
                // Set ahead of the choice between waiting and trying, not
                // in the waiting branch alone.
                if let Some(choice) = sql.find(waits_at_once!()) {
                    assert!(timeout < choice, "{sql}");
                }
                assert_eq!(step == Step::TryOrWait, sql.contains(waits_at_once!()));
            }
        }
    }

    #[test]
    fn fencing_issues_a_token_only_on_exclusive_session_locks() {
        for step in [Step::Try, Step::TryOrWait, Step::Wait] {
            assert!(
                session(step, Lock::Exclusive, true).contains("distlock.next_token_and_cache()")
            );
            assert!(!session(step, Lock::Exclusive, false).contains("next_token"));
            assert!(!session(step, Lock::Shared, true).contains("next_token"));
        }
    }
}
