# syntax=docker/dockerfile:1
# The adaserve gateway: OpenAI-compatible HTTP front, SLO-aware routing over the workers in Redis.
# No torch, no model code: a slim image that starts in a second.
#   docker build -f docker/gateway.Dockerfile -t ghcr.io/adaserve/gateway:0.1.0 .     (from the repo root)
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# dependencies first: this layer survives every source change
COPY docker/requirements-gateway.txt /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt

# --no-deps: pyproject's dependencies include torch and transformers, which the gateway never imports
COPY pyproject.toml README.md /src/
COPY adaserve /src/adaserve
RUN pip install --no-deps /src && rm -rf /src \
    # fail the build, not the pod, if the gateway grew an import outside requirements-gateway.txt
    && python -c "import importlib, pkgutil, adaserve.gateway as p; [importlib.import_module(m.name) for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.') if not m.name.endswith('__main__')]"

RUN useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin adaserve
USER 10001:10001
WORKDIR /tmp

EXPOSE 8080
# the operator sets ADASERVE_GATEWAY_HOST=0.0.0.0; this default makes `docker run -p 8080:8080` work too
ENV ADASERVE_GATEWAY_HOST=0.0.0.0 \
    ADASERVE_GATEWAY_PORT=8080
CMD ["python", "-m", "adaserve.gateway"]
