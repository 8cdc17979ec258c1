#!/bin/bash
# The lease table's grant statement with and without its statement-local
# `lock_timeout` (the `CASE` around the key's name), each followed by the
# release, sent by pgbench itself (no client library) as distlock sends
# them: simple queries, one client, one key. Prints "round script tps"
# lines; the two scripts take turns, round after round.
#
#   bash run.sh SECONDS ROUNDS      (e.g. bash run.sh 5 8)
#
# The database (PGDATABASE, default distlock_probe) needs distlock's schema.
# PGBENCH, PGHOST, PGUSER as for pgbench (defaults: the PostgreSQL 15
# pgbench, localhost, postgres).
set -euo pipefail
cd "$(dirname "$0")"
pgbench=${PGBENCH:-/usr/lib/postgresql/15/bin/pgbench}
t=$1; r=$2
for round in $(seq 1 "$r"); do
  for v in with_lock_timeout without; do
    tps=$("$pgbench" -h "${PGHOST:-localhost}" -U "${PGUSER:-postgres}" -n -M simple \
      -c 1 -T "$t" -f "$v.sql" "${PGDATABASE:-distlock_probe}" 2>&1 \
      | grep -oP 'tps = \K[0-9.]+' | head -1)
    echo "$round $v $tps"
  done
done
