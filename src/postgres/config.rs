//! The settings of a `PgLocker`, shared by its session locks, keepers and
//! multiplexed connections (which depend on this module, not on the locker).

use std::time::Duration;

use crate::Error;
use crate::setting::at_least;

/// Settings shared by every lock of one [`PgLocker`](crate::postgres::PgLocker).
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) heartbeat: Duration,
    pub(crate) heartbeat_timeout: Duration,
    pub(crate) release_timeout: Duration,
    pub(crate) fencing: bool,
    /// Shared connections for multiplexed session locks; 0 = one per lock.
    pub(crate) multiplex: usize,
    /// Multiplexed mode: at most this many locks held at once (`None`: no
    /// cap).
    pub(crate) max_locks: Option<usize>,
    /// At most this many connections kept warm between locks, each for at
    /// most `warm_idle` (see `warm`).
    pub(crate) warm: usize,
    pub(crate) warm_idle: Duration,
    /// `with_advisory_lock` sends its try with the `BEGIN`
    /// ([`prepared_try`](crate::postgres::request::prepared_try)).
    pub(crate) try_with_begin: bool,
}

/// Default interval between two heartbeats of a session lock.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(1);
/// The most shared connections a multiplexed locker opens
/// ([`PgLockerBuilder::multiplex`](crate::PgLockerBuilder::multiplex)).
pub const MAX_MULTIPLEX: usize = 1024;
/// Default deadline for releasing a session lock.
pub const DEFAULT_RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

impl Default for Config {
    fn default() -> Self {
        Self {
            heartbeat: DEFAULT_HEARTBEAT,
            heartbeat_timeout: DEFAULT_HEARTBEAT,
            release_timeout: DEFAULT_RELEASE_TIMEOUT,
            fencing: false,
            multiplex: 0,
            max_locks: None,
            warm: crate::postgres::conn::warm::DEFAULT_WARM,
            warm_idle: crate::postgres::conn::warm::DEFAULT_WARM_IDLE,
            try_with_begin: false,
        }
    }
}

/// The shortest heartbeat interval and heartbeat deadline: below this the
/// heartbeat's own round trip would be most of its budget.
pub const MIN_HEARTBEAT: Duration = Duration::from_millis(10);

/// The longest `heartbeat + heartbeat_timeout`: 5 s short of the server's
/// keepalive cut-off, so a cut-off holder has stopped trusting its lock
/// before the server can grant it to anyone else.
pub const MAX_DETECTION: Duration =
    Duration::from_secs(crate::postgres::request::fragments::SERVER_CUTOFF.as_secs() - 5);

/// The shortest release deadline: a zero deadline would close every
/// released lock's connection instead of unlocking it.
const MIN_RELEASE_TIMEOUT: Duration = Duration::from_millis(1);

impl Config {
    /// Refuses the first setting outside its range, naming it: a builder
    /// never changes what it was given (a lowered heartbeat, a raised
    /// deadline) behind its caller's back.
    pub(crate) fn validate(&self) -> Result<(), Error> {
        at_least("heartbeat", self.heartbeat, MIN_HEARTBEAT)?;
        at_least("heartbeat_timeout", self.heartbeat_timeout, MIN_HEARTBEAT)?;
        let detection = self.heartbeat.saturating_add(self.heartbeat_timeout);
        if detection > MAX_DETECTION {
            return Err(Error::InvalidSetting {
                setting: "heartbeat + heartbeat_timeout",
                value: format!("{detection:?}"),
                allowed: format!(
                    "at most {MAX_DETECTION:?} (a holder must notice a cut-off before the \
                     server frees its lock)"
                ),
            });
        }
        at_least("release_timeout", self.release_timeout, MIN_RELEASE_TIMEOUT)?;
        if self.multiplex > MAX_MULTIPLEX {
            return Err(Error::InvalidSetting {
                setting: "multiplex",
                value: self.multiplex.to_string(),
                allowed: format!("at most {MAX_MULTIPLEX} connections"),
            });
        }
        match self.max_locks {
            Some(0) => Err(Error::InvalidSetting {
                setting: "max_locks",
                value: "0".to_owned(),
                allowed: "at least 1".to_owned(),
            }),
            // A cap that would silently do nothing is a mistake in the
            // caller's setup, not a default to fall back on.
            Some(limit) if self.multiplex == 0 => Err(Error::InvalidSetting {
                setting: "max_locks",
                value: limit.to_string(),
                allowed: "set together with multiplex(n), n >= 1".to_owned(),
            }),
            _ => Ok(()),
        }
    }
}
