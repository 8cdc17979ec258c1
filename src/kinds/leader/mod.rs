//! Leader election over any backend: campaigns hold one lock, the leader is
//! whoever holds it; where the backend records leaders, anyone can ask who
//! leads.
//!
//! | file | what it holds |
//! |---|---|
//! | `mod.rs` | [`LeaderElection`]: the election, its `campaign`, `leader` and `observe` |
//! | `builder.rs` | [`LeaderElectionBuilder`]: identity, value, timings |
//! | `campaign.rs` | [`Campaign`]: the cloneable handle of one campaign |
//! | `run.rs` | the campaign's background task |
//! | `term.rs` | [`Term`]: one stretch of leadership and its cancellation |
//! | `info.rs` | [`LeaderInfo`]: who leads, as the backend records it |
//! | `observer.rs` | [`Observer`]: changes of who leads |
//! | `permanent.rs` | which errors end a campaign |

mod builder;
mod campaign;
mod info;
mod observer;
mod permanent;
mod run;
mod term;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

pub use builder::LeaderElectionBuilder;
pub use campaign::Campaign;
pub use info::LeaderInfo;
pub use observer::Observer;
pub use term::Term;

use crate::{Error, LockKey, Locker};

/// Elects one leader among the campaigns for `key`, across processes, and
/// tells anyone who leads.
///
/// Each candidate calls [`campaign`](Self::campaign); a campaign leads in
/// [`Term`]s, each with a token that is cancelled when the term ends, so
/// work started under a term never outlives it unnoticed, even when the
/// campaign loses its lock and wins it again. Anyone, candidate or not,
/// can ask who leads ([`leader`](Self::leader)) or follow it
/// ([`observe`](Self::observe)).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), distlock::Error> {
/// # async fn schedule(_: Option<distlock::FencingToken>) {}
/// use std::sync::Arc;
/// let locker = Arc::new(distlock::PgLocker::builder(pool).fencing(true).build()?);
/// let election = distlock::LeaderElection::builder(locker, "scheduler")
///     .identity("scheduler-1")
///     .build()?;
/// let campaign = election.campaign();
/// loop {
///     // Err once the campaign ends: resigned, or an error no retry cures.
///     let term = campaign.elected().await?;
///     tokio::select! {
///         // Deposed (or resigning): stop at once, the next term starts over.
///         () = term.ended() => continue,
///         // The leader's work, its writes fenced with the term's token.
///         () = schedule(term.fencing_token()) => {}
///     }
///     # break;
/// }
/// campaign.resign().await?;
/// # Ok(()) }
/// ```
///
/// # Backends
///
/// Every backend elects leaders. Backends that keep a record of leaders
/// ([`ElectionLocker`](crate::ElectionLocker): [`PgLocker`](crate::PgLocker),
/// [`TableLocker`](crate::postgres::TableLocker),
/// [`MemoryLocker`](crate::memory::MemoryLocker)) also say who leads, under
/// which term number, and make a takeover from a leader that did not step
/// down wait its [`grace`](LeaderElectionBuilder::grace). On Redis
/// [`leader`](Self::leader) and [`observe`](Self::observe) report
/// [`Error::Unsupported`], and a term has no [`number`](Term::number). On
/// PostgreSQL the record lives in `distlock.leaders`: run
/// [`migrate`](crate::migrate) first (a campaign on an unmigrated database
/// ends with [`Error::NotMigrated`]).
#[derive(Debug, Clone)]
pub struct LeaderElection {
    inner: Arc<Election>,
}

/// What every campaign and observer of one election shares.
#[derive(Debug)]
struct Election {
    locker: Arc<dyn Locker>,
    key: LockKey,
    identity: Arc<str>,
    value: Arc<str>,
    wait: Duration,
    retry: Duration,
    /// `None`: the backend's loss-notice bound.
    grace: Option<Duration>,
    poll: Duration,
    /// Woken when a campaign of this election starts a term or has
    /// withdrawn one, so this process's observers read at once.
    changed: Notify,
}

impl LeaderElection {
    /// An election for `key` on `locker`, with the default settings of
    /// [`builder`](Self::builder). Cannot fail: a bad key ends each
    /// campaign at once ([`Campaign::failure`]).
    pub fn new(locker: Arc<dyn Locker>, key: impl Into<LockKey>) -> Self {
        // The defaults are within every range: nothing to check.
        LeaderElectionBuilder::new(locker, key.into())
            .assemble(builder::default_identity(), String::new())
    }

    /// A builder for an election for `key` on `locker`: identity, value,
    /// wait, retry pause, takeover grace, observer poll.
    pub fn builder(locker: Arc<dyn Locker>, key: impl Into<LockKey>) -> LeaderElectionBuilder {
        LeaderElectionBuilder::new(locker, key.into())
    }

    /// The election's key.
    pub fn key(&self) -> &LockKey {
        &self.inner.key
    }

