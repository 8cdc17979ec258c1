//! A session lock kept by someone other than its guard (a multiplexed
//! connection's driver): what the guard holds of it, so that `release()`
//! runs on the caller's task and a dropped guard queues the unlock without
//! awaiting. No task stands between the guard and the keeper: a task on the
//! caller's runtime would be dropped with that runtime, and would let go of
//! a lock its guard still trusts.

use std::future::Future;
use std::pin::Pin;

use crate::Error;

/// The release of a lock kept elsewhere. Dropping it without
/// [`release`](Self::release) queues the unlock (never blocks, needs no
/// runtime).
pub(crate) trait KeptElsewhere: Send + Sync {
    /// Unlocks, within the locker's release deadline.
    fn release(self: Box<Self>) -> Pin<Box<dyn Future<Output = Result<(), Error>> + Send>>;
}
