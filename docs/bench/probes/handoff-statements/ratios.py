"""Per-round ratios of `run.sh` output: each script against `rawp` (the
bare statements) and against `full` (distlock's), and their medians.

    python3 ratios.py out.txt
"""

import collections
import statistics
import sys

rows = [line.split() for line in open(sys.argv[1]) if len(line.split()) == 3]
by_round = collections.defaultdict(dict)
for rnd, script, tps in rows:
    by_round[int(rnd)][script] = float(tps)
scripts = {s for _, s, _ in rows}
for base in ("rawp", "full"):
    if base not in scripts:
        continue
    print(f"against {base}:")
    for script in sorted(scripts):
        ratios = [r[script] / r[base] for r in by_round.values() if script in r and base in r]
        print(f"  {script:20s} {' '.join(f'{x:.2f}' for x in ratios)}  median {statistics.median(ratios):.2f}")
