# syntax=docker/dockerfile:1
# The adaserve operator: kopf handlers that turn an AdaServeDeployment into workers, a gateway and Redis.
# No torch, no model code. The chart passes its namespace flags as arguments.
#   docker build -f docker/operator.Dockerfile -t ghcr.io/adaserve/operator:0.1.0 .    (from the repo root)
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

COPY docker/requirements-operator.txt /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt

# --no-deps: pyproject's dependencies include torch and transformers, which the operator never imports
COPY pyproject.toml README.md /src/
COPY adaserve /src/adaserve
RUN pip install --no-deps /src && rm -rf /src \
    # fail the build, not the pod, if the handlers grew an import outside requirements-operator.txt
    && python -c "import importlib, pkgutil, adaserve.operator as p; [importlib.import_module(m.name) for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.') if not m.name.endswith('__main__')]"

# uid 10001 matches the chart's podSecurityContext (runAsUser/runAsGroup 10001, runAsNonRoot)
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin adaserve
USER 10001:10001
WORKDIR /tmp

EXPOSE 8080
# `kopf run -m adaserve.operator.handlers --all-namespaces --peering=adaserve` with kopf's liveness endpoint on
# 8080 and a random --priority (docs/k8s-contract.md); arguments are kopf run options
ENTRYPOINT ["python", "-m", "adaserve.operator"]
CMD []
