#!/usr/bin/env bash
# The engine's own cost before and after a change (docs/benchmarks.md, "The engine's own cost").
# Two git worktrees, one per version; every (mode, batch) cell runs once in each, back to back, so both
# versions see the same machine conditions; ROUNDS rounds; then one combined JSON with the table.
# Usage: [MODEL=demo-tiny] [BATCHES="1 8 16 32"] bash scripts/engine-only-before-after.sh BEFORE_DIR AFTER_DIR OUT.json \
#            [THREADS] [ROUNDS] [STEPS]
#   BEFORE_DIR / AFTER_DIR: checkouts of the two versions (git worktree add --detach DIR COMMIT); the
#   measuring module is taken from this checkout's adaserve/bench, so both are measured the same way.
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=$1 AFTER=$2 OUT=$3 THREADS=${4:-1} ROUNDS=${5:-3} STEPS=${6:-12}
PY=${ADASERVE_PYTHON:-$PWD/.venv/bin/python}
TMP=$(mktemp -d)
for dir in "$BEFORE" "$AFTER"; do
  cp adaserve/bench/engine_only.py adaserve/bench/microbench_options.py "$dir/adaserve/bench/"
done
for r in $(seq 1 "$ROUNDS"); do
  for mode in spec plain; do
    for n in ${BATCHES:-1 8 16 32}; do
      for v in before after; do
        dir=$BEFORE; [ "$v" = after ] && dir=$AFTER
        (cd "$dir" && PYTHONPATH="$dir" "$PY" -m adaserve.bench.engine_only --threads "$THREADS" --repeats 1 \
          --steps "$STEPS" ${MODEL:+--model "$MODEL"} --modes "$mode" --batches "$n" --json "$TMP/$v-$mode-$n-r$r.json" > /dev/null)
      done
    done
  done
done
"$PY" -m adaserve.bench.engine_only --before "$TMP"/before-*.json --after "$TMP"/after-*.json --json "$OUT" > /dev/null
echo "wrote $OUT (runs in $TMP)"
