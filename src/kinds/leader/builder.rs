//! `LeaderElectionBuilder`: an election's identity, value and timings,
//! checked at `build()`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

use super::{Election, LeaderElection};
use crate::setting::within;
use crate::{Error, LockKey, Locker};

/// How long one wait for the election's lock lasts before it is renewed:
/// short enough that a candidate whose waiting session a partition ended
/// (see [`LeaderElectionBuilder::wait`]) is back in the race within about a
/// minute.
pub(super) const DEFAULT_WAIT: Duration = Duration::from_secs(60);
/// Pause after an error that may pass before campaigning again.
pub(super) const DEFAULT_RETRY: Duration = Duration::from_secs(1);
/// How often an observer reads who leads.
pub(super) const DEFAULT_POLL: Duration = Duration::from_secs(1);

/// The longest identity, in bytes.
const MAX_IDENTITY: usize = 256;
/// The longest value, in bytes.
const MAX_VALUE: usize = 64 * 1024;
/// The shortest wait, retry pause and poll interval.
const MIN_INTERVAL: Duration = Duration::from_millis(10);
/// The longest wait: PostgreSQL's `lock_timeout` allows about 24.8 days,
/// but a wait that is renewed daily costs nothing.
const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);
/// The longest retry pause and poll interval (a grace's limit is the leader
/// record's, [`Proclamation::MAX_GRACE`](crate::Proclamation::MAX_GRACE)).
const MAX_PAUSE: Duration = Duration::from_secs(3600);

/// Configures a [`LeaderElection`]; from [`LeaderElection::builder`].
///
/// ```
/// # fn demo(locker: std::sync::Arc<dyn distlock::Locker>) -> Result<(), distlock::Error> {
/// use std::time::Duration;
/// let election = distlock::LeaderElection::builder(locker, "scheduler")
///     .identity("scheduler-7f9c")
///     .value("http://10.0.0.7:8080")
///     .retry(Duration::from_secs(2))
///     .build()?;
/// # let _ = election; Ok(()) }
/// ```
#[derive(Debug)]
#[must_use = "a builder does nothing until .build() is called"]
pub struct LeaderElectionBuilder {
    locker: Arc<dyn Locker>,
    key: LockKey,
    identity: Option<String>,
    value: String,
    wait: Duration,
    retry: Duration,
    grace: Option<Duration>,
    poll: Duration,
}

impl LeaderElectionBuilder {
    pub(super) fn new(locker: Arc<dyn Locker>, key: LockKey) -> Self {
        Self {
            locker,
            key,
            identity: None,
            value: String::new(),
            wait: DEFAULT_WAIT,
            retry: DEFAULT_RETRY,
            grace: None,
            poll: DEFAULT_POLL,
        }
    }

    /// Names this candidate: what [`LeaderElection::leader`] says of it
    /// while it leads. Default: `host:pid#n` (the host name, the process
    /// id, and which election of the process this is). Set your own where
    /// several candidates share a host and pid name (containers), or to
    /// name a pod.
    ///
    /// Range: 1 to 256 bytes, no NUL character (PostgreSQL text cannot
    /// hold one).
    pub fn identity(mut self, identity: impl Into<String>) -> Self {
        self.identity = Some(identity.into());
        self
    }

    /// What this candidate tells everyone while it leads (etcd's
    /// `Campaign(val)`): an address to send work to, a version. Default:
    /// empty.
    ///
    /// Range: up to 64 KiB, no NUL character.
    pub fn value(mut self, value: impl Into<String>) -> Self {
        self.value = value.into();
        self
    }

    /// How long one wait for the election's lock lasts before it is
    /// renewed (default one minute). On PostgreSQL the wait is on the
    /// server, so it costs nothing while it lasts and a takeover is not
    /// delayed by it; a shorter wait only renews more often (on
    /// PostgreSQL a renewal is the timed-out wait's holder look-up, 1 round
    /// trip, and a new `lock()`, 2 round trips on a connection from the
    /// pool). One case it bounds: a network partition long enough for the
    /// server to end the waiting session (its keepalives, 25–30 s) leaves
    /// this candidate waiting on a connection that will never answer, out
    /// of the race until the wait and its heartbeat deadlines run out.
    ///
    /// Range: 10 ms to 24 hours.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// The pause after an error that may pass (a server down or
    /// unreachable) before campaigning again (default one second). Errors
    /// no retry can cure end the campaign instead (see
    /// [`Campaign::failure`](crate::Campaign::failure)).
    ///
    /// Range: 10 ms to one hour.
    pub fn retry(mut self, pause: Duration) -> Self {
        self.retry = pause;
        self
    }

    /// How long a campaign that wins the lock from a leader that did not
    /// step down (its session ended, it was partitioned away: it did not
    /// withdraw its record) waits before it leads, so that the deposed
    /// leader has learnt of its loss first and two campaigns never report
    /// leadership at once. A takeover after a resignation does not wait,
    /// unless the one who resigned never led (it stopped during its own
    /// grace: the leader before it may not know yet).
    ///
    /// Default: the backend's
    /// [`loss_notice_bound`](crate::ElectionLocker::loss_notice_bound) and a
    /// quarter more for the deposed leader's task to run (on
    /// [`PgLocker`](crate::PgLocker) `1.25 × (heartbeat +
    /// heartbeat_timeout)`, 2.5 s with the defaults; this assumes every
    /// candidate's locker has the same settings: set it from the largest
    /// otherwise); zero on [`TableLocker`](crate::postgres::TableLocker), whose
    /// holders give up before their lease expires, and on backends that
    /// keep no record of leaders, where the wait would apply to every
    /// takeover. Zero turns the
    /// wait off: the fencing token then is the only guard against a deposed
    /// leader that does not know yet.
    ///
    /// Range: zero to one hour.
    pub fn grace(mut self, grace: Duration) -> Self {
        self.grace = Some(grace);
        self
    }

