"""The HTTP front's connections, bounded: uvicorn's HTTP protocols, guarded.

How this connects: the HTTP front process (:mod:`client.service.http_front`) serves with
uvicorn's protocol on the ``httptools`` parser (llhttp, in C), or :class:`GuardedH11` (the
pure-Python ``h11``) where that parser is not installed (:func:`guarded_protocol`): one
subclass an endpoint, carrying its :class:`IdleConnections`, so connections held open
without a request never exhaust the front's descriptors or keep a real request out. Both
share :class:`_Guard`, so the bounds are the same whichever parser runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from client.service.write_coalescing import HeadHeldTransport

__all__ = ["HEAD_TIMEOUT_S", "GuardedH11", "IdleConnections", "guarded_protocol"]

HEAD_TIMEOUT_S = 10.0
"""A request's head must arrive whole within this."""
_IDLE_GRACE_S = 1.0  # a fresh connection's head usually arrives within milliseconds
_HEAD_SEEN = "dpmtv.head_seen"


class IdleConnections:
    """The endpoint's connections without a request under way, oldest first, by client.

    A connection is idle from its start until its request head arrives, and again after each
    answer (keep-alive). Two rules make room for newcomers, so connections held open without
    a request never keep a real request out:

    * **per client**: past ``per_client`` idle connections of one client address, its oldest
      one idle for at least ``grace_s`` is closed (a client's burst of fresh connections,
      each about to send its request, is left alone);
    * **in total**: when the open connections reach the endpoint's limit, the oldest idle
      connection of anyone is closed for the newcomer, whatever its age
      (:meth:`oldest`); only when none is idle is the newcomer itself refused.

    One event loop uses it, so it needs no lock.
    """

    def __init__(self, per_client: int, grace_s: float = _IDLE_GRACE_S) -> None:
        self.per_client = per_client
        self.grace_s = grace_s
        self._order: OrderedDict[asyncio.BaseProtocol, tuple[str, float]] = OrderedDict()
        self._clients: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._order)

    def idle(
        self, connection: asyncio.BaseProtocol, client: str, now: float
    ) -> list[asyncio.BaseProtocol]:
        """Mark ``connection`` idle (the newest); return its client's connections to close."""
        self.busy(connection)
        self._order[connection] = (client, now)
        self._clients[client] += 1
        evicted = []
        while self._clients[client] > self.per_client:
            stale = next(
                (c for c, (k, since) in self._order.items() if k == client),
                None,
            )
            if stale is None or now - self._order[stale][1] < self.grace_s or stale is connection:
                break
            self.busy(stale)
            evicted.append(stale)
        return evicted

    def oldest(self, besides: asyncio.BaseProtocol) -> asyncio.BaseProtocol | None:
        """The oldest idle connection other than ``besides`` (now no longer idle), or None."""
        found = next((c for c in self._order if c is not besides), None)
        if found is not None:
            self.busy(found)
        return found

    def busy(self, connection: asyncio.BaseProtocol) -> None:
        """``connection`` has a request under way, or is gone: no longer idle."""
        entry = self._order.pop(connection, None)
        if entry is not None:
            self._clients[entry[0]] -= 1


