#!/usr/bin/env bash
# Measured-profile validation of the simulated clock (docs/benchmarks.md, "Does the simulated clock
# match this machine?"): the same workload on the wall clock and on the simulated clock priced by this
# machine's measured profile, one torch thread each, back to back, twice. Wants a quiet machine.
# Usage: bash scripts/sim-validation.sh [OUT_DIR]      (default docs/results)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${ADASERVE_BIN:-.venv/bin/adaserve}
OUT=${1:-docs/results}
export OMP_NUM_THREADS=1
COMMON=(--model demo-tiny --policies incremental,chain:4,adaserve+ours --rps 4 --duration 20 --seed 0 --max-tokens 96
        --max-prompt-tokens 256)
for i in 1 2; do
  echo "round $i, load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
  "$BIN" bench "${COMMON[@]}" --json "$OUT/sim-validation-demo-tiny-wall-$i.json" > /dev/null
  echo "round $i, load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
  "$BIN" bench "${COMMON[@]}" --clock simulated --device-profile measured --sched-ms measured \
      --json "$OUT/sim-validation-demo-tiny-measured-$i.json" > /dev/null
done