    /// The identity this election's campaigns proclaim.
    pub fn identity(&self) -> &str {
        &self.inner.identity
    }

    /// The value this election's campaigns proclaim.
    pub fn value(&self) -> &str {
        &self.inner.value
    }

    /// How long a takeover from a leader that did not step down waits (see
    /// [`LeaderElectionBuilder::grace`]): as set, or the backend's default.
    pub fn grace(&self) -> Duration {
        self.inner.grace()
    }

    /// Starts campaigning in a background task: waits for the lock (on
    /// PostgreSQL, on the server: a takeover costs no poll), proclaims this
    /// candidate where the backend records leaders, leads a [`Term`] while
    /// it holds the lock, and campaigns again after a loss (and after
    /// errors that may pass, such as an unreachable server, after the
    /// [`retry`](LeaderElectionBuilder::retry) pause).
    ///
    /// It never panics and costs no round trip itself. A campaign that can
    /// never lead ends and says why: [`Campaign::failure`] returns the
    /// error, [`Campaign::elected`] and [`Campaign::resign`] return it, and
    /// the receivers of [`Campaign::leadership`] see the channel closed.
    /// That happens at once for a key that is not valid
    /// ([`Error::InvalidKey`]) and a call outside a Tokio runtime
    /// ([`Error::NoRuntime`]: the task needs one to run on), and at the
    /// first attempt for what the backend refuses for good: a key it cannot
    /// lock (Redis refuses namespaced keys), a configuration
    /// ([`Error::InvalidArgument`], [`Error::InvalidSetting`]), a database
    /// that was not migrated ([`Error::NotMigrated`], fencing tokens and the
    /// leader record need it), a schema it does not trust
    /// ([`Error::UntrustedSchema`]), a transaction pooler in front
    /// ([`Error::PoolerDetected`]).
    pub fn campaign(&self) -> Campaign {
        Campaign::start(Arc::clone(&self.inner))
    }

    /// Who leads now, candidate or not: identity, value, term number,
    /// since when, and the term's fencing token; `Ok(None)` if nobody does.
    ///
    /// The answer comes from the backend's own view of the lock: on
    /// PostgreSQL the record a leader wrote is believed only if
    /// `pg_locks` shows the backend it named holding the election's lock at
    /// the moment of the read (and that backend is the one that wrote it:
    /// same pid, same start time), so a leader whose session ended is never
    /// named, whatever the table still says. Between a takeover's grant and
    /// its proclamation (one round trip) nobody is named. One window
    /// remains: a leader that steps down withdraws its record before it
    /// releases the lock; if that withdrawal fails but the release succeeds,
    /// and the same pooled session is then granted the lock for another
    /// campaign of this process, the old identity is named until the new
    /// leader proclaims (one round trip later).
    ///
    /// On the lease table ([`TableLocker`](crate::postgres::TableLocker)) the record
    /// names the lease's owner and is believed while the lease's row is that
    /// owner's and unexpired by the server's clock.
    ///
    /// Costs 1 round trip on PostgreSQL (none in memory); writes nothing.
    /// [`Error::Unsupported`] on backends that keep no record of leaders
    /// (Redis); [`Error::InvalidKey`] for a bad key, before any round trip.
    /// With a [`PgLocker`](crate::PgLocker) the reading role must see the
    /// leader's session in `pg_stat_activity` (its own role's sessions, or
    /// any with `pg_read_all_stats`); a leader it cannot see is not named.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn leader(&self) -> Result<Option<LeaderInfo>, Error> {
        self.inner.leader().await
    }

    /// Follows who leads: an [`Observer`] whose value is the leader as last
    /// read ([`leader`](Self::leader)), read every
    /// [`poll`](LeaderElectionBuilder::poll) interval in a background task,
    /// and at once whenever a campaign of this election in this process
    /// starts or ends a term. For anyone, candidate or not.
    ///
    /// Costs one round trip per poll on PostgreSQL, as long as a clone of
    /// the observer lives. It never panics: outside a Tokio runtime, or on a
    /// backend without a record of leaders, the observer ends at once with
    /// [`Error::NoRuntime`] or [`Error::Unsupported`].
    pub fn observe(&self) -> Observer {
        Observer::start(Arc::clone(&self.inner))
    }
}

impl Election {
    fn grace(&self) -> Duration {
        self.grace.unwrap_or_else(|| {
            let bound = self
                .locker
                .election()
                .map_or(Duration::ZERO, |board| board.loss_notice_bound());
            // A quarter more, for the deposed leader's task to run (timers,
            // a busy runtime) once its backend has told it.
            bound.saturating_add(bound / 4)
        })
    }

    async fn leader(&self) -> Result<Option<LeaderInfo>, Error> {
        self.key.validate()?;
        match self.locker.election() {
            Some(board) => board.leader(&self.key).await,
            None => Err(Error::Unsupported {
                what: "LeaderElection::leader",
                backend: self.locker.backend(),
            }),
        }
    }
}
