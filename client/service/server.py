"""The site service: one long-lived process that owns the site's data, model, ledger and keys.

How this connects (OpenSSH-style privilege separation, docs/design.md "Threat model"): the
site admin starts ``dpmtv-site serve`` from the package installed at the site, under its own
user. Flower's SuperNode starts a fresh ``flwr-clientapp`` per message, which runs the relay
(:mod:`client.service.relay`, possibly code the coordinator shipped in its FAB): it forwards
the serialised ``Message`` over this service's Unix socket and returns the reply. The service
decodes it, runs the real handlers (:mod:`client.service.handlers`: plan, secure sums,
artifact) on an empty ``Context`` of its own — never the relay's state or node config; every
state lives in the site's record and ledger — and answers with the reply ``Message``. The
relay is never given a path, a key or a plaintext contribution: it sees plans, masked
integers and artifacts, as the coordinator does.

Lifecycle: one service per ledger (an exclusive lock beside the ledger; a second service is
refused), one request at a time under a lock, a log line per release state change, a sweep
that resolves releases left idle, and on SIGTERM/SIGINT a clean stop: the request in flight
finishes, open releases are resolved from the site's record, the socket file is removed.

Resources: whoever can write to the socket (the relay, perhaps the coordinator's code) must
not be able to wear the service down. At most ``max_connections`` connections are served at
once (more are answered "busy" and closed); a request frame must arrive whole within
``read_timeout_s`` (a peer that trickles bytes loses its slot); and its length is checked
against a bound before any payload byte is read. A ``MESSAGE`` frame may carry at most
:data:`SMALL_FRAME_BYTES` while no plan is open, and at most what the largest open plan
needs (its noisy vector or artifact, twice over for encodings) while one is; ``INFER`` is
bounded by the inference limits (:data:`client.service.inference.MAX_REQUEST_BYTES`).
Memory taken by requests is thus at most ``max_connections`` times the largest bound. A
release's idle timer is renewed only by an accepted message of its own run, so junk cannot
keep a reservation alive. No reply carries a path of the site.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import socketserver
import stat
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from flwr.app import Context, Message, RecordDict
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Message as ProtoMessage
from pydantic import ValidationError

from client.release.record import ReleaseRecord
from client.release.site import Site
from client.service.answer_ends import AnswerEnds
from client.service.handlers import build_site_app, error_message
from client.service.inference import (
    MAX_REQUEST_BYTES,
    InferRequest,
    answer_queries,
    check_request,
)
from client.service.sum_stages import SiteSums
from client.service.wire import FrameKind, read_frame, write_frame
from client.settings import SiteSettings, service_status_file
from dpmtv_common.errors import DpmtvError, ServiceError
from dpmtv_common.files import write_atomic
from protocol import MESSAGE_RECORD_KEY, ErrorReply, message_from_record

__all__ = ["DEFAULT_MAX_CONNECTIONS", "SMALL_FRAME_BYTES", "SiteService"]

_log = logging.getLogger(__name__)
_READ_TIMEOUT_S = 120.0  # a whole request frame, from the first byte to the last
_BUSY_REPLY_TIMEOUT_S = 1.0

SMALL_FRAME_BYTES = 1 << 20
"""Largest ``MESSAGE`` payload while no plan is open: plans, secure-sum keys, shares, notices."""
DEFAULT_MAX_CONNECTIONS = 4
"""Connections served at once; one relay runs one message at a time per run."""
_BYTES_PER_COORDINATE = 16  # float64, twice over: base64 in JSON records, numpy headers


class SiteService:
    """The site's policy engine behind its socket.

    Attributes:
        site: The site whose handlers decide.
        max_connections: Connections served at once; more are refused at once.
        read_timeout_s: Time a request frame has to arrive whole, from its first byte.
    """

    def __init__(
        self,
        settings: SiteSettings,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        read_timeout_s: float = _READ_TIMEOUT_S,
    ) -> None:
        if max_connections < 1:
            raise ServiceError(f"max_connections must be >= 1, got {max_connections}.")
        if not read_timeout_s > 0:
            raise ServiceError(f"read_timeout_s must be > 0, got {read_timeout_s}.")
        self.site = Site(settings)
        self.max_connections = max_connections
        self.read_timeout_s = read_timeout_s
        self._message_bound = SMALL_FRAME_BYTES
        self.sums = SiteSums(self.site)
        self.answer_ends = AnswerEnds(self.site.settings)  # refuses private data as public
        self._app = build_site_app(self.site, self.sums)
        self._lock = threading.Lock()
        self._lock_file: IO[str] | None = None
        self._server: socketserver.UnixStreamServer | None = None
        self._status_path: Path | None = None  # set while serving on a socket
        self._started = datetime.now(UTC).isoformat(timespec="seconds")

    @property
    def settings(self) -> SiteSettings:
        """The site admin's settings."""
        return self.site.settings

    @property
    def model_lock(self) -> threading.Lock:
        """The lock every use of the site's model and state takes (one at a time)."""
        return self._lock

    def frame_limit(self, kind: FrameKind) -> int:
        """The largest request payload of ``kind`` the service reads now (before reading it)."""
        if kind is FrameKind.MESSAGE:
            return self._message_bound  # set under the lock after every message
        if kind is FrameKind.INFER:
            return MAX_REQUEST_BYTES
        return 0  # PING carries nothing; any other kind is refused after its header

    def handle_message(self, message: Message) -> Message:
        """Run the site's handlers on one message (its context is empty: see ``_context_for``).

        Only an accepted message renews the idle timer of its run's releases: a refused one,
        or junk, leaves a reservation to expire.
        """
        with self._lock:
            context = self._context_for(message)
            try:
                reply = self._app(message, context)
            except Exception as exc:  # failures become data; the text stays in the log
                _log.warning("%s failed: %s", message.metadata.message_type, exc)
                reply = error_message(message, exc)
            if _accepted(reply):
                self.site.touch(message.metadata.run_id)
            self._update_message_bound()
            return reply

    def handle_bytes(self, payload: bytes) -> bytes:
        """One serialised request ``Message`` in, one serialised reply out."""
        try:
            message = message_from_proto(ProtoMessage.FromString(payload))
        except Exception as exc:
            raise ServiceError(f"request must be a serialised Flower Message: {exc}") from exc
        reply = self.handle_message(message)
        return bytes(message_to_proto(reply).SerializeToString())

    def handle_inference(self, payload: bytes) -> tuple[FrameKind, bytes]:
        """Answer a local inference request (JSON) with the loaded model; errors as text."""
        try:
            request = InferRequest.model_validate_json(payload)
            check_request(request)  # sizes from the headers, before the lock or any decoding
        except ValidationError as exc:
            return FrameKind.ERROR, f"inference request must be valid: {exc}".encode()
        except DpmtvError as exc:  # the request's own checks: they quote no path of the site
            return FrameKind.ERROR, str(exc).encode()
        try:
            with self._lock:
                answers = answer_queries(self.site, request, self.answer_ends)
        except Exception as exc:  # artifact, keys, model: the text may name a path; logged
            _log.warning("inference failed: %s", exc)
            reply = ErrorReply.from_exception(exc)
            text = f"{reply.code.value}: {reply.error_type}: {reply.reason} (see the site log)"
            return FrameKind.ERROR, text.encode()
        return FrameKind.ANSWERS, answers.model_dump_json().encode()

    def status(self) -> dict[str, Any]:
        """What a ``PING`` answers: only that the service is alive (the relay may be asking)."""
        return {"status": "ok"}

    def admin_status(self) -> dict[str, Any]:
        """What the admin's status file holds: the process, its files and its open releases."""
        return {
            "status": "ok",
            "site": self.settings.name,
            "pid": os.getpid(),
            "open_releases": len(self.site.records.open_records()),
            "ledger": str(self.settings.ledger_file),
            "socket": str(self.settings.socket_file),
            "started_utc": self._started,
            "updated_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        }

    def _update_message_bound(self) -> None:
        records = self.site.records.open_records()
        self._message_bound = SMALL_FRAME_BYTES + max(
            (_plan_payload_bytes(record) for record in records), default=0
        )
        if self._status_path is not None:
            _write_private_json(self._status_path, self.admin_status())

    @staticmethod
    def _context_for(message: Message) -> Context:
        """An empty context: the handlers keep every state on the site's own record, none here."""
        return Context(
            run_id=message.metadata.run_id,
            node_id=message.metadata.dst_node_id,
            node_config={},
            state=RecordDict(),
            run_config={},
        )

    # ------------------------------------------------------------------ lifecycle

    def acquire(self, *, exclusive: bool = True) -> None:
        """Take the one-service-per-ledger lock and resolve what a previous run left open.

        ``exclusive=False`` skips the lock: only for in-process consortia (simulation, tests),
        whose services share one process and never run a message concurrently.

        Raises:
            ServiceError: Another service holds the lock.
        """
        if exclusive:
            self._lock_file = _lock_ledger(self.settings.ledger_file)
        with self._lock:
            for release_id in self.site.sweep(everything=True):
                _log.info("release %s: resolved at start (left open by an earlier run)", release_id)
            self._update_message_bound()

    def sweep(self) -> None:
        """Resolve releases idle past the site's limit (called periodically)."""
        with self._lock:
            self.site.sweep()
            self.sums.forget_resolved()  # a swept release gets no release/abort message
            self._update_message_bound()

    def serve(self, socket_path: Path, *, ready: threading.Event | None = None) -> None:
        """Listen on ``socket_path`` until :meth:`stop`; blocks."""
        if self._lock_file is None:
            self.acquire()
        _prepare_socket_path(socket_path)
        server = _Server(str(socket_path), _Handler, bind_and_activate=False)
        server.service = self
        server.slots = threading.BoundedSemaphore(self.max_connections)
        _bind_private(server, socket_path, self.settings.socket_mode)
        self._server = server
        with self._lock:
            self._status_path = service_status_file(socket_path)
            self._update_message_bound()  # writes the admin's status file
        sweeper = _Sweeper(self, interval=min(30.0, self.settings.idle_release_seconds / 4))
        sweeper.start()
        _log.info("site %s serving on %s", self.settings.name, socket_path)
        if ready is not None:
            ready.set()
        try:
            server.serve_forever(poll_interval=0.2)
        finally:
            sweeper.stop()
            server.server_close()
            socket_path.unlink(missing_ok=True)
            with self._lock:
                status, self._status_path = self._status_path, None
            if status is not None:
                status.unlink(missing_ok=True)
            self._shutdown()

    def stop(self) -> None:
        """Ask :meth:`serve` to return after the request in flight (safe from any thread)."""
        if self._server is not None:
            threading.Thread(target=self._server.shutdown, daemon=True).start()

    def close(self) -> None:
        """Resolve open releases and release the lock (what a stop does, without a socket)."""
        self._shutdown()

    def _shutdown(self) -> None:
        with self._lock:
            for release_id in self.site.sweep(everything=True):
                _log.info("release %s: resolved at stop", release_id)
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None
        _log.info("site %s stopped", self.settings.name)


def _accepted(reply: Message) -> bool:
    """Whether the site accepted the message ``reply`` answers (no error of either kind)."""
    if reply.has_error():
        return False
    records = reply.content.config_records
    if MESSAGE_RECORD_KEY not in records:
        return True  # a SecAgg+ stage's reply
    try:
        answer = message_from_record(reply.content)
    except DpmtvError:  # a reply the site built itself always decodes; fail closed
        return False
    return not isinstance(answer, ErrorReply)


def _plan_payload_bytes(record: ReleaseRecord) -> int:
    """The largest payload a message of this plan carries: its noisy vector or artifact."""
    coordinates = record.num_layers * record.num_heads * record.head_dim
    return _BYTES_PER_COORDINATE * coordinates


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    service: SiteService
    slots: threading.BoundedSemaphore

    def process_request(self, request: Any, client_address: Any) -> None:
        # Counted before a thread starts or a byte is read: a flood of connections costs a
        # short "busy" answer each, never a thread or a buffer.
        if not self.slots.acquire(blocking=False):
            _refuse_busy(request, self.service.max_connections)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def _refuse_busy(sock: socket.socket, limit: int) -> None:
    _log.warning("relay connection refused: %d connections already served", limit)
    with contextlib.suppress(OSError):  # the peer may be gone: nothing to tell it
        sock.settimeout(_BUSY_REPLY_TIMEOUT_S)
        write_frame(sock, FrameKind.ERROR, b"site service busy: too many connections")


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        service: SiteService = self.server.service  # type: ignore[attr-defined]
        sock: socket.socket = self.request
        sock.settimeout(service.read_timeout_s)
        try:
            deadline = time.monotonic() + service.read_timeout_s
            kind, payload = read_frame(sock, max_bytes=service.frame_limit, deadline=deadline)
            if kind is FrameKind.PING:
                write_frame(sock, FrameKind.STATUS, json.dumps(service.status()).encode())
            elif kind is FrameKind.MESSAGE:
                write_frame(sock, FrameKind.REPLY, service.handle_bytes(payload))
            elif kind is FrameKind.INFER:
                write_frame(sock, *service.handle_inference(payload))
            else:
                write_frame(sock, FrameKind.ERROR, f"unexpected frame kind {kind.name}".encode())
        except (ServiceError, OSError) as exc:
            _log.warning("relay connection refused: %s", exc)
            with contextlib.suppress(OSError):  # the relay may be gone: nothing to tell it
                write_frame(sock, FrameKind.ERROR, b"request refused by the site service")


class _Sweeper(threading.Thread):
    def __init__(self, service: SiteService, *, interval: float) -> None:
        super().__init__(name="dpmtv-sweeper", daemon=True)
        self._service = service
        self._interval = interval
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self._service.sweep()
            except Exception:  # a sweep failure must not stop the service; it is logged
                _log.exception("sweep failed")

    def stop(self) -> None:
        self._stopped.set()


def _write_private_json(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` to ``path`` atomically, readable and writable by this user only."""
    write_atomic(path, json.dumps(document, sort_keys=True), durable=False)


def _lock_ledger(ledger: Path) -> IO[str]:
    ledger.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    handle = ledger.with_name(ledger.name + ".service-lock").open("a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise ServiceError(
            f"another dpmtv-site service already serves ledger {ledger} (pid {holder}); "
            "stop it first, or give this one another --ledger or --state-dir."
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def _bind_private(server: _Server, path: Path, mode: int) -> None:
    """Bind with no access for anyone, then open exactly ``mode``, then listen.

    The umask covers the moment between bind and chmod (a socket file is created with the
    process's umask); nobody can connect before the mode is the site admin's.
    """
    previous = os.umask(0o777)
    try:
        server.server_bind()
    finally:
        os.umask(previous)
    os.chmod(path, mode)
    server.server_activate()


def _prepare_socket_path(path: Path) -> None:
    """Make the socket's folder; remove a stale socket (we hold the lock), never a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not (path.exists() or path.is_symlink()):
        return
    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise ServiceError(f"socket path must be free or a stale socket, got a file at {path}.")
    path.unlink()
