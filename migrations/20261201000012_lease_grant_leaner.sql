-- A lease grant does less on the server.
--
-- 1. A free key is taken by its first statement. lease_acquire looked for
--    an expired row to take over (UPDATE), then for a live one (SELECT),
--    and only then inserted: three statements for the most common grant.
--    It now inserts first (ON CONFLICT DO NOTHING: a row in the way, live
--    or expired, is left alone and not locked) and looks at the row in the
--    way only when there is one. A refused attempt still writes nothing:
--    DO NOTHING finds the conflict before it inserts, and an UPDATE whose
--    WHERE fails does not lock the row.
--
-- 2. Expired rows are purged by about one grant in 16, up to 32 rows each
--    time, instead of by every grant, up to 8. The purge probes the
--    expires_at index even when nothing has expired, which made it a
--    large part of a grant's server time. Every vanished holder leaves at
--    most one expired row per grant it got, and the purges remove up to 2
--    per grant on average, so such rows still cannot accumulate; a takeover
--    of an expired row of the same key removes it at once, as before, and
--    distlock.lease_purge (TableLocker::purge_expired) clears any number.
--
-- 3. lease_purge finds expired rows through the expires_at index. It
--    compared expires_at with clock_timestamp(), which is volatile, so the
--    index could only be read in order from its start with a filter on
--    every entry: a purge read every live lease (and every dead index entry
--    not yet cleaned up) before it found that nothing had expired. It now
--    compares with the time it read once at its start, an index condition
--    that stops at the first lease still running. The DELETE still checks
--    each row against clock_timestamp() once it is locked.
--
-- The contract is unchanged otherwise: the same arguments and columns, a
-- token drawn only once the row is won (20261201000010), greater than
-- every token issued before; NOTIFY only on release (lease_release).

-- Deletes up to p_limit expired leases (oldest first, skipping rows another
-- transaction has locked); returns how many. Called by about one grant in
-- 16, so rows of holders that vanished without releasing do not
-- accumulate.
CREATE OR REPLACE FUNCTION distlock.lease_purge(p_limit integer)
RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n bigint;
    -- A value, not clock_timestamp() in the query: an index condition.
    now_at timestamptz := pg_catalog.clock_timestamp();
BEGIN
    WITH doomed AS (
        SELECT l.space, l.lock_id FROM distlock.leases AS l
        WHERE l.expires_at <= now_at
        ORDER BY l.expires_at
        LIMIT greatest(p_limit, 0)
        FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM distlock.leases AS l USING doomed AS d
        WHERE l.space = d.space AND l.lock_id = d.lock_id
          -- Re-checked on the locked row: a lease renewed or taken over in
          -- between is not expired any more.
          AND l.expires_at <= pg_catalog.clock_timestamp()
        RETURNING 1
    )
    SELECT pg_catalog.count(*) INTO n FROM gone;
    RETURN n;
END
$$;

CREATE OR REPLACE FUNCTION distlock.lease_acquire(
    p_space smallint, p_lock_id bigint, p_key text, p_owner uuid, p_ttl_ms bigint,
    OUT granted boolean, OUT fencing_token bigint, OUT wait_ms bigint)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    ttl interval;
BEGIN
    IF p_ttl_ms IS NULL OR p_ttl_ms < 1 OR p_ttl_ms > 86400000 THEN
        RAISE EXCEPTION 'distlock: lease ttl must be between 1 and 86400000 ms, not %', p_ttl_ms
            USING ERRCODE = '22023';
    END IF;
    ttl := p_ttl_ms * interval '1 millisecond';
    LOOP
        -- No row: insert one. A concurrent inserter of the same key makes
        -- this wait for its commit and then do nothing. The token is drawn
        -- only once the row is ours (see the end of the function); 0
        -- stands in until then, seen by nobody else.
        INSERT INTO distlock.leases AS l
            (space, lock_id, key_text, owner, token, acquired_at, renewed_at, expires_at)
        VALUES (p_space, p_lock_id, p_key, p_owner,
                0,
                pg_catalog.clock_timestamp(), pg_catalog.clock_timestamp(),
                pg_catalog.clock_timestamp() + ttl)
        ON CONFLICT (space, lock_id) DO NOTHING
        RETURNING l.token INTO fencing_token;
        IF FOUND THEN
            EXIT;
        END IF;

        -- A row is in the way: take it over if it has expired (the
        -- condition is evaluated again on the locked, newest row version,
        -- so two takers cannot both win).
        UPDATE distlock.leases AS l
        SET key_text = p_key, owner = p_owner,
            token = 0,
            acquired_at = pg_catalog.clock_timestamp(),
            renewed_at = pg_catalog.clock_timestamp(),
            expires_at = pg_catalog.clock_timestamp() + ttl
        WHERE l.space = p_space AND l.lock_id = p_lock_id
          AND l.expires_at <= pg_catalog.clock_timestamp()
        RETURNING l.token INTO fencing_token;
        IF FOUND THEN
            EXIT;
        END IF;

        SELECT pg_catalog.ceil(pg_catalog.date_part('epoch',
                   l.expires_at - pg_catalog.clock_timestamp()) * 1000)::bigint
        INTO wait_ms
        FROM distlock.leases AS l
        WHERE l.space = p_space AND l.lock_id = p_lock_id;
        IF FOUND AND wait_ms >= 1 THEN
            granted := false;
            RETURN;
        END IF;
        -- Released or expired between the statements: look again.
    END LOOP;
    -- The row is ours (locked until commit): draw the token now. A token
    -- drawn before the row was won could be smaller than that of a taker
    -- who was granted and released the key in between, had this statement
    -- been delayed (tokens would then not follow the order of grants).
    -- The counter is distlock.next_token(), shared by every lock, so
    -- tokens are ordered across PgLocker and TableLocker and never repeat
    -- after a crash or a failover.
    UPDATE distlock.leases AS l
    SET token = distlock.next_token()
    WHERE l.space = p_space AND l.lock_id = p_lock_id
    RETURNING l.token INTO fencing_token;
    granted := true;
    wait_ms := NULL;
    IF pg_catalog.random() < 0.0625 THEN
        PERFORM distlock.lease_purge(32);
    END IF;
END
$$;
