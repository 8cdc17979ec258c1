//! The commands that take, extend and release a lease.
//!
//! Scripts go out with `EVAL` (not `EVALSHA`), so every call costs exactly one
//! round trip, also against a server that restarted and lost its script
//! cache; the scripts are a few hundred bytes.

use redis::Cmd;

use super::claim::Claim;
use super::signals;

/// Takes the lock if it is free or already holds our token (an earlier try
/// of the same wait whose reply was lost); with fencing (keys 2 and 3), also
/// issues the next fencing token in the same atomic step, so a token always
/// belongs to exactly one holder. Returns -1 when another holder has the
/// lock (the holder's token instead, given `ARGV[3]`), else the token (0
/// without fencing); a key of another type (an
/// application's data under the lock's name) fails the script with
/// `WRONGTYPE`, a permanent error, before it writes anything.
///
/// The first token ever counted in the counter (key 2) continues above the
/// counter of earlier versions (key 3) if that holds a plain count; a lock's
/// random token (32 characters) never passes for one. Counting happens in
/// Redis (`SET`, `INCR`), not in Lua's floating point.
///
/// The lock's key is written last: Redis does not undo a script's writes
/// when a later command in it fails, so a failing `INCR` (a counter that is
/// not a number) must come before the `SET`, or the key would stay held with
/// no lease to release it.
const ACQUIRE: &str = "\
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then
  if ARGV[3] then return held end
  return -1
end
local token = 0
if KEYS[2] then
  token = redis.call('INCR', KEYS[2])
  if token == 1 then
    local old = redis.pcall('GET', KEYS[3])
    if type(old) == 'string' and #old <= 18 and string.match(old, '^[1-9]%d*$') then
      redis.call('SET', KEYS[2], old)
      token = redis.call('INCR', KEYS[2])
    end
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return token";

/// Deletes the key only while it still holds our token: after an expiry the
/// key may belong to the next owner, whose lock must survive. Then, given a
/// channel (`ARGV[2]`), publishes on it in the same atomic step, which wakes
/// the lock's waiters (see `signals.rs`). A refused `PUBLISH` (a user
/// without access to the channel) does not fail the release: waiters then
/// find the key free at their next poll.
const RELEASE: &str = "\
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
if ARGV[2] then redis.pcall('PUBLISH', ARGV[2], '') end
return 1";

/// Resets the TTL only while the key still holds our token.
const EXTEND: &str = "\
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0";

/// The acquire script (with the two counter keys if `fencing`), as a single
/// instance sends it.
pub(crate) fn acquire(claim: &Claim, fencing: bool) -> Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(ACQUIRE);
    if fencing {
        cmd.arg(3)
            .arg(&claim.name)
            .arg(claim.fence_key())
            .arg(claim.legacy_fence_key());
    } else {
        cmd.arg(1).arg(&claim.name);
    }
    cmd.arg(&claim.token).arg(claim.ttl_millis());
    cmd
}

/// [`ACQUIRE`] without fencing, as Redlock sends it to every node,
/// answering a refusal with the token that holds the key instead of -1: an
/// attempt that reached no quorum tells one holder on a quorum (whose
/// release will signal) from a split vote among several calls (whose quiet
/// cleanups will not) by counting the nodes of each token. Replies 0 when
/// it took the key.
pub(crate) fn acquire_naming_holder(claim: &Claim) -> Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(ACQUIRE)
        .arg(1)
        .arg(&claim.name)
        .arg(&claim.token)
        .arg(claim.ttl_millis())
        .arg(1);
    cmd
}

/// Compare-then-`DEL`, and a signal to the lock's waiters when our key was
/// deleted; replies 1 when it was.
pub(crate) fn release(claim: &Claim) -> Cmd {
    let mut cmd = release_quietly(claim);
    cmd.arg(signals::channel(&claim.name));
    cmd
}

/// Compare-then-`DEL` without a signal: the cleanup of a Redlock attempt
/// that did not reach a quorum. Its keys held nothing up that a waiter is
/// waiting for, and a signal would wake the other contenders into
/// attempts of their own, whose cleanups would wake them again.
pub(crate) fn release_quietly(claim: &Claim) -> Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(RELEASE).arg(1).arg(&claim.name).arg(&claim.token);
    cmd
}

/// Compare-then-`PEXPIRE`; replies 1 when our key got a fresh TTL.
pub(crate) fn extend(claim: &Claim) -> Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(EXTEND)
        .arg(1)
        .arg(&claim.name)
        .arg(&claim.token)
        .arg(claim.ttl_millis());
    cmd
}
