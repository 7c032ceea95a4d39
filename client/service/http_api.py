"""The OpenAI-compatible routes of the site service: answers only, behind a token.

How this connects: the HTTP front process (:mod:`client.service.http_front`) serves
:func:`build_app`; Starlette routes the requests (no HTTP parsing of ours);
:mod:`client.service.chat_format` maps a chat request onto a prompt under the bounds of
``dpmtv-site ask`` and decodes its images here, in the front; the request then goes over the
link (:class:`FrontLink`, :mod:`client.service.front_link`) to the site service, which names
the release it may use and runs its row with the batcher
(:mod:`client.service.http_backend`), and its answer comes back the same way.

Routes: ``POST /v1/chat/completions`` (``stream`` as server-sent events), ``GET /v1/models``
(and ``/v1/models/{id}``), ``GET /metrics`` (Prometheus text format) and ``GET /health``.
Every route but ``/health`` (which says ``ok`` and nothing else) needs
``Authorization: Bearer <token>``, the token the site admin wrote in the token file,
compared in constant time.

Trust: whoever holds the token can query the model with inputs of its own; it reaches no
data, ledger, key or path of the site (nor does this process: it holds no model, artifact or
path, only the token and what the link answers). Answers, release ids and counters are all a
reply ever carries: a failure whose text might name a path is logged by the site service and
answered with its type.

Bounds: a body is read up to :data:`~client.service.request_limits.MAX_REQUEST_BYTES` (413
beyond) within 120 s (408); every image is checked from its header before it is decoded
(400); at most ``max_queue`` requests are admitted (prepared, queued or running): one more
gets 503 with ``Retry-After``; and the bodies and decoded images held at once stay within
``max_memory`` bytes (:meth:`FrontApi.hold`; 503 beyond it, unless the request is alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from client.service.chat_format import (
    ChatRequest,
    ParsedChat,
    chat_frame,
    chat_request_from_json,
    decode_images,
    parse_chat,
)
from client.service.front_link import Frame, FrameReader, LinkError, encode_frame
from client.service.request_limits import DEFAULT_REQUEST_MEMORY, MAX_REQUEST_BYTES
from client.service.write_coalescing import TurnWriter
from dpmtv_common.errors import ConfigError, DataError

__all__ = ["FrontApi", "FrontLink", "announce_chat", "build_app"]

_log = logging.getLogger(__name__)
CHAT_PATH = "/v1/chat/completions"
_BODY_TIMEOUT_S = 120.0  # and its body within this (the relay socket's frame limit)
# A body this small is parsed and its images decoded on the event loop: a thread's round trip
# would cost more than the work (about a millisecond), and larger images would hold the loop.
_INLINE_BODY_BYTES = 64 << 10
_ANNOUNCED = "dpmtv.announced"  # in a request's scope: the service expects it
_Handler = Callable[[Request], Awaitable[Response]]
_LINK_GONE = {"kind": "fail", "status": 503, "type": "overloaded_error", "code": "unavailable",
              "message": "the site service is stopping; retry later."}  # fmt: skip


class _HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code

    @classmethod
    def of(cls, fields: dict[str, Any]) -> _HttpError:
        """The error the site service answered (``http_backend.error_fields``)."""
        return cls(int(fields["status"]), str(fields["message"]), str(fields["type"]),
                   fields.get("code"))  # fmt: skip


class FrontLink(asyncio.Protocol):
    """The front's end of the link, on its event loop: frames out, answers to their requests.

    ``on_stop`` runs once the site service's end closes (it is stopping, or gone): every
    request still waiting is answered 503 and the front stops. ``defer`` schedules the write
    of frames queued in a turn of the loop (:class:`~client.service.write_coalescing.TurnWriter`);
    None: at the end of the turn.
    """

    def __init__(
        self,
        on_stop: Callable[[], None],
        defer: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self._on_stop = on_stop
        self._defer = defer
        self._reader = FrameReader()
        self._transport: asyncio.Transport | None = None
        self._writer: TurnWriter | None = None
        self._waiting: dict[int, asyncio.Queue[dict[str, Any]]] = {}
        self._next_id = 0
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the link's transport to write frames on (a turn's frames in one write)."""
        self._transport = transport  # type: ignore[assignment]
        self._writer = TurnWriter(self._transport, self._defer)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        """Route each whole frame to its request's queue (or stop, when told)."""
        try:
            frames = self._reader.feed(data)
        except LinkError as exc:
            _log.error("the site service's link failed: %s", exc)
            if self._transport is not None:
                self._transport.close()
            return
        for frame in frames:
            self._deliver(frame)

    def _deliver(self, frame: Frame) -> None:
        message, _ = frame
        if message.get("kind") == "stop":
            self._on_stop()
            return
        queue = self._waiting.get(int(message.get("id", -1)))
        if queue is not None:  # else: its request is gone (its client left)
            queue.put_nowait(message)

    def connection_lost(self, exc: Exception | None) -> None:
        """The site service's end closed: answer every waiting request 503, and stop."""
        self.lost = True
        for queue in self._waiting.values():
            queue.put_nowait(dict(_LINK_GONE))
        self._on_stop()

    def send(self, message: dict[str, Any], blobs: tuple[bytes, ...] = ()) -> None:
        """One frame to the site service, from the event loop's thread.

        Written with the others of this turn of the loop
        (:class:`~client.service.write_coalescing.TurnWriter`); an announcement
        (``{"kind": "expect"}``) ahead of the requests queued with it, so the service counts
        every request on its way before it sees one arrive.
        """
        if self.lost or self._writer is None:
            raise _HttpError.of(_LINK_GONE)
        ahead = message.get("kind") == "expect"
        self._writer.send(encode_frame(message, blobs), ahead=ahead)

    def open(self) -> tuple[int, asyncio.Queue[dict[str, Any]]]:
        """A new request id and the queue its answers arrive in (until :meth:`close`)."""
        self._next_id += 1
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._waiting[self._next_id] = queue
        return self._next_id, queue

    def close(self, request_id: int) -> None:
        """Stop routing answers to ``request_id`` (answered, or its client left)."""
        self._waiting.pop(request_id, None)

    async def ask(self, kind: str) -> dict[str, Any]:
        """One question to the site service (``models``, ``stats``) and its reply."""
        request_id, queue = self.open()
        try:
            self.send({"kind": kind, "id": request_id})
            reply = await queue.get()
        finally:
            self.close(request_id)
        if reply["kind"] != "reply":
            raise _HttpError.of(reply)
        return reply


