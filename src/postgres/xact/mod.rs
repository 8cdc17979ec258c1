//! Transaction-scoped locks: `with_advisory_lock*`, which open the
//! transaction the lock lives in ([`with_lock`]), locks inside the caller's
//! own transaction ([`caller`]: `try_lock_xact`, `lock_xact`), and the
//! per-task record that names a nested lock on the same key ([`nesting`]).

pub(crate) mod caller;
pub(crate) mod nesting;
pub(crate) mod with_lock;
