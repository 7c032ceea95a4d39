"""The relay ↔ site-service socket protocol: versioned, size-bounded frames (stdlib only).

A frame is a 12-byte header and a payload::

    magic b"DPMS" | version u8 | kind u8 | reserved u16 (0) | payload length u32 (big-endian)

Kinds: ``MESSAGE`` (a Flower ``Message`` as serialised protobuf: ``flwr.common.serde``),
``REPLY`` (the reply ``Message``, same encoding), ``ERROR`` (UTF-8 text: the service could not
produce a reply at all), ``PING`` / ``STATUS`` (health: JSON), ``INFER`` / ``ANSWERS`` (local
inference with a stored artifact: JSON, ``client.service.inference``). One request, one answer, then
the connection closes. A frame of another version or kind, or longer than the reader's bound,
is refused before its payload is read, so a hostile peer cannot make either side allocate
more than the bound; the bound may depend on the kind (the service allows a large payload
only for what its accepted plans need). A reader may also set a deadline for the whole
frame, so a peer that trickles bytes cannot hold a connection open. Nothing here unpickles
or evaluates peer data.

This module is imported by the relay that Flower starts per message: keep it free of torch,
transformers and everything that touches the site's data.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from enum import IntEnum

from dpmtv_common.errors import ServiceError

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "WIRE_VERSION",
    "FrameKind",
    "FrameLimit",
    "read_frame",
    "write_frame",
]

WIRE_VERSION = 1
MAGIC = b"DPMS"
DEFAULT_MAX_FRAME_BYTES = 1 << 30  # a full-model artifact or noisy vector is ~100 MB
_HEADER = struct.Struct(">4sBBHI")


class FrameKind(IntEnum):
    """What a frame carries."""

    MESSAGE = 1
    REPLY = 2
    ERROR = 3
    PING = 4
    STATUS = 5
    INFER = 6
    ANSWERS = 7


def write_frame(sock: socket.socket, kind: FrameKind, payload: bytes) -> None:
    """Send one frame.

    Raises:
        ServiceError: The payload is too large for the 32-bit length.
    """
    if len(payload) >= 1 << 32:
        raise ServiceError(f"frame payload must be < 4 GiB, got {len(payload)} bytes.")
    sock.sendall(_HEADER.pack(MAGIC, WIRE_VERSION, int(kind), 0, len(payload)) + payload)


FrameLimit = int | Callable[[FrameKind], int]
"""The largest payload a reader accepts: one bound, or one per frame kind."""


def read_frame(
    sock: socket.socket,
    *,
    max_bytes: FrameLimit = DEFAULT_MAX_FRAME_BYTES,
    deadline: float | None = None,
) -> tuple[FrameKind, bytes]:
    """Receive one frame, refusing a bad header before reading (or allocating) the payload.

    Args:
        sock: A connected stream socket.
        max_bytes: The largest payload accepted, or a function of the frame's kind that
            gives it; checked against the header's length before any payload byte is read.
        deadline: A ``time.monotonic()`` instant by which the whole frame must have arrived.

    Raises:
        ServiceError: The peer closed early or too late, or sent a bad magic, version, kind
            or length.
    """
    header = _read_exact(sock, _HEADER.size, deadline)
    magic, version, kind, reserved, length = _HEADER.unpack(header)
    if magic != MAGIC or reserved != 0:
        raise ServiceError(f"frame must start with {MAGIC!r}, got {magic!r}.")
    if version != WIRE_VERSION:
        raise ServiceError(
            f"frame version must be {WIRE_VERSION}, got {version}: relay and service come "
            "from different dpmtv versions."
        )
    if kind not in FrameKind.__members__.values():
        raise ServiceError(f"frame kind must be one of {[k.value for k in FrameKind]}, got {kind}.")
    frame_kind = FrameKind(kind)
    bound = max_bytes(frame_kind) if callable(max_bytes) else max_bytes
    if length > bound:
        raise ServiceError(
            f"{frame_kind.name} frame payload must be at most {bound} bytes, got {length}."
        )
    return frame_kind, _read_exact(sock, length, deadline)


def _read_exact(sock: socket.socket, size: int, deadline: float | None) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServiceError(
                    f"frame must arrive in time, got {len(chunks)} of {size} bytes by the deadline."
                )
            sock.settimeout(left)
        chunk = sock.recv(min(size - len(chunks), 1 << 20))
        if not chunk:
            raise ServiceError(f"peer closed the connection after {len(chunks)} of {size} bytes.")
        chunks += chunk
    return bytes(chunks)
