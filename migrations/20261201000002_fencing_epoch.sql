-- Fencing tokens that never repeat, without a durable write per token.
--
-- A token is a plain positive bigint laid out as
--
--   bit 63       0 (tokens stay positive)
--   bits 62..32  the epoch: (timeline << 16) | restart number (31 bits)
--   bits 31..0   the counter within the epoch (32 bits)
--
-- The counter is a sequence: nextval is atomic and increases in real time,
-- and a holder calls it only after the lock is granted, so the next holder
-- of any lock draws a larger value. A sequence is not transactional and is
-- WAL-logged only every 32 values, so issuing a token writes no table row
-- and, with synchronous_commit = off, flushes nothing.
--
-- What a crash or a failover may lose is covered by the epoch, which is
-- written (and flushed) once per server start, promotion or counter wrap:
--
-- * Crash and restart: the sequence may fall back (its last WAL record was
--   not flushed). The postmaster start time differs from the stored one, so
--   the first token after the restart moves to the next epoch, durably,
--   before anyone sees it.
-- * Failover: the promoted server's stored epoch may be behind the old
--   primary's, but its timeline is higher, and the epoch of timeline t is
--   at least t << 16, above every epoch of any lower timeline. A timeline
--   therefore has 65535 epochs: restarts and counter wraps past that raise
--   DL002 rather than reuse the next timeline's numbers.
-- * Counter wrap (2^32 tokens in one epoch): the next epoch starts.
--
-- The stored epoch and the start of its counter live in one row; only the
-- functions below write it (SECURITY DEFINER, fixed search_path).
CREATE SEQUENCE distlock.token_counter AS bigint NO CYCLE;
-- From PostgreSQL 15 on the counter can skip WAL altogether (a logged
-- sequence writes a record, and under synchronous_commit = on waits for a
-- flush, every 32 values). A crash resets an unlogged sequence, and a
-- standby does not have it; both already start the next epoch.
DO $$
BEGIN
    IF current_setting('server_version_num')::int >= 150000 THEN
        EXECUTE 'ALTER SEQUENCE distlock.token_counter SET UNLOGGED';
    END IF;
END
$$;

CREATE TABLE distlock.token_epoch (
    only_row        boolean     PRIMARY KEY DEFAULT true CHECK (only_row),
    epoch           bigint      NOT NULL CHECK (epoch >= 0 AND epoch < 2147483648),
    timeline        bigint      NOT NULL,
    server_started  timestamptz NOT NULL,
    counter_base    bigint      NOT NULL,
    changed_at      timestamptz NOT NULL DEFAULT now()
);

-- The timeline WAL is written on now (the insert position's file name starts
-- with it). On a standby this fails: tokens are only issued by a primary.
CREATE FUNCTION distlock.current_timeline()
RETURNS bigint
LANGUAGE sql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT ('x' || substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_insert_lsn()), 1, 8))::bit(32)::bigint $$;

-- The next fencing token. 1 nextval and a read of one row; a durable write
-- only when an epoch starts. Starting an epoch is part of this function
-- (not a function of its own) so that no role can call it to use epochs up.
CREATE FUNCTION distlock.next_token()
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    e       distlock.token_epoch%ROWTYPE;
    counter bigint;
    tli     bigint;
    next    bigint;
