//! The statements of the lease table, as the text of simple queries.
//!
//! # Why not bound parameters
//!
//! sqlx sends a statement with bound parameters as two protocol exchanges
//! (`Parse`/`Describe`/`Sync`, then `Bind`/`Execute`/`Sync`). A transaction
//! pooler such as PgBouncer (before 1.21, or without
//! `max_prepared_statements`) may run the two on different server
//! connections, where the statement does not exist, or exists under the same
//! name with another client's text. A simple query is one message, one round
//! trip and one implicit transaction on one server connection, whatever sits
//! in between.
//!
//! # Why this text is safe
//!
//! Only three kinds of value go into the text, none of which can hold a
//! quote, a backslash or a semicolon: integers (Rust's own `Display`, with
//! a unit in a setting's value), the owner as a UUID rendered here from
//! 128 random bits, and the key's name as
//! hexadecimal digits that the server decodes (`convert_from(decode(..,
//! 'hex'), 'UTF8')`). No input can change a statement's shape; the tests
//! below pin that for hostile names. Every name is schema-qualified, so the
//! session's `search_path` does not matter.

use std::time::Duration;

use crate::LockKey;
use crate::key::Repr;

/// The `LISTEN` channel on which `distlock.lease_release` announces a freed
/// key, with payload `<space>:<lock_id>`.
pub(super) const CHANNEL: &str = "distlock_lease";

/// A lease row `l` as [`LIVE_LEASES`] answers it: key text, token, and
/// granted, renewed and expiry times in microseconds since the epoch.
macro_rules! lease_columns {
    () => {
        "SELECT l.key_text, l.token, \
         (extract(epoch FROM l.acquired_at) OPERATOR(pg_catalog.*) 1000000)::pg_catalog.int8, \
         (extract(epoch FROM l.renewed_at) OPERATOR(pg_catalog.*) 1000000)::pg_catalog.int8, \
         (extract(epoch FROM l.expires_at) OPERATOR(pg_catalog.*) 1000000)::pg_catalog.int8"
    };
}

/// Whether the lease row `l` is live (not expired by the server's clock).
macro_rules! live {
    () => {
        "l.expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()"
    };
}

/// The live leases, by key ([`lease_columns`]). No value goes into the
/// text.
pub(super) const LIVE_LEASES: &str = concat!(
    lease_columns!(),
    " FROM distlock.leases AS l WHERE ",
    live!(),
    " ORDER BY l.space, l.lock_id"
);

/// The live lease of `key`, if any ([`lease_columns`]): the row a grant of
/// `key` would find, by the key's space and lock id (two names whose hashes
/// collide share one row, spelled as its holder spelled it).
pub(super) fn live_lease_of(key: &KeyExpr) -> String {
    format!(
        concat!(
            lease_columns!(),
            " FROM (SELECT {name} AS k) AS n \
             JOIN distlock.leases AS l ON l.space OPERATOR(pg_catalog.=) {space}::pg_catalog.int2 \
             AND l.lock_id OPERATOR(pg_catalog.=) {id} WHERE ",
            live!()
        ),
        name = key.name,
        space = key.space,
        id = key.id,
    )
}

/// A lease's owner: random, known only to its holder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Owner(u128);

impl Owner {
    /// The owner's 128 bits, as an election's seat carries them.
    pub(super) fn bits(self) -> u128 {
        self.0
    }

    /// The owner whose bits are `bits`.
    pub(super) fn from_bits(bits: u128) -> Self {
        Self(bits)
    }

    /// 122 random bits laid out as a version-4 UUID.
    pub(super) fn random() -> Self {
        let bits = rand::random::<u128>();
        let bits = (bits & !(0xF << 76)) | (0x4 << 76); // version 4
        let bits = (bits & !(0x3 << 62)) | (0x2 << 62); // RFC 4122 variant
        Self(bits)
    }

    pub(super) fn literal(self) -> String {
        let hex = format!("{:032x}", self.0);
        format!(
            "'{}-{}-{}-{}-{}'::pg_catalog.uuid",
            &hex[0..8],
            &hex[8..12],
            &hex[12..16],
            &hex[16..20],
            &hex[20..32]
        )
    }
}

