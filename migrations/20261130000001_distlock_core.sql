-- distlock's tables live in the schema "distlock" (created by distlock::migrate),
-- next to their own migrations table distlock._sqlx_migrations.

-- Fencing tokens: one counter per lock key, incremented by every session-lock
-- acquisition made with fencing enabled (while the advisory lock is held).
CREATE TABLE distlock.fencing_tokens (
    lock_key   text        PRIMARY KEY,
    token      bigint      NOT NULL,
    issued_at  timestamptz NOT NULL DEFAULT now()
);

-- The resource side: the highest token each protected resource has accepted.
CREATE TABLE distlock.fence_seen (
    resource    text        PRIMARY KEY,
    token       bigint      NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- Records `token` for `resource` if it is not older than the newest seen, and
-- returns the newest token after the call. The presented token was accepted
-- if and only if the result equals it.
CREATE FUNCTION distlock.fence_advance(p_resource text, p_token bigint)
RETURNS bigint
LANGUAGE plpgsql
AS $$
DECLARE
    newest bigint;
BEGIN
    INSERT INTO distlock.fence_seen AS s (resource, token)
    VALUES (p_resource, p_token)
    ON CONFLICT (resource) DO UPDATE
        SET token = EXCLUDED.token, updated_at = now()
        WHERE s.token <= EXCLUDED.token
    RETURNING s.token INTO newest;
    IF NOT FOUND THEN
        -- The conflicting row is locked by the ON CONFLICT above, so this
        -- reads the value that made the token stale.
        SELECT s.token INTO newest FROM distlock.fence_seen AS s WHERE s.resource = p_resource;
    END IF;
    RETURN newest;
END
$$;

-- The same rule for triggers and other languages: raises SQLSTATE DL001
-- ("stale fencing token") for a token older than the newest seen, which
-- aborts the caller's transaction and so the protected write.
CREATE FUNCTION distlock.fence_check(p_resource text, p_token bigint)
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    newest bigint := distlock.fence_advance(p_resource, p_token);
BEGIN
    IF newest > p_token THEN
        RAISE EXCEPTION 'stale fencing token for %: presented %, but % was already seen',
            p_resource, p_token, newest
            USING ERRCODE = 'DL001', DETAIL = newest::text;
    END IF;
END
$$;

-- Idempotency keys: a (scope, key) can be claimed once; the claim commits or
-- rolls back with the transaction that makes the effect.
CREATE TABLE distlock.idempotency_keys (
    scope       text        NOT NULL,
    key         text        NOT NULL,
    claimed_at  timestamptz NOT NULL DEFAULT now(),
    result      text,
    PRIMARY KEY (scope, key)
);
CREATE INDEX idempotency_keys_claimed_at ON distlock.idempotency_keys (claimed_at);

-- Deletes claims older than `older_than`; returns how many were deleted.
CREATE FUNCTION distlock.purge_idempotency_keys(older_than interval)
RETURNS bigint
LANGUAGE sql
AS $$
    WITH gone AS (
        DELETE FROM distlock.idempotency_keys WHERE claimed_at < now() - older_than RETURNING 1
    )
    SELECT count(*) FROM gone;
$$;

-- Singleton jobs: one row per (job, window start) that has run, so a restart
-- within the same window does not run the job again.
CREATE TABLE distlock.job_runs (
    job           text        NOT NULL,
    window_start  timestamptz NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT now(),
    finished_at   timestamptz,
    outcome       text,
    PRIMARY KEY (job, window_start)
);
