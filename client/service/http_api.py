"""The OpenAI-compatible routes of the site service: answers only, behind a token.

How this connects: :mod:`client.service.http_server` serves :func:`build_app` beside the
relay's Unix socket, in the same process (the model is loaded once). Starlette routes the
requests (no HTTP parsing of ours); :mod:`client.service.chat_format` maps a chat request
onto a prompt under the bounds of ``dpmtv-site ask``; :mod:`client.service.releases` names
the releases a request may use; :mod:`client.service.batching` runs the rows of concurrent
requests together.

Routes: ``POST /v1/chat/completions`` (``stream`` as server-sent events), ``GET /v1/models``
(and ``/v1/models/{id}``), ``GET /metrics`` (Prometheus text format) and ``GET /health``.
Every route but ``/health`` (which says ``ok`` and nothing else) needs
``Authorization: Bearer <token>``, the token the site admin wrote in the token file,
compared in constant time.

Trust: whoever holds the token can query the model with inputs of its own; it reaches no
data, ledger, key or path of the site. Answers, release ids and counters are all a reply
ever carries: a failure whose text might name a path is logged and answered with its type.

Bounds: a body is read up to :data:`~client.service.inference.MAX_REQUEST_BYTES` (413
beyond) within 120 s (408); every image is checked from its header before it is decoded
(400); at most ``max_queue`` requests are admitted (prepared, queued or running): one more
gets 503 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from client.activations.hooks import PatchPolicy
from client.models import LoadedModel
from client.release.site import Site
from client.service.answer_ends import AnswerEnds
from client.service.batching import Batcher, OverloadedError
from client.service.chat_format import (
    ChatRequest,
    ParsedChat,
    chat_request_from_json,
    parse_chat,
    prompt_from_chat,
)
from client.service.inference import MAX_REQUEST_BYTES
from client.service.preparation import RowRequest
from client.service.releases import ReleaseCatalogue, UnknownModelError
from client.service.rows import Row
from dpmtv_common.errors import ConfigError, DataError

__all__ = ["ChatApi", "build_app"]

_log = logging.getLogger(__name__)
_BODY_TIMEOUT_S = 120.0  # and its body within this (the relay socket's frame limit)
_Handler = Callable[[Request], Awaitable[Response]]


class _HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code


class _Sink:
    """One row's tokens, from the worker thread to the request's event loop."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, done: Callable[[], None], *, streaming: bool
    ) -> None:
        self._loop = loop
        self._done = done
        self._streaming = streaming
        self.tokens: list[int] = []  # appended by the worker thread only
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def _put(self, kind: str, value: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self._loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def token(self, token_id: int) -> None:
        self.tokens.append(token_id)
        if self._streaming:  # a whole answer wakes its request once, at the end
            self._put("token", token_id)

    def finish(self, reason: str) -> None:
        self._done()
        self._put("finish", reason)

    def fail(self, error: Exception) -> None:
        self._done()
        self._put("fail", error)


@dataclass
class _Metrics:
    requests: Counter[tuple[str, int]]
    request_seconds: float = 0.0
    completions: int = 0

    def text(self, batcher: Batcher) -> str:
        stats = batcher.stats
        lines = [
            "# TYPE dpmtv_http_requests_total counter",
            *(
                f'dpmtv_http_requests_total{{route="{route}",code="{code}"}} {count}'
                for (route, code), count in sorted(self.requests.items())
            ),
            "# TYPE dpmtv_completion_seconds summary",
            f"dpmtv_completion_seconds_sum {self.request_seconds:.6f}",
            f"dpmtv_completion_seconds_count {self.completions}",
            "# TYPE dpmtv_queue_rows gauge",
            f"dpmtv_queue_rows {batcher.depth}",
            "# TYPE dpmtv_batch_mode gauge",
            f'dpmtv_batch_mode{{mode="{batcher.mode}"}} 1',
            "# TYPE dpmtv_batch_passes_total counter",
            f"dpmtv_batch_passes_total {stats.passes}",
            "# TYPE dpmtv_batch_prefills_total counter",
            f"dpmtv_batch_prefills_total {stats.prefills}",
            "# TYPE dpmtv_batch_steps_total counter",
            f"dpmtv_batch_steps_total {stats.steps}",
            "# TYPE dpmtv_batch_step_rows_total counter",
            f"dpmtv_batch_step_rows_total {stats.step_rows}",
            "# TYPE dpmtv_batch_rows_total counter",
            f"dpmtv_batch_rows_total {stats.rows_served}",
            "# TYPE dpmtv_batch_running_rows gauge",
            f"dpmtv_batch_running_rows {stats.running}",
            "# TYPE dpmtv_generated_tokens_total counter",
            f"dpmtv_generated_tokens_total {stats.tokens_generated}",
            "# TYPE dpmtv_generation_seconds_total counter",
            f"dpmtv_generation_seconds_total {stats.busy_seconds:.6f}",
            "# TYPE dpmtv_batch_failures_total counter",
            f"dpmtv_batch_failures_total {stats.failures}",
        ]
        return "\n".join(lines) + "\n"


class ChatApi:
    """The routes' shared state: the model, the releases, the batcher, the token."""

    def __init__(
        self,
        site: Site,
        batcher: Batcher,
        token: bytes,
        *,
        max_queue: int,
        plain_name: str,
        model_lock: threading.Lock,
    ) -> None:
        self.site = site
        self.batcher = batcher
        self.token = token
        self.admitted = threading.BoundedSemaphore(max_queue)
        self.metrics = _Metrics(Counter())
        self.owner = plain_name
        self._capped_lock = threading.Lock()
        self._capped_models: dict[int | None, LoadedModel] = {}
        self.catalogue = ReleaseCatalogue(
            site,
            model_lock=model_lock,
            answer_ends=AnswerEnds(site.settings),  # refuses private data as public
            capped=self._capped,
        )

    def authorised(self, request: Request) -> bool:
        """Whether ``request`` carries the site's token (compared in constant time)."""
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(given.strip().encode(), self.token)

    def admit(
        self, body: bytes, loop: asyncio.AbstractEventLoop
    ) -> tuple[ChatRequest, Future[Row], _Sink]:
        """Parse and check a request and queue it for the batcher to prepare (in a worker thread).

        Returns:
            The request, its row once prepared (raising what refused it, if anything did:
            then its sink is never called), and its sink.

        Raises:
            ConfigError, DataError: The request is malformed or out of bounds.
            UnknownModelError: It names no servable model.
            OverloadedError: The batcher's queue is full.
        """
        try:
            chat = chat_request_from_json(body)
            request = self.row_request(chat, parse_chat(chat))
        except BaseException:
            self.batcher.cancel_expected()
            raise
        sink = _Sink(loop, self.admitted.release, streaming=chat.stream)
        prepared = self.batcher.submit(request, sink, expected=True)
        prepared.add_done_callback(self._release_if_refused)
        return chat, prepared, sink

    def _release_if_refused(self, prepared: Future[Row]) -> None:
        """Give back the request's place if the batcher refused it: its sink is never called."""
        if prepared.exception() is not None:
            self.admitted.release()

    def row_request(self, chat: ChatRequest, parsed: ParsedChat) -> RowRequest:
        """Verify the release and decode the images (in a worker thread); the batcher tokenises."""
        patch, crops = self.catalogue.patch(
            chat.model, PatchPolicy(chat.policy), instruction=parsed.instruction
        )
        temperature = chat.temperature or 0.0
        return RowRequest(
            self._capped(crops),
            prompt_from_chat(parsed),
            instruction=parsed.instruction,
            patch=patch,
            max_new_tokens=chat.answer_tokens,
            temperature=temperature,
            seed=chat.seed if chat.seed is not None else secrets.randbits(63),
        )

    def _capped(self, crops: int | None) -> LoadedModel:
        """The model with its processor capped at ``crops`` (a copy, kept per cap)."""
        with self._capped_lock:
            if crops not in self._capped_models:
                self._capped_models[crops] = self.site.model().with_image_crops(crops)
            return self._capped_models[crops]

    def decode(self, token_ids: list[int]) -> str:
        """The text of generated tokens (special tokens dropped)."""
        tokenizer = self.site.model().processor.tokenizer
        return str(tokenizer.decode(token_ids, skip_special_tokens=True))


def _error_response(error: _HttpError) -> JSONResponse:
    body = {"error": {"message": error.message, "type": error.kind, "code": error.code}}
    headers = {"Retry-After": "1"} if error.status == 503 else None
    if error.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(body, status_code=error.status, headers=headers)


def _route(api: ChatApi, name: str, handler: _Handler, *, auth: bool = True) -> _Handler:
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
        except UnknownModelError as exc:
            response = _error_response(_HttpError(404, str(exc), "invalid_request_error",
                                                  "model_not_found"))  # fmt: skip
        except OverloadedError as exc:
            response = _error_response(_HttpError(503, str(exc), "overloaded_error", "overloaded"))
        except (ConfigError, DataError) as exc:  # the request's own checks: no path of the site
            response = _error_response(_HttpError(400, str(exc), "invalid_request_error"))
        except Exception as exc:  # the text may name a path: logged, answered with its type
            _log.warning("%s failed: %s", name, exc)
            message = f"{type(exc).__name__} (see the site service's log)"
            response = _error_response(_HttpError(500, message, "server_error"))
        api.metrics.requests[(name, response.status_code)] += 1
        return response

    return wrapped


async def _read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_REQUEST_BYTES:
        raise _HttpError(413, f"request body must be at most {MAX_REQUEST_BYTES} bytes, "
                         f"got {declared}.", "invalid_request_error")  # fmt: skip
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(_BODY_TIMEOUT_S):
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_REQUEST_BYTES:
                    raise _HttpError(413, f"request body must be at most {MAX_REQUEST_BYTES} "
                                     "bytes.", "invalid_request_error")  # fmt: skip
                chunks.append(chunk)
    except TimeoutError:
        raise _HttpError(408, f"request body must arrive within {_BODY_TIMEOUT_S:g} s.",
                         "invalid_request_error") from None  # fmt: skip
    return b"".join(chunks)


def build_app(api: ChatApi) -> Starlette:
    """The routes, each authorised and counted."""

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(api.metrics.text(api.batcher), media_type="text/plain")

    async def models(request: Request) -> Response:
        ids = await run_in_threadpool(api.catalogue.model_ids)
        data = [{"id": i, "object": "model", "created": 0, "owned_by": api.owner} for i in ids]
        return JSONResponse({"object": "list", "data": data})

    async def model(request: Request) -> Response:
        name = str(request.path_params["name"])
        ids = await run_in_threadpool(api.catalogue.model_ids)
        if name not in ids:
            raise UnknownModelError(f"model must be one GET /v1/models lists, got {name[:80]!r}.")
        return JSONResponse({"id": name, "object": "model", "created": 0, "owned_by": api.owner})

    async def chat(request: Request) -> Response:
        started = time.monotonic()
        body = await _read_body(request)
        if not api.admitted.acquire(blocking=False):
            raise OverloadedError(
                f"requests in progress must stay below {api.batcher.max_queue}, got a full "
                "service; retry later."
            )
        loop = asyncio.get_running_loop()
        api.batcher.expect()  # a pass about to start waits for this row (briefly)
        try:  # one trip to a worker thread: parse, check, decode, queue
            chat_request, prepared, sink = await run_in_threadpool(api.admit, body, loop)
        except BaseException:
            api.admitted.release()
            raise
        # The batcher tokenises it with the requests beside it. One it refuses (too long for
        # the model) is answered here as a bad request, before any byte of a response.
        row = await asyncio.wrap_future(prepared)
        completion = _Completion(api, chat_request, row, sink, started)
        if chat_request.stream:
            return StreamingResponse(completion.events(), media_type="text/event-stream")
        return JSONResponse(await completion.whole())

    routes = [
        Route("/health", _route(api, "health", health, auth=False), methods=["GET"]),
        Route("/metrics", _route(api, "metrics", metrics), methods=["GET"]),
        Route("/v1/models", _route(api, "models", models), methods=["GET"]),
        Route("/v1/models/{name:path}", _route(api, "models", model), methods=["GET"]),
        Route("/v1/chat/completions", _route(api, "chat", chat), methods=["POST"]),
    ]
    return Starlette(routes=routes)


class _Completion:
    """One request's answer, as one JSON body or as server-sent events."""

    def __init__(
        self, api: ChatApi, request: ChatRequest, row: Row, sink: _Sink, started: float
    ) -> None:
        self.api, self.request, self.row, self.sink = api, request, row, sink
        self.started = started
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.tokens: list[int] = []

    def _usage(self) -> dict[str, int]:
        made = len(self.tokens)
        prompt = self.row.prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made}

    def _done(self) -> None:
        self.api.metrics.completions += 1
        self.api.metrics.request_seconds += time.monotonic() - self.started

    async def _events(self) -> AsyncIterator[tuple[str, Any]]:
        while True:
            kind, value = await self.sink.events.get()
            if kind == "token":
                self.tokens.append(value)
            else:
                self.tokens = list(self.sink.tokens)  # every token, streamed or not
            yield kind, value
            if kind != "token":
                return

    async def whole(self) -> dict[str, Any]:
        reason = "length"
        async for kind, value in self._events():
            if kind == "fail":
                raise value
            if kind == "finish":
                reason = value
        self._done()
        message = {"role": "assistant", "content": self.api.decode(self.tokens)}
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.request.model,
            "choices": [{"index": 0, "message": message, "finish_reason": reason,
                         "logprobs": None}],
            "usage": self._usage(),
        }  # fmt: skip

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
        async for kind, value in self._events():
            if kind == "fail":
                _log.warning("streamed completion failed: %s", value)
                error = {"message": f"{type(value).__name__} (see the site service's log)",
                         "type": "server_error", "code": None}  # fmt: skip
                yield f"data: {json.dumps({'error': error})}\n\n"
                return
            text = self.api.decode(self.tokens)
            if kind == "token" and text.endswith("\ufffd"):  # a character cut mid-bytes
                continue
            if text[len(sent) :]:
                yield self._chunk({"content": text[len(sent) :]})
                sent = text
            if kind == "finish":
                yield self._chunk({}, value)
        self._done()
        options = self.request.stream_options
        if options is not None and options.include_usage:
            body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.request.model, "choices": [], "usage": self._usage()}  # fmt: skip
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