class _Guard(asyncio.Protocol):
    """uvicorn's HTTP protocol (the class mixed in after it), with the descriptors bounded.

    uvicorn answers requests beyond ``limit_concurrency`` with 503 but keeps every connection
    it accepts, and a connection may stay silent, or trickle a request's head, forever: a flood
    of such connections would exhaust the process's descriptors (and with them the ledger's and
    the relay's), and enough silent ones would keep every real request out. So open
    connections stay below the limit, the oldest idle one closed for each newcomer, and idle
    ones are bounded per client (:class:`IdleConnections`); a newcomer is refused only when
    every other connection has a request under way; and each request's head must arrive
    whole within :data:`HEAD_TIMEOUT_S` of the connection or of the previous answer, or the
    connection is closed (as the relay's socket does with a trickled frame).
    """

    idle: IdleConnections  # set per endpoint (the front)
    on_head: Callable[[dict[str, Any]], None] | None = None  # each request's ASGI scope, once
    _head_deadline: asyncio.TimerHandle | None = None
    if TYPE_CHECKING:  # what both of uvicorn's protocols hold
        cycle: Any
        transport: asyncio.Transport
        loop: asyncio.AbstractEventLoop
        limit_concurrency: int | None
        connections: Any

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """A newcomer: idle until its head arrives; room is made for it (class docstring).

        Its responses' heads wait for their bodies, to leave in one send
        (:class:`~client.service.write_coalescing.HeadHeldTransport`).
        """
        held = HeadHeldTransport(transport, self.loop)  # type: ignore[arg-type]
        super().connection_made(held)  # type: ignore[arg-type]
        self._now_idle()
        limit = self.limit_concurrency
        while limit is not None and _open_count(self.connections) > limit - 1:
            oldest = self.idle.oldest(besides=self)
            if oldest is None:  # every other connection has a request under way
                self.idle.busy(self)
                transport.close()
                return
            _close(oldest)

    def data_received(self, data: bytes) -> None:
        """Bytes in: once a request's head is whole, the connection is no longer idle."""
        super().data_received(data)
        self._heads_arrived()

    def on_response_complete(self) -> None:
        """An answer sent: the kept-alive connection is idle again.

        Unless a pipelined request already waits: then its head has arrived.
        """
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing() and not self._heads_arrived():
            self._now_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        """Gone: no longer idle, no deadline."""
        self._disarm_head_deadline()
        self.idle.busy(self)
        super().connection_lost(exc)

    def _heads_arrived(self) -> bool:
        """Whether a request is under way (its head announced, once)."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return False
        self._disarm_head_deadline()
        self.idle.busy(self)
        self._announce(cycle.scope)
        return True

    def _announce(self, scope: dict[str, Any]) -> None:
        if self.on_head is not None and not scope.get(_HEAD_SEEN):
            scope[_HEAD_SEEN] = True
            self.on_head(scope)

    def _now_idle(self) -> None:
        self._arm_head_deadline()
        for connection in self.idle.idle(self, _client_of(self.transport), self.loop.time()):
            _close(connection)

    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        self._head_deadline = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()


class GuardedH11(_Guard, H11Protocol):
    """:class:`_Guard` on uvicorn's ``h11`` protocol (pure Python)."""


def guarded_protocol(
    idle: IdleConnections, on_head: Callable[[dict[str, Any]], None] | None
) -> type[asyncio.Protocol]:
    """The guarded protocol class of one endpoint: on ``httptools`` where it is installed.

    ``httptools`` (llhttp, in C) parses a request's head in a fraction of ``h11``'s time,
    which on a small model is a visible share of each answer; ``h11`` stays the fallback.
    """
    base: type[_Guard] = GuardedH11
    with contextlib.suppress(ImportError):
        base = _httptools_protocol()
    hook = None if on_head is None else staticmethod(on_head)  # a plain attribute, not a method
    return type(f"_Endpoint{base.__name__}", (base,), {"idle": idle, "on_head": hook})


def _httptools_protocol() -> type[_Guard]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # needs httptools

    class GuardedHttpTools(_Guard, HttpToolsProtocol):
        """:class:`_Guard` on uvicorn's ``httptools`` protocol.

        httptools parses every request a read holds, pipelined ones included, so each head
        is announced as it is parsed (``h11`` parses the next only once the last is answered).
        """

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            if self.cycle is not None:
                self._announce(self.cycle.scope)

    return GuardedHttpTools


def _close(connection: asyncio.BaseProtocol) -> None:
    transport = getattr(connection, "transport", None)
    if transport is not None:
        transport.close()


def _open_count(connections: Iterable[asyncio.Protocol]) -> int:
    """Connections not already closing (a closed one leaves the set a loop turn later)."""
    transports = [getattr(connection, "transport", None) for connection in connections]
    return len([t for t in transports if t is None or not t.is_closing()])


def _client_of(transport: asyncio.BaseTransport) -> str:
    """The client's address (its host, not its port); a Unix socket's peers are one client."""
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return "local"
