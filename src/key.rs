//! Lock keys: how a name becomes a PostgreSQL advisory lock key.
//!
//! PostgreSQL advisory locks live in two separate keyspaces: one `bigint`, or
//! two `int4`. [`LockKey`] picks one of four documented derivations:
//!
//! | constructor | PostgreSQL key | computed by |
//! |---|---|---|
//! | `LockKey::from("name")` | `hashtext('name')` widened to `bigint` | the server |
//! | [`LockKey::id`]`(n)` | `n` | nobody |
//! | [`LockKey::namespaced`]`(ns, "name")` | `(ns, hashtext('name'))` | the server |
//! | [`LockKey::hashed64`]`("name")` | HKDF-SHA256, as sqlx's `PgAdvisoryLock::new` | the client |
//!
//! # Choosing a form
//!
//! `From<&str>` is the default because it interoperates with SQL that other
//! programs already run: `pg_try_advisory_xact_lock(hashtext('invoice:process'))`
//! takes the same lock as `LockKey::from("invoice:process")`.
//!
//! `hashtext` yields only 32 bits. By the birthday bound there is a 50% chance
//! that *some* two names collide once about 77,000 distinct names are in use
//! (1% at about 9,300). For a try-lock a collision means a job is silently
//! skipped because an unrelated name "holds" it. `hashtext` is also an
//! internal PostgreSQL function, not a documented API. With more than a few
//! thousand distinct names, or where a skipped run is costly, use
//! [`LockKey::hashed64`]: 64 bits push the 50% collision point past four
//! billion names, and its value is computed in the client by a fixed,
//! tested algorithm.
//!
//! [`LockKey::namespaced`] uses the two-`int4` keyspace, which never collides
//! with single-`bigint` keys; give each application sharing a database its own
//! namespace number.

use std::fmt;
use std::sync::Arc;

/// The name of a distributed lock and the PostgreSQL advisory key it maps to.
///
/// Displays as the name it was made from (or the number, for [`LockKey::id`]).
/// Validation (empty names, NUL bytes) happens when the key is used, so
/// `From<&str>` can stay infallible; [`LockKey::validate`] checks eagerly.
///
/// ```
/// use distlock::LockKey;
///
/// let a = LockKey::from("invoice:process");
/// let b: LockKey = String::from("invoice:process").into();
/// assert_eq!(a, b);
/// assert_eq!(a.to_string(), "invoice:process");
/// assert_eq!(LockKey::id(42).to_string(), "42");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LockKey {
    pub(crate) repr: Repr,
}

/// The namespace of upgrade intents (see
/// [`UpgradeableLock::INTENT_NAMESPACE`](crate::UpgradeableLock::INTENT_NAMESPACE)),
/// refused in keys.
pub(crate) const INTENT_NAMESPACE: i32 = i32::MIN + 1;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Repr {
    Text(Arc<str>),
    Id(i64),
    Namespaced(i32, Arc<str>),
    Hashed64(Arc<str>, i64),
}

impl LockKey {
    /// A raw `bigint` key, used as is.
    ///
    /// ```
    /// # use distlock::LockKey;
    /// assert_eq!(LockKey::id(7).pg_bigint(), Some(7));
    /// ```
    pub fn id(id: i64) -> Self {
        Self { repr: Repr::Id(id) }
    }

    /// The two-`int4` key `(ns, hashtext(name))`.
    ///
    /// This keyspace is separate from every single-`bigint` key, so two
    /// applications sharing a database can each pick a namespace and never
    /// collide with each other or with `LockKey::from(..)` keys.
    pub fn namespaced(ns: i32, name: &str) -> Self {
        Self {
            repr: Repr::Namespaced(ns, Arc::from(name)),
        }
    }

