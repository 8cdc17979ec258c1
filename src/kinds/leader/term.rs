//! `Term`: one stretch of leadership of one campaign, with the token that
//! cancels the leader's work when it ends.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio_util::sync::{CancellationToken, DropGuard};

use crate::FencingToken;

/// One term of a [`Campaign`](crate::Campaign): from the moment it started
/// to lead until it stopped (resigned, or lost its lock). A campaign that
/// loses its lock and wins it again leads a *new* term, with a new
/// [`cancellation`](Self::cancellation) token, a new fencing token and,
/// where the backend records leaders, a higher [`number`](Self::number):
/// work started under the old term sees it end.
///
/// Cheap to clone; clones are the same term (`==`).
///
/// The term's end is signalled **before** its lease is released (on
/// resignation) and as soon as a loss is known, so work that stops when
/// [`ended`](Self::ended) completes never runs beside a successor that
/// stepped up after a resignation. After a loss the backend may have freed
/// the lock before the campaign could know (a partition, a paused
/// process): pass the [`fencing_token`](Self::fencing_token) with every
/// write.
#[derive(Clone)]
pub struct Term {
    inner: Arc<Inner>,
}

struct Inner {
    number: Option<u64>,
    token: Option<FencingToken>,
    since: SystemTime,
    started: Instant,
    identity: Arc<str>,
    value: Arc<str>,
    cancel: CancellationToken,
}

impl Term {
    pub(super) fn start(
        number: Option<u64>,
        token: Option<FencingToken>,
        identity: Arc<str>,
        value: Arc<str>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                number,
                token,
                since: SystemTime::now(),
                started: Instant::now(),
                identity,
                value,
                cancel: CancellationToken::new(),
            }),
        }
    }

    /// Ends the term when dropped: [`ended`](Self::ended) then completes
    /// for every clone. Held by the campaign's task while it leads, so a
    /// term ends with that task, however it ends: the lock lost, the
    /// campaign stopped, or the task dropped with its runtime.
    pub(super) fn ends_with(&self) -> DropGuard {
        self.inner.cancel.clone().drop_guard()
    }

    /// The election-wide term number the backend recorded
    /// ([`LeaderInfo::term`](crate::LeaderInfo::term)); `None` on backends
    /// that keep no record of leaders (see
    /// [`ElectionLocker`](crate::ElectionLocker)).
    pub fn number(&self) -> Option<u64> {
        self.inner.number
    }

    /// The fencing token of this term's lease, where the backend issues
    /// them: strictly higher than every earlier term's.
    pub fn fencing_token(&self) -> Option<FencingToken> {
        self.inner.token
    }

    /// When this campaign started to lead this term, by this process's
    /// clock.
    pub fn since(&self) -> SystemTime {
        self.inner.since
    }

    /// How long this term has lasted (until now, or until it ended).
    pub fn held_for(&self) -> Duration {
        self.inner.started.elapsed()
    }

    /// The identity this campaign proclaimed.
    pub fn identity(&self) -> &str {
        &self.inner.identity
    }

    /// The value this campaign proclaimed.
    pub fn value(&self) -> &str {
        &self.inner.value
    }

    /// Whether the term has ended. No round trip.
    pub fn is_over(&self) -> bool {
        self.inner.cancel.is_cancelled()
    }

    /// Completes when the term ends: the campaign resigned (before its
    /// lease is released) or lost its lock (as soon as that is known).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only watches the term's token.
    pub async fn ended(&self) {
        self.inner.cancel.cancelled().await;
    }

    /// A token cancelled when the term ends, to hand to the leader's work
    /// (`tokio_util`'s `CancellationToken`, as client-go hands a context to
    /// `OnStartedLeading`). A child of the term's own: cancelling it stops
    /// only the work it was given to, never the term.
    pub fn cancellation(&self) -> CancellationToken {
        self.inner.cancel.child_token()
    }
}

impl PartialEq for Term {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for Term {}

impl fmt::Debug for Term {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Term")
            .field("number", &self.inner.number)
            .field("fencing_token", &self.inner.token)
            .field("identity", &self.inner.identity)
            .field("held_for", &self.held_for())
            .field("over", &self.is_over())
            .finish()
    }
}
