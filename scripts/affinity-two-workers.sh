#!/usr/bin/env bash
# Prefix affinity through the gateway, measured (docs/benchmarks.md, "Prefix affinity: two workers, multi-turn").
# Two demo-tiny workers registered in Redis under a fresh prefix; per round, one gateway with prefix affinity
# off (--prefix-index-blocks 0) and one with it on (the default), in alternating order, each driven by
# `adaserve loadtest --conversations` with a seed of its own (the workers' caches stay warm across runs: a
# repeated seed would find its whole conversations cached). Then one JSON with every run and a summary.
# Usage: bash scripts/affinity-two-workers.sh OUT.json [ROUNDS] [CONVERSATIONS] [RATE]
#   env: ADASERVE_PYTHON (default .venv/bin/python), REDIS_URL (default redis://127.0.0.1:6379/0),
#        GATEWAY_ARGS (extra gateway options, e.g. --slo-classes-file F)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$1 ROUNDS=${2:-2} CONVERSATIONS=${3:-12} RATE=${4:-1.0}
PY=${ADASERVE_PYTHON:-$PWD/.venv/bin/python}
REDIS=${REDIS_URL:-redis://127.0.0.1:6379/0}
PREFIX=adaserve-affinity-$$-$RANDOM
TMP=$(mktemp -d)
export ADASERVE_TORCH_THREADS=1 ADASERVE_REDIS_PREFIX=$PREFIX ADASERVE_MODEL_NAME=demo
pids=()
cleanup() {  # the workers, then every key under the prefix (records, registrations)
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  "$PY" -c 'import sys, redis; r = redis.Redis.from_url(sys.argv[1]); ks = list(r.scan_iter(sys.argv[2] + ":*"))
if ks: r.delete(*ks)' "$REDIS" "$PREFIX" || true
}
trap cleanup EXIT
free_port() { "$PY" -c 'from adaserve.server_process import free_port; print(free_port())'; }
wait_ready() {  # URL: until /readyz answers 200
  for _ in $(seq 1 600); do
    curl -sf "$1/readyz" > /dev/null && return 0
    sleep 1
  done
  echo "not ready: $1" >&2; return 1
}
for wid in w-a w-b; do
  port=$(free_port)
  "$PY" -m adaserve worker --target demo-tiny --budget 8 --redis-url "$REDIS" --worker-id "$wid" \
    --host 127.0.0.1 --port "$port" > "$TMP/$wid.log" 2>&1 &
  pids+=($!)
  wait_ready "http://127.0.0.1:$port"
done
run() {  # MODE SEED
  local port gw
  port=$(free_port)
  local extra=()
  [ "$1" = off ] && extra=(--prefix-index-blocks 0)
  # shellcheck disable=SC2086
  "$PY" -m adaserve gateway --redis-url "$REDIS" --redis-prefix "$PREFIX" --port "$port" --log-level warning \
    "${extra[@]}" ${GATEWAY_ARGS:-} > "$TMP/gateway-$1-$2.log" 2>&1 &
  gw=$!
  wait_ready "http://127.0.0.1:$port"
  sleep 2  # both workers listed
  "$PY" -m adaserve loadtest --url "http://127.0.0.1:$port" --conversations "$CONVERSATIONS" --turns 2 \
    --conversation-rate "$RATE" --think-s 0.5 --turn-tokens 32 --system-chars 1200 --seed "$2" \
    --json "$TMP/run-$1-$2.json" > /dev/null
  kill -TERM "$gw"; wait "$gw" || true
}
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) -eq 1 ]; then order="off on"; else order="on off"; fi
  i=0
  for mode in $order; do
    i=$((i + 1)); run "$mode" $((10 * r + i))
  done
done
"$PY" - "$OUT" "$TMP" "$*" <<'EOF'
import json, pathlib, statistics, sys
out, tmp, args = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
runs = []
for f in sorted(tmp.glob("run-*.json")):
    _, mode, seed = f.stem.split("-")
    mt = json.loads(f.read_text())["multi_turn"]
    runs.append({"mode": mode, "seed": int(seed), **mt})
summary = {}
for mode in ("off", "on"):
    rs = [r for r in runs if r["mode"] == mode]
    summary[mode] = {"affinity": [r["affinity"] for r in rs],
                     "turn2_ttft_median_ms": [r["ttft_ms"]["2"]["median"] for r in rs],
                     "turn1_ttft_median_ms": [r["ttft_ms"]["1"]["median"] for r in rs],
                     "gateway_prefix": [r["gateway_prefix"] for r in rs]}
doc = {"command": f"bash scripts/affinity-two-workers.sh {args}", "summary": summary, "runs": runs}
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps(doc, indent=2) + "\n")
print(json.dumps(summary, indent=2))
EOF
echo "wrote $OUT (logs in $TMP)" >&2
