-- Fencing counters keyed by the lock as PostgreSQL sees it, not by the
-- spelling of the key: LockKey::from('x') and LockKey::id(hashtext('x')) are
-- one server lock and share one counter; id(42), from('42') and
-- hashed64('42') are three locks with three counters.
--
-- space 1: pg_advisory_lock(bigint), lock_id is that bigint.
-- space 2: pg_advisory_lock(int, int), lock_id is (a << 32) | (b & 0xffffffff).
CREATE TABLE distlock.fencing_counters (
    space      smallint    NOT NULL CHECK (space IN (1, 2)),
    lock_id    bigint      NOT NULL,
    token      bigint      NOT NULL,
    issued_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (space, lock_id)
);

-- Every token issued from now on is above every token the name-keyed
-- counters (distlock.fencing_tokens) ever issued: the floor starts at their
-- highest token, and a process of the previous version that still issues
-- tokens there during a rolling upgrade raises it (trigger below).
CREATE TABLE distlock.fencing_floor (
    only_row  boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    token     bigint  NOT NULL
);
INSERT INTO distlock.fencing_floor (token)
SELECT coalesce(max(token), 0) FROM distlock.fencing_tokens;

CREATE FUNCTION distlock.raise_fencing_floor()
RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    UPDATE distlock.fencing_floor SET token = NEW.token WHERE token < NEW.token;
    RETURN NULL;
END
$$;

CREATE TRIGGER raise_fencing_floor
AFTER INSERT OR UPDATE ON distlock.fencing_tokens
FOR EACH ROW EXECUTE FUNCTION distlock.raise_fencing_floor();

-- Issues the next token of one server lock: one more than both its own
-- counter and the floor. Called by distlock's lock statements while the
-- advisory lock is held, so tokens of one lock strictly increase.
CREATE FUNCTION distlock.issue_token_in(p_space smallint, p_lock_id bigint)
RETURNS bigint
LANGUAGE sql
AS $$
    INSERT INTO distlock.fencing_counters AS c (space, lock_id, token)
    SELECT p_space, p_lock_id, f.token + 1 FROM distlock.fencing_floor AS f
    ON CONFLICT (space, lock_id) DO UPDATE
        SET token = greatest(c.token, (SELECT f.token FROM distlock.fencing_floor AS f)) + 1,
            issued_at = now()
    RETURNING c.token
$$;

-- The next token of pg_advisory_lock(p_key).
CREATE FUNCTION distlock.issue_token(p_key bigint)
RETURNS bigint
LANGUAGE sql
AS $$ SELECT distlock.issue_token_in(1::smallint, p_key) $$;

-- The next token of pg_advisory_lock(p_a, p_b).
CREATE FUNCTION distlock.issue_token(p_a int, p_b int)
RETURNS bigint
LANGUAGE sql
AS $$ SELECT distlock.issue_token_in(2::smallint, (p_a::bigint << 32) | (p_b::bigint & 4294967295)) $$;

COMMENT ON TABLE distlock.fencing_tokens IS
    'Name-keyed fencing counters of distlock before per-server-lock counters; '
    'no longer written by current versions, kept for processes of the previous '
    'version during a rolling upgrade (their tokens raise distlock.fencing_floor).';