@dataclass
class FrontApi:
    """The routes' shared state: the token, the admission count, the counters, the link."""

    token: bytes
    max_queue: int
    owner: str
    link: FrontLink
    max_memory: int = DEFAULT_REQUEST_MEMORY
    admitted: int = 0
    held: int = 0  # bytes of request bodies and decoded images held now (see hold())
    requests: Counter[tuple[str, int]] = field(default_factory=Counter)
    request_seconds: float = 0.0
    completions: int = 0

    def authorised(self, request: Request) -> bool:
        """Whether ``request`` carries the site's token (compared in constant time)."""
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(given.strip().encode(), self.token)

    def admit(self) -> None:
        """Count a request in (one event loop: no lock), or refuse it with 503."""
        if self.admitted >= self.max_queue:
            raise _HttpError(503, f"requests in progress must stay below {self.max_queue}, got "
                             "a full service; retry later.", "overloaded_error",
                             "overloaded")  # fmt: skip
        self.admitted += 1

    def hold(self, size: int, what: str, *, own: int = 0) -> None:
        """Count ``size`` bytes of a request's memory in (one event loop: no lock), or refuse.

        Bodies are held as their bytes arrive until their request is decoded, decoded images
        until their request ends (the site service holds them until then): ``max_memory``
        bounds both, summed over every request at once. A request is refused with 503 only while
        others hold memory (``own``: bytes this request already holds), so one request within
        the per-request bounds always gets through.
        """
        if self.held > own and self.held + size > self.max_memory:
            raise _HttpError(
                503, f"request bodies and decoded images held at once must stay within "
                f"{self.max_memory} bytes, got {self.held} held and {size} more for {what}; "
                "retry later.", "overloaded_error", "overloaded",
            )  # fmt: skip
        self.held += size

    def release(self, size: int) -> None:
        """Count ``size`` bytes :meth:`hold` counted in back out."""
        self.held -= size

    def withdraw(self) -> None:
        """Withdraw a row announced to the site service that will not come."""
        with contextlib.suppress(_HttpError):  # the link is gone: nothing to withdraw from
            self.link.send({"kind": "cancel_expected"})

    def done(self, started: float | None, held: int = 0) -> None:
        """Count a request out with the ``held`` bytes of its images (``started``: answered)."""
        self.admitted -= 1
        self.release(held)
        if started is not None:
            self.completions += 1
            self.request_seconds += time.monotonic() - started

    async def metrics_text(self) -> str:
        """The counters, the site service's batcher's included (Prometheus text format)."""
        stats = await self.link.ask("stats")
        lines = [
            "# TYPE dpmtv_http_requests_total counter",
            *(
                f'dpmtv_http_requests_total{{route="{route}",code="{code}"}} {count}'
                for (route, code), count in sorted(self.requests.items())
            ),
            "# TYPE dpmtv_completion_seconds summary",
            f"dpmtv_completion_seconds_sum {self.request_seconds:.6f}",
            f"dpmtv_completion_seconds_count {self.completions}",
            "# TYPE dpmtv_http_held_bytes gauge",
            f"dpmtv_http_held_bytes {self.held}",
            "# TYPE dpmtv_http_max_held_bytes gauge",
            f"dpmtv_http_max_held_bytes {self.max_memory}",
            "# TYPE dpmtv_queue_rows gauge",
            f"dpmtv_queue_rows {stats['depth']}",
            "# TYPE dpmtv_batch_mode gauge",
            f'dpmtv_batch_mode{{mode="{stats["mode"]}"}} 1',
        ]
        for name, key, kind in _BATCH_METRICS:
            value = stats[key]
            shown = f"{value:.6f}" if isinstance(value, float) else str(value)
            lines += [f"# TYPE {name} {kind}", f"{name} {shown}"]
        return "\n".join(lines) + "\n"


