-- Fencing epochs start after every crash recovery, not only after a restart
-- of the postmaster.
--
-- When one backend dies (kill -9, a segfault, the OOM killer) the postmaster
-- ends every other backend and runs crash recovery without restarting, so
-- pg_postmaster_start_time() stays. WAL that was not flushed is lost. Where
-- the token counter is a logged sequence (PostgreSQL 14, see
-- 20261201000002_fencing_epoch.sql), its last advance may be among it: the
-- counter fell back, the start time matched, and next_token() issued tokens
-- again that it had issued before the crash.
--
-- Every crash recovery, on every version, resets each unlogged relation to
-- empty, and a standby has none of their rows (nor has it after promotion).
-- The epoch in force is therefore also written to an unlogged one-row table
-- when it starts; next_token() issues tokens of the stored epoch only while
-- that row names it. A missing or different row means the server went
-- through recovery since the epoch started (a crash of any kind, a promoted
-- standby, a restored backup): the next epoch starts, durably, before any of
-- its tokens is seen. A clean shutdown keeps unlogged rows, and the counter
-- with them; a restart still starts an epoch (the start time rule is kept,
-- as is the timeline rule), so a restart costs one epoch, as before.
--
-- Cost per token: the epoch row and the marker are read in one statement.
-- In loops of 200,000 calls on PostgreSQL 15 (a loaded 2-core machine) a
-- call took 7-14 µs, against 5-8 µs without the marker; a lock statement's
-- round trip is far longer. Writing the marker is no WAL.
--
-- Idempotent (the hardening below may be run again after new grants).

CREATE UNLOGGED TABLE IF NOT EXISTS distlock.token_epoch_live (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    epoch    bigint  NOT NULL
);

COMMENT ON TABLE distlock.token_epoch_live IS
    'The fencing epoch in force since the last crash recovery (unlogged: '
    'emptied by every recovery, which makes distlock.next_token() start the '
    'next epoch). Written only by distlock.next_token().';

-- Only the owner (through next_token) writes the marker: a role that could
-- insert it after a crash would keep the fallen-back counter in the old
-- epoch, and one that could delete it would use epochs up. Revoked from
-- every other role that was given a write privilege (a default privilege
-- of the schema, a grant on all its tables), as the hardening migration
-- does for the other fencing tables.
DO $$
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT DISTINCT a.grantee
          FROM pg_catalog.pg_class AS c, pg_catalog.aclexplode(c.relacl) AS a
         WHERE c.oid = 'distlock.token_epoch_live'::regclass
           AND a.grantee <> c.relowner
           AND a.privilege_type IN ('INSERT', 'UPDATE', 'DELETE', 'TRUNCATE')
    LOOP
        EXECUTE pg_catalog.format(
            'REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON distlock.token_epoch_live FROM %s',
            CASE WHEN g.grantee = 0 THEN 'PUBLIC'
                 ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(g.grantee)) END);
    END LOOP;
END
$$;

-- As in 20261201000002_fencing_epoch.sql, plus the marker: tokens of the
-- stored epoch only while the marker names it.
CREATE OR REPLACE FUNCTION distlock.next_token()
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    e_epoch    bigint;
    e_timeline bigint;
    e_started  timestamptz;
    e_base     bigint;
    live       boolean;
    counter    bigint;
    tli        bigint;
    next       bigint;
BEGIN
    LOOP
        -- Read before the draw: a marker seen here was written before this
        -- counter value, by the transaction that started the epoch after
        -- the last recovery (a recovery ends this backend too).
        -- The marker as a scalar subquery (at most one row: only_row is
        -- its key), not a join: without statistics the planner made the
        -- join a merge join of two sorts, measured slower (10-20 µs a call).
        SELECT x.epoch, x.timeline, x.server_started, x.counter_base,
               coalesce(x.epoch = (SELECT m.epoch FROM distlock.token_epoch_live AS m), false)
          INTO STRICT e_epoch, e_timeline, e_started, e_base, live
          FROM distlock.token_epoch AS x;
        counter := nextval('distlock.token_counter');
        -- The timeline WAL is written on now (the insert position's file
        -- name starts with it), inline: a call of current_timeline() would
        -- cost a function call with its own search_path, per token.
        tli := ('x' || substr(pg_catalog.pg_walfile_name(
                   pg_catalog.pg_current_wal_insert_lsn()), 1, 8))::bit(32)::bigint;
        IF live
           AND e_started = pg_catalog.pg_postmaster_start_time()
           AND e_timeline = tli
           AND counter > e_base
           AND counter - e_base < 4294967296 THEN
            RETURN (e_epoch << 32) | (counter - e_base);
        END IF;
        -- The server recovered since this epoch started (the marker is
        -- gone: the counter may have fallen back), restarted, was promoted,
        -- or the counter ran out: start the next epoch, then draw again
        -- (the loop ends: the new epoch and its marker match this server
        -- and its base is below the next draw). Above every earlier epoch
        -- of this timeline and, as epochs of timeline t start at t << 16,
        -- of every lower one.
        SELECT greatest(x.epoch + 1, tli << 16) INTO next
        FROM distlock.token_epoch AS x WHERE x.epoch = e_epoch FOR UPDATE;
        CONTINUE WHEN NOT FOUND; -- someone else started the next epoch first
        -- A timeline lower than the stored one (a cluster made by pg_upgrade
        -- starts at 1) cannot order failovers any more; tokens still increase.
        IF (tli >= e_timeline AND next >= (tli + 1) << 16) OR next >= 2147483648 THEN
            RAISE EXCEPTION 'distlock: fencing epochs of timeline % are used up (epoch %)', tli, next
                USING ERRCODE = 'DL002';
        END IF;
        -- Durable even where the session runs with synchronous_commit = off:
        -- a token of this epoch must never be issued again after a crash.
        -- (Others see the new epoch and its marker only once this commit is
        -- flushed.)
        IF current_setting('synchronous_commit') = 'off' THEN
            PERFORM set_config('synchronous_commit', 'local', true);
        END IF;
        UPDATE distlock.token_epoch
        SET epoch = next, timeline = tli, server_started = pg_catalog.pg_postmaster_start_time(),
            counter_base = counter, changed_at = now();
        INSERT INTO distlock.token_epoch_live AS m (only_row, epoch) VALUES (true, next)
        ON CONFLICT (only_row) DO UPDATE SET epoch = EXCLUDED.epoch;
    END LOOP;
END
$$;
