-- Fencing tokens drawn by the lock statement itself, without a function call
-- on the common path.
--
-- distlock.next_token() reads the epoch row and the crash marker before every
-- draw: the epoch it issues in must have started after the server's last
-- recovery (20261201000011). A backend that has seen a live epoch once
-- needs no second look for as long as it lives: every event that makes an
-- epoch stale (a crash recovery, a restart, a promotion: a standby draws no
-- token) ends every backend that was running before it. The one exception is
-- a counter that runs out (2^32 tokens in one epoch): another backend then
-- starts the next epoch, with a base above this backend's base + 2^32, which
-- this backend's own draws show.
--
-- So distlock.next_token_and_cache() issues a token as next_token() does and
-- then remembers the epoch it issued in, for this backend only, in three
-- settings of the session (never written elsewhere; rolled back with a
-- failed transaction; emptied by RESET ALL and DISCARD ALL):
--   distlock.token_base  the epoch's counter base,
--   distlock.token_high  the epoch << 32,
--   distlock.token_seq   the oid of distlock.token_counter (a schema dropped
--                        and created again has a new counter: the remembered
--                        epoch is not its epoch).
-- A lock statement whose backend remembers an epoch of this counter (the
-- oid matches) draws nextval('distlock.token_counter') and issues
-- token_high + (draw - token_base) when 0 < draw - token_base < 2^32: the
-- token next_token() would have issued for that draw. Otherwise it calls
-- next_token_and_cache(): a backend's first token (no draw wasted), a counter
-- run out, a setting reset. The measured gain is in BENCHMARKS.md.
--
-- A session can set these settings itself, and then draws tokens of its own
-- choosing; a role that can take a lock can present any number to a fence in
-- any case. The shared state (the counter, the epoch row, the fence) still
-- only grows: setval needs UPDATE on the counter, which no application role
-- holds (20261201000009).
--
-- The statement draws from the counter with the caller's privileges: every
-- role that may execute next_token() is given USAGE on the counter (nextval
-- and currval, not setval). A role given EXECUTE later needs the same grant
-- (the README's grants for an application role, under "Locks, fencing
-- tokens and idempotency keys").
--
-- Idempotent: running it again changes nothing.

CREATE OR REPLACE FUNCTION distlock.next_token_and_cache()
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    token  bigint := distlock.next_token();
    e      bigint;
    b      bigint;
BEGIN
    -- The epoch row as it is now; remembered only if the token just issued
    -- is of that epoch (another backend may have started the next one in
    -- between: then the next statement comes back here).
    SELECT x.epoch, x.counter_base INTO e, b FROM distlock.token_epoch AS x;
    IF FOUND AND token >> 32 = e THEN
        PERFORM set_config('distlock.token_base', b::text, false),
                set_config('distlock.token_high', (e << 32)::text, false),
                set_config('distlock.token_seq',
                           'distlock.token_counter'::regclass::oid::text, false);
    END IF;
    RETURN token;
END
$$;

COMMENT ON FUNCTION distlock.next_token_and_cache() IS
    'distlock.next_token(), remembering its epoch for this backend in the '
    'settings distlock.token_base, distlock.token_high and distlock.token_seq '
    '(see migration token_draw_in_statement).';

-- USAGE on the counter for every role that may execute next_token().
DO $$
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT DISTINCT a.grantee
          FROM pg_catalog.pg_proc AS p,
               pg_catalog.aclexplode(coalesce(p.proacl, pg_catalog.acldefault('f', p.proowner))) AS a
         WHERE p.oid = 'distlock.next_token()'::regprocedure
           AND a.privilege_type = 'EXECUTE'
           AND a.grantee <> p.proowner
    LOOP
        EXECUTE pg_catalog.format(
            'GRANT USAGE ON SEQUENCE distlock.token_counter TO %s',
            CASE WHEN g.grantee = 0 THEN 'PUBLIC'
                 ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(g.grantee)) END);
    END LOOP;
END
$$;