_BATCH_METRICS = (
    ("dpmtv_batch_passes_total", "passes", "counter"),
    ("dpmtv_batch_prefills_total", "prefills", "counter"),
    ("dpmtv_batch_steps_total", "steps", "counter"),
    ("dpmtv_batch_step_rows_total", "step_rows", "counter"),
    ("dpmtv_batch_rows_total", "rows_served", "counter"),
    ("dpmtv_batch_running_rows", "running", "gauge"),
    ("dpmtv_generated_tokens_total", "tokens_generated", "counter"),
    ("dpmtv_generation_seconds_total", "busy_seconds", "counter"),
    ("dpmtv_batch_failures_total", "failures", "counter"),
)


def _error_response(error: _HttpError) -> JSONResponse:
    body = {"error": {"message": error.message, "type": error.kind, "code": error.code}}
    headers = {"Retry-After": "1"} if error.status == 503 else {}
    if error.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(body, status_code=error.status, headers=headers)


def _route(api: FrontApi, name: str, handler: _Handler, *, auth: bool = True) -> _Handler:
    """Authorise, turn typed errors into HTTP errors, count the answer."""

    async def wrapped(request: Request) -> Response:
        try:
            if auth and not api.authorised(request):
                raise _HttpError(
                    401, "Authorization must be 'Bearer <token>' with the site's token.",
                    "authentication_error", "invalid_api_key",
                )  # fmt: skip
            response = await handler(request)
        except _HttpError as exc:
            response = _error_response(exc)
        except (ConfigError, DataError) as exc:  # the request's own checks: no path of the site
            response = _error_response(_HttpError(400, str(exc), "invalid_request_error"))
        except Exception as exc:  # the text may name a path: logged, answered with its type
            _log.warning("%s failed: %s", name, exc)
            message = f"{type(exc).__name__} (see the site service's log)"
            response = _error_response(_HttpError(500, message, "server_error"))
        finally:
            if request.scope.pop(_ANNOUNCED, False):  # announced, but no chat handler took it
                api.withdraw()
        api.requests[(name, response.status_code)] += 1
        return response

    return wrapped


def announce_chat(link: FrontLink, scope: dict[str, Any]) -> None:
    """Tell the site service of a chat request as soon as its head arrives.

    The front's event loop reads every connection's bytes before it runs any handler, so
    requests that arrive together are announced together, and the batcher starts their rows
    in one batch instead of starting the first alone while the front parses the others.
    Withdrawn if the request is refused before it reaches the service.
    """
    if scope.get("method") == "POST" and scope.get("path") == CHAT_PATH:
        with contextlib.suppress(_HttpError):  # the link is gone: nothing to announce to
            link.send({"kind": "expect"})
            scope[_ANNOUNCED] = True


