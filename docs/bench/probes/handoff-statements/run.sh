#!/bin/bash
# Hand-offs of one hot key driven by pgbench itself (no sqlx, no distlock
# client): each script is one hold, a lock statement and an unlock
# statement, sent prepared (`-M prepared`, as sqlx sends them) by every
# client on the same key. Prints "round script tps" lines; the scripts run
# in turns, round after round, so that drift on the machine spreads over
# all of them.
#
#   bash run.sh CLIENTS SECONDS ROUNDS SCRIPT...   (script names without .sql)
#   bash run.sh 32 5 5 rawp full no_keepalive no_standby no_lock_timeout raw_wait_dl_unlock dl_wait_raw_unlock
#
# PGBENCH, PGHOST, PGUSER, PGDATABASE as for pgbench (defaults: the
# PostgreSQL 15 pgbench, localhost, postgres, postgres).
set -euo pipefail
cd "$(dirname "$0")"
pgbench=${PGBENCH:-/usr/lib/postgresql/15/bin/pgbench}
c=$1; t=$2; r=$3; shift 3
for round in $(seq 1 "$r"); do
  for v in "$@"; do
    tps=$("$pgbench" -h "${PGHOST:-localhost}" -U "${PGUSER:-postgres}" -n -M prepared \
      -c "$c" -j 2 -T "$t" -D sp=1 -D nm=hk -D lt=10s -f "$v.sql" "${PGDATABASE:-postgres}" 2>&1 \
      | grep -oP 'tps = \K[0-9.]+' | head -1)
    echo "$round $v $tps"
  done
done
