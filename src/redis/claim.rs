//! What a lease asserts on the server: a Redis key holding a random token
//! for a time to live.

use std::time::Duration;

use tokio::time::Instant;

use super::node::Failure;
use crate::{Error, LockKey};

/// The shortest TTL a lease may have: the watchdog extends every TTL/3, and
/// below this a single slow round trip would already eat the lease.
pub(crate) const MIN_TTL: Duration = Duration::from_millis(100);

/// The longest TTL a lease may have. The watchdog makes long TTLs pointless,
/// and a holder that dies blocks others for a whole TTL.
pub(crate) const MAX_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// Prefix of the companion key that counts a lock's fencing tokens. The NUL
/// byte keeps counters apart from locks: no lock name can contain one
/// ([`LockKey::validate`]), so no lock's key is ever a counter's.
pub(crate) const FENCE_PREFIX: &str = "distlock:fencing\0";

/// Prefix of the Redis key of a [`Semaphore`](crate::Semaphore) permit
/// slot (a key in [`Semaphore::SLOT_NAMESPACE`](crate::Semaphore::SLOT_NAMESPACE)).
/// The NUL byte keeps slots apart from plain locks, as it does counters.
pub(crate) const SLOT_PREFIX: &str = "distlock:semaphore\0";

/// Prefix of the counter key of earlier versions, which a lock named
/// `distlock:fencing:<name>` collided with. Read once per name, so that the
/// new counter continues above it.
pub(crate) const LEGACY_FENCE_PREFIX: &str = "distlock:fencing:";

/// One lease's identity on the server(s), shared by the acquiring call, the
/// watchdog and the cancellation guard.
#[derive(Debug)]
pub(crate) struct Claim {
    pub(crate) key: LockKey,
    /// The Redis key: the lock's name.
    pub(crate) name: String,
    /// A random 128-bit value, in hex: only its holder can extend or delete.
    pub(crate) token: String,
    pub(crate) ttl: Duration,
}

impl Claim {
    /// A fresh claim on `key` with a new random token.
    pub(crate) fn new(key: LockKey, ttl: Duration) -> Result<Self, Error> {
        check_ttl(ttl)?;
        let name = redis_key(&key)?;
        Ok(Self {
            key,
            name,
            token: format!("{:032x}", rand::random::<u128>()),
            ttl,
        })
    }

    /// The TTL in whole milliseconds, as `PX`/`PEXPIRE` take it.
    pub(crate) fn ttl_millis(&self) -> u64 {
        u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX)
    }

    /// How long after a successful write *started* the lease is known to be
    /// held: the TTL less the clock-drift margin of the Redlock algorithm.
    /// Measuring from the start (not the reply) counts the round trip as
    /// already spent.
    pub(crate) fn window(&self) -> Duration {
        window(self.ttl)
    }

    /// The companion key whose `INCR` issues this lock's fencing tokens:
    /// `distlock:fencing`, a NUL byte, the name.
    pub(crate) fn fence_key(&self) -> String {
        format!("{FENCE_PREFIX}{}", self.name)
    }

    /// Where earlier versions counted this lock's tokens.
    pub(crate) fn legacy_fence_key(&self) -> String {
        format!("{LEGACY_FENCE_PREFIX}{}", self.name)
    }

    /// The error of a release that found another token (or none).
    pub(crate) fn not_held(&self) -> Error {
        Error::LockLost {
            key: self.key.clone(),
            reason: crate::LossReason::Expired,
        }
    }

    /// The error of a release whose command failed.
    pub(crate) fn release_failed(&self, failure: Failure) -> Error {
        match failure {
            Failure::TimedOut(after) => Error::ReleaseTimedOut {
                key: self.key.clone(),
                after,
            },
            Failure::Redis(err) => Error::Redis(err),
        }
    }

    /// The error of a lock command that failed.
    pub(crate) fn failed(&self, failure: Failure) -> Error {
        match failure {
            Failure::TimedOut(after) => Error::CommandTimedOut {
                key: self.key.clone(),
                after,
            },
            Failure::Redis(err) => Error::Redis(err),
        }
    }

    /// [`Error::Timeout`] for a wait that began at `started`.
    pub(crate) fn timed_out(&self, started: Instant) -> Error {
        Error::Timeout {
            key: self.key.clone(),
            waited: started.elapsed(),
            holder_pid: None,
            holder_application: None,
            chain: Default::default(),
        }
    }
}

