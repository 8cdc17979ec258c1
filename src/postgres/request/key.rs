//! Keys in the one shape every statement binds: `$1` the key space
//! (`int4`: 1 for the single-`bigint` space, 2 for the two-`int4` one),
//! `$2` a value known to the client (`int8`, or NULL) and `$3` a name the
//! server hashes (`text`, or NULL). The statement resolves them once to
//! `(space, a, b)` (see [`sql`](super::sql)'s `resolved` fragments; a
//! session lock's statements and `with_advisory_lock`'s try resolve them
//! in place, `call_in_place`), so one
//! statement text serves every key shape, and every key maps to the server
//! lock it always did: a name to `hashtext(name)` widened to `bigint`, an
//! id to itself, a pair to `(ns, hashtext(name))`.

use crate::postgres::request::fragments::PgQuery;
use crate::postgres::request::key_args::KeyArgs;

/// One key's parameters, in the order the statements bind them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bound<'a> {
    space: i32,
    value: Option<i64>,
    name: Option<&'a str>,
}

impl<'a> From<KeyArgs<'a>> for Bound<'a> {
    fn from(args: KeyArgs<'a>) -> Self {
        match args {
            KeyArgs::Text(name) => Self {
                space: 1,
                value: None,
                name: Some(name),
            },
            KeyArgs::BigInt(id) => Self {
                space: 1,
                value: Some(id),
                name: None,
            },
            KeyArgs::Pair(ns, name) => Self {
                space: 2,
                value: Some(i64::from(ns)),
                name: Some(name),
            },
        }
    }
}

impl<'a> Bound<'a> {
    /// The key's space, value and name, as [`bind`](Self::bind) binds them.
    pub(crate) fn values(self) -> (i32, Option<i64>, Option<&'a str>) {
        (self.space, self.value, self.name)
    }

    /// Binds `$1`, `$2`, `$3`.
    pub(crate) fn bind(self, query: PgQuery<'a>) -> PgQuery<'a> {
        query.bind(self.space).bind(self.value).bind(self.name)
    }
}

/// Several keys' parameters as three parallel arrays (`$1`, `$2`, `$3`),
/// in the caller's order: the statement's ordinality is the caller's index
/// plus one.
#[derive(Debug, Default)]
pub(crate) struct BoundAll<'a> {
    spaces: Vec<i32>,
    values: Vec<Option<i64>>,
    names: Vec<Option<&'a str>>,
}

impl<'a> BoundAll<'a> {
    /// Appends one key.
    pub(crate) fn push(&mut self, key: Bound<'a>) {
        self.spaces.push(key.space);
        self.values.push(key.value);
        self.names.push(key.name);
    }

    /// Binds `$1`, `$2`, `$3`.
    pub(crate) fn bind(&self, query: PgQuery<'a>) -> PgQuery<'a> {
        query
            .bind(self.spaces.clone())
            .bind(self.values.clone())
            .bind(self.names.clone())
    }
}