async def _read_body(api: FrontApi, request: Request) -> tuple[bytes, int]:
    """The whole body, and the bytes :meth:`FrontApi.hold` counted in for it (to release).

    A body is held as its bytes arrive, not by the length it declares: a client that declares
    a large body and sends it slowly holds only what it sent.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_REQUEST_BYTES:
        raise _HttpError(413, f"request body must be at most {MAX_REQUEST_BYTES} bytes, "
                         f"got {declared}.", "invalid_request_error")  # fmt: skip
    held, chunks = 0, []
    try:
        async with asyncio.timeout(_BODY_TIMEOUT_S):
            async for chunk in request.stream():
                if held + len(chunk) > MAX_REQUEST_BYTES:
                    raise _HttpError(413, f"request body must be at most {MAX_REQUEST_BYTES} "
                                     "bytes.", "invalid_request_error")  # fmt: skip
                api.hold(len(chunk), "its body", own=held)
                held += len(chunk)
                chunks.append(chunk)
    except TimeoutError:
        api.release(held)
        raise _HttpError(408, f"request body must arrive within {_BODY_TIMEOUT_S:g} s.",
                         "invalid_request_error") from None  # fmt: skip
    except BaseException:
        api.release(held)
        raise
    return b"".join(chunks), held


def _parsed(body: bytes) -> tuple[ChatRequest, ParsedChat]:
    """Parse and check a request, its images' headers included (in a worker thread if large).

    Raises:
        ConfigError, DataError: The request is malformed or out of bounds.
    """
    chat = chat_request_from_json(body)
    return chat, parse_chat(chat)


def _decoded(chat: ChatRequest, parsed: ParsedChat) -> tuple[dict[str, Any], tuple[bytes, ...]]:
    """Decode a parsed request's images: the frame the service gets, and its pixels.

    Raises:
        DataError: An image does not decode.
    """
    images = decode_images(parsed)
    frame = chat_frame(chat, parsed, images)
    return frame.model_dump(mode="json"), tuple(image.tobytes() for image in images)


_Asgi = Callable[
    [MutableMapping[str, Any], Callable[..., Awaitable[Any]], Callable[..., Awaitable[Any]]],
    Coroutine[Any, Any, None],
]
"""An ASGI application: ``(scope, receive, send)``."""


def build_app(api: FrontApi) -> _Asgi:
    """The routes, each authorised and counted.

    ``POST /v1/chat/completions``, the endpoint's hot path, goes straight to its handler,
    ahead of Starlette's middleware and router: they cost a small model's request a few
    percent of its throughput (measured in docs/benchmarks/serving.md), and the handler
    already answers every error of its own (:func:`_route`). Every other request, the chat
    path under another method included (405), goes through Starlette as before.
    """

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(await api.metrics_text(), media_type="text/plain")

    async def models(request: Request) -> Response:
        ids = (await api.link.ask("models"))["models"]
        data = [{"id": i, "object": "model", "created": 0, "owned_by": api.owner} for i in ids]
        return JSONResponse({"object": "list", "data": data})

    async def model(request: Request) -> Response:
        name = str(request.path_params["name"])
        if name not in (await api.link.ask("models"))["models"]:
            raise _HttpError(404, f"model must be one GET /v1/models lists, got {name[:80]!r}.",
                             "invalid_request_error", "model_not_found")  # fmt: skip
        return JSONResponse({"id": name, "object": "model", "created": 0, "owned_by": api.owner})

    chat = _route(api, "chat", functools.partial(_chat, api))
    routes = [
        Route("/health", _route(api, "health", health, auth=False), methods=["GET"]),
        Route("/metrics", _route(api, "metrics", metrics), methods=["GET"]),
        Route("/v1/models", _route(api, "models", models), methods=["GET"]),
        Route("/v1/models/{name:path}", _route(api, "models", model), methods=["GET"]),
        Route(CHAT_PATH, chat, methods=["POST"]),
    ]
    routed = Starlette(routes=routes)

    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == CHAT_PATH:
            response = await chat(Request(scope, receive, send))
            await response(scope, receive, send)
            return
        await routed(scope, receive, send)

    return app


async def _chat(api: FrontApi, request: Request) -> Response:
    """``POST /v1/chat/completions``: admitted, sent to the site service, answered."""
    completion = await _admitted(api, request)
    if completion.request.stream:
        return _Streamed(completion)
    try:
        return JSONResponse(await completion.whole())
    finally:
        completion.end(answered=False)  # a no-op once its answer came


async def _admitted(api: FrontApi, request: Request) -> _Completion:
    """Read, admit and start a chat request; its body is dropped when this returns."""
    started = time.monotonic()
    announced = bool(request.scope.pop(_ANNOUNCED, False))
    try:
        body, body_held = await _read_body(api, request)
    except BaseException:
        if announced:
            api.withdraw()
        raise
    try:
        api.admit()
    except BaseException:
        api.release(body_held)
        if announced:
            api.withdraw()
        raise
    try:
        return await _start(api, body, body_held, started, announced=announced)
    except BaseException:
        api.done(None)
        raise
    finally:
        api.release(body_held)


async def _start(
    api: FrontApi, body: bytes, body_held: int, started: float, *, announced: bool
) -> _Completion:
    """Send the request to the site service; its completion once its row is accepted.

    A row the service refuses (an unknown model, a prompt too long for the model, a full
    queue) is answered here, before any byte of a response. ``announced``: the service was
    told of it when its head arrived (:func:`announce_chat`). Its decoded images' bytes are
    held (:meth:`FrontApi.hold`) from its headers, before any pixel is decoded, until it ends.
    """
    link = api.link
    if not announced:
        link.send({"kind": "expect"})  # a batch about to start waits for this row (briefly)
    inline = len(body) <= _INLINE_BODY_BYTES  # else parsed and decoded in a worker thread
    held = 0
    try:
        chat_request, parsed = _parsed(body) if inline else await run_in_threadpool(_parsed, body)
        decoded = parsed.decoded_bytes()
        api.hold(decoded, "its decoded images", own=body_held)
        held = decoded
        if inline:
            message, images = _decoded(chat_request, parsed)
        else:
            message, images = await run_in_threadpool(_decoded, chat_request, parsed)
    except BaseException:
        api.release(held)
        api.withdraw()
        raise
    request_id, answers = link.open()
    try:
        link.send({**message, "id": request_id}, images)
        first = await answers.get()
        if first["kind"] != "accepted":
            raise _HttpError.of(first)
    except BaseException:
        link.close(request_id)
        api.release(held)
        raise
    return _Completion(api, chat_request, int(first["prompt_tokens"]), request_id, answers,
                       started, held)  # fmt: skip


class _Streamed(StreamingResponse):
    """A completion as server-sent events, ended however its response ends.

    Its client may leave before the stream's first byte: the events are then never iterated
    and could not end the completion themselves.
    """

    def __init__(self, completion: _Completion) -> None:
        super().__init__(completion.events(), media_type="text/event-stream")
        self._completion = completion

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._completion.end(answered=False)  # a no-op once its answer came


class _Completion:
    """One request's answer, as one JSON body or as server-sent events."""

    def __init__(
        self, api: FrontApi, request: ChatRequest, prompt_tokens: int, request_id: int,
        answers: asyncio.Queue[dict[str, Any]], started: float, held: int,
    ) -> None:  # fmt: skip
        self.api, self.request, self.prompt_tokens = api, request, prompt_tokens
        self._request_id, self._answers, self.started = request_id, answers, started
        self._held = held  # its decoded images' bytes, released when it ends
        self._ended = False
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.made = 0

    def _usage(self) -> dict[str, int]:
        prompt = self.prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": self.made,
                "total_tokens": prompt + self.made}  # fmt: skip

    async def _events(self) -> AsyncIterator[dict[str, Any]]:
        """The row's answers until it ends; its place is given back however it ends."""
        answered = False
        try:
            while True:
                event = await self._answers.get()
                yield event
                if event["kind"] != "token":
                    answered = event["kind"] == "finish"
                    return
        finally:
            self.end(answered=answered)

    def end(self, *, answered: bool) -> None:
        """Stop its answers and give back its place and memory, once however it ends."""
        if self._ended:
            return
        self._ended = True
        self.api.link.close(self._request_id)
        self.api.done(self.started if answered else None, self._held)

    async def whole(self) -> dict[str, Any]:
        async for event in self._events():
            if event["kind"] == "finish":
                self.made = int(event["tokens"])
                message = {"role": "assistant", "content": event["text"]}
                return {
                    "id": self.id,
                    "object": "chat.completion",
                    "created": self.created,
                    "model": self.request.model,
                    "choices": [{"index": 0, "message": message,
                                 "finish_reason": event["reason"], "logprobs": None}],
                    "usage": self._usage(),
                }  # fmt: skip
            if event["kind"] != "token":
                raise _HttpError.of(event)
        raise _HttpError.of(_LINK_GONE)

    def _chunk(self, delta: dict[str, str], reason: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        body = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.request.model,
            "choices": [choice],
        }
        return f"data: {json.dumps(body)}\n\n"

    async def events(self) -> AsyncIterator[str]:
        yield self._chunk({"role": "assistant", "content": ""})
        sent = ""
        async for event in self._events():
            if event["kind"] not in ("token", "finish"):
                error = {"message": event["message"], "type": event["type"], "code": None}
                yield f"data: {json.dumps({'error': error})}\n\n"
                return
            text = str(event["text"])
            if event["kind"] == "token" and text.endswith("\ufffd"):  # a character cut mid-bytes
                continue
            if text[len(sent) :]:
                yield self._chunk({"content": text[len(sent) :]})
                sent = text
            if event["kind"] == "finish":
                self.made = int(event["tokens"])
                yield self._chunk({}, event["reason"])
        options = self.request.stream_options
        if options is not None and options.include_usage:
            body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.request.model, "choices": [], "usage": self._usage()}  # fmt: skip
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
