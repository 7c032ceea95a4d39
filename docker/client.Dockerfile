# syntax=docker/dockerfile:1
# A site: Flower's SuperNode image plus this project, so the SuperNode's own SuperExec runs our
# ClientApp in a subprocess (`--isolation subprocess`, the default), one process per message.
# The site's model, data, ledger and keys are mounted at run time, never baked in.
#
# Build from the repository root (docker/compose.yaml does this):
#   docker build -f docker/client.Dockerfile -t dpmtv-site:0.1.0 .
ARG FLWR_VERSION=1.42.0
FROM flwr/supernode:${FLWR_VERSION}

# CPU torch from the official index first, so resolving `torch>=2.4` below never pulls a
# multi-GB CUDA build from PyPI. A GPU site builds with its own TORCH_INDEX instead.
ARG TORCH_REQUIREMENT="torch>=2.4"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN python -m pip install --no-cache-dir --index-url "${TORCH_INDEX}" "${TORCH_REQUIREMENT}"

WORKDIR /app
COPY --chown=app:app pyproject.toml README.md ./
COPY --chown=app:app dpmtv_common ./dpmtv_common
COPY --chown=app:app protocol ./protocol
COPY --chown=app:app client ./client
COPY --chown=app:app server ./server
# The image already has flwr; the [simulation] extra (Ray) is for the simulation engine only.
RUN sed -i 's/"flwr\[simulation\]/"flwr/' pyproject.toml \
    && python -m pip install --no-cache-dir . \
    && python -c "import client.app, torch, flwr; assert flwr.__version__.startswith('1.42')"

USER root
RUN mkdir -p /app/state /app/secrets && chown app:app /app/state /app/secrets
USER app

# Offline operation: no telemetry, no update check, no hub downloads (the model is local).
# One torch thread per ClientApp process unless the operator sets more.
ENV FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    HF_HUB_OFFLINE=1 \
    OMP_NUM_THREADS=1

ENTRYPOINT ["flower-supernode"]
