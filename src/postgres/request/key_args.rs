//! How a [`LockKey`] is bound into SQL: the one or two values each key
//! shape binds, never formatted into the statement text.

use crate::key::Repr;
use crate::{Error, LockKey};

/// The advisory-lock arguments a key binds to a query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyArgs<'a> {
    /// `hashtext($1)` widened to bigint.
    Text(&'a str),
    /// `$1::int8`.
    BigInt(i64),
    /// `$1::int4, hashtext($2)`.
    Pair(i32, &'a str),
}

impl LockKey {
    /// The validated arguments to bind for this key.
    pub(crate) fn args(&self) -> Result<KeyArgs<'_>, Error> {
        self.validate()?;
        Ok(match &self.repr {
            Repr::Text(name) => KeyArgs::Text(name),
            Repr::Id(id) | Repr::Hashed64(_, id) => KeyArgs::BigInt(*id),
            Repr::Namespaced(ns, name) => KeyArgs::Pair(*ns, name),
        })
    }
}
