#!/usr/bin/env bash
# End-to-end on a throwaway kind cluster, CPU only: build the three images (the worker in its CPU variant),
# load them into kind, install the chart, declare an AdaServeDeployment over the demo models baked into
# the worker image, wait for Ready, call the gateway, and delete the cluster.
#
# Needs: docker (with BuildKit), kind, and network access for the base images and PyPI. helm and kubectl
# come from .tools/bin (scripts/get-k8s-tools.sh) or your PATH. About 2 GiB of images; a few minutes.
#
# Usage: scripts/kind-e2e.sh
#   env KEEP=1          keep the cluster (and print how to reach it) instead of deleting it
#       CLUSTER=name    kind cluster name (default adaserve-e2e)
#       KIND_IMAGE=...  kind node image, Kubernetes >= 1.29 (default: kind's own default)
#       BUDGET=auto     speculation budget of the demo resource; auto profiles on the pod's CPU first
#       SKIP_BUILD=1    reuse the adaserve/*:e2e images already in the local docker
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER=${CLUSTER:-adaserve-e2e}
KEEP=${KEEP:-0}
BUDGET=${BUDGET:-auto}
TAG=e2e
SYSTEM_NS=adaserve-system
NS=adaserve-e2e
LOCAL_PORT=${LOCAL_PORT:-18080}
REDIS_IMAGE=redis:7-alpine

say() { printf '\n==> %s\n' "$*"; }
die() { printf 'kind-e2e: %s\n' "$*" >&2; exit 1; }

tool() {  # tool NAME: .tools/bin/NAME, else NAME on PATH
    if [ -x ".tools/bin/$1" ]; then echo ".tools/bin/$1"
    elif command -v "$1" >/dev/null; then command -v "$1"
    else die "$1 not found: run scripts/get-k8s-tools.sh or install it"; fi
}
command -v docker >/dev/null || die "docker not found"
command -v kind >/dev/null || die "kind not found (https://kind.sigs.k8s.io)"
command -v curl >/dev/null || die "curl not found"
HELM=$(tool helm)
KUBECTL=$(tool kubectl)
export DOCKER_BUILDKIT=1  # the per-Dockerfile .dockerignore files in docker/ need BuildKit

PF_PID=""
cleanup() {
    status=$?
    if [ -n "$PF_PID" ]; then kill "$PF_PID" 2>/dev/null || true; fi
    if [ "$status" -ne 0 ] && kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
        say "FAILED; state of the cluster"
        k get asd -A -o wide || true
        k -n "$NS" describe asd demo || true
        k get pods -A -o wide || true
        k -n "$SYSTEM_NS" logs deployment/adaserve-operator --tail=100 || true
        k -n "$NS" logs deployment/demo-worker --tail=50 || true
        k -n "$NS" logs deployment/demo-gateway --tail=50 || true
    fi
    if [ "$KEEP" = 1 ]; then
        say "keeping cluster $CLUSTER: kubectl --context kind-$CLUSTER -n $NS get asd; delete with: kind delete cluster --name $CLUSTER"
    elif kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
        say "deleting cluster $CLUSTER"
        kind delete cluster --name "$CLUSTER"
    fi
    exit "$status"
}
trap cleanup EXIT
k() { "$KUBECTL" --context "kind-$CLUSTER" "$@"; }

if [ "${SKIP_BUILD:-0}" != 1 ]; then
    say "building images"
    docker build -f docker/operator.Dockerfile -t "adaserve/operator:$TAG" .
    docker build -f docker/gateway.Dockerfile -t "adaserve/gateway:$TAG" .
    docker build -f docker/worker.Dockerfile --build-arg DEVICE=cpu -t "adaserve/worker:$TAG-cpu" .
fi
docker image inspect "$REDIS_IMAGE" >/dev/null 2>&1 || docker pull "$REDIS_IMAGE"

say "creating kind cluster $CLUSTER"
kind get clusters 2>/dev/null | grep -qx "$CLUSTER" && die "cluster $CLUSTER exists; delete it or set CLUSTER"
kind create cluster --name "$CLUSTER" --wait 180s ${KIND_IMAGE:+--image "$KIND_IMAGE"}
kind load docker-image --name "$CLUSTER" "adaserve/operator:$TAG" "adaserve/gateway:$TAG" \
    "adaserve/worker:$TAG-cpu" "$REDIS_IMAGE"

say "installing the chart"
"$HELM" --kube-context "kind-$CLUSTER" install adaserve charts/adaserve -n "$SYSTEM_NS" --create-namespace \
    --set operator.image.repository=adaserve/operator --set "operator.image.tag=$TAG" \
    --set operator.image.pullPolicy=Never --set operator.logLevel=verbose --wait --timeout 5m

say "declaring the demo AdaServeDeployment (CPU: gpusPerWorker 0 makes the operator set ADASERVE_DEVICE=cpu)"
k create namespace "$NS"
# the operator may take a moment to start watching; a resource created before that is still picked up
k apply -f - <<EOF
apiVersion: adaserve.io/v1alpha1
kind: AdaServeDeployment
metadata: {name: demo, namespace: $NS}
spec:
  model:
    name: demo
    source: image
    target: /app/models/demo/target
    draft: /app/models/demo/draft
    dtype: float32
  replicas: 1
  image: adaserve/worker:$TAG-cpu
  resources: {gpusPerWorker: 0, memory: 2Gi, cpu: "1"}
  sloClasses:
    - {name: coding, tpotMs: 400, ttftMs: 5000, priority: 10}
    - {name: chat, tpotMs: 500, priority: 0}
    - {name: summarization, tpotMs: 1500, priority: -1, sheddable: true}
  defaultSloClass: chat
  speculation: {policy: adaserve, budget: $BUDGET, maxDepth: 4, maxWidth: 2}
  gateway: {replicas: 1, image: adaserve/gateway:$TAG, serviceType: ClusterIP, port: 80, routing: headroom}
  redis: {managed: true, image: $REDIS_IMAGE}
EOF

say "waiting for Ready (the worker loads the models and, with budget auto, profiles its budget first)"
k -n "$NS" wait asd/demo --for=condition=Ready --timeout=20m
k -n "$NS" get asd demo -o wide
k -n "$NS" get asd demo -o jsonpath='{range .status.workers[*]}{.id}  budget={.budget}  {.status}{"\n"}{end}'

say "calling the gateway through a port-forward"
k -n "$NS" port-forward svc/demo-gateway "$LOCAL_PORT:80" >/dev/null &
PF_PID=$!
URL="http://127.0.0.1:$LOCAL_PORT"
for _ in $(seq 60); do curl -fsS "$URL/readyz" >/dev/null 2>&1 && break; sleep 1; done
curl -fsS "$URL/readyz" >/dev/null || die "gateway not ready at $URL/readyz"
curl -fsS "$URL/v1/models"; echo
curl -fsS "$URL/v1/slo-classes"; echo
curl -fsS "$URL/v1/completions" -H 'Content-Type: application/json' -H 'X-SLO-Class: coding' \
    -d '{"model": "demo", "prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0}'
echo
curl -fsS "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model": "demo", "messages": [{"role": "user", "content": "import os"}], "max_tokens": 16, "slo_class": "chat"}'
echo
metrics=$(curl -fsS "$URL/metrics")
grep -m 5 '^adaserve_' <<<"$metrics" || die "no adaserve_* metrics on the gateway"

say "PASS"
