"""The HTTP front's routes against a recorded link: what it tells the site service, and when."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
from collections.abc import MutableMapping
from typing import Any

import pytest
from PIL import Image
from starlette.applications import Starlette

from client.service.front_link import FrameReader
from client.service.http_api import FrontApi, FrontLink, announce_chat, build_app

TOKEN = "t" * 32
CHAT = {"type": "http", "method": "POST", "path": "/v1/chat/completions"}


class _Recorded(asyncio.Transport):
    """A transport that keeps what is written to it."""

    def __init__(self) -> None:
        super().__init__()
        self.reader = FrameReader()
        self.frames: list[dict[str, Any]] = []

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.frames += [message for message, _ in self.reader.feed(bytes(data))]

    def is_closing(self) -> bool:
        return False


def _link() -> tuple[FrontLink, _Recorded]:
    link, transport = FrontLink(on_stop=lambda: None), _Recorded()
    link.connection_made(transport)
    return link, transport


def _full(scope: dict[str, Any]) -> dict[str, Any]:
    """``scope`` with the rest of an HTTP request's ASGI scope."""
    return {"headers": [], "query_string": b"", "root_path": "", "http_version": "1.1",
            "scheme": "http", "server": ("test", 80), "client": ("c", 1), **scope}  # fmt: skip


async def _call(api: FrontApi, scope: dict[str, Any], body: bytes = b"{}") -> int:
    """One request through the app; its status."""
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    await build_app(api)(_full(scope), receive, send)
    return next(int(m["status"]) for m in sent if m["type"] == "http.response.start")


def test_a_chat_request_is_announced_when_its_head_arrives_and_nothing_else_is():
    link, transport = _link()
    chat: dict[str, Any] = dict(CHAT)
    health: dict[str, Any] = {"type": "http", "method": "GET", "path": "/health"}
    announce_chat(link, chat)
    announce_chat(link, health)
    assert [frame["kind"] for frame in transport.frames] == ["expect"]
    assert chat.get("dpmtv.announced") is True
    assert "dpmtv.announced" not in health


def test_an_announcement_reaches_the_service_before_requests_queued_ahead_of_it():
    # Arrange: a request's frame queued, then another request's head arrives (same turn)
    async def run() -> list[str]:
        link, transport = _link()
        link.send({"kind": "chat", "id": 1})
        announce_chat(link, dict(CHAT))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return [frame["kind"] for frame in transport.frames]

    # Act / Assert: the service counts the second request before it sees the first arrive
    assert asyncio.run(run()) == ["expect", "chat"]


@pytest.mark.parametrize(
    ("headers", "body", "status"),
    [
        ([], b"{}", 401),  # refused before the chat handler runs
        ([(b"authorization", f"Bearer {TOKEN}".encode())], b"{not json", 400),  # by the handler
        ([(b"authorization", f"Bearer {TOKEN}".encode())], b'{"model": "r1"}', 400),
    ],
)
def test_an_announced_request_refused_in_the_front_is_withdrawn_once(headers, body, status):
    # Arrange: the request's head arrived and was announced
    link, transport = _link()
    api = FrontApi(token=TOKEN.encode(), max_queue=4, owner="site", link=link)
    scope = {**CHAT, "headers": headers}
    announce_chat(link, scope)

    # Act
    got = asyncio.run(_call(api, scope, body))

    # Assert: the service is told it will not come, exactly once; nothing else was sent
    assert got == status
    assert [frame["kind"] for frame in transport.frames] == ["expect", "cancel_expected"]
    assert api.admitted == 0


class _Answering(_Recorded):
    """A link that answers every chat frame as the site service would: accepted, then ok."""

    def __init__(self, link: FrontLink) -> None:
        super().__init__()
        self.link = link

    def write(self, data: bytes) -> None:  # type: ignore[override]
        before = len(self.frames)
        super().write(data)
        for frame in self.frames[before:]:
            if frame["kind"] == "chat":
                ident = frame["id"]
                for reply in ({"kind": "accepted", "id": ident, "prompt_tokens": 3},
                              {"kind": "finish", "id": ident, "reason": "stop", "text": "ok",
                               "tokens": 1}):  # fmt: skip
                    asyncio.get_running_loop().call_soon(self.link._deliver, (reply, []))


