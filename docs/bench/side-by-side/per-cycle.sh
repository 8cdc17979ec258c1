#!/usr/bin/env bash
# Client-side cost of one lock cycle, counted rather than timed: the
# instructions the client process executes (valgrind's callgrind, which
# counts within 1% of the same total for the same binary and inputs however
# busy the machine is: only how often a task is polled depends on timing) and the system calls it makes (strace -c), per cycle, for
# each alternative of the side-by-side binary (`--only ALT`, current-thread
# runtime, back to back). Each alternative runs twice, for 100 and for 600
# cycles after the same warm-up; the difference divided by 500 is the cost
# of a cycle, without the set-up (connecting, migrating) both runs share.
#
#   per-cycle.sh BINARY [ALT ...]
#
# BINARY is a built side-by-side binary (run.sh with SBS_DIR keeps it, in
# $SBS_DIR/target/release/distlock-side-by-side); ALT defaults to the
# session and transaction cycles and their baselines. The runs go one
# after the other (they share the databases sbs_old and sbs_new).
set -euo pipefail

bin=${1:?usage: per-cycle.sh BINARY [ALT ...]}
shift
alts=("$@")
if [[ ${#alts[@]} -eq 0 ]]; then
    alts=(XactRaw OldXact NewXact SessionRaw SessionSqlx OldSession NewSession)
fi
out=$(mktemp -d /tmp/distlock-per-cycle.XXXXXX)

instructions() { # ALT N -> total instructions of the run
    valgrind --tool=callgrind --callgrind-out-file="$out/$1.$2.cg" \
        "$bin" --only "$1" --cycles "$2" --warmup 20 >/dev/null 2>&1
    sed -n 's/^totals: *//p; s/^summary: *//p' "$out/$1.$2.cg" | head -1
}

syscalls() { # ALT N -> "name calls" lines
    strace -f -c -o "$out/$1.$2.st" "$bin" --only "$1" --cycles "$2" --warmup 20 >/dev/null 2>&1
    awk 'NF >= 5 && $1 ~ /^[0-9]/ && $NF != "total" { print $NF, $4 }' "$out/$1.$2.st"
}

echo "| alternative | instructions per cycle | system calls per cycle |"
echo "|---|---:|---|"
for alt in "${alts[@]}"; do
    short=$(instructions "$alt" 100)
    long=$(instructions "$alt" 600)
    # One run at a time: both create and drop the same databases.
    syscalls "$alt" 100 | sort >"$out/short"
    syscalls "$alt" 600 | sort >"$out/long"
    calls=$(join -a1 -a2 -e0 -o 0,1.2,2.2 "$out/short" "$out/long" |
        awk '{ d = ($3 - $2) / 500; if (d >= 0.05 || d <= -0.05) printf "%s %.2f, ", $1, d }')
    echo "| $alt | $(((long - short) / 500)) | ${calls%, } |"
done
rm -rf "$out"
