-- Hardening against other roles of the database.
--
-- 1. Every function of schema distlock runs with a fixed search_path, so a
--    role that can create objects in a schema earlier on the caller's path
--    (or a temporary table) cannot substitute an operator or function inside
--    them. Written generically: it covers every function present when it
--    runs; migrations written after it declare the same on their own
--    functions (`SET search_path = pg_catalog, pg_temp`).
--
-- 2. Fencing state can only grow. Writes to the counters, the floor and the
--    fence go through functions that run as the schema's owner (SECURITY
--    DEFINER, fixed search_path) and only ever raise a value, so application
--    roles need no write privilege on those tables; write privileges other
--    roles hold on them are revoked here. See the README for the grants an
--    application role needs.
--
-- Idempotent: running it again changes nothing.

DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure
          FROM pg_catalog.pg_proc AS p
         WHERE p.pronamespace = 'distlock'::regnamespace
           AND p.proname IN ('fence_advance', 'issue_token_in', 'raise_fencing_floor')
    LOOP
        EXECUTE pg_catalog.format('ALTER FUNCTION %s SECURITY DEFINER', f);
    END LOOP;

    FOR f IN
        SELECT p.oid::regprocedure
          FROM pg_catalog.pg_proc AS p
         WHERE p.pronamespace = 'distlock'::regnamespace
    LOOP
        EXECUTE pg_catalog.format('ALTER FUNCTION %s SET search_path = pg_catalog, pg_temp', f);
    END LOOP;
END
$$;

-- Only the owner (through the functions above) writes fencing state.
DO $$
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT DISTINCT t.table_name, t.grantee
          FROM information_schema.role_table_grants AS t
         WHERE t.table_schema = 'distlock'
           AND t.table_name IN ('fencing_counters', 'fencing_floor', 'fence_seen', 'token_epoch')
           AND t.privilege_type IN ('INSERT', 'UPDATE', 'DELETE', 'TRUNCATE')
           AND t.grantee <> (SELECT pg_catalog.pg_get_userbyid(c.relowner)
                               FROM pg_catalog.pg_class AS c
                              WHERE c.oid = pg_catalog.format('distlock.%I', t.table_name)::regclass)
    LOOP
        EXECUTE pg_catalog.format(
            'REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON distlock.%I FROM %s',
            g.table_name,
            CASE WHEN g.grantee = 'PUBLIC' THEN 'PUBLIC' ELSE pg_catalog.quote_ident(g.grantee) END);
    END LOOP;
END
$$;

-- The token counter: setval would let a role move it back within an epoch.
DO $$
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT DISTINCT a.grantee
          FROM pg_catalog.pg_class AS c, pg_catalog.aclexplode(c.relacl) AS a
         WHERE c.oid = 'distlock.token_counter'::regclass
           AND a.grantee <> c.relowner
           AND a.privilege_type = 'UPDATE'
    LOOP
        EXECUTE pg_catalog.format(
            'REVOKE UPDATE ON SEQUENCE distlock.token_counter FROM %s',
            CASE WHEN g.grantee = 0 THEN 'PUBLIC'
                 ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(g.grantee)) END);
    END LOOP;
END
$$;