/// How one key names its row: its space (1: one `bigint`, 2: two `int4`),
/// and its lock id once the server has computed it (see
/// [`KeyExpr::with_id`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct KeyExpr {
    space: i16,
    /// The lock id as an SQL expression of `k` (the name): computed on the
    /// server for keys hashed with `hashtext`, as advisory locks do.
    id: String,
    /// The key's text as an SQL expression.
    name: String,
}

impl KeyExpr {
    /// The expressions for a validated `key`.
    pub(super) fn new(key: &LockKey) -> Self {
        match &key.repr {
            Repr::Text(name) => Self {
                space: 1,
                id: "pg_catalog.hashtext(n.k)::pg_catalog.int8".into(),
                name: text(name),
            },
            Repr::Id(id) => Self {
                space: 1,
                id: int8(*id),
                name: text(&id.to_string()),
            },
            Repr::Hashed64(name, id) => Self {
                space: 1,
                id: int8(*id),
                name: text(name),
            },
            Repr::Namespaced(ns, name) => Self {
                space: 2,
                id: format!(
                    "(({ns})::pg_catalog.int8 OPERATOR(pg_catalog.<<) 32) OPERATOR(pg_catalog.|) \
                     (pg_catalog.hashtext(n.k)::pg_catalog.int8 OPERATOR(pg_catalog.&) 4294967295)"
                ),
                name: text(name),
            },
        }
    }

    /// The same key with the lock id the server reported, so later
    /// statements need not hash the name again.
    pub(super) fn with_id(&self, lock_id: i64) -> Self {
        Self {
            space: self.space,
            id: int8(lock_id),
            name: self.name.clone(),
        }
    }

    pub(super) fn space(&self) -> i16 {
        self.space
    }
}

/// `text` as an SQL expression that holds no character of it: hexadecimal
/// digits the server decodes.
fn text(text: &str) -> String {
    format!(
        "pg_catalog.convert_from(pg_catalog.decode('{}', 'hex'), 'UTF8')",
        hex::encode(text)
    )
}

/// `(n)::pg_catalog.int8`; parenthesised so that `i64::MIN` parses.
fn int8(n: i64) -> String {
    format!("({n})::pg_catalog.int8")
}

/// Whole milliseconds, at least 1 (the caller has validated the range).
fn millis(ttl: Duration) -> u128 {
    ttl.as_millis().max(1)
}

/// Columns: `granted` (bool), `fencing_token` (int8, NULL if refused),
/// `wait_ms` (int8, NULL if granted), `lock_id` (int8).
///
/// Each of its waits for a row locked by another transaction (an expired
/// lease's, which it would take over) lasts at most `wait`
/// ([`after_lock_timeout`]), what is left of the time its caller's task
/// waits for the answer: such a wait does not make a grant given up on
/// later.
pub(super) fn acquire(key: &KeyExpr, owner: Owner, ttl: Duration, wait: Duration) -> String {
    format!(
        "SELECT a.granted, a.fencing_token, a.wait_ms, i.lock_id \
         FROM (SELECT {name} AS k) AS n \
         CROSS JOIN LATERAL (SELECT {id} AS lock_id) AS i \
         CROSS JOIN LATERAL distlock.lease_acquire({space}::pg_catalog.int2, i.lock_id, n.k, \
         {owner}, {ttl}::pg_catalog.int8) AS a",
        name = after_lock_timeout(wait, &key.name),
        id = key.id,
        space = key.space,
        owner = owner.literal(),
        ttl = millis(ttl),
    )
}

/// One column: whether the lease was the owner's and unexpired, and is
/// extended now.
///
/// It waits for the lease's row (locked by anyone's `FOR UPDATE`, say) at
/// most `wait` ([`after_lock_timeout`]), what is left of the attempt's
/// budget: a renewal its holder gave up on does not extend, once the row
/// is freed, a lease its holder was told is lost.
pub(super) fn renew(key: &KeyExpr, owner: Owner, ttl: Duration, wait: Duration) -> String {
    let call = format!(
        "distlock.lease_renew({space}::pg_catalog.int2, {id}, {owner}, {ttl}::pg_catalog.int8)",
        space = key.space,
        id = key.id,
        owner = owner.literal(),
        ttl = millis(ttl),
    );
    call_waiting_at_most(key, &call, wait)
}

