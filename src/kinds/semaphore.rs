//! A counting semaphore over any backend: at most `permits` leases at once
//! across all processes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::JoinSet;

use crate::{Error, Lease, LockKey, Locker};

/// At most `permits` holders at once, across every process and locker that
/// uses the same backend and name.
///
/// The permits are `permits` ordinary locks, `"{name}#0"` … `"{name}#{permits-1}"`:
/// a holder of any one of them holds a permit, so the bound is exactly as
/// strong as the backend's mutual exclusion, and each permit's lease is the
/// backend's lease (with its fencing token where the backend issues them,
/// and its `lost()`). The cost of that layout: a try costs up to `permits`
/// lock attempts (it starts at a random slot, so holders spread out), and a
/// waiting [`acquire`](Self::acquire) waits on every slot at once (on
/// PostgreSQL's default mode, one pooled connection per slot while it
/// waits), so keep `permits` small (tens, not thousands).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), distlock::Error> {
/// use std::sync::Arc;
/// use std::time::Duration;
/// let locker = Arc::new(distlock::PgLocker::new(pool));
/// let exports = distlock::Semaphore::new(locker, "exports", 3);
/// let permit = exports.acquire(Duration::from_secs(30)).await?;
/// // ... at most three exports run at once, cluster-wide ...
/// permit.release().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Semaphore {
    locker: Arc<dyn Locker>,
    name: String,
    permits: u32,
}

impl Semaphore {
    /// A semaphore of `permits` permits named `name` on `locker`. Zero
    /// permits, or a name that is not a valid key, is refused by the first
    /// `try_acquire` / `acquire` with an [`Error`].
    pub fn new(locker: Arc<dyn Locker>, name: &str, permits: u32) -> Self {
        Self {
            locker,
            name: name.to_owned(),
            permits,
        }
    }

    /// The number of permits.
    pub fn permits(&self) -> u32 {
        self.permits
    }

    fn slot(&self, i: u32) -> LockKey {
        LockKey::from(format!("{}#{i}", self.name))
    }

    fn check(&self) -> Result<(), Error> {
        if self.permits == 0 {
            return Err(Error::InvalidConfig(
                "a semaphore needs at least one permit",
            ));
        }
        LockKey::from(self.name.as_str()).validate()
    }

    /// Takes a free permit, without waiting; `Ok(None)` if all are held.
    ///
    /// Tries the slots one after another from a random one: up to
    /// `permits` lock attempts (each what the backend's `try_lock` costs).
    ///
    /// # Cancel safety
    ///
    /// As the backend's `try_lock`: a dropped call holds nothing.
    pub async fn try_acquire(&self) -> Result<Option<Box<dyn Lease>>, Error> {
        self.check()?;
        let start = rand_start(self.permits);
        for i in 0..self.permits {
            let slot = self.slot((start + i) % self.permits);
            if let Some(lease) = self.locker.try_lock(slot).await? {
                return Ok(Some(lease));
            }
        }
        Ok(None)
    }

    /// Takes a permit, waiting up to `timeout`; [`Error::Timeout`] when the
    /// deadline passes.
    ///
    /// Tries first; if every permit is held, waits on all slots at once with
    /// the backend's `lock` (on PostgreSQL a wait on the server, so a freed
    /// permit reaches a waiter as soon as the server grants it, without
    /// polling) and keeps the first it gets; the other waits are cancelled,
    /// and a slot granted to one of them in the same instant is released in
    /// the background.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future cancels every wait (each as cancel safe as the
    /// backend's `lock`); no permit is left held.
    pub async fn acquire(&self, timeout: Duration) -> Result<Box<dyn Lease>, Error> {
        if let Some(lease) = self.try_acquire().await? {
            return Ok(lease);
        }
        let started = Instant::now();
        let remaining = timeout;
        let mut waits = JoinSet::new();
        for i in 0..self.permits {
            let (locker, slot) = (Arc::clone(&self.locker), self.slot(i));
            waits.spawn(async move { locker.lock(slot, remaining).await });
        }
        let mut last_error = None;
        while let Some(done) = waits.join_next().await {
            match done {
                Ok(Ok(lease)) => {
                    // Dropping the set cancels the other waits; a lease one
                    // of them got meanwhile is dropped, so released.
                    waits.shutdown().await;
                    return Ok(lease);
                }
                Ok(Err(Error::Timeout { .. })) => {}
                Ok(Err(err)) => last_error = Some(err),
                // A backend's panic is the caller's to see.
                Err(join) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
                Err(_) => {}
            }
        }
        Err(last_error.unwrap_or(Error::Timeout {
            key: self.name.clone(),
            waited: started.elapsed(),
            holder_pid: None,
            holder_application: None,
        }))
    }
}

/// A random slot to start from, so that holders spread over the slots.
fn rand_start(permits: u32) -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    nanos % permits.max(1)
}
