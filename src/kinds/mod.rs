//! Kinds of locks built on any backend's [`Locker`](crate::Locker): a
//! counting [`Semaphore`] and [`LeaderElection`].

mod leader;
mod semaphore;

pub use leader::{Campaign, LeaderElection};
pub use semaphore::Semaphore;
