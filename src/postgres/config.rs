//! The settings of a `PgLocker`, shared by its session locks, keepers and
//! multiplexed connections (which depend on this module, not on the locker).

use std::time::Duration;

/// Settings shared by every lock of one [`PgLocker`](super::PgLocker).
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
}

/// Default interval between two heartbeats of a session lock.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(1);
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
            warm: super::warm::DEFAULT_WARM,
            warm_idle: super::warm::DEFAULT_WARM_IDLE,
        }
    }
}

/// The longest `heartbeat + heartbeat_timeout`: 5 s short of the server's
/// keepalive cut-off, so a cut-off holder has stopped trusting its lock
/// before the server can grant it to anyone else.
pub(crate) const MAX_DETECTION: Duration =
    Duration::from_secs(super::sql::SERVER_CUTOFF.as_secs() - 5);

impl Config {
    pub(crate) fn clamp_to_server_cutoff(&mut self) {
        let (every, deadline) = (self.heartbeat, self.heartbeat_timeout);
        if every + deadline <= MAX_DETECTION {
            return;
        }
        self.heartbeat = every.min(MAX_DETECTION / 2);
        self.heartbeat_timeout = deadline.min(MAX_DETECTION - self.heartbeat);
        tracing::warn!(
            heartbeat = ?every,
            heartbeat_timeout = ?deadline,
            clamped_heartbeat = ?self.heartbeat,
            clamped_heartbeat_timeout = ?self.heartbeat_timeout,
            "distlock: heartbeat + heartbeat_timeout must stay below the server's keepalive \
             cut-off (20 s); lowered"
        );
    }
}