def _chat_body(side: int) -> bytes:
    """A chat request for one ``side`` x ``side`` image (decoded: 3 x side**2 bytes)."""
    image = io.BytesIO()
    Image.new("RGB", (side, side), "red").save(image, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(image.getvalue()).decode()
    content = [{"type": "text", "text": "What colour?"}, {"type": "image_url",
                                                            "image_url": {"url": uri}}]  # fmt: skip
    body = {"model": "r1", "messages": [{"role": "user", "content": content}]}
    return json.dumps(body).encode()


def _api(max_memory: int) -> tuple[FrontApi, _Answering]:
    link = FrontLink(on_stop=lambda: None)
    transport = _Answering(link)
    link.connection_made(transport)
    return FrontApi(token=TOKEN.encode(), max_queue=4, owner="site", link=link,
                    max_memory=max_memory), transport  # fmt: skip


AUTHORISED = [(b"authorization", f"Bearer {TOKEN}".encode())]


@pytest.mark.parametrize(
    ("method", "path", "status", "through_starlette"),
    [
        ("POST", "/v1/chat/completions", 200, False),  # the hot path, straight to its handler
        ("GET", "/v1/chat/completions", 405, True),
        ("POST", "/v1/models", 405, True),
        ("GET", "/health", 200, True),
        ("GET", "/v1/nothing", 404, True),
    ],
)
def test_only_a_chat_post_skips_starlette_s_router_and_every_route_answers_as_before(
    monkeypatch, method, path, status, through_starlette
):
    # Arrange: requests seen by Starlette recorded
    seen: list[str] = []
    routed = Starlette.__call__

    async def recording(self: Starlette, scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["path"])
        await routed(self, scope, receive, send)

    monkeypatch.setattr(Starlette, "__call__", recording)
    api, _ = _api(max_memory=1 << 30)
    scope = {"type": "http", "method": method, "path": path, "headers": AUTHORISED}

    # Act
    got = asyncio.run(_call(api, scope, _chat_body(8)))

    # Assert
    assert got == status
    assert seen == ([path] if through_starlette else [])


def test_a_request_whose_images_would_pass_the_memory_bound_is_503_and_holds_nothing():
    # Arrange: another request holds 1 byte; this one's body fits beside it, its decoded
    # image (3 x 64 x 64 bytes, read from its header) does not
    body = _chat_body(64)
    api, transport = _api(max_memory=len(body) + 1 + 3 * 64 * 64 - 1)
    api.held = 1
    scope = {**CHAT, "headers": [*AUTHORISED, (b"content-length", str(len(body)).encode())]}
    announce_chat(api.link, scope)

    # Act
    got = asyncio.run(_call(api, scope, body))

    # Assert: refused before any pixel was decoded or sent; its announcement withdrawn
    assert got == 503
    assert [frame["kind"] for frame in transport.frames] == ["expect", "cancel_expected"]
    assert (api.held, api.admitted) == (1, 0)


@pytest.mark.parametrize("declared", [True, False])
def test_a_body_that_would_pass_the_memory_bound_is_503_declared_or_not(declared):
    body = _chat_body(8)
    api, transport = _api(max_memory=len(body))
    api.held = 1
    length = [(b"content-length", str(len(body)).encode())] if declared else []
    assert asyncio.run(_call(api, {**CHAT, "headers": [*AUTHORISED, *length]}, body)) == 503
    assert (api.held, api.admitted) == (1, 0)
    assert transport.frames == []


def test_a_request_alone_gets_through_whatever_the_bound_and_its_memory_is_released():
    # Arrange: a bound far below one request's body and image
    body = _chat_body(64)
    api, transport = _api(max_memory=10)
    scope = {**CHAT, "headers": [*AUTHORISED, (b"content-length", str(len(body)).encode())]}

    # Act: alone, then again beside a request holding 1 byte
    alone = asyncio.run(_call(api, scope, body))
    after_alone = (api.held, api.admitted)
    api.held = 1
    beside = asyncio.run(_call(api, scope, body))

    # Assert: answered alone, everything released; refused beside another
    assert (alone, beside) == (200, 503)
    assert after_alone == (0, 0)
    assert [frame["kind"] for frame in transport.frames] == ["expect", "chat"]
    assert (api.held, api.admitted) == (1, 0)


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (json.dumps({"model": "r1", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ]}]}).encode(), 400),  # a header that does not read
    ],
)  # fmt: skip
def test_a_refused_request_releases_what_it_held(body, status):
    api, _ = _api(max_memory=1 << 20)
    scope = {**CHAT, "headers": [*AUTHORISED, (b"content-length", str(len(body)).encode())]}
    assert asyncio.run(_call(api, scope, body)) == status
    assert (api.held, api.admitted) == (0, 0)


