#!/usr/bin/env bash
# The AdaServe paper's Figures 8-11 in shape, on the replay clock (docs/benchmarks.md, "The paper's figures on
# the replay clock"): the artifact's own traces, its Llama-3.1-70B latency table, the paper's baselines, and
# acceptance replayed from the demo pair's recorded draft/target agreement.
#
# Usage: bash scripts/paper-figures-replay.sh ARTIFACT_CHECKOUT [fig8 fig10 fig11 ...]   (default: all three)
#   ARTIFACT_CHECKOUT: a clone of github.com/zikun-li/AdaServe-Artifact-Evaluation (its exps/ folder is read,
#   nothing of it is copied into this repository). The agreement pool is recorded once (~20 min on 2 cores)
#   into $OUT/pool-demo-256.npz and reused; each figure writes $OUT/replay-<fig>.json and .png.
# Env: OUT (default docs/results), SEEDS (default 0,1,2), JOBS (default 2), BIN (default .venv/bin/adaserve).
set -euo pipefail
cd "$(dirname "$0")/.."
ART=${1:?usage: paper-figures-replay.sh ARTIFACT_CHECKOUT [fig8 fig10 fig11]}
shift
BIN=${BIN:-.venv/bin/adaserve}
OUT=${OUT:-docs/results}
SEEDS=${SEEDS:-0,1,2}
JOBS=${JOBS:-2}
POOL=$OUT/pool-demo-256.npz
SYSTEMS=vllm,sarathi,vllm-spec:4,vllm-spec:6,vllm-spec:8,chain:2,chain:3,chain:4,adaserve,adaserve+ours
# chain:K and adaserve+ours are not presets: they run with adaserve's admission (64 running, 1024-token chunks)
# and the engine's SLO prefill rule (prefill_chunk.py), the same for all of them: only the trees differ.
# The presets (vllm, sarathi, vllm-spec:K, adaserve) keep their own admission and prefill rules.
COMMON=(--pool "$POOL" --systems "$SYSTEMS" --seeds "$SEEDS" --max-batch 64 --prefill-chunk 1024 --prefill-rule slo
        --jobs "$JOBS")
[ -d "$ART/exps" ] || { echo "no exps/ folder under $ART: give a checkout of the AdaServe artifact" >&2; exit 2; }
if [ ! -f "$POOL" ]; then
  "$BIN" replay record --model demo-tiny --trace-json "$ART/exps/fig8,9/emission_rps4.8_ol256.json" \
      --per-class 40 --out "$POOL"
fi
run() {
  local fig=$1; shift
  "$BIN" replay run "${COMMON[@]}" --trace-json "$@" --json "$OUT/replay-$fig.json" --plot "$OUT/replay-$fig.png"
}
figs=("$@"); [ ${#figs[@]} -gt 0 ] || figs=(fig8 fig10 fig11)
for f in "${figs[@]}"; do
  case "$f" in
    # rps 2.4 = 2.6, 3.2 = 3.4, 3.8 = 4.0 and 4.6 = 4.8 are the same files: each runs once
    fig8) run fig8-9 "$ART"/exps/fig8,9/emission_rps{2.6,2.8,3.0,3.4,3.6,4.0,4.2,4.4,4.8}_ol256.json ;;
    fig10) run fig10 "$ART"/exps/fig10/emission_rps4.0_prop*.json ;;
    fig11) run fig11 "$ART"/exps/fig11/emission_slo*_ol256.json ;;
    *) echo "unknown figure $f: fig8, fig10 or fig11" >&2; exit 2 ;;
  esac
done