BEGIN
    LOOP
        SELECT * INTO STRICT e FROM distlock.token_epoch;
        counter := nextval('distlock.token_counter');
        -- The timeline WAL is written on now (the insert position's file
        -- name starts with it), inline: a call of current_timeline() would
        -- cost a function call with its own search_path, per token.
        tli := ('x' || substr(pg_catalog.pg_walfile_name(
                   pg_catalog.pg_current_wal_insert_lsn()), 1, 8))::bit(32)::bigint;
        IF e.server_started = pg_catalog.pg_postmaster_start_time()
           AND e.timeline = tli
           AND counter > e.counter_base
           AND counter - e.counter_base < 4294967296 THEN
            RETURN (e.epoch << 32) | (counter - e.counter_base);
        END IF;
        -- This epoch's counter may have fallen back (a crash) or run out,
        -- or the server was promoted: start the next epoch, then draw again
        -- (the loop ends: the new epoch matches this server and its base is
        -- below the next draw). Above every earlier epoch of this timeline
        -- and, as epochs of timeline t start at t << 16, of every lower one.
        SELECT greatest(x.epoch + 1, tli << 16) INTO next
        FROM distlock.token_epoch AS x WHERE x.epoch = e.epoch FOR UPDATE;
        CONTINUE WHEN NOT FOUND; -- someone else started the next epoch first
        -- A timeline lower than the stored one (a cluster made by pg_upgrade
        -- starts at 1) cannot order failovers any more; tokens still increase.
        IF (tli >= e.timeline AND next >= (tli + 1) << 16) OR next >= 2147483648 THEN
            RAISE EXCEPTION 'distlock: fencing epochs of timeline % are used up (epoch %)', tli, next
                USING ERRCODE = 'DL002';
        END IF;
        -- Durable even where the session runs with synchronous_commit = off:
        -- a token of this epoch must never be issued again after a crash.
        IF current_setting('synchronous_commit') = 'off' THEN
            PERFORM set_config('synchronous_commit', 'local', true);
        END IF;
        UPDATE distlock.token_epoch
        SET epoch = next, timeline = tli, server_started = pg_catalog.pg_postmaster_start_time(),
            counter_base = counter, changed_at = now();
    END LOOP;
END
$$;

-- Tokens of every kind of lock come from the one counter: tokens of any
-- lock strictly increase, and two spellings of one server lock can never
-- see the same token. The arguments are kept for callers of the previous
-- version.
CREATE OR REPLACE FUNCTION distlock.issue_token_in(p_space smallint, p_lock_id bigint)
RETURNS bigint
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$ SELECT distlock.next_token() $$;

-- The lock statements call these; each goes straight to next_token (a
-- function with a search_path of its own costs a few µs per call).
CREATE OR REPLACE FUNCTION distlock.issue_token(p_key bigint)
RETURNS bigint
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$ SELECT distlock.next_token() $$;

CREATE OR REPLACE FUNCTION distlock.issue_token(p_a int, p_b int)
RETURNS bigint
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$ SELECT distlock.next_token() $$;

-- Epoch 0 of this server; every token above the previous counters'. The
-- first token moves to the server's timeline epoch (>= 1 << 16), so all new
-- tokens exceed 2^48 and every token the per-lock counters issued (checked).
DO $$
BEGIN
    IF (SELECT coalesce(max(token), 0) FROM distlock.fencing_counters) >= (1::bigint << 48)
       OR (SELECT token FROM distlock.fencing_floor) >= (1::bigint << 48) THEN
        RAISE EXCEPTION 'distlock: existing fencing tokens exceed 2^48; the epoch layout cannot continue above them'
            USING ERRCODE = 'DL002';
    END IF;
END
$$;
INSERT INTO distlock.token_epoch (epoch, timeline, server_started, counter_base)
VALUES (0, 0, pg_postmaster_start_time(), 0);

-- Processes of the name-keyed version still write distlock.fencing_tokens
-- during a rolling upgrade: give them tokens from the same counter, so their
-- tokens and ours stay ordered.
DROP TRIGGER raise_fencing_floor ON distlock.fencing_tokens;
CREATE FUNCTION distlock.fencing_tokens_from_epoch()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    NEW.token := distlock.next_token();
    RETURN NEW;
END
$$;
CREATE TRIGGER fencing_tokens_from_epoch
BEFORE INSERT OR UPDATE ON distlock.fencing_tokens
FOR EACH ROW EXECUTE FUNCTION distlock.fencing_tokens_from_epoch();

COMMENT ON TABLE distlock.fencing_counters IS
    'Per-lock fencing counters of the previous version; tokens now come from '
    'distlock.next_token() (epoch << 32 | counter) and are all above these.';
