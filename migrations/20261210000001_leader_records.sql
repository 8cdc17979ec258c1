-- Leader records of distlock::LeaderElection: who leads an election, written
-- by the leader while it holds the election's lock, and believed by readers
-- only while the server shows that holder holding the lock: for a session
-- advisory lock (PgLocker) pg_locks shows the backend the record names, for a
-- lease of the lease table (TableLocker) its row is the record's owner's and
-- unexpired. A record outlives its leader (a crash writes nothing), so the
-- table alone never says who leads: distlock.leader_of does.
--
-- Idempotent (IF NOT EXISTS, OR REPLACE): running it again changes nothing.
--
-- via 1: a session advisory lock; pid and backend_start name its backend.
-- via 2: a lease of distlock.leases; owner names it.
-- space 1: a single-bigint key, lock_id is that bigint, as
--          pg_advisory_lock(bigint) sees it (objsubid 1 in pg_locks).
-- space 2: a two-int key (a, b), lock_id is (a << 32) | (b & 0xffffffff)
--          (objsubid 2).
CREATE TABLE IF NOT EXISTS distlock.leaders (
    via           smallint    NOT NULL CHECK (via IN (1, 2)),
    space         smallint    NOT NULL CHECK (space IN (1, 2)),
    lock_id       bigint      NOT NULL,
    -- The key as the client spelled it, for people reading this table.
    key_text      text        NOT NULL,
    -- Terms proclaimed for this election so far; the current one's number.
    term          bigint      NOT NULL,
    identity      text        NOT NULL,
    value         text        NOT NULL,
    fencing_token bigint,
    -- via 1: the backend that holds the election's lock for this term, and
    -- when it started (so a later backend given the same pid is not taken
    -- for it). NULL once the leader withdrew.
    pid           integer,
    backend_start timestamptz,
    -- via 2: the lease's owner. NULL once the leader withdrew.
    owner         uuid,
    -- When the term started (after a takeover's grace: later than written).
    since         timestamptz NOT NULL,
    PRIMARY KEY (via, space, lock_id)
);

-- Whether backend p_pid holds the exclusive advisory lock (p_space,
-- p_lock_id) of this database, as the lock manager shows it now (pg_locks
-- is read live, not from the transaction's snapshot).
CREATE OR REPLACE FUNCTION distlock.holds_advisory_lock(p_pid integer, p_space smallint, p_lock_id bigint)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN EXISTS (
        SELECT 1 FROM pg_catalog.pg_locks AS l
        WHERE l.pid = p_pid
          AND l.locktype = 'advisory'
          AND l.granted
          AND l.mode = 'ExclusiveLock'
          AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                            WHERE d.datname = pg_catalog.current_database())
          AND l.objsubid = p_space
          AND ((l.classid::pg_catalog.int8 << 32) | l.objid::pg_catalog.int8) = p_lock_id);
END
$$;

-- Whether the holder a record names holds the election's lock now: via 1,
-- backend p_pid (started at p_started) holds the advisory lock; via 2, the
-- lease row is p_owner's and unexpired (by this server's clock).
CREATE OR REPLACE FUNCTION distlock.leader_holds(
    p_via smallint, p_space smallint, p_lock_id bigint,
    p_pid integer, p_started timestamptz, p_owner uuid)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_via = 1 THEN
        RETURN p_pid IS NOT NULL
           AND p_started IS NOT DISTINCT FROM
               (SELECT s.backend_start FROM pg_catalog.pg_stat_get_activity(p_pid) AS s)
           AND p_started IS NOT NULL
           AND distlock.holds_advisory_lock(p_pid, p_space, p_lock_id);
    END IF;
    RETURN p_owner IS NOT NULL AND EXISTS (
        SELECT 1 FROM distlock.leases AS l
        WHERE l.space = p_space AND l.lock_id = p_lock_id AND l.owner = p_owner
          AND l.expires_at > pg_catalog.clock_timestamp());
END
$$;

