"""The site service's side of the HTTP endpoint: chat requests in, tokens out, over the link.

How this connects: the HTTP front process (:mod:`client.service.http_front`) parses, checks
and decodes each request, then sends it over the link (:mod:`client.service.front_link`);
:class:`HttpBackend` reads the link in one thread of the site service, names the release a
request asks for (:class:`~client.service.releases.ReleaseCatalogue`: verified before it is
served, with the instruction its prompts carried), and queues the row with the batcher
(:mod:`client.service.batching`), whose worker sends its answer back over the link. The
front never touches the model, an artifact or a path of the site: it learns release ids,
answers and counters, as an HTTP client does.

Every failure is answered as data (status, type, message): a request's own mistakes (400),
an unknown model (404), a full queue (503); anything else as its type only (500), its text
logged here, since it may name a path of the site.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
from collections.abc import Callable
from typing import Any

from PIL import Image
from pydantic import ValidationError

from client.activations.hooks import PatchPolicy
from client.models import LoadedModel
from client.release.site import Site
from client.service.answer_ends import AnswerEnds
from client.service.batching import Batcher, OverloadedError
from client.service.chat_format import ChatFrame, prompt_of
from client.service.front_link import Frame, FrameWriter, LinkError, read_frame
from client.service.preparation import RowRequest
from client.service.releases import ReleaseCatalogue, UnknownModelError
from client.service.rows import Row
from dpmtv_common.errors import ConfigError, DataError

__all__ = ["HttpBackend", "error_fields"]

_log = logging.getLogger(__name__)


def error_fields(exc: BaseException) -> dict[str, Any]:
    """How a failure is answered: HTTP status, error type and code, a message safe to show."""
    if isinstance(exc, UnknownModelError):
        return {"status": 404, "type": "invalid_request_error", "code": "model_not_found",
                "message": str(exc)}  # fmt: skip
    if isinstance(exc, OverloadedError):
        return {"status": 503, "type": "overloaded_error", "code": "overloaded",
                "message": str(exc)}  # fmt: skip
    if isinstance(exc, (ConfigError, DataError)):  # the request's own checks: no site path
        return {"status": 400, "type": "invalid_request_error", "code": None, "message": str(exc)}
    return {"status": 500, "type": "server_error", "code": None,
            "message": f"{type(exc).__name__} (see the site service's log)"}  # fmt: skip


class _LinkSink:
    """One row's tokens, from the batcher's worker to the front, as frames.

    Its text is decoded by the tokenizer of the model that runs the row, held from the start:
    the batcher's worker decodes every finished row, and looking the site's model up again
    there (a check of its files on disk) would cost each answer a pass's worth of time on a
    small model.
    """

    def __init__(
        self, backend: HttpBackend, request_id: int, *, streaming: bool, tokenizer: Any
    ) -> None:
        self._backend, self._id, self._streaming = backend, request_id, streaming
        self._tokenizer = tokenizer
        self._tokens: list[int] = []

    def token(self, token_id: int) -> None:
        self._tokens.append(token_id)
        if self._streaming:  # a whole answer is sent once, at the end
            self._backend.send({"kind": "token", "id": self._id, "text": self._text()})

    def finish(self, reason: str) -> None:
        self._backend.send({"kind": "finish", "id": self._id, "reason": reason,
                            "text": self._text(), "tokens": len(self._tokens)})  # fmt: skip

    def fail(self, error: Exception) -> None:
        _log.warning("a served row failed: %s", error)
        self._backend.send({"kind": "fail", "id": self._id, **error_fields(error)})

    def _text(self) -> str:
        return str(self._tokenizer.decode(self._tokens, skip_special_tokens=True))


class HttpBackend:
    """Answers the front's frames from the site's model (one reader thread, see module doc).

    Args:
        site: The site whose model and stored artifacts answer.
        batcher: Runs the rows.
        model_lock: The lock every use of the site's model takes.
        link: The service's end of the link to the front.
    """

    def __init__(
        self, site: Site, batcher: Batcher, model_lock: threading.Lock, link: socket.socket
    ) -> None:
        self.site = site
        self.batcher = batcher
        self._link = link
        self._writer = FrameWriter(link, name="dpmtv-http-link-writer")
        self._capped_lock = threading.Lock()
        self._capped_models: dict[int | None, LoadedModel] = {}
        self.catalogue = ReleaseCatalogue(
            site,
            model_lock=model_lock,
            answer_ends=AnswerEnds(site.settings),  # refuses private data as public
            capped=self._capped,
        )
        self._announced = 0  # rows the front announced and has not sent (the reader's own)
        self._handlers: dict[str, Callable[[dict[str, Any], list[bytes]], None]] = {
            "expect": self._expect,
            "cancel_expected": self._cancel_expected,
            "chat": self._chat,
            "models": self._models,
            "stats": self._stats,
        }

    def send(self, message: dict[str, Any], blobs: tuple[bytes, ...] = ()) -> None:
        """One frame to the front, from any thread, never waiting on the link.

        Written by :class:`~client.service.front_link.FrameWriter`; dropped once the front is
        gone (its clients are gone with it). A frame beyond the link's bounds (a bug of ours:
        none the service builds comes near them) is answered, when it names a request, with a
        server error, so that request does not wait for an answer that never comes.
        """
        try:
            self._writer.send(message, blobs)
        except LinkError as exc:
            _log.error("a frame to the HTTP front was not sent: %s", exc)
            if "id" in message:
                self._writer.send({"kind": "fail", "id": message["id"], **error_fields(exc)})

    def close(self) -> None:
        """Write what is queued, then close the service's end of the link."""
        self._writer.close()
        self._link.close()

    def serve(self, on_ready: Callable[[], None]) -> None:
        """Answer frames until the front closes the link (the reader thread's body).

        Rows the front announced and never sent are withdrawn when the link ends, so the
        batcher waits for none of them.
        """
        try:
            while True:
                try:
                    frame = read_frame(self._link)
                except (LinkError, OSError) as exc:
                    _log.error("the HTTP front's link failed: %s", exc)
                    return
                if frame is None:
                    return
                self._dispatch(frame, on_ready)
        finally:
            for _ in range(self._announced):
                self.batcher.cancel_expected()
            self._announced = 0

    def _expect(self, message: dict[str, Any], blobs: list[bytes]) -> None:
        self._announced += 1
        self.batcher.expect()

    def _cancel_expected(self, message: dict[str, Any], blobs: list[bytes]) -> None:
        if self._announced > 0:  # only this front's own announcements
            self._announced -= 1
            self.batcher.cancel_expected()

    def _dispatch(self, frame: Frame, on_ready: Callable[[], None]) -> None:
        message, blobs = frame
        kind = message.get("kind")
        if kind == "ready":
            on_ready()
            return
        handler = self._handlers.get(str(kind))
        if handler is None:
            _log.error("the HTTP front sent a frame of unknown kind %r", kind)
            return
        try:
            handler(message, blobs)
        except Exception as exc:  # answered as data; the text is logged (it may name a path)
            if not isinstance(exc, (ConfigError, DataError, OverloadedError)):
                _log.warning("an HTTP request failed: %s", exc)
            if "id" in message:
                self.send({"kind": "error", "id": message["id"], **error_fields(exc)})

    def _chat(self, message: dict[str, Any], blobs: list[bytes]) -> None:
        """Name the release, build the row request and queue it (see the module docstring)."""
        expected = self._announced > 0  # it was announced (the front announces every chat)
        self._announced -= int(expected)
        try:
            frame, request = self._row_request(message, blobs)
        except BaseException:
            if expected:
                self.batcher.cancel_expected()
            raise
        request_id = int(message["id"])
        tokenizer = request.loaded.processor.tokenizer
        sink = _LinkSink(self, request_id, streaming=frame.stream, tokenizer=tokenizer)
        prepared = self.batcher.submit(request, sink, expected=expected)
        prepared.add_done_callback(lambda done: self._prepared(request_id, done))

    def _prepared(self, request_id: int, prepared: Any) -> None:
        """Tell the front its row is accepted (its prompt's tokens), or why it was refused."""
        error = prepared.exception()
        if error is not None:
            self.send({"kind": "error", "id": request_id, **error_fields(error)})
            return
        row: Row = prepared.result()
        self.send({"kind": "accepted", "id": request_id, "prompt_tokens": row.prompt_tokens})

    def _row_request(
        self, message: dict[str, Any], blobs: list[bytes]
    ) -> tuple[ChatFrame, RowRequest]:
        """A chat frame, checked again (the front is not trusted for it), and its row request."""
        try:
            frame = ChatFrame.model_validate(message)
        except ValidationError as exc:
            problems = "; ".join(f"{e['loc']}: {e['msg']}" for e in exc.errors()[:3])
            raise ConfigError(f"a chat frame must hold a checked request: {problems}") from None
        frame.check_pixels(blobs)
        images = [
            Image.frombytes("RGB", size, data)
            for size, data in zip(frame.sizes, blobs, strict=True)
        ]
        prompt = prompt_of(images, frame.questions, frame.answers)
        patch, crops = self.catalogue.patch(
            frame.model, PatchPolicy(frame.policy), instruction=frame.instruction
        )
        return frame, RowRequest(
            self._capped(crops),
            prompt,
            instruction=frame.instruction,
            patch=patch,
            max_new_tokens=frame.max_new_tokens,
            temperature=frame.temperature,
            seed=frame.seed if frame.seed is not None else secrets.randbits(63),
        )

    def _models(self, message: dict[str, Any], blobs: list[bytes]) -> None:
        self.send({"kind": "reply", "id": message["id"], "models": self.catalogue.model_ids()})

    def _stats(self, message: dict[str, Any], blobs: list[bytes]) -> None:
        stats = self.batcher.stats
        self.send({
            "kind": "reply", "id": message["id"], "depth": self.batcher.depth,
            "max_queue": self.batcher.max_queue, "mode": self.batcher.mode,
            "passes": stats.passes, "prefills": stats.prefills, "steps": stats.steps,
            "step_rows": stats.step_rows, "rows_served": stats.rows_served,
            "running": stats.running, "tokens_generated": stats.tokens_generated,
            "busy_seconds": stats.busy_seconds, "failures": stats.failures,
        })  # fmt: skip

    def _capped(self, crops: int | None) -> LoadedModel:
        """The model with its processor capped at ``crops`` (a copy, kept per cap)."""
        with self._capped_lock:
            if crops not in self._capped_models:
                self._capped_models[crops] = self.site.model().with_image_crops(crops)
            return self._capped_models[crops]
