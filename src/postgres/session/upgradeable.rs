//! Taking upgradeable read locks: `PgLocker::try_lock_upgradeable` and
//! `PgLocker::lock_upgradeable`, which return an [`UpgradeableLock`]
//! (`upgradeable_lock.rs`). They are session locks of one more shape
//! ([`Hold::Upgradeable`]): the same acquisition, on a dedicated connection
//! in every mode.

use std::time::Duration;

use crate::postgres::locker::PgLocker;
use crate::postgres::session::hold::Hold;
use crate::postgres::session::upgradeable_lock::UpgradeableLock;
use crate::{Error, LockKey};

impl PgLocker {
    /// Takes an upgradeable read lock on `key` if no one holds it
    /// exclusively and no other session holds it upgradeable, without
    /// waiting; `Ok(None)` if someone does.
    ///
    /// Plain readers ([`try_lock_shared`](Self::try_lock_shared),
    /// [`lock_shared`](Self::lock_shared)) hold `key` beside it; a plain
    /// writer ([`try_lock`](Self::try_lock), [`lock`](Self::lock)) does not,
    /// as beside any reader. The guard can [`upgrade`](UpgradeableLock::upgrade)
    /// to exclusive and [`downgrade`](UpgradeableLock::downgrade) back; see
    /// [`UpgradeableLock`] for how. No fencing token (readers do not write;
    /// an upgrade draws one).
    ///
    /// Costs what [`try_lock`](Self::try_lock) costs: 1 round trip (the
    /// key's upgrade intent and the key itself are tried in one statement,
    /// which gives the intent back if the key is busy), plus what the pool
    /// spends on a connection; bounded on a stalled network as
    /// [`try_lock`](Self::try_lock) is ([`Error::CommandTimedOut`]). In the
    /// multiplexed mode it takes a connection of its own from the pool, as a
    /// shared lock does.
    ///
    /// # Cancel safety
    ///
    /// As for [`try_lock`](Self::try_lock): dropped before it returns, the
    /// connection is closed, which frees whatever it took.
    pub async fn try_lock_upgradeable(
        &self,
        key: impl Into<LockKey>,
    ) -> Result<Option<UpgradeableLock>, Error> {
        let lock = self.try_lock_as(key.into(), Hold::Upgradeable).await?;
        Ok(lock.map(|lock| self.upgradeable(lock)))
    }

    /// Takes an upgradeable read lock on `key`, waiting up to `timeout`
    /// while someone holds it exclusively or another session holds it
    /// upgradeable; fails with [`Error::Timeout`] when the deadline passes.
    ///
    /// The wait happens on the server, first for the key's upgrade intent (the
    /// other upgradeable holder), then for the key (a writer), both within the
    /// one `timeout`; as for [`lock_shared`](Self::lock_shared), the read
    /// queues behind a writer that waits already. The intent is always taken
    /// before the key, so two sessions that wait for it never hold the key
    /// shared against each other's upgrade. Costs as for [`lock`](Self::lock):
    /// 1 round trip when free, 2 when it waits (4 on a session with a
    /// `statement_timeout` or `transaction_timeout`), plus 1 to name a holder
    /// on timeout (the intent's holder, or with the intent free the writer,
    /// never a plain reader); a wait that fails closes its connection. A `timeout` of zero
    /// is a single try; one longer than the server's `lock_timeout` can express
    /// (about 24.8 days) means "as long as the server allows", as for
    /// [`lock`](Self::lock). In the multiplexed mode it takes a connection of
    /// its own from the pool.
    ///
    /// ```no_run
    /// # async fn demo(locker: distlock::PgLocker) -> Result<(), distlock::Error> {
    /// use std::time::Duration;
    /// let mut cache = locker.lock_upgradeable("cache:prices", Duration::from_secs(5)).await?;
    /// // ... read; other readers read too ...
    /// cache.upgrade(Duration::from_secs(5)).await?; // waits for the other readers to leave
    /// // ... write, alone ...
    /// cache.release().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// As for [`lock`](Self::lock): dropped while it waits, the connection
    /// is closed and the server abandons the wait within 100 ms; nothing is
    /// left held.
    pub async fn lock_upgradeable(
        &self,
        key: impl Into<LockKey>,
        timeout: Duration,
    ) -> Result<UpgradeableLock, Error> {
        let lock = self.lock_as(key.into(), timeout, Hold::Upgradeable).await?;
        Ok(self.upgradeable(lock))
    }

    fn upgradeable(&self, lock: crate::SessionLock) -> UpgradeableLock {
        let config = self.config();
        UpgradeableLock::new(lock, config.fencing, config.heartbeat_timeout)
    }
}