-- Records a new term of the election (p_via, p_space, p_lock_id) led by the
-- holder p_pid (via 1) or p_owner (via 2), if it holds the election's lock
-- now; all NULL, recording nothing, if it does not. after_loss: the record
-- replaced still named a leader (it had not withdrawn), which may not know
-- yet that it lost; the new leader then waits p_grace_ms before it leads,
-- and its term starts (since) that much later.
CREATE OR REPLACE FUNCTION distlock.leader_proclaim(
    p_via smallint, p_space smallint, p_lock_id bigint, p_key text,
    p_pid integer, p_owner uuid,
    p_identity text, p_value text, p_token bigint, p_grace_ms bigint,
    OUT term bigint, OUT since timestamptz, OUT after_loss boolean)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    started  timestamptz;
    previous distlock.leaders%ROWTYPE;
BEGIN
    IF p_via = 1 THEN
        SELECT s.backend_start INTO started FROM pg_catalog.pg_stat_get_activity(p_pid) AS s;
    END IF;
    IF NOT coalesce(distlock.leader_holds(p_via, p_space, p_lock_id, p_pid, started, p_owner), false) THEN
        RETURN;
    END IF;
    INSERT INTO distlock.leaders (via, space, lock_id, key_text, term, identity, value, since)
    VALUES (p_via, p_space, p_lock_id, p_key, 0, '', '', pg_catalog.clock_timestamp())
    ON CONFLICT (via, space, lock_id) DO NOTHING;
    SELECT * INTO STRICT previous FROM distlock.leaders AS r
    WHERE r.via = p_via AND r.space = p_space AND r.lock_id = p_lock_id
    FOR UPDATE;
    -- Checked again with the row locked: a holder deposed since the first
    -- check must not overwrite the record of a successor that waits for
    -- this row.
    IF NOT coalesce(distlock.leader_holds(p_via, p_space, p_lock_id, p_pid, started, p_owner), false) THEN
        RETURN;
    END IF;
    after_loss := previous.pid IS NOT NULL OR previous.owner IS NOT NULL;
    UPDATE distlock.leaders AS r
    SET key_text = p_key, term = previous.term + 1, identity = p_identity, value = p_value,
        fencing_token = p_token, pid = p_pid, backend_start = started, owner = p_owner,
        since = pg_catalog.clock_timestamp()
                + CASE WHEN after_loss THEN p_grace_ms * interval '1 millisecond'
                       ELSE interval '0' END
    WHERE r.via = p_via AND r.space = p_space AND r.lock_id = p_lock_id
    RETURNING r.term, r.since INTO term, since;
END
$$;

-- Clears the record of (p_via, p_space, p_lock_id) if it names the holder
-- p_pid / p_owner (and term p_term, unless NULL): its leader stepped down.
-- Whether it did.
CREATE OR REPLACE FUNCTION distlock.leader_withdraw(
    p_via smallint, p_space smallint, p_lock_id bigint,
    p_pid integer, p_owner uuid, p_term bigint)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE distlock.leaders AS r
    SET pid = NULL, backend_start = NULL, owner = NULL
    WHERE r.via = p_via AND r.space = p_space AND r.lock_id = p_lock_id
      AND (r.pid = p_pid OR r.owner = p_owner)
      AND (p_term IS NULL OR r.term = p_term);
    RETURN FOUND;
END
$$;

-- Who leads the election (p_via, p_space, p_lock_id): its record, if its
-- term has started and the holder it names holds the election's lock now
-- (distlock.leader_holds); no row otherwise. Via 1 the caller must see the
-- holder's backend in pg_stat_activity (its own role's, or any with
-- pg_read_all_stats).
CREATE OR REPLACE FUNCTION distlock.leader_of(p_via smallint, p_space smallint, p_lock_id bigint)
RETURNS TABLE (identity text, value text, term bigint, since timestamptz, fencing_token bigint)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT r.identity, r.value, r.term, r.since, r.fencing_token
    FROM distlock.leaders AS r
    WHERE r.via = p_via AND r.space = p_space AND r.lock_id = p_lock_id
      AND r.since <= pg_catalog.clock_timestamp()
      AND coalesce(distlock.leader_holds(r.via, r.space, r.lock_id, r.pid, r.backend_start, r.owner), false);
END
$$;
