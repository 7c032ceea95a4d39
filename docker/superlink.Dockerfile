# syntax=docker/dockerfile:1
# The coordinator: Flower's Ubuntu-based SuperLink image plus what the ServerApp imports. Its
# SuperExec runs our ServerApp (from the FAB that `flwr run` submits) in a subprocess. No torch:
# the coordinator never loads a model.
#
# Build from the repository root (docker/compose.yaml does this):
#   docker build -f docker/superlink.Dockerfile -t dpmtv-superlink:0.1.0 .
ARG FLWR_VERSION=1.42.0
ARG FLWR_IMAGE_SUFFIX=py3.11-ubuntu24.04
FROM flwr/superlink:${FLWR_VERSION}-${FLWR_IMAGE_SUFFIX}

# The ServerApp's dependencies (pyproject.toml) without the sites' model stack.
RUN python -m pip install --no-cache-dir \
        "cryptography>=44" "dp-accounting>=0.6,<0.7" "numpy>=2.0" "opendp>=0.16,<0.17" \
        "pydantic>=2.9" "pydantic-settings>=2.6" "safetensors>=0.4" "scipy>=1.13"
COPY --chown=app:app dpmtv_common /tmp/server-check/dpmtv_common
COPY --chown=app:app protocol /tmp/server-check/protocol
COPY --chown=app:app server /tmp/server-check/server
RUN cd /tmp/server-check \
    && python -c "import server.app, sys; assert 'torch' not in sys.modules" \
    && rm -rf /tmp/server-check

# Named volumes copy the ownership of the directory they are mounted on: make it the app user's.
USER root
RUN mkdir -p /app/state /app/secrets && chown app:app /app/state /app/secrets
USER app

# Offline operation (notes/flower.md §6.15): no telemetry, no update check, no `uv sync` at
# run time; the SuperExec picks up the ServerApp task within 0.1 s instead of 1 s.
ENV FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1 \
    OMP_WAIT_POLICY=PASSIVE \
    DPMTV_SERVER_LEDGER_PATH=/app/state/consortium-ledger.sqlite \
    DPMTV_SERVER_ARTIFACTS_DIR=/app/state/artifacts

ENTRYPOINT ["flower-superlink"]
