//! Kinds of locks built on any backend's [`Locker`](crate::Locker): a
//! counting [`Semaphore`] and [`LeaderElection`].

mod leader;
mod permit;
mod semaphore;

pub use leader::{Campaign, LeaderElection, LeaderElectionBuilder, LeaderInfo, Observer, Term};
pub use permit::SemaphorePermit;
pub use semaphore::Semaphore;
