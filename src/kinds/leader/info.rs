//! `LeaderInfo`: who leads an election, as its backend records it.

use std::time::SystemTime;

use crate::FencingToken;

/// Who leads an election: from [`LeaderElection::leader`](crate::LeaderElection::leader)
/// and [`Observer`](crate::Observer), built by the backend's
/// [`ElectionLocker`](crate::ElectionLocker).
///
/// Only ever handed out while the backend saw its holder hold the
/// election's lock, at the moment the record was read.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaderInfo {
    /// The leader's identity ([`LeaderElectionBuilder::identity`](crate::LeaderElectionBuilder::identity)).
    pub identity: String,
    /// What the leader proclaims ([`LeaderElectionBuilder::value`](crate::LeaderElectionBuilder::value)).
    pub value: String,
    /// The term: 1 for the first leader the backend recorded for this key,
    /// higher for each proclamation after it. A leader that loses its lock
    /// and wins it again leads a new term. Numbers can be skipped: a
    /// proclamation that never led (stopped in its grace, or whose answer
    /// was lost) used one; they never go back.
    pub term: u64,
    /// When the term started, by the backend's clock (on PostgreSQL the
    /// server's): when it was proclaimed, or, after a takeover from a
    /// leader that did not step down, when the grace ended (the term is not
    /// named before).
    pub since: SystemTime,
    /// The leader's fencing token for this term, where the backend issues
    /// them: pass it to the resource its writes go to.
    pub fencing_token: Option<FencingToken>,
}

impl LeaderInfo {
    /// A record of term `term`, for a backend's
    /// [`ElectionLocker`](crate::ElectionLocker) to return.
    pub fn new(
        identity: impl Into<String>,
        value: impl Into<String>,
        term: u64,
        since: SystemTime,
        fencing_token: Option<FencingToken>,
    ) -> Self {
        Self {
            identity: identity.into(),
            value: value.into(),
            term,
            since,
            fencing_token,
        }
    }
}