/// Refuses a lease TTL outside `MIN_TTL..=MAX_TTL`, as the builders'
/// `ttl` setting.
pub(crate) fn check_ttl(ttl: Duration) -> Result<(), Error> {
    if (MIN_TTL..=MAX_TTL).contains(&ttl) {
        return Ok(());
    }
    Err(Error::InvalidSetting {
        setting: "ttl",
        value: format!("{ttl:?}"),
        allowed: format!("between {MIN_TTL:?} and {MAX_TTL:?} (30 days)"),
    })
}

/// How long a lease of `ttl` is trusted: the TTL less the drift margin.
pub(crate) fn window(ttl: Duration) -> Duration {
    ttl.saturating_sub(drift(ttl))
}

/// The clock-drift margin of the published Redlock algorithm: 1% of the TTL
/// plus 2 ms for the granularity of Redis' expiry.
pub(crate) fn drift(ttl: Duration) -> Duration {
    ttl / 100 + Duration::from_millis(2)
}

/// The Redis key of a lock: its name, or the decimal text of a
/// [`LockKey::id`].
///
/// [`LockKey::namespaced`] keys are refused: their namespace is a PostgreSQL
/// keyspace that Redis does not have, and dropping it silently would make two
/// different locks one. The one exception is the namespace reserved for
/// semaphore slots, which maps to [`SLOT_PREFIX`] and the name: a key no
/// lock name can spell.
pub(crate) fn redis_key(key: &LockKey) -> Result<String, Error> {
    key.validate()?;
    let Some(name) = key.name() else {
        return Ok(key.to_string());
    };
    if *key == LockKey::from(name) || *key == LockKey::hashed64(name) {
        return Ok(name.to_owned());
    }
    if *key == LockKey::namespaced(crate::Semaphore::SLOT_NAMESPACE, name) {
        return Ok(format!("{SLOT_PREFIX}{name}"));
    }
    Err(Error::InvalidKey {
        key: key.clone(),
        reason: "namespaced keys select a PostgreSQL keyspace that Redis does not have; \
                 put the namespace into the name instead",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_map_to_names_and_decimal_ids() {
        assert_eq!(
            redis_key(&LockKey::from("jobs:a")).ok().as_deref(),
            Some("jobs:a")
        );
        assert_eq!(redis_key(&LockKey::id(-42)).ok().as_deref(), Some("-42"));
        assert_eq!(
            redis_key(&LockKey::hashed64("h")).ok().as_deref(),
            Some("h")
        );
        assert!(matches!(
            redis_key(&LockKey::namespaced(1, "a")),
            Err(Error::InvalidKey { .. })
        ));
        assert_eq!(
            redis_key(&LockKey::namespaced(
                crate::Semaphore::SLOT_NAMESPACE,
                "s#0"
            ))
            .ok()
            .as_deref(),
            Some("distlock:semaphore\0s#0")
        );
        assert!(matches!(
            redis_key(&LockKey::from("")),
            Err(Error::InvalidKey { .. })
        ));
    }

    #[test]
    fn no_lock_name_is_a_fence_counter() -> Result<(), Error> {
        let claim = Claim::new(LockKey::from("x"), MIN_TTL)?;
        assert_eq!(claim.fence_key(), "distlock:fencing\0x");
        assert!(matches!(
            redis_key(&LockKey::from(claim.fence_key().as_str())),
            Err(Error::InvalidKey { .. })
        ));
        assert_eq!(claim.legacy_fence_key(), "distlock:fencing:x");
        Ok(())
    }

    #[test]
    fn tokens_are_128_bit_hex_and_differ() -> Result<(), Error> {
        let a = Claim::new(LockKey::from("k"), MIN_TTL)?;
        let b = Claim::new(LockKey::from("k"), MIN_TTL)?;
        assert_eq!(a.token.len(), 32);
        assert_ne!(a.token, b.token);
        Ok(())
    }

    #[test]
    fn window_subtracts_the_drift_margin() -> Result<(), Error> {
        let claim = Claim::new(LockKey::from("k"), Duration::from_secs(10))?;
        assert_eq!(claim.window(), Duration::from_millis(10_000 - 100 - 2));
        for ttl in [Duration::from_millis(99), MAX_TTL * 2, Duration::MAX] {
            assert!(matches!(
                Claim::new(LockKey::from("k"), ttl),
                Err(Error::InvalidSetting { setting: "ttl", .. })
            ));
        }
        Ok(())
    }
}
