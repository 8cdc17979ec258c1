//! One waiter per key and process on the server.
//!
//! Every multiplexed `lock()` waits for a busy key on a temporary pooled
//! connection, by taking the key exclusively and giving it back in the same
//! statement. When the holder lets go, each such waiter in turn is granted
//! and at once gives the key back, so all of them wake within moments. With
//! many local waiters for one key that is a thundering herd (all of them
//! wake, all of them try on the shared connection, one wins, the rest queue
//! up again, at a cost that grows with the number of waiters), and each
//! waiter holds a pooled connection while it waits. Local waiters of a key
//! therefore first queue on an in-process FIFO gate; only the gate's holder
//! waits on the server.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

use crate::LockKey;

/// The gates of the keys someone in this process is waiting for, with how
/// many passes (queued or holding) each has.
#[derive(Debug, Default)]
pub(super) struct Gates {
    gates: Mutex<HashMap<LockKey, Gate>>,
}

/// A key's FIFO gate and how many passes it has.
type Gate = (Arc<AsyncMutex<()>>, usize);

impl Gates {
    /// Queues for `key`'s gate (first come, first served); the gate is held
    /// until the returned pass is dropped.
    pub(super) async fn enter(&self, key: &LockKey) -> Pass<'_> {
        let gate = {
            let mut gates = self.gates.lock().unwrap_or_else(PoisonError::into_inner);
            let (gate, passes) = gates.entry(key.clone()).or_default();
            *passes += 1;
            gate.clone()
        };
        // Counted before awaiting, so a cancelled wait still cleans up.
        let mut pass = Pass {
            gates: self,
            key: key.clone(),
            held: None,
        };
        pass.held = Some(gate.lock_owned().await);
        pass
    }
}

/// A place in (or at the head of) a key's gate.
#[derive(Debug)]
pub(super) struct Pass<'a> {
    gates: &'a Gates,
    key: LockKey,
    held: Option<OwnedMutexGuard<()>>,
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        drop(self.held.take());
        let mut gates = self
            .gates
            .gates
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some((_, passes)) = gates.get_mut(&self.key) {
            *passes -= 1;
            if *passes == 0 {
                gates.remove(&self.key);
            }
        }
    }
}
