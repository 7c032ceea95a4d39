"""The thin relay that Flower runs per message: forward to the site service, return its reply.

The relay is the only site code Flower starts, and it may be code the coordinator shipped in
its FAB (Flower puts the FAB first on ``sys.path``): the site treats it as untrusted. It holds
no secret and opens no file: it knows only the socket path from the SuperNode's node config
(``site-socket``), sends the ``Message`` it was given, and returns what the service answers.
Its ``Context`` is never sent: the service keeps its own state per run. A hostile relay can
drop, replay or forge messages; the service's state machine and policy decide what each gets.

Imports: Flower and :mod:`client.service.wire` only, so a per-message process starts fast.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Message as ProtoMessage

from client.service.wire import FrameKind, read_frame, write_frame
from dpmtv_common.errors import ServiceError

__all__ = ["SOCKET_KEY", "RelayApp", "Transport", "unix_socket_transport"]

SOCKET_KEY = "site-socket"
"""The node-config key that names the site service's socket."""

Transport = Callable[[Context, bytes], bytes]
"""Sends one serialised request ``Message``; returns the serialised reply."""

_TIMEOUT_S = 3600.0  # one collect stage runs the site's whole extraction


def unix_socket_transport(context: Context, payload: bytes) -> bytes:
    """Exchange one frame pair with the service whose socket the node config names.

    Raises:
        ServiceError: No socket configured, the service is down, or it refused the request.
    """
    path = context.node_config.get(SOCKET_KEY)
    if not isinstance(path, str) or not path:
        raise ServiceError(
            f"node config must set {SOCKET_KEY} to the dpmtv-site service's socket path "
            f"(flower-supernode --node-config \"{SOCKET_KEY}='/run/dpmtv/site.sock'\"), "
            f"got {path!r}."
        )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(_TIMEOUT_S)
        try:
            sock.connect(path)
        except OSError as exc:
            raise ServiceError(
                f"the site service must listen on {path}: {exc}. Start it with "
                "'dpmtv-site serve' (as the site's user) before the SuperNode takes part."
            ) from exc
        write_frame(sock, FrameKind.MESSAGE, payload)
        kind, answer = read_frame(sock)
    if kind is not FrameKind.REPLY:
        raise ServiceError(f"site service answered {kind.name}: {answer[:200]!r}")
    return answer


class RelayApp(ClientApp):
    """A ``ClientApp`` that forwards every message to the site service."""

    def __init__(self, transport: Transport = unix_socket_transport) -> None:
        super().__init__()
        self._transport = transport

    def __call__(self, message: Message, context: Context) -> Message:
        """Forward ``message``; return the service's reply."""
        payload = bytes(message_to_proto(message).SerializeToString())
        answer = self._transport(context, payload)
        return message_from_proto(ProtoMessage.FromString(answer))
