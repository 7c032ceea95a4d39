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
  the requests parsed one after another in that turn, reach the service in one read. In the
  front its frames wait longer, until the loop has nothing left to run
  (:class:`IdleSelector`): requests that arrive together are parsed over several turns (each
  handler awaits its body, then the service's acceptance), and the service prepares none of
  them before the last has come (it waits for every request announced), so sending each
  turn's frames apart only adds sends, each as costly as a tenth of a request's work in the
  front. A frame never waits more than ``max_hold_s`` (1 ms) beyond the turn that wrote it.

Neither changes what is written. :class:`HeadHeldTransport` only decides when a send happens;
:class:`TurnWriter` also sends the front's announcements ahead of the frames queued before
them in the same write (:meth:`TurnWriter.send`), each kind in the order it was queued.
"""

from __future__ import annotations

import asyncio
import logging
import selectors
import time
from collections.abc import Callable
from typing import Any

__all__ = ["HeadHeldTransport", "IdleSelector", "TurnWriter"]

_log = logging.getLogger(__name__)

MAX_HOLD_S = 0.001
"""Longest a deferred write waits for the event loop to go idle (beyond its turn)."""

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


class IdleSelector(selectors.DefaultSelector):
    """The event loop's selector, running deferred writes when the loop is about to wait.

    An asyncio loop calls :meth:`select` once a turn, with a timeout of 0 while callbacks are
    ready to run and a longer one (or None) when it has nothing to do until I/O or a timer.
    Writes deferred with :meth:`defer` run at the first call that would wait, or at the first
    call after the oldest has waited ``max_hold_s``, so a loop kept busy still writes them.
    That call then only polls (timeout 0): the writes may have scheduled callbacks (a failed
    write closes its transport), which must not wait behind a blocking wait for I/O. A write
    that raises is logged, as the loop logs a callback's exception, and the others still run.

    Args:
        max_hold_s: Longest a deferred write waits for the loop to go idle.
    """

    def __init__(self, max_hold_s: float = MAX_HOLD_S) -> None:
        super().__init__()
        self._max_hold_s = max_hold_s
        self._deferred: list[Callable[[], None]] = []
        self._oldest = 0.0

    def defer(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` (a write) when the loop is about to wait, or within ``max_hold_s``."""
        if not self._deferred:
            self._oldest = time.monotonic()
        self._deferred.append(callback)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        """Run the deferred writes if it is time (class docstring), then select."""
        if self._deferred and (
            timeout is None or timeout > 0 or time.monotonic() - self._oldest >= self._max_hold_s
        ):
            due, self._deferred = self._deferred, []
            for callback in due:
                try:
                    callback()
                except Exception:  # as asyncio's own callbacks: logged, the loop goes on
                    _log.exception("a deferred write failed")
            timeout = 0
        return super().select(timeout)


class TurnWriter:
    """Frames to one transport, written together at the end of the event loop's turn.

    ``send`` is called from the event loop's thread (the front's one thread); called where no
    loop runs, there is no turn to wait for and the frame is written at once.

    Args:
        transport: Where the frames go.
        defer: Schedules the write of a turn's frames (:meth:`IdleSelector.defer`: when the
            loop goes idle); None: at the end of the turn (``call_soon``).
    """

    def __init__(
        self,
        transport: asyncio.Transport,
        defer: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self._transport = transport
        self._defer = defer
        self._queued: list[bytes] = []
        self._ahead: list[bytes] = []  # sent before the frames queued in the usual order
        self._flushes_on: asyncio.AbstractEventLoop | None = None  # where a flush is due

    def send(self, frame: bytes, *, ahead: bool = False) -> None:
        """Queue ``frame``; the turn's frames leave in one write when the turn ends.

        ``ahead``: the frame leaves before every frame queued without it (still in order among
        its own kind), as the front's announcements do: a request announced after another was
        queued would otherwise reach the service after it, which may then take the requests
        before it for all there are.
        """
        if ahead:
            self._ahead.append(frame)
        else:
            self._queued.append(frame)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop, no turn
            self.flush()
            return
        if self._flushes_on is not loop:  # (a loop that closed first never ran its flush)
            self._flushes_on = loop
            (self._defer or loop.call_soon)(self.flush)

    def flush(self) -> None:
        """Write every queued frame now: those sent ``ahead`` first, each kind in order."""
        self._flushes_on = None
        queued = self._ahead + self._queued
        self._ahead, self._queued = [], []
        if queued and not self._transport.is_closing():
            self._transport.write(b"".join(queued))
