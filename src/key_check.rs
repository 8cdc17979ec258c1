//! The check every locking call runs on a key before it reaches a server:
//! a name that can name a lock on every backend.

use crate::key::{INTENT_NAMESPACE, Repr};
use crate::{Error, LockKey};

impl LockKey {
    /// Checks that the key can name a lock: its name is neither empty nor
    /// contains a NUL byte, and it is not in the namespace reserved for
    /// upgrade intents
    /// ([`UpgradeableLock::INTENT_NAMESPACE`](crate::UpgradeableLock::INTENT_NAMESPACE)).
    ///
    /// Every locking call runs this check first; call it yourself to reject a
    /// bad name early.
    ///
    /// ```
    /// # use distlock::{Error, LockKey};
    /// assert!(LockKey::from("jobs:nightly").validate().is_ok());
    /// assert!(matches!(LockKey::from("").validate(), Err(Error::InvalidKey { .. })));
    /// assert!(matches!(LockKey::from("a\0b").validate(), Err(Error::InvalidKey { .. })));
    /// let intent = distlock::UpgradeableLock::INTENT_NAMESPACE;
    /// assert!(matches!(LockKey::namespaced(intent, "x").validate(), Err(Error::InvalidKey { .. })));
    /// ```
    pub fn validate(&self) -> Result<(), Error> {
        if let Repr::Namespaced(INTENT_NAMESPACE, _) = self.repr {
            return Err(Error::InvalidKey {
                key: self.clone(),
                reason: "its namespace is reserved for upgrade intents \
                         (UpgradeableLock::INTENT_NAMESPACE)",
            });
        }
        let Some(name) = self.name() else {
            return Ok(());
        };
        let reason = if name.is_empty() {
            "the name is empty"
        } else if name.contains('\0') {
            "the name contains a NUL byte, which PostgreSQL text cannot hold"
        } else {
            return Ok(());
        };
        Err(Error::InvalidKey {
            key: self.clone(),
            reason,
        })
    }
}
