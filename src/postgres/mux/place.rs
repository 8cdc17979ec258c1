//! One lock's place under a multiplexed locker's `max_locks`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// One place under `max_locks`, given back when dropped: by the attempt or
/// the driver when the try took nothing, or, once granted, with the lock's
/// unlock request when the driver has run it (or dropped it with its
/// connection, which freed the lock on the server). Until then the lock may
/// still be held on the server, so its place stays taken, whatever the
/// guard's `release()` reported, and whether or not the caller was still
/// there to receive the grant.
#[derive(Debug)]
pub(super) struct Place(Option<Arc<AtomicUsize>>);

impl Place {
    /// No place: the locker has no limit.
    pub(super) fn unlimited() -> Self {
        Self(None)
    }

    /// A place counted in `held`, and how many were taken before it.
    pub(super) fn counted(held: &Arc<AtomicUsize>) -> (Self, usize) {
        (
            Self(Some(held.clone())),
            held.fetch_add(1, Ordering::AcqRel),
        )
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        if let Some(held) = &self.0 {
            held.fetch_sub(1, Ordering::AcqRel);
        }
    }
}
