"""The HTTP endpoint's listener: address, token, the front process, bounded connections.

How this connects: ``dpmtv-site serve ... --http 127.0.0.1:8080 --http-token-file F``
(:mod:`client.cli.http_options`) starts :class:`HttpEndpoint` once the service holds its
ledger. It binds the socket itself (a loopback address, or a Unix socket with the admin's
mode, unless ``--http-allow-remote``: then put TLS in front, the token travels in clear),
reads the admin's token, and starts the HTTP front (:mod:`client.service.http_front`) as a
process of its own on that socket: uvicorn (on the httptools parser where it is installed,
else h11) on the routes of :mod:`client.service.http_api`, which parse, check and decode each
request there and send it over a Unix socket pair (:mod:`client.service.front_link`) to this
process, where :class:`~client.service.http_backend.HttpBackend` names its release and the
batcher runs its row. The model, the artifacts and every path of the site stay in this process.

uvicorn answers requests beyond ``max_connections`` open connections with 503;
:mod:`client.service.http_guard` keeps open connections below that limit (a newcomer closes the
oldest connection without a request under way; it is refused only when every other one has a
request under way), bounds idle ones per client address, and closes any whose request head does
not arrive whole within 10 s: connections held open without a request never keep a real request
out.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from client.release.site import Site
from client.service.batching import Batcher
from client.service.http_backend import HttpBackend
from client.service.http_guard import IdleConnections
from client.service.request_limits import DEFAULT_REQUEST_MEMORY
from dpmtv_common.errors import ConfigError, ServiceError

__all__ = ["HttpEndpoint", "HttpSettings", "IdleConnections", "parse_address", "read_token"]

_log = logging.getLogger(__name__)
_MIN_TOKEN_CHARS = 24
_START_TIMEOUT_S = 60.0  # the front imports its libraries, then listens
_RESTARTS = 3
"""A front that dies is started again at most this often within :data:`_RESTART_WINDOW_S`."""
_RESTART_WINDOW_S = 60.0


@dataclass(frozen=True)
class HttpSettings:
    """How the endpoint listens and how much it admits.

    Attributes:
        address: ``HOST:PORT`` (an IP literal or ``localhost``) or ``unix:PATH``.
        token_file: The bearer token, written by the site admin, readable by its owner only.
        allow_remote: Bind to a non-loopback address (put TLS in front of it).
        max_queue: Requests admitted at once (being prepared, queued or generated).
        max_connections: Open connections uvicorn serves; more get 503.
        max_request_memory: Bytes of request bodies and decoded images held at once (a
            request's images until it ends, the site service's copy included); a request
            that would pass it gets 503, unless it is the only one.
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
    max_request_memory: int = DEFAULT_REQUEST_MEMORY
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
    """The endpoint's socket, its front process, and the batcher and backend beside the model.

    The service keeps the listening socket: a front that dies is started again on it (at most
    :data:`_RESTARTS` times in :data:`_RESTART_WINDOW_S`), and connections made meanwhile wait
    in its backlog.

    Args:
        site: The site whose model answers.
        model_lock: The lock every use of the site's model takes.
        settings: Address, token file and bounds.
    """

    def __init__(self, site: Site, model_lock: threading.Lock, settings: HttpSettings) -> None:
        if min(settings.max_queue, settings.max_connections, settings.max_request_memory) < 1:
            raise ConfigError(
                "max_queue, max_connections and max_request_memory must be >= 1, got "
                f"{settings.max_queue}, {settings.max_connections} and "
                f"{settings.max_request_memory}."
            )
        per_client = settings.idle_per_client()
        if not 1 <= per_client <= settings.max_connections:
            raise ConfigError(
                f"max_idle_per_client must be in [1, max_connections="
                f"{settings.max_connections}], got {per_client}."
            )
        self.settings = settings
        self._token = read_token(settings.token_file)
        self._target = parse_address(settings.address, allow_remote=settings.allow_remote)
        self._site, self._model_lock = site, model_lock
        rows = site.settings.batch_size
        self.batcher = Batcher(site.model(), model_lock, rows=rows, max_queue=settings.max_queue,
                               batch_invariant=settings.batch_invariant)  # fmt: skip
        self.front: subprocess.Popen[bytes] | None = None
        self._where: str | None = None
        self._listener: socket.socket | None = None
        self._backend: HttpBackend | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # a restart and a stop never interleave
        self._stopping = False
        self._deaths: list[float] = []

    def start(self) -> str:
        """Bind, start the batcher, the front process and the link's reader; say where."""
        self._listener = _listen(self._target, self.settings.socket_mode)
        self._where = _where(self._target, self._listener)
        self.batcher.start()
        with self._lock:
            ready = self._launch()
        self._wait_ready(ready)
        return self._where

    def _launch(self) -> threading.Event:
        """Start a front on the listening socket, and the thread that answers its link."""
        if self._listener is None:
            raise ServiceError("the HTTP endpoint must be bound before its front starts.")
        ours, theirs = socket.socketpair()
        try:
            self.front = _start_front(self._listener, theirs)
        finally:  # the front holds its own copy now
            theirs.close()
        ready = threading.Event()
        backend = HttpBackend(self._site, self.batcher, self._model_lock, ours)
        self._backend = backend
        backend.send({"kind": "init", "token": self._token.decode(),
                      "max_queue": self.settings.max_queue,
                      "max_connections": self.settings.max_connections,
                      "max_request_memory": self.settings.max_request_memory,
                      "idle_per_client": self.settings.idle_per_client(),
                      "owner": self._site.settings.name})  # fmt: skip
        self._thread = threading.Thread(
            target=self._serve, args=(backend, ready, self.front), name="dpmtv-http-link",
            daemon=True,
        )  # fmt: skip
        self._thread.start()
        return ready

    def _serve(
        self, backend: HttpBackend, ready: threading.Event, front: subprocess.Popen[bytes]
    ) -> None:
        """Answer the front until its link closes; a front that died is started again."""
        backend.serve(ready.set)
        with self._lock:
            if self._stopping:
                return
            backend.close()
            try:
                code = front.wait(5)
            except subprocess.TimeoutExpired:
                front.kill()
                code = front.wait(5)
            now = time.monotonic()
            self._deaths = [t for t in self._deaths if now - t < _RESTART_WINDOW_S] + [now]
            if len(self._deaths) > _RESTARTS:
                _log.error(
                    "the HTTP front ended unexpectedly (exit code %s), %d times within %g s: "
                    "not started again; the HTTP endpoint is down until the service restarts, "
                    "the rest of the service runs on (see the log above).",
                    code, len(self._deaths), _RESTART_WINDOW_S,
                )  # fmt: skip
                return
            _log.error(
                "the HTTP front ended unexpectedly (exit code %s): starting it again (see the "
                "log above).", code,
            )  # fmt: skip
            self._launch()

    def _wait_ready(self, ready: threading.Event) -> None:
        front = self.front
        waited = 0.0
        while not ready.wait(0.05):
            waited += 0.05
            if front is not None and front.poll() is not None:
                self.stop(timeout=5)
                raise ServiceError(
                    f"the HTTP front must start, got an exit with code {front.returncode} "
                    "(see the log)."
                )
            if waited > _START_TIMEOUT_S:
                self.stop(timeout=5)
                raise ServiceError(
                    f"the HTTP front must start within {_START_TIMEOUT_S:g} s, got no start."
                )

    def where(self) -> str:
        """``http://HOST:PORT`` or ``unix:PATH`` (the port chosen when 0 was asked)."""
        if self._where is None:
            raise ServiceError("the HTTP endpoint must be started before it is somewhere.")
        return self._where

    def stop(self, timeout: float = 30.0) -> None:
        """Stop taking connections, finish what runs, stop the front and release the socket."""
        with self._lock:
            self._stopping = True
            front, backend, thread = self.front, self._backend, self._thread
        if backend is not None:
            backend.send({"kind": "stop"})  # dropped if the front is gone already
        if front is not None:
            try:
                front.wait(timeout)
            except subprocess.TimeoutExpired:
                _log.warning("the HTTP front did not stop within %g s: killed", timeout)
                front.kill()
                front.wait(5)
        if backend is not None:
            backend.close()
        if thread is not None:
            thread.join(timeout)
        self.batcher.stop(timeout)
        if self._listener is not None:
            self._listener.close()
        if isinstance(self._target, Path):
            self._target.unlink(missing_ok=True)


def _start_front(listener: socket.socket, link: socket.socket) -> subprocess.Popen[bytes]:
    """The front process, given the listening socket and its end of the link."""
    fds = (listener.fileno(), link.fileno())
    command = [sys.executable, "-m", "client.service.http_front",
               "--listen-fd", str(fds[0]), "--link-fd", str(fds[1])]  # fmt: skip
    return subprocess.Popen(command, pass_fds=fds, stdin=subprocess.DEVNULL)  # noqa: S603


def _where(target: tuple[str, int] | Path, listener: socket.socket) -> str:
    if isinstance(target, Path):
        return f"unix:{target}"
    host, port = listener.getsockname()[:2]
    return f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"


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
