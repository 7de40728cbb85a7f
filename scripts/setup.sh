#!/usr/bin/env bash
# Create .venv and install adaserve with its test tools. Safe to run again.
# torch is installed first and then held by constraints.txt, so no dependency can swap in a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -c constraints.txt -e ".[dev]"
scripts/get-k8s-tools.sh || echo "setup: warning: no helm/kubectl in .tools/bin (chart tests need them); see scripts/get-k8s-tools.sh" >&2
.venv/bin/python -c "import torch, adaserve; print(f'adaserve {adaserve.__version__} ready (torch {torch.__version__})')"