/// `SELECT call` for `key` (its name evaluated, as in every statement),
/// `call` waiting for a locked row at most `wait` ([`after_lock_timeout`]).
fn call_waiting_at_most(key: &KeyExpr, call: &str, wait: Duration) -> String {
    format!(
        "SELECT {call} FROM (SELECT {name} AS k) AS n",
        call = after_lock_timeout(wait, call),
        name = key.name,
    )
}

/// `expr`, evaluated once the statement-local `lock_timeout` is `wait` (a
/// `CASE` evaluates its condition first): the statement waits for a row
/// locked by another transaction at most `wait`, then fails with SQLSTATE
/// 55P03. The server does not notice a closed socket while a statement
/// waits (unless `client_connection_check_interval` is set, 0 by
/// default), so a statement its client gave up on (closing its connection)
/// would otherwise stay behind as a backend waiting on the row, and write
/// once the row is freed. Each wait for a lock gets `wait` anew; the
/// server starts counting when the wait starts, a moment after the client
/// computed `wait`.
fn after_lock_timeout(wait: Duration, expr: &str) -> String {
    format!(
        "CASE WHEN pg_catalog.set_config('lock_timeout', '{wait}', true) IS NULL \
         THEN NULL ELSE {expr} END",
        wait = crate::postgres::request::fragments::millis_setting(wait),
    )
}

/// One column: whether the lease was the owner's and unexpired (it is gone
/// either way).
///
/// It waits for the lease's row (locked by another transaction) at most
/// `wait` ([`after_lock_timeout`]), what is left of the release deadline:
/// a release given up on does not stay behind as a backend waiting on the
/// row.
pub(super) fn release(key: &KeyExpr, owner: Owner, wait: Duration) -> String {
    let call = format!(
        "distlock.lease_release({space}::pg_catalog.int2, {id}, {owner})",
        space = key.space,
        id = key.id,
        owner = owner.literal(),
    );
    call_waiting_at_most(key, &call, wait)
}

/// Columns: `term` (int8), `since` (µs since the epoch, int8),
/// `after_loss` (bool); all NULL if `owner` does not hold the lease. The
/// leader record of a lease is `via` 2 (see the `leader_records`
/// migration).
///
/// Each of its waits for the record's row (an insert of it still in
/// progress, or the row locked by another transaction) lasts at most
/// `wait` ([`after_lock_timeout`], evaluated with the function's
/// arguments), what its caller waits for the answer.
pub(super) fn proclaim(
    key: &KeyExpr,
    owner: Owner,
    proclamation: &crate::Proclamation,
    (key_text, wait): (&str, Duration),
) -> String {
    let token = proclamation
        .fencing_token
        .map_or_else(|| "NULL".to_owned(), |t| int8(t.value()));
    format!(
        "SELECT p.term, (extract(epoch FROM p.since) OPERATOR(pg_catalog.*) 1000000)::pg_catalog.int8, p.after_loss \
         FROM (SELECT {name} AS k) AS n \
         CROSS JOIN LATERAL distlock.leader_proclaim(2::pg_catalog.int2, \
         {space}::pg_catalog.int2, {id}, {key_text}, NULL, {owner}, {identity}, {value}, \
         {token}, {grace}::pg_catalog.int8) AS p",
        name = key.name,
        space = key.space,
        id = key.id,
        key_text = after_lock_timeout(wait, &text(key_text)),
        owner = owner.literal(),
        identity = text(&proclamation.identity),
        value = text(&proclamation.value),
        grace = proclamation.grace.as_millis(),
    )
}

/// One column: whether the record named `owner` (and `term`) and is
/// cleared now.
///
/// It waits for the record's row (locked by another transaction) at most
/// `wait` ([`after_lock_timeout`]), what its caller waits for the answer.
pub(super) fn withdraw(key: &KeyExpr, owner: Owner, term: Option<i64>, wait: Duration) -> String {
    let call = format!(
        "distlock.leader_withdraw(2::pg_catalog.int2, {space}::pg_catalog.int2, {id}, \
         NULL, {owner}, {term})",
        space = key.space,
        id = key.id,
        owner = owner.literal(),
        term = term.map_or_else(|| "NULL".to_owned(), int8),
    );
    call_waiting_at_most(key, &call, wait)
}

