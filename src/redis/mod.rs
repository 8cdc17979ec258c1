//! Leases on Redis: [`RedisLocker`] on one server, [`Redlock`] over several
//! independent servers.
//!
//! Both hand out leases with the same API as the PostgreSQL session locks
//! (`try_lock` → `Ok(None)` when held elsewhere, `lock` with a deadline,
//! `release`, `lost`, `is_lost`, `fencing_token`), and both implement
//! [`Locker`](crate::Locker) and [`Lease`](crate::Lease), so the job runner
//! and the CLI work with them unchanged.
//!
//! A lease is a key with a time to live (TTL, default 30 s) holding a random
//! 128-bit token. A watchdog task resets the TTL every TTL/3 while the lease
//! lives; only the token's owner can extend or delete the key. If the holder
//! dies, the key expires after at most one TTL.
//!
//! # Keys
//!
//! The Redis key is the lock's name: `LockKey::from("jobs:nightly")` locks the
//! key `jobs:nightly`, `LockKey::id(42)` the key `42`, and
//! `LockKey::hashed64("x")` the key `x`. [`LockKey::namespaced`](crate::LockKey::namespaced)
//! keys are refused with [`Error::InvalidKey`](crate::Error::InvalidKey): put
//! the namespace into the name. (The one namespace taken is
//! [`Semaphore::SLOT_NAMESPACE`](crate::Semaphore::SLOT_NAMESPACE), reserved
//! for a semaphore's permits: `distlock:semaphore`, a NUL byte, the slot's
//! name.) With fencing on, [`RedisLocker`] also keeps a
//! counter key per lock name: `distlock:fencing`, a NUL byte, then the name
//! (`"distlock:fencing\x00jobs:nightly"` in `redis-cli`). Lock names cannot
//! contain NUL, so no lock's key is ever a counter's, whatever its name: a
//! lock may be called `distlock:fencing:jobs:nightly`. Releases are
//! signalled on the channel `distlock:released`, a NUL byte, the key (see
//! [Waiting](#waiting)).
//!
//! # PostgreSQL, Redis or Redlock?
//!
//! * **PostgreSQL** ([`PgLocker`](crate::PgLocker)) when the work's data is in
//!   PostgreSQL. Locks are held by a session, not a clock: they cannot expire
//!   under a slow holder, waiters are queued by the server, and fencing tokens
//!   and the fence share the database's transactions. This is the crate's
//!   first choice.
//! * **[`RedisLocker`]** when there is no PostgreSQL to share, or to keep
//!   frequent locking off the database. It is a single point of failure and
//!   of truth: while it is down nobody gets a lease, and with replication and
//!   failover (Sentinel, Cluster, managed "high availability") it can grant
//!   the same lock twice (see below). Its fencing tokens make double
//!   *effects* impossible where the resource checks them.
//! * **[`Redlock`]** when locking must survive the loss of a minority of
//!   Redis servers. It is an efficiency lock, not a correctness lock: it
//!   keeps contenders apart almost always, but it depends on bounded process
//!   pauses, network delays and clock drift, and offers no fencing tokens. Use
//!   it where a rare double run only costs work (a duplicate report, a cache
//!   refilled twice). Where a double run would corrupt data, add a fence.
//!
//! This follows Martin Kleppmann's critique ("How to do distributed locking",
//! 2016) and the published Redlock algorithm: a lease based on time can
//! always be outlived by a paused holder, so correctness must come from the
//! resource rejecting stale writers, and that takes tokens from a
//! linearizable source.
//!
//! # Fencing tokens
//!
//! [`RedisLocker`] issues one with every lease: the acquire script `INCR`s
//! the lock's counter key (see [Keys](#keys)) in the same atomic step as the
//! `SET`, so a token belongs to exactly one holder and each is greater than
//! every earlier one. The counter is only as durable as the server's data: a
//! restart without persistence (AOF with `appendfsync always`) or a failover
//! to a replica that had not yet received the last `INCR` can hand out a
//! token again.
//!
//! Earlier versions counted in `distlock:fencing:<name>`, a key that the lock
//! named `distlock:fencing:<name>` shared (that lock then never came free,
//! and the first lock's acquisitions failed while it was held). An existing
//! deployment needs no migration step: the first token a name gets from the
//! new counter continues above the old counter if that key holds a count, so
//! tokens keep increasing across the upgrade. The old key is only read, never
//! changed or deleted (it may be a lock now); delete the old counters by hand
//! once every client is upgraded. Upgrade all clients that lock the same
//! names together: an older client still counting in the old key issues
//! tokens that are not ordered with the new ones.
//!
//! A [`Redlock`] lease has none ([`RedlockLease::fencing_token`] is `None`).
//! Counters on the nodes would not be sound:
//!
//! * **Process pauses.** A holder paused (GC, VM freeze, swap) past its
//!   validity keeps believing it holds the lease while a successor takes it.
//!   Only a token the *resource* checks stops its late write, and that token
//!   must be strictly greater for the successor.
//! * **Clock jumps.** Keys expire by each node's clock. A node whose clock
//!   jumps forward (NTP step, a VM resumed) expires the key early, a second
//!   client wins a majority that includes that node, and both hold the lease.
//!   Per-node counters incremented by both would not order them.
//! * **Failover and restarts.** A node that restarts without its data, or is
//!   replaced by a replica that missed writes, forgets both the key and its
//!   counter. Majorities overlap in some node, but which node's counter wins
//!   differs per attempt, so the "newest" token is not well defined: two
//!   holders can present the same value, or the successor a smaller one.
//!
//! Take the token from PostgreSQL instead, and let the resource check it with
//! [`fence::check`](crate::fence::check). Here Redlock keeps the fleet from
//! piling onto the database; the PostgreSQL lock (built with
//! `.fencing(true)`) issues the token; the fence makes a stale write
//! impossible:
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool, redlock: distlock::redis::Redlock) -> Result<(), distlock::Error> {
//! use std::time::Duration;
//! use distlock::PgLocker;
//!
//! let pg = PgLocker::builder(pool.clone()).fencing(true).build()?;
//! let Some(lease) = redlock.try_lock("report:2026-11").await? else {
//!     return Ok(()); // another worker has it
//! };
//! let lock = pg.lock("report:2026-11", Duration::from_secs(5)).await?;
//! let token = lock.fencing_token().expect("built with .fencing(true)");
//! let mut tx = pool.begin().await?;
//! distlock::fence::check(&mut tx, "report:2026-11", token).await?;
//! sqlx::query("UPDATE reports SET body = $1 WHERE month = '2026-11'")
//!     .bind("...")
//!     .execute(&mut *tx)
//!     .await?;
//! tx.commit().await?;
//! lock.release().await?;
//! lease.release().await?;
//! # Ok(()) }
//! ```
//!
//! # Unsafe setups
//!
//! Redis replication is asynchronous. With Sentinel, Cluster or any managed
//! failover, a primary can grant a lease and fail before the key reaches its
//! replica; the promoted replica does not have the key and grants the same
//! lease to a second client. A single instance therefore only guarantees
//! mutual exclusion while that one server lives with its data; Redlock's
//! majority argument only holds if its N nodes are independent primaries (no
//! replicas, not the same server twice) that keep their data or stay down
//! for a TTL after a restart.
//!
//! [`Redlock::check_setup`] and [`RedisLocker::check_setup`] ask every node
//! with `INFO` and report (and log at `WARN`) a node that is a replica, has
//! replicas, is the same server as another node (same `run_id`), evicts
//! keys at its memory limit (a held lock's key, or a fencing counter, can
//! be deleted), or does not answer. Both `connect` functions run this check
//! once.
//!
//! # Waiting
//!
//! A `lock` that finds the key held does not poll it. A release (the
//! compare-then-`DEL` script) also `PUBLISH`es, in the same atomic step,
//! on a channel named after the key: `distlock:released`, a NUL byte, then
//! the key. The waiting `lock` subscribes to that channel, tries once more
//! (a release between its first try and the subscription sent a message it
//! could not hear), and then sleeps until a release wakes it, and tries.
//!
//! * **Connections.** A locker and all its clones keep one subscriber
//!   connection per server, opened by the first `lock` that has to wait and
//!   shared by all waiters, whatever their number. The first waiter of a
//!   key subscribes to its channel on it (1 `SUBSCRIBE`), the last one to
//!   leave unsubscribes.
//! * **One wake per release.** In one locker a release wakes one waiter of
//!   the key, the one waiting longest; the others sleep on. A woken waiter
//!   that is dropped before its try passes the wake on. Under Redlock every
//!   node's message of one release wakes one waiter, so a release can wake
//!   up to one per node: the first woken may try before the other nodes
//!   have let the key go, and the later messages are what wake a waiter
//!   once they have. The extra tries count against a
//!   [`retry_count`](crate::redis::RedlockBuilder::retry_count).
//! * **The fallback poll.** Pub/sub is at-most-once, and a holder that
//!   vanishes without releasing (a crash, a partition: its key expires
//!   after at most the TTL) sends nothing. So a waiter also tries again
//!   after at most the poll interval (default 1 s,
//!   [`DEFAULT_POLL_INTERVAL`](crate::redis::DEFAULT_POLL_INTERVAL); the builders' `poll_interval`). When the
//!   subscriber connection breaks, every waiter tries once and polls with
//!   the old backoff (a single instance: 5 ms doubling to 100 ms; Redlock:
//!   the retry delay and jitter) until it is back, subscribed, and every
//!   waiter has tried once more. A server that refuses the subscription
//!   (an ACL user without access to the channels: grant it
//!   `&distlock:released*`) is logged once at `WARN`, and its waiters poll
//!   the same way.
//! * **Redlock.** Every node publishes its own release; a waiter relies on
//!   the signals when a quorum of its subscribers listens (a holder's keys
//!   are on a quorum of nodes, so at least one of those hears). An attempt
//!   that no quorum of others held (a split vote) waits the retry delay
//!   and jitter, as the published algorithm says, and its cleanup sends no
//!   signal: waking the other contenders would only make them split again.
//! * **Round trips.** A waiting `lock` costs its tries: 1 (a Redlock
//!   round: 1 to every node), then after a busy one a second try, then 1
//!   per release it is woken by or per poll. A release costs 1, as before.
//!
//! Clients of earlier versions release without publishing: their waiters
//! and releases mix with these, but a release by such a client is only
//! seen at the next poll. Upgrade all clients of the same keys together.
//!
//! # Drops, cancellation and faults
//!
//! Dropping a lease never blocks: its watchdog task deletes the key in the
//! background. Dropping an acquiring future deletes whatever it may have set.
//! Every command has a deadline; an extension that fails or finds the key
//! gone or taken fires [`lost`][`RedisLease::lost`] at once on a single
//! instance, while Redlock retries until the validity runs out. A waiting
//! `lock` treats a failure that passes (a connection refused or reset, a
//! reply that misses its deadline, `LOADING`, a failover) like a busy lock
//! and tries again until its deadline; a permanent error (a lock's key of
//! another type on a single instance, failed authentication, a missing ACL
//! permission) ends it at once; on Redlock, once the nodes failing for good
//! leave no quorum. Spans
//! `distlock.acquire` and `distlock.release` (at `DEBUG`) carry the key, the
//! backend (`redis`, `redlock`), the wait or hold time and the outcome.
//!
//! [`RedisLocker`]: crate::redis::RedisLocker
//! [`RedisLocker::check_setup`]: crate::redis::RedisLocker::check_setup
//! [`RedisLease::lost`]: crate::redis::RedisLease::lost
//! [`Redlock`]: crate::redis::Redlock
//! [`Redlock::check_setup`]: crate::redis::Redlock::check_setup
//! [`RedlockLease::fencing_token`]: crate::redis::RedlockLease::fencing_token

mod builder;
mod claim;
mod lease;
pub(crate) mod node;
mod redlock;
mod retry;
mod scripts;
mod setup;
mod signals;
mod single;
mod subscriber;
mod watchdog;

pub use builder::{RedisLockerBuilder, RedlockBuilder};
pub use lease::{RedisLease, RedlockLease};
pub use redlock::{DEFAULT_NODE_TIMEOUT, DEFAULT_RETRY_DELAY, DEFAULT_RETRY_JITTER, Redlock};
pub use setup::{NodeStatus, SetupReport, SetupWarning};
pub use single::{DEFAULT_COMMAND_TIMEOUT, RedisLocker};

/// Default of the longest pause between two tries of a waiting `lock` that
/// hears the key's releases (see [Waiting](self#waiting)): the fallback
/// poll, for a holder that vanishes without releasing and a signal lost
/// with a broken connection. Set it with the builders' `poll_interval`.
pub const DEFAULT_POLL_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);
