//! The connections a lock lives on: a pooled connection that is closed,
//! not returned, while it may hold a lock ([`held`]); one whose socket can be
//! read while idle, so a session lock hears the server's goodbye
//! ([`watched`]); a pooled connection within a waiting call's deadline
//! ([`pooled`]); and the few connections a locker keeps warm between
//! acquisitions ([`warm`]).

pub(crate) mod held;
pub(crate) mod pooled;
pub(crate) mod warm;
pub(crate) mod watched;
