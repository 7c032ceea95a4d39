"""The front's guarded HTTP protocol on either parser: requests answered, heads announced once."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from client.service import http_guard
from client.service.http_guard import IdleConnections, guarded_protocol


async def _echo_path(scope: dict[str, Any], receive: Any, send: Any) -> None:
    while (await receive()).get("more_body"):
        pass
    body = scope["path"].encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(params=["httptools", "h11"])
def served(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A guarded server on 127.0.0.1 (the parser as asked), and the heads it announced."""
    if request.param == "h11":  # as where httptools is not installed

        def missing() -> type[asyncio.Protocol]:
            raise ImportError("httptools")

        monkeypatch.setattr(http_guard, "_httptools_protocol", missing)
    heads: list[str] = []
    idle = IdleConnections(8)
    protocol = guarded_protocol(idle, lambda scope: heads.append(scope["path"]))
    assert request.param.lower() in protocol.__mro__[1].__name__.lower()
    config = uvicorn.Config(_echo_path, http=protocol, lifespan="off", log_config=None,
                            ws="none", limit_concurrency=16)  # fmt: skip
    server = uvicorn.Server(config)
    listener = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield listener.getsockname(), heads, idle
    server.should_exit = True
    thread.join(10)
    listener.close()


def _answers(sock: socket.socket, count: int) -> list[bytes]:
    """The bodies of ``count`` answers read off ``sock`` (each with Content-Length)."""
    data, bodies = b"", list[bytes]()
    while len(bodies) < count:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        data += chunk
        while b"\r\n\r\n" in data:
            head, rest = data.split(b"\r\n\r\n", 1)
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            if len(rest) < length:
                break
            bodies.append(rest[:length])
            data = rest[length:]
    return bodies


def test_pipelined_requests_are_each_answered_and_each_head_announced_once(served):
    address, heads, _ = served
    with socket.create_connection(address, timeout=10) as sock:
        # two requests in one write, then a third on the kept-alive connection
        sock.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n")
        first = _answers(sock, 2)
        sock.sendall(b"POST /c HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        second = _answers(sock, 1)
    assert first + second == [b"/a", b"/b", b"/c"]
    assert heads == ["/a", "/b", "/c"]


def test_a_connection_without_a_whole_head_is_closed_at_its_deadline(served, monkeypatch):
    monkeypatch.setattr(http_guard, "HEAD_TIMEOUT_S", 0.3)
    address, heads, _ = served
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(b"GET /a HT")  # a trickled head
        started = time.monotonic()
        assert sock.recv(64) == b""
    assert time.monotonic() - started < 5
    assert heads == []


def test_connections_that_close_leave_the_idle_bookkeeping(served):
    # Arrange: connections held idle, some after an answer (kept alive)
    address, _, idle = served
    held = [socket.create_connection(address, timeout=10) for _ in range(6)]
    for sock in held[:3]:
        sock.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _answers(sock, 1) == [b"/a"]
    _wait_for(lambda: len(idle) == 6)

    # Act: every client leaves
    for sock in held:
        sock.close()

    # Assert: none of them is still counted idle (else the limits would close dead ones)
    _wait_for(lambda: len(idle) == 0)


def _wait_for(condition: Any, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.01)
