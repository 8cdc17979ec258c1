-- Lease tokens follow the order of grants.
--
-- lease_acquire drew the fencing token while building the row, before it
-- knew the row would be its own. A taker delayed between that draw and its
-- insert (a busy server, a stalled backend) could be granted a free key
-- with a token below that of a taker who had been granted and released the
-- key meanwhile. The token is now drawn after the row is won, by a second
-- UPDATE of the locked row in the same transaction.

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
        -- The token is drawn only once the row is ours (see the end of the
        -- function); 0 stands in until then, seen by nobody else.
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
        IF FOUND THEN
            IF wait_ms >= 1 THEN
                granted := false;
                RETURN;
            END IF;
            -- It expired between the two statements: take it over.
            CONTINUE;
        END IF;

        -- No row: insert one. A concurrent inserter of the same key makes
        -- this wait for its commit and then do nothing; look again.
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
    PERFORM distlock.lease_purge(8);
END
$$;
