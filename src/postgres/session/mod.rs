//! Session-scoped locks: taking them ([`acquire`], [`multi`]), their guards
//! ([`guard`]: `SessionLock`; [`multi_lock`]: `MultiLock`), and what keeps a
//! held lock honest: the slot the guard and its keeper share ([`slot`]), the
//! keeper task and its heartbeat ([`keeper`], [`heartbeat`]), the timer that
//! starts keepers ([`timer`]), and the unlock ([`unlock`], [`hold`]); a lock
//! another task keeps (the multiplexed driver) is released through
//! [`kept_elsewhere`]. An
//! upgradeable read lock ([`upgradeable_lock`]: `UpgradeableLock`) is a
//! session lock whose holder changes what it holds ([`upgrade`]), one
//! operation at a time on its own connection ([`in_flight`]).

pub(crate) mod acquire;
pub(crate) mod guard;
pub(crate) mod heartbeat;
pub(crate) mod hold;
pub(crate) mod in_flight;
pub(crate) mod keeper;
pub(crate) mod kept_elsewhere;
pub(crate) mod multi;
pub(crate) mod multi_lock;
pub(crate) mod slot;
pub(crate) mod timer;
pub(crate) mod unlock;
pub(crate) mod upgrade;
pub(crate) mod upgradeable;
pub(crate) mod upgradeable_lock;