    /// How often an [`Observer`](crate::Observer) reads who leads (default
    /// one second). A read also follows at once every change made by a
    /// campaign of this election in this process.
    ///
    /// Range: 10 ms to one hour.
    pub fn poll(mut self, every: Duration) -> Self {
        self.poll = every;
        self
    }

    /// The election, or [`Error::InvalidSetting`] naming the first setting
    /// out of its range. The key is checked when a campaign starts (as by
    /// [`LeaderElection::new`]). No round trip.
    pub fn build(mut self) -> Result<LeaderElection, Error> {
        let identity = match self.identity.take() {
            Some(identity) => text("identity", identity, 1, MAX_IDENTITY)?,
            None => default_identity(),
        };
        let value = text("value", std::mem::take(&mut self.value), 0, MAX_VALUE)?;
        within("wait", self.wait, MIN_INTERVAL, MAX_WAIT)?;
        within("retry", self.retry, MIN_INTERVAL, MAX_PAUSE)?;
        if let Some(grace) = self.grace {
            within(
                "grace",
                grace,
                Duration::ZERO,
                crate::Proclamation::MAX_GRACE,
            )?;
        }
        within("poll", self.poll, MIN_INTERVAL, MAX_PAUSE)?;
        Ok(self.assemble(identity, value))
    }

    /// The election with `identity` and `value` and the other settings as
    /// they are, already checked (or the defaults).
    pub(super) fn assemble(self, identity: String, value: String) -> LeaderElection {
        LeaderElection {
            inner: Arc::new(Election {
                locker: self.locker,
                key: self.key,
                identity: identity.into(),
                value: value.into(),
                wait: self.wait,
                retry: self.retry,
                grace: self.grace,
                poll: self.poll,
                changed: Notify::new(),
            }),
        }
    }
}

fn text(setting: &'static str, value: String, min: usize, max: usize) -> Result<String, Error> {
    let refuse = |allowed: String| Error::InvalidSetting {
        setting,
        value: format!("{:?}", shortened(&value)),
        allowed,
    };
    if value.len() < min || value.len() > max {
        return Err(refuse(format!("{min} to {max} bytes long")));
    }
    if value.contains('\0') {
        return Err(refuse("free of NUL characters".to_owned()));
    }
    Ok(value)
}

/// At most 64 characters of `value`, for an error message.
fn shortened(value: &str) -> String {
    let cut: String = value.chars().take(64).collect();
    if cut.len() < value.len() {
        format!("{cut}...")
    } else {
        cut
    }
}

/// `host:pid#n`: the host name (`HOSTNAME`, else the kernel's), the
/// process id, and which election this process built (from 1).
pub(super) fn default_identity() -> String {
    static BUILT: AtomicU64 = AtomicU64::new(0);
    let n = BUILT.fetch_add(1, Ordering::Relaxed) + 1;
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|h| h.trim().replace('\0', ""))
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_owned());
    let host = shortened(&host);
    format!("{host}:{}#{n}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryLocker;

    fn builder() -> LeaderElectionBuilder {
        LeaderElectionBuilder::new(Arc::new(MemoryLocker::new()), "k".into())
    }

    fn refused(result: Result<LeaderElection, Error>) -> &'static str {
        match result {
            Err(Error::InvalidSetting { setting, .. }) => setting,
            other => panic!("expected InvalidSetting, got {other:?}"),
        }
    }

    #[test]
    fn settings_out_of_range_are_refused_by_name() {
        assert_eq!(refused(builder().identity("").build()), "identity");
        assert_eq!(refused(builder().identity("a\0b").build()), "identity");
        assert_eq!(
            refused(builder().identity("x".repeat(257)).build()),
            "identity"
        );
        assert_eq!(refused(builder().value("a\0b").build()), "value");
        assert_eq!(
            refused(builder().value("x".repeat(64 * 1024 + 1)).build()),
            "value"
        );
        assert_eq!(refused(builder().wait(Duration::ZERO).build()), "wait");
        assert_eq!(
            refused(builder().wait(Duration::from_secs(86_401)).build()),
            "wait"
        );
        assert_eq!(
            refused(builder().retry(Duration::from_millis(9)).build()),
            "retry"
        );
        assert_eq!(
            refused(builder().grace(Duration::from_secs(3601)).build()),
            "grace"
        );
        assert_eq!(refused(builder().poll(Duration::MAX).build()), "poll");
    }

    #[test]
    fn settings_at_their_bounds_are_kept() {
        let election = builder()
            .identity("x".repeat(256))
            .value("")
            .wait(Duration::from_millis(10))
            .retry(Duration::from_secs(3600))
            .grace(Duration::ZERO)
            .poll(Duration::from_millis(10))
            .build()
            .expect("in range");
        assert_eq!(election.identity().len(), 256);
        assert_eq!(election.grace(), Duration::ZERO);
    }

    #[test]
    fn the_default_identity_names_the_process() {
        let identity = builder().build().expect("defaults").identity().to_owned();
        assert!(
            identity.contains(&format!(":{}#", std::process::id())),
            "{identity}"
        );
    }
}
