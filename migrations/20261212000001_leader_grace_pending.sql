-- A proclamation waits its grace also after a record whose term never
-- started (its since still ahead).
--
-- Whether a new leader waits depended only on whether the record it replaces
-- had withdrawn. A successor that proclaimed after a loss and stopped during
-- its grace (a deploy, a lost lock, a proclamation whose answer was lost)
-- withdrew a term that never started: the leader before it, which never
-- stepped down, may still believe it leads until that grace is over. The
-- next proclamation saw a withdrawn record and led at once, beside it.
-- Such a record counts as not withdrawn now.
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
    after_loss := previous.pid IS NOT NULL OR previous.owner IS NOT NULL
                  OR previous.since > pg_catalog.clock_timestamp();
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