    /// A 64-bit key hashed in the client, identical to sqlx's
    /// `PgAdvisoryLock::new(name)`.
    ///
    /// The algorithm is HKDF (RFC 5869) with SHA-256, no salt, the name's
    /// UTF-8 bytes as input key material and the info string
    /// `"SQLx (Rust) Postgres advisory lock"`, expanded to 8 bytes read as a
    /// little-endian `i64`. It is stable: tests pin its values.
    ///
    /// ```
    /// # use distlock::LockKey;
    /// let key = LockKey::hashed64("my first Postgres advisory lock!");
    /// assert_eq!(key.pg_bigint(), Some(-5560419505042474287));
    /// ```
    pub fn hashed64(name: &str) -> Self {
        Self {
            repr: Repr::Hashed64(Arc::from(name), sqlx_key(name)),
        }
    }

    /// The name this key was made from (`None` for [`LockKey::id`]).
    pub fn name(&self) -> Option<&str> {
        match &self.repr {
            Repr::Text(name) | Repr::Namespaced(_, name) | Repr::Hashed64(name, _) => Some(name),
            Repr::Id(_) => None,
        }
    }

    /// The `bigint` PostgreSQL locks when it is known in the client
    /// ([`LockKey::id`] and [`LockKey::hashed64`]); `None` for server-hashed keys.
    pub fn pg_bigint(&self) -> Option<i64> {
        match self.repr {
            Repr::Id(id) | Repr::Hashed64(_, id) => Some(id),
            Repr::Text(_) | Repr::Namespaced(..) => None,
        }
    }
}

/// sqlx's derivation for `PgAdvisoryLock::new(name)` (HKDF-SHA256 of the
/// name, 8 bytes, little-endian), taken from sqlx itself so the two cannot
/// drift apart; the golden-value test below pins it. `new` always derives a
/// bigint key (`as_bigint` is `Some`); 0 would only be reached if a later
/// sqlx changed that, which the golden-value test would catch first.
fn sqlx_key(name: &str) -> i64 {
    sqlx::postgres::PgAdvisoryLock::new(name)
        .key()
        .as_bigint()
        .unwrap_or_default()
}

impl From<&str> for LockKey {
    fn from(name: &str) -> Self {
        Self {
            repr: Repr::Text(Arc::from(name)),
        }
    }
}

impl From<String> for LockKey {
    fn from(name: String) -> Self {
        Self {
            repr: Repr::Text(Arc::from(name)),
        }
    }
}

impl From<&String> for LockKey {
    fn from(name: &String) -> Self {
        Self::from(name.as_str())
    }
}

impl From<&LockKey> for LockKey {
    fn from(key: &LockKey) -> Self {
        key.clone()
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.repr {
            Repr::Id(id) => write!(f, "{id}"),
            Repr::Text(name) | Repr::Namespaced(_, name) | Repr::Hashed64(name, _) => {
                f.write_str(name)
            }
        }
    }
}

impl LockKey {
    /// How a key reads in a message: a name in quotes, an id bare, so that
    /// `LockKey::from("42")` and `LockKey::id(42)` (two different locks) never
    /// read the same. Long names are cut at 64 characters.
    pub(crate) fn shown(&self) -> String {
        let quoted = |name: &str| {
            let cut: String = name.chars().take(64).collect();
            if cut.len() < name.len() {
                format!("{cut:?}...")
            } else {
                format!("{cut:?}")
            }
        };
        match &self.repr {
            Repr::Id(id) => id.to_string(),
            Repr::Text(name) => quoted(name),
            Repr::Namespaced(ns, name) => format!("{} in namespace {ns}", quoted(name)),
            Repr::Hashed64(name, _) => format!("{} (hashed64)", quoted(name)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashed64_matches_sqlx_golden_values() {
        for name in [
            "my first Postgres advisory lock!",
            "invoice:process",
            "é",
            "x",
        ] {
            let ours = LockKey::hashed64(name).pg_bigint();
            let sqlx = match sqlx::postgres::PgAdvisoryLock::new(name).key() {
                sqlx::postgres::PgAdvisoryLockKey::BigInt(k) => Some(*k),
                other => panic!("unexpected sqlx key {other:?}"),
            };
            assert_eq!(ours, sqlx, "{name}");
        }
        assert_eq!(
            LockKey::hashed64("my first Postgres advisory lock!").pg_bigint(),
            Some(-5560419505042474287)
        );
    }
}
