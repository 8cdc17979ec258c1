-- Leases in a table (distlock::postgres::TableLocker): one row per held key,
-- for clients that reach PostgreSQL through a transaction pooler (no session
-- of their own) or that must keep their locks across a failover to a
-- synchronous standby (a row is replicated; a session lock is not).
--
-- Every call below is one statement in one short transaction. Expiry is
-- judged by this server's clock (clock_timestamp()), never a client's.
--
-- space 1: a single-bigint key, lock_id is that bigint (hashtext(name) widened,
--          an id, or a 64-bit hash), as pg_advisory_lock(bigint) sees it.
-- space 2: a two-int key (ns, hashtext(name)), lock_id is
--          (ns << 32) | (hashtext(name) & 0xffffffff).
CREATE TABLE distlock.leases (
    space       smallint    NOT NULL CHECK (space IN (1, 2)),
    lock_id     bigint      NOT NULL,
    -- The key as the client spelled it, for people reading this table.
    key_text    text        NOT NULL,
    -- A random value per lease: only its holder knows it.
    owner       uuid        NOT NULL,
    token       bigint      NOT NULL,
    acquired_at timestamptz NOT NULL,
    renewed_at  timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (space, lock_id)
);
-- Finds expired rows for lease_purge without reading the live ones.
CREATE INDEX leases_expires_at ON distlock.leases (expires_at);

-- Deletes up to p_limit expired leases (oldest first, skipping rows another
-- transaction has locked); returns how many. Called by every grant, so rows of
-- holders that vanished without releasing do not accumulate.
-- plpgsql, not sql: a sql function with its own search_path is planned
-- again on every call (about 0.3 ms for this statement); plpgsql keeps the
-- plan for the session.
CREATE FUNCTION distlock.lease_purge(p_limit integer)
RETURNS bigint
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n bigint;
BEGIN
    WITH doomed AS (
        SELECT l.space, l.lock_id FROM distlock.leases AS l
        WHERE l.expires_at <= pg_catalog.clock_timestamp()
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

-- Grants the lease (space, lock_id) to p_owner for p_ttl_ms milliseconds if
-- nobody holds it or its holder's lease has expired.
--
-- granted:       whether p_owner holds it now.
-- fencing_token: the new lease's token (NULL when not granted); greater than
--                every token issued for this key before.
-- wait_ms:       when not granted, how long the holder's lease has left (at
--                least 1): a waiter need not look again sooner, unless the
--                holder releases (NOTIFY distlock_lease, see lease_release).
--
-- A refused attempt writes nothing. A grant takes over an expired row
-- (UPDATE ... WHERE expired: the condition is evaluated again on the locked,
-- newest row version, so two takers cannot both win) or inserts a new one.
CREATE FUNCTION distlock.lease_acquire(
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
        -- The fencing token comes from distlock.next_token(), the counter
        -- of every lock, so tokens are ordered across PgLocker and
        -- TableLocker and never repeat after a crash or a failover.
        UPDATE distlock.leases AS l
        SET key_text = p_key, owner = p_owner,
            token = distlock.next_token(),
            acquired_at = pg_catalog.clock_timestamp(),
            renewed_at = pg_catalog.clock_timestamp(),
            expires_at = pg_catalog.clock_timestamp() + ttl
        WHERE l.space = p_space AND l.lock_id = p_lock_id
          AND l.expires_at <= pg_catalog.clock_timestamp()
        RETURNING l.token INTO fencing_token;
        IF FOUND THEN
            granted := true;
            PERFORM distlock.lease_purge(8);
            RETURN;
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
        -- this wait for its commit and then do nothing (the token drawn for
        -- this attempt is skipped, which keeps tokens increasing); look again.
        INSERT INTO distlock.leases AS l
            (space, lock_id, key_text, owner, token, acquired_at, renewed_at, expires_at)
        VALUES (p_space, p_lock_id, p_key, p_owner,
                distlock.next_token(),
                pg_catalog.clock_timestamp(), pg_catalog.clock_timestamp(),
                pg_catalog.clock_timestamp() + ttl)
        ON CONFLICT (space, lock_id) DO NOTHING
        RETURNING l.token INTO fencing_token;
        IF FOUND THEN
            granted := true;
            wait_ms := NULL;
            PERFORM distlock.lease_purge(8);
            RETURN;
        END IF;
    END LOOP;
END
$$;

-- Extends p_owner's lease by p_ttl_ms from now, only while it is p_owner's
-- and unexpired: a renewal that arrives late (after expiry, or after someone
-- else took the key) changes nothing and returns false, so an expired lease
-- is never brought back.
CREATE FUNCTION distlock.lease_renew(
    p_space smallint, p_lock_id bigint, p_owner uuid, p_ttl_ms bigint)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE distlock.leases AS l
    SET renewed_at = pg_catalog.clock_timestamp(),
        expires_at = pg_catalog.clock_timestamp()
            + least(greatest(p_ttl_ms, 1), 86400000) * interval '1 millisecond'
    WHERE l.space = p_space AND l.lock_id = p_lock_id AND l.owner = p_owner
      AND l.expires_at > pg_catalog.clock_timestamp();
    RETURN FOUND;
END
$$;

-- Ends p_owner's lease: returns true if it was p_owner's and unexpired.
-- p_owner's row is deleted even when it has expired (nobody else holds a row
-- that carries p_owner), and waiters are told at commit on channel
-- distlock_lease, payload '<space>:<lock_id>'. Another owner's row is never
-- touched.
CREATE FUNCTION distlock.lease_release(p_space smallint, p_lock_id bigint, p_owner uuid)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    valid boolean;
BEGIN
    DELETE FROM distlock.leases AS l
    WHERE l.space = p_space AND l.lock_id = p_lock_id AND l.owner = p_owner
    RETURNING l.expires_at > pg_catalog.clock_timestamp() INTO valid;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM pg_catalog.pg_notify('distlock_lease', p_space::text || ':' || p_lock_id::text);
    RETURN valid;
END
$$;
