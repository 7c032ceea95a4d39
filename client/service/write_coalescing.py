"""Fewer system calls in the HTTP front: writes that belong together leave together.

How this connects: the HTTP front (:mod:`client.service.http_front`) answers each chat request
with two socket writes, the response head and its body (uvicorn writes each ASGI message as it
comes), and sends the site service two frames a request, its announcement and the request
itself (:class:`~client.service.http_api.FrontLink`). On a small model a send costs as much as
a tenth of a request's own work in the front, and each wakes its reader: the HTTP client, or
the site service's link thread, beside the model's decoding loop.

* :class:`HeadHeldTransport` (the front's connections, :mod:`client.service.http_guard`)
  holds a response head until the next write on its connection, which for a whole answer is
  its body, written in the same turn of the event loop: head and body leave in one send. A
  head that nothing follows (a streamed answer between events) leaves at the end of that turn.
* :class:`TurnWriter` (the link) writes every frame queued during one turn of the event loop
  in one send at its end: the announcements of requests whose heads arrived together, and
  the requests parsed one after another in that turn, reach the service in one read.

Neither reorders bytes or changes what is written; each only decides when a send happens, and
nothing waits beyond the end of the turn that wrote it.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["HeadHeldTransport", "TurnWriter"]

_HEAD_PREFIX = b"HTTP/1."  # every HTTP/1.x response head starts with its status line


class HeadHeldTransport:
    """A connection's transport whose response heads wait for the write that follows them.

    Every attribute but :meth:`write`, :meth:`writelines`, :meth:`close` and :meth:`abort` is
    the wrapped transport's own (reading, flow control, peer address).
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` after any held head; hold it instead if it is a response head."""
        if self._held is not None:
            data, self._held = self._held + bytes(data), None
            self._transport.write(data)
            return
        if bytes(data[: len(_HEAD_PREFIX)]) == _HEAD_PREFIX:
            self._held = bytes(data)
            self._loop.call_soon(self.flush)
            return
        self._transport.write(data)

    def writelines(self, parts: Any) -> None:
        """As :meth:`write` of the parts joined: never ahead of a held head."""
        self.write(b"".join(bytes(part) for part in parts))

    def flush(self) -> None:
        """Write a held head now (nothing followed it in its turn); dropped if it closed."""
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        """Write a held head, then close."""
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        """Close at once; a held head is dropped with whatever else was unsent."""
        self._held = None
        self._transport.abort()


class TurnWriter:
    """Frames to one transport, written together at the end of the event loop's turn.

    ``send`` is called from the event loop's thread (the front's one thread); called where no
    loop runs, there is no turn to wait for and the frame is written at once.
    """

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._queued: list[bytes] = []
        self._flushes_on: asyncio.AbstractEventLoop | None = None  # where a flush is due

    def send(self, frame: bytes) -> None:
        """Queue ``frame``; the turn's frames leave in one write when the turn ends."""
        self._queued.append(frame)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop, no turn
            self.flush()
            return
        if self._flushes_on is not loop:  # (a loop that closed first never ran its flush)
            self._flushes_on = loop
            loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write every queued frame now, in order."""
        self._flushes_on = None
        queued, self._queued = self._queued, []
        if queued and not self._transport.is_closing():
            self._transport.write(b"".join(queued))
