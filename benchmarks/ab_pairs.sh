#!/usr/bin/env bash
# A paired A/B of two source trees, interleaved: ab_pairs.sh TREE_A TREE_B [PAIRS] -- one JSON line per run of
# benchmarks/ab_tree.py, then the median over pairs of each figure's ratio A/B (issue 54: within 1.00 +- 0.10).
set -euo pipefail
a=$1; b=$2; pairs=${3:-5}
py=${PYTHON:-python}
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp)
for i in $(seq "$pairs"); do
  for side in a b; do
    tree=$([ "$side" = a ] && echo "$a" || echo "$b")
    line=$(PYTHONPATH="$tree" "$py" "$here/ab_tree.py" ${AB_ARGS:-})
    echo "$side $line" | tee -a "$out"
  done
done
"$py" - "$out" <<'PY'
import json, statistics, sys
runs = {"a": [], "b": []}
for line in open(sys.argv[1]):
    side, body = line.split(" ", 1)
    runs[side].append(json.loads(body))
for key in runs["a"][0]:
    ratios = [x[key] / y[key] for x, y in zip(runs["a"], runs["b"])]
    print(f"{key}: median A/B {statistics.median(ratios):.3f} over {len(ratios)} pairs "
          f"(A median {statistics.median(r[key] for r in runs['a']) * 1e3:.1f} ms, "
          f"B {statistics.median(r[key] for r in runs['b']) * 1e3:.1f} ms)")
PY
