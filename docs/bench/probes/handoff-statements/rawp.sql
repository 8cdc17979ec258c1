SELECT pg_catalog.pg_advisory_lock(pg_catalog.hashtext(:nm));
SELECT pg_catalog.pg_advisory_unlock(pg_catalog.hashtext(:nm));