/// Columns: `identity`, `value` (text), `term`, `since` (µs since the
/// epoch), `fencing_token` (int8); no row if nobody leads.
pub(super) fn leader_of(key: &KeyExpr) -> String {
    format!(
        "SELECT l.identity, l.value, l.term, \
         (extract(epoch FROM l.since) OPERATOR(pg_catalog.*) 1000000)::pg_catalog.int8, l.fencing_token \
         FROM (SELECT {name} AS k) AS n \
         CROSS JOIN LATERAL distlock.leader_of(2::pg_catalog.int2, {space}::pg_catalog.int2, \
         {id}) AS l",
        name = key.name,
        space = key.space,
        id = key.id,
    )
}

/// One column: how many expired rows were deleted. `lease_purge` takes an
/// `integer`: a larger literal would be a `bigint`, for which no function
/// exists, so the limit stops at `i32::MAX` (more rows than one statement
/// can usefully delete anyway).
pub(super) fn purge(limit: u32) -> String {
    let limit = limit.min(i32::MAX.unsigned_abs());
    format!("SELECT distlock.lease_purge({limit})")
}

/// The payload `lease_release` sends for `(space, lock_id)`.
pub(super) fn parse_payload(payload: &str) -> Option<(i16, i64)> {
    let (space, id) = payload.split_once(':')?;
    Some((space.parse().ok()?, id.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a statement may contain besides its fixed text: hex digits,
    /// integers, a UUID. A hostile name must leave no trace of itself.
    #[test]
    fn hostile_names_never_reach_the_statement_text() {
        let hostile = "x'); DROP TABLE distlock.leases; --\\'\"$$ é";
        for key in [
            LockKey::from(hostile),
            LockKey::namespaced(-7, hostile),
            LockKey::hashed64(hostile),
            LockKey::id(i64::MIN),
        ] {
            let expr = KeyExpr::new(&key);
            let owner = Owner::random();
            let proclamation = crate::Proclamation {
                identity: hostile.to_owned(),
                value: hostile.to_owned(),
                fencing_token: Some(crate::FencingToken::new(i64::MIN)),
                grace: Duration::from_secs(1),
            };
            for sql in [
                acquire(
                    &expr,
                    owner,
                    Duration::from_secs(1),
                    Duration::from_millis(1),
                ),
                renew(
                    &expr,
                    owner,
                    Duration::from_secs(1),
                    Duration::from_millis(1),
                ),
                release(&expr, owner, Duration::from_millis(1)),
                release(&expr.with_id(-42), owner, Duration::from_millis(1)),
                proclaim(
                    &expr,
                    owner,
                    &proclamation,
                    (hostile, Duration::from_millis(1)),
                ),
                withdraw(&expr, owner, Some(i64::MIN), Duration::from_millis(1)),
                withdraw(&expr, owner, None, Duration::from_millis(1)),
                leader_of(&expr),
                live_lease_of(&expr),
            ] {
                assert!(!sql.contains("DROP"), "{sql}");
                assert!(!sql.contains(';'), "{sql}");
                assert!(!sql.contains('\\'), "{sql}");
                assert!(!sql.contains('"'), "{sql}");
                assert!(!sql.contains("$$"), "{sql}");
                // Quotes come in pairs around hex digits, a UUID, 'hex'/'UTF8'
                // or a setting's name and value.
                for (i, quoted) in sql.split('\'').enumerate().filter(|(i, _)| i % 2 == 1) {
                    assert!(
                        quoted
                            .chars()
                            .all(|c| c == '-' || c == '_' || c.is_ascii_alphanumeric()),
                        "quoted part {i} {quoted:?} in {sql}"
                    );
                }
            }
        }
    }

    #[test]
    fn owners_are_version_4_uuids_and_differ() {
        let a = Owner::random();
        let b = Owner::random();
        assert_ne!(a, b);
        let text = a.literal();
        assert_eq!(text.len(), "''::pg_catalog.uuid".len() + 36);
        assert_eq!(&text[15..16], "4", "{text}");
    }

    #[test]
    fn payloads_parse() {
        assert_eq!(parse_payload("1:-42"), Some((1, -42)));
        assert_eq!(parse_payload("2:9223372036854775807"), Some((2, i64::MAX)));
        assert_eq!(parse_payload("probe"), None);
    }
}
