# syntax=docker/dockerfile:1
# A site's service (`dpmtv-site serve`): the only container of a site that sees its model,
# data, ledger and keys. Debian bookworm, so the official torch wheels install (the Alpine-based
# Flower images have none). The SuperNode runs in its own container (supernode.Dockerfile) and
# reaches this one only through the Unix socket on the site's shared socket volume.
#
# Build from the repository root (docker/compose.yaml does this):
#   docker build -f docker/site-service.Dockerfile -t dpmtv-site-service:0.1.0 .
FROM python:3.11-slim-bookworm

# CPU torch from the official index first, so resolving `torch>=2.4` below never pulls a
# multi-GB CUDA build from PyPI. A GPU site builds with its own TORCH_INDEX instead.
ARG TORCH_REQUIREMENT="torch>=2.4"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN python -m pip install --no-cache-dir --index-url "${TORCH_INDEX}" "${TORCH_REQUIREMENT}"

WORKDIR /opt/dpmtv
COPY pyproject.toml README.md ./
COPY dpmtv_common ./dpmtv_common
COPY protocol ./protocol
COPY client ./client
COPY server ./server
# flwr's [simulation] extra (Ray) serves the in-process engine only, never a deployed site.
RUN sed -i 's/"flwr\[simulation\]/"flwr/' pyproject.toml \
    && python -m pip install --no-cache-dir . \
    && dpmtv-site serve --help > /dev/null

# The service's own user. Its primary group dpmtv-socket (gid 10100) owns the socket (mode
# 0660): the SuperNode container joins that group (compose `group_add`) and so may connect,
# and reads nothing else of this container. State, socket and cache folders are created here
# so that named volumes mounted on them start with these owners and modes.
RUN groupadd --gid 10100 dpmtv-socket \
    && useradd --uid 10001 --gid 10100 --no-create-home --shell /usr/sbin/nologin dpmtv \
    && install -d -o dpmtv -g dpmtv-socket -m 0700 /var/lib/dpmtv /var/cache/dpmtv \
    && install -d -o dpmtv -g dpmtv-socket -m 0750 /run/dpmtv
USER dpmtv

# Offline, and no spinning thread pools on shared cores.
ENV HF_HUB_OFFLINE=1 \
    OMP_WAIT_POLICY=PASSIVE \
    OMP_NUM_THREADS=1 \
    DPMTV_CLIENT_STATE_DIR=/var/lib/dpmtv \
    DPMTV_CLIENT_SOCKET_PATH=/run/dpmtv/site.sock \
    DPMTV_CLIENT_CACHE_DIR=/var/cache/dpmtv

HEALTHCHECK --interval=10s --timeout=10s --start-period=120s --retries=3 \
    CMD ["dpmtv-site", "service-status", "--socket", "/run/dpmtv/site.sock"]
# SIGTERM (docker stop) finishes the request in flight and resolves open releases.
STOPSIGNAL SIGTERM
ENTRYPOINT ["dpmtv-site", "serve"]
