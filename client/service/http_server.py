"""The HTTP endpoint's listener: address, token, uvicorn in a thread, bounded connections.

How this connects: ``dpmtv-site serve ... --http 127.0.0.1:8080 --http-token-file F``
(:mod:`client.cli.http_options`) starts :class:`HttpEndpoint` once the service holds its
ledger. It binds the socket itself (a loopback address, or a Unix socket with the admin's
mode, unless ``--http-allow-remote``: then put TLS in front, the token travels in clear),
reads the admin's token, and runs uvicorn (h11) on the routes of
:mod:`client.service.http_api` in a thread with its own event loop, beside the batcher's
worker thread. uvicorn answers requests beyond ``max_connections`` open connections with
503; :class:`_GuardedH11` keeps open connections below that limit (a newcomer closes the
oldest connection without a request under way; it is refused only when every other one has
a request under way), bounds idle ones per client address (:class:`IdleConnections`), and
closes any whose request head does not arrive whole within 10 s: connections held open
without a request never keep a real request out.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import stat
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from uvicorn.protocols.http.h11_impl import H11Protocol

from client.release.site import Site
from client.service.batching import Batcher
from client.service.http_api import ChatApi, build_app
from dpmtv_common.errors import ConfigError, ServiceError

__all__ = ["HttpEndpoint", "HttpSettings", "IdleConnections", "parse_address", "read_token"]

_MIN_TOKEN_CHARS = 24
_HEAD_TIMEOUT_S = 10.0  # a request's head must arrive whole within this
_IDLE_GRACE_S = 1.0  # a fresh connection's head usually arrives within milliseconds


@dataclass(frozen=True)
class HttpSettings:
    """How the endpoint listens and how much it admits.

    Attributes:
        address: ``HOST:PORT`` (an IP literal or ``localhost``) or ``unix:PATH``.
        token_file: The bearer token, written by the site admin, readable by its owner only.
        allow_remote: Bind to a non-loopback address (put TLS in front of it).
        max_queue: Requests admitted at once (being prepared, queued or generated).
        max_connections: Open connections uvicorn serves; more get 503.
        socket_mode: Permission bits of a Unix socket.
        batch_invariant: Answer each request alone, bit-identical to plain ``generate()``
            whatever the load, at the price of batching (``client.service.batching``).
        max_idle_per_client: Connections without a request under way one client address
            keeps open (a Unix socket's peers are one client); past it, its oldest idle one
            is closed once idle for a second. None: a quarter of ``max_connections``. In
            total, a newcomer at ``max_connections`` open closes the oldest idle one.
    """

    address: str
    token_file: Path
    allow_remote: bool = False
    max_queue: int = 64
    max_connections: int = 256
    socket_mode: int = 0o660
    batch_invariant: bool = False
    max_idle_per_client: int | None = None

    def idle_per_client(self) -> int:
        """Idle connections a client address keeps, the default filled in."""
        given = self.max_idle_per_client
        return given if given is not None else max(1, self.max_connections // 4)


def parse_address(address: str, *, allow_remote: bool) -> tuple[str, int] | Path:
    """``(host, port)`` for TCP, a ``Path`` for ``unix:PATH``.

    Raises:
        ConfigError: Not ``HOST:PORT`` or ``unix:PATH``, or a non-loopback host without
            ``allow_remote``.
    """
    if address.startswith("unix:"):
        path = Path(address[len("unix:") :])
        if not path.is_absolute():
            raise ConfigError(f"--http unix: path must be absolute, got {str(path)!r}.")
        return path
    host, sep, port_text = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise ConfigError(
            f"--http must be HOST:PORT (e.g. 127.0.0.1:8080) or unix:PATH, got {address!r}."
        )
    if host == "localhost":
        host = "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(
            f"--http host must be an IP address or localhost, got {host!r}."
        ) from None
    if not ip.is_loopback and not allow_remote:
        raise ConfigError(
            f"--http host must be a loopback address, got {host!r}; pass --http-allow-remote "
            "to serve other machines (and put TLS in front: the token travels in clear)."
        )
    return host, int(port_text)


def read_token(path: Path) -> bytes:
    """The bearer token in ``path``: one line, at least 24 characters, owner-only file.

    Raises:
        ConfigError: The file is missing, readable by group or others, or the token is short.
    """
    try:
        info = path.stat()
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--http-token-file must be a readable text file: {exc}") from exc
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise ConfigError(
            f"--http-token-file must be readable by its owner only, got mode "
            f"{stat.S_IMODE(info.st_mode):o}; run chmod 600 on it."
        )
    if len(text) < _MIN_TOKEN_CHARS or any(c.isspace() or not c.isprintable() for c in text):
        raise ConfigError(
            f"--http-token-file must hold one token of at least {_MIN_TOKEN_CHARS} printable "
            f"characters without spaces, got {len(text)} characters; make one with: "
            "python -c 'import secrets; print(secrets.token_urlsafe(32))'."
        )
    return text.encode()


class HttpEndpoint:
    """The endpoint's socket, its uvicorn server (own thread and event loop) and batcher.

    Args:
        site: The site whose model answers.
        model_lock: The lock every use of the site's model takes.
        settings: Address, token file and bounds.
    """

    def __init__(self, site: Site, model_lock: threading.Lock, settings: HttpSettings) -> None:
        import uvicorn

        if settings.max_queue < 1 or settings.max_connections < 1:
            raise ConfigError(
                "max_queue and max_connections must be >= 1, got "
                f"{settings.max_queue} and {settings.max_connections}."
            )
        per_client = settings.idle_per_client()
        if not 1 <= per_client <= settings.max_connections:
            raise ConfigError(
                f"max_idle_per_client must be in [1, max_connections="
                f"{settings.max_connections}], got {per_client}."
            )
        self.settings = settings
        token = read_token(settings.token_file)
        self._target = parse_address(settings.address, allow_remote=settings.allow_remote)
        rows = site.settings.batch_size
        self.batcher = Batcher(site.model(), model_lock, rows=rows, max_queue=settings.max_queue,
                               batch_invariant=settings.batch_invariant)  # fmt: skip
        api = ChatApi(site, self.batcher, token, max_queue=settings.max_queue,
                   plain_name=site.settings.name, model_lock=model_lock)  # fmt: skip
        config = uvicorn.Config(
            build_app(api),
            lifespan="off",
            log_config=None,
            access_log=False,
            server_header=False,
            http=type("_EndpointH11", (_GuardedH11,), {"idle": IdleConnections(per_client)}),
            ws="none",  # no websockets served (nor their library imported)
            loop="asyncio",
            limit_concurrency=settings.max_connections,
            timeout_keep_alive=5,
            timeout_graceful_shutdown=10,  # a stop waits this long for answers under way
        )
        self._server = uvicorn.Server(config)
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        """Bind, start the batcher and the server thread; return where it listens."""
        self._listener = _listen(self._target, self.settings.socket_mode)
        self.batcher.start()
        self._thread = threading.Thread(target=self._serve, name="dpmtv-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started and self._thread.is_alive():
            if time.monotonic() > deadline:
                self.stop(timeout=5)
                raise ServiceError("the HTTP endpoint must start within 30 s, got no start.")
            time.sleep(0.02)
        if not self._server.started:
            self.stop(timeout=5)
            raise ServiceError("the HTTP endpoint must start, got a failure (see the log).")
        return self.where()

    def where(self) -> str:
        """``http://HOST:PORT`` or ``unix:PATH`` (the port chosen when 0 was asked)."""
        if isinstance(self._target, Path):
            return f"unix:{self._target}"
        assert self._listener is not None  # noqa: S101 (typing only: set by start())
        host, port = self._listener.getsockname()[:2]
        return f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"

    def _serve(self) -> None:
        assert self._listener is not None  # noqa: S101 (typing only: set by start())
        asyncio.run(self._server.serve(sockets=[self._listener]))

    def stop(self, timeout: float = 30.0) -> None:
        """Stop taking connections, finish what runs, release the socket."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.batcher.stop(timeout)
        if self._listener is not None:
            self._listener.close()
        if isinstance(self._target, Path):
            self._target.unlink(missing_ok=True)


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


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol, with the service's file descriptors bounded.

    uvicorn answers requests beyond ``limit_concurrency`` with 503 but keeps every connection
    it accepts, and a connection may stay silent, or trickle a request's head, forever: a flood
    of such connections would exhaust the process's descriptors (and with them the ledger's and
    the relay's), and enough silent ones would keep every real request out. So open
    connections stay below the limit, the oldest idle one closed for each newcomer, and idle
    ones are bounded per client (:class:`IdleConnections`); a newcomer is refused only when
    every other connection has a request under way; and each request's head must arrive
    whole within :data:`_HEAD_TIMEOUT_S` of the connection or of the previous answer, or the
    connection is closed (as the relay's socket does with a trickled frame).
    """

    idle: IdleConnections  # set per endpoint (HttpEndpoint)
    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
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
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:  # a head arrived
            self._disarm_head_deadline()
            self.idle.busy(self)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._now_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        self.idle.busy(self)
        super().connection_lost(exc)

    def _now_idle(self) -> None:
        self._arm_head_deadline()
        for connection in self.idle.idle(self, _client_of(self.transport), self.loop.time()):
            _close(connection)

    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        self._head_deadline = self.loop.call_later(_HEAD_TIMEOUT_S, self._head_timed_out)

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()


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


def _listen(target: tuple[str, int] | Path, mode: int) -> socket.socket:
    if isinstance(target, Path):
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists() or target.is_symlink():
            if not stat.S_ISSOCK(target.lstat().st_mode):
                raise ServiceError(f"--http unix: path must be free, got a file at {target}.")
            target.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        previous = os.umask(0o777)  # nobody can connect before the mode is set
        try:
            sock.bind(str(target))
        finally:
            os.umask(previous)
        os.chmod(target, mode)
    else:
        family = socket.AF_INET6 if ":" in target[0] else socket.AF_INET
        # proto named: asyncio sets TCP_NODELAY on accepted sockets only when it reads
        # IPPROTO_TCP, and without it each answer waits ~40 ms for a delayed ACK (Nagle).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind(target)
        except OSError as exc:
            sock.close()
            raise ServiceError(f"--http must name a free address, got {target}: {exc}") from exc
    sock.listen(512)
    sock.setblocking(False)
    return sock
