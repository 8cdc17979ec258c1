//! The fencing token type, shared by every backend that issues tokens.

use std::fmt;

/// A fencing token: strictly increasing per lock across all holders.
///
/// On PostgreSQL every lock draws from one counter per database, so a
/// token is higher than every token issued before it, of any lock, also
/// after a crash or a failover (its high bits carry an epoch that grows
/// with both; the README's "Fencing token layout" has the bits). On a
/// single Redis instance it is counted per lock name.
///
/// Present it with every write to the protected resource; the resource keeps
/// the highest token it has seen and rejects older ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(i64);

impl FencingToken {
    /// Wraps a raw token value (for tokens passed between processes).
    pub fn new(value: i64) -> Self {
        Self(value)
    }

    /// The token's value.
    pub fn value(self) -> i64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}
