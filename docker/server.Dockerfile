# syntax=docker/dockerfile:1
# The coordinator: Flower's SuperLink image plus this project, so the SuperLink's own SuperExec
# runs our ServerApp in a subprocess (`--isolation subprocess`, the default). That is the
# process layout tests/integration/test_deployment.py runs on 127.0.0.1.
#
# Build from the repository root (docker/compose.yaml does this):
#   docker build -f docker/server.Dockerfile -t dpmtv-coordinator:0.1.0 .
ARG FLWR_VERSION=1.42.0
FROM flwr/superlink:${FLWR_VERSION}

# The project depends on torch (the sites need it; the coordinator only imports it if it
# computes public head selection). Install the CPU build from the official index first, so
# resolving `torch>=2.4` below never pulls a multi-GB CUDA build from PyPI.
ARG TORCH_REQUIREMENT="torch>=2.4"
RUN python -m pip install --no-cache-dir \
        --index-url https://download.pytorch.org/whl/cpu "${TORCH_REQUIREMENT}"

WORKDIR /app
COPY --chown=app:app pyproject.toml README.md ./
COPY --chown=app:app dpmtv_common ./dpmtv_common
COPY --chown=app:app protocol ./protocol
COPY --chown=app:app client ./client
COPY --chown=app:app server ./server
# The image already has flwr; the [simulation] extra (Ray) is for the simulation engine only.
RUN sed -i 's/"flwr\[simulation\]/"flwr/' pyproject.toml \
    && python -m pip install --no-cache-dir . \
    && python -c "import server.app, flwr; assert flwr.__version__.startswith('1.42')"

# Named volumes copy the ownership of the directory they are mounted on: make it the app user's.
USER root
RUN mkdir -p /app/state /app/secrets && chown app:app /app/state /app/secrets
USER app

# Offline operation (notes/flower.md §6.15): no telemetry, no update check, and no `uv sync`
# of the app's dependencies at run time (they are installed above).
ENV FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    HF_HUB_OFFLINE=1 \
    DPMTV_SERVER_LEDGER_PATH=/app/state/consortium-ledger.sqlite \
    DPMTV_SERVER_ARTIFACTS_DIR=/app/state/artifacts

ENTRYPOINT ["flower-superlink"]
