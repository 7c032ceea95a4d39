# syntax=docker/dockerfile:1
# A site's SuperNode: Flower's Ubuntu-based SuperNode image, nothing of the site's. Its
# SuperExec starts one `flwr-clientapp` per message, which runs the relay that the coordinator's
# FAB carries (client/app.py, client/service/relay.py: Flower and a Unix socket, no torch). The relay
# forwards each message to the site service over the socket volume; this container mounts no
# model, data, ledger or key other than its own SuperNode key.
#
# Build from the repository root (docker/compose.yaml does this):
#   docker build -f docker/supernode.Dockerfile -t dpmtv-supernode:0.1.0 .
ARG FLWR_VERSION=1.42.0
ARG FLWR_IMAGE_SUFFIX=py3.11-ubuntu24.04
FROM flwr/supernode:${FLWR_VERSION}-${FLWR_IMAGE_SUFFIX}

# What importing the relay needs beyond Flower (dpmtv_common's package import reads
# safetensors); checked below against the very files the FAB ships, then thrown away.
RUN python -m pip install --no-cache-dir "safetensors>=0.4"
COPY --chown=app:app dpmtv_common /tmp/relay-check/dpmtv_common
COPY --chown=app:app client/__init__.py client/app.py /tmp/relay-check/client/
COPY --chown=app:app client/service/__init__.py client/service/relay.py client/service/wire.py \
     /tmp/relay-check/client/service/
RUN cd /tmp/relay-check \
    && python -c "import client.app, sys; assert 'torch' not in sys.modules" \
    && rm -rf /tmp/relay-check

# Offline operation; the SuperExec picks up a message within 0.1 s instead of 1 s.
ENV FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1 \
    OMP_WAIT_POLICY=PASSIVE \
    OMP_NUM_THREADS=1

ENTRYPOINT ["flower-supernode"]
