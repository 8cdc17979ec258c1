//! Fencing tokens: numbers that grow with every acquisition of a lock, so a
//! protected resource can reject writes from a holder that was overtaken.

use std::fmt;

/// A fencing token: strictly increasing per key across all holders.
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
