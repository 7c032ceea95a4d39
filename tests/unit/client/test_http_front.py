"""The HTTP front's routes against a recorded link: what it tells the site service, and when."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

import pytest

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


def _link() -> tuple[FrontLink, _Recorded]:
    link, transport = FrontLink(on_stop=lambda: None), _Recorded()
    link.connection_made(transport)
    return link, transport


async def _call(api: FrontApi, scope: dict[str, Any], body: bytes = b"{}") -> int:
    """One request through the app; its status."""
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    full = {"headers": [], "query_string": b"", "root_path": "", "http_version": "1.1",
            "scheme": "http", "server": ("test", 80), "client": ("c", 1), **scope}  # fmt: skip
    await build_app(api)(full, receive, send)
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