def test_a_streamed_request_whose_client_leaves_before_its_stream_starts_gives_back_its_place():
    # Arrange: the answer's head cannot be sent (the client is gone)
    body = json.loads(_chat_body(16)) | {"stream": True}
    raw = json.dumps(body).encode()
    api, _ = _api(max_memory=1 << 20)
    scope = _full({**CHAT, "headers": [*AUTHORISED, (b"content-length", str(len(raw)).encode())]})
    messages = iter([{"type": "http.request", "body": raw, "more_body": False}])

    async def receive() -> dict[str, Any]:
        return next(messages, {"type": "http.disconnect"})

    async def send(message: MutableMapping[str, Any]) -> None:
        raise OSError("the client is gone")

    # Act
    async def run() -> None:
        with contextlib.suppress(Exception):
            await build_app(api)(scope, receive, send)

    asyncio.run(run())

    # Assert: its admission and its images' memory are given back
    assert (api.admitted, api.held) == (0, 0)


def test_a_body_without_a_length_arriving_in_pieces_alone_gets_through_any_bound():
    # Arrange: a lone request's body in 4 pieces, no declared length, a 10-byte bound
    body = _chat_body(16)
    api, _ = _api(max_memory=10)
    cut = len(body) // 4
    pieces = [body[:cut], body[cut : 2 * cut], body[2 * cut : 3 * cut], body[3 * cut :]]
    messages = iter([{"type": "http.request", "body": piece, "more_body": i < 3}
                     for i, piece in enumerate(pieces)])  # fmt: skip
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return next(messages, {"type": "http.disconnect"})

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = _full({**CHAT, "headers": AUTHORISED})

    # Act
    asyncio.run(build_app(api)(scope, receive, send))

    # Assert: its own earlier pieces never count against it
    assert next(m["status"] for m in sent if m["type"] == "http.response.start") == 200
    assert (api.admitted, api.held) == (0, 0)


def test_a_body_sent_slowly_holds_what_it_sent_not_what_it_declares():
    # Arrange: a body declaring 40 MB that has sent 100 bytes so far
    api, _ = _api(max_memory=1 << 30)
    first_piece, go_on = asyncio.Event(), asyncio.Event()

    async def receive() -> dict[str, Any]:
        if not first_piece.is_set():
            first_piece.set()
            return {"type": "http.request", "body": b"x" * 100, "more_body": True}
        await go_on.wait()
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        pass

    headers = [*AUTHORISED, (b"content-length", str(40 << 20).encode())]
    scope = _full({**CHAT, "headers": headers})

    # Act: look while the rest has not come
    async def run() -> int:
        request = asyncio.create_task(build_app(api)(scope, receive, send))
        await first_piece.wait()
        await asyncio.sleep(0.05)
        during = api.held
        go_on.set()
        await request
        return during

    during = asyncio.run(run())

    # Assert: 100 bytes held while it trickles; nothing once it is answered (a 400: not JSON)
    assert during == 100
    assert (api.held, api.admitted) == (0, 0)
