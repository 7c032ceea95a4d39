"""The HTTP front's link: frames of JSON and binary parts, read whole or piece by piece."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from typing import Any

import pytest

from client.service.batching import OverloadedError
from client.service.front_link import (
    MAX_FRAME_BYTES,
    FrameReader,
    FrameWriter,
    LinkError,
    encode_frame,
    read_frame,
)
from client.service.http_backend import error_fields
from client.service.releases import UnknownModelError
from dpmtv_common.errors import ConfigError, DataError, ServiceError

MESSAGE = {"kind": "chat", "id": 7, "questions": ["What colour?"], "sizes": [[2, 1]]}
BLOBS = (b"\x01\x02\x03\x04\x05\x06", b"", b"xyz")


def test_a_frame_round_trips_through_a_socket_and_piece_by_piece():
    frame = encode_frame(MESSAGE, BLOBS)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.sendall(frame + frame)
        assert read_frame(theirs) == (MESSAGE, list(BLOBS))
        assert read_frame(theirs) == (MESSAGE, list(BLOBS))
        ours.close()
        assert read_frame(theirs) is None  # a clean end between frames
    reader = FrameReader()
    got = [f for byte in frame + frame for f in reader.feed(bytes([byte]))]
    assert got == [(MESSAGE, list(BLOBS))] * 2


def test_a_link_that_ends_inside_a_frame_is_an_error():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.sendall(encode_frame(MESSAGE, BLOBS)[:-2])
        ours.close()
        with pytest.raises(LinkError, match="closed inside a frame"):
            read_frame(theirs)


def _raw(text: bytes, data: bytes = b"") -> bytes:
    return struct.pack("!II", len(text), len(data)) + text + data


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (struct.pack("!II", 10, MAX_FRAME_BYTES), "within"),  # claims more than any request
        (_raw(b"not json"), "JSON object"),
        (_raw(b"[1, 2]"), "JSON object"),
        (_raw(json.dumps({"kind": "x"}).encode()), "JSON object"),  # no blob lengths
        (_raw(json.dumps({"blobs": [4]}).encode(), b"abc"), "add up"),
        (_raw(json.dumps({"blobs": [-1, 4]}).encode(), b"abc"), "add up"),
    ],
)
def test_a_malformed_frame_ends_the_link_whichever_reader(frame, match):
    with pytest.raises(LinkError, match=match):
        FrameReader().feed(frame + b"\x00" * 16)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.sendall(frame)
        ours.close()
        with pytest.raises(LinkError, match=match):
            read_frame(theirs)


def test_a_frame_beyond_the_largest_request_is_not_sent():
    with pytest.raises(LinkError, match="must stay within"):
        encode_frame({"kind": "chat"}, (b"\x00" * MAX_FRAME_BYTES,))


@pytest.mark.parametrize(
    ("error", "status", "kind", "shown"),
    [
        (UnknownModelError("model must be one GET /v1/models lists"), 404,
         "invalid_request_error", "model must be one"),
        (OverloadedError("queued rows must stay below 6"), 503, "overloaded_error", "below 6"),
        (ConfigError("messages must end with a user message"), 400, "invalid_request_error",
         "messages must end"),
        (DataError("image 0 must be a readable picture"), 400, "invalid_request_error",
         "image 0"),
        # anything else is answered with its type only: its text may name a path of the site
        (ServiceError("/srv/site/artifacts/r1 is unreadable"), 500, "server_error",
         "ServiceError (see the site service's log)"),
        (OSError("/srv/site/secret.key: permission denied"), 500, "server_error",
         "OSError (see the site service's log)"),
    ],
)  # fmt: skip
def test_failures_cross_the_link_as_data_that_names_no_path(error, status, kind, shown):
    fields = error_fields(error)
    assert (fields["status"], fields["type"]) == (status, kind)
    assert shown in fields["message"]
    if status == 500:
        assert "/srv" not in fields["message"]
    json.dumps(fields)  # plain data: nothing pickled


def _frame(**changes: object) -> dict[str, object]:
    fields: dict[str, object] = {
        "kind": "chat", "id": 1, "model": "r1", "policy": "prompt-last-token",
        "instruction": None, "questions": ["What colour?"], "answers": [], "sizes": [[2, 1]],
        "max_new_tokens": 16, "temperature": 0.0, "seed": None, "stream": False,
    }  # fmt: skip
    return fields | changes


@pytest.mark.parametrize(
    ("changes", "blobs"),
    [
        ({"max_new_tokens": 10**6}, [bytes(6)]),  # more than any request may ask
        ({"temperature": 9.0}, [bytes(6)]),
        ({"instruction": "x" * 9000}, [bytes(6)]),
        ({"questions": ["q"] * 9, "sizes": [[2, 1]] * 9}, [bytes(6)] * 9),
        ({}, [bytes(5)]),  # pixels that do not fit the size
        ({}, [bytes(6), bytes(6)]),  # more images than sizes
        ({"sizes": [[4096, 4096]]}, [bytes(3 * 4096 * 4096)]),  # beyond the pixel bound
        ({"extra": 1}, [bytes(6)]),
    ],
)
def test_the_service_checks_a_chat_frame_again_whatever_the_front_sent(changes, blobs):
    from pydantic import ValidationError

    from client.service.chat_format import ChatFrame

    with pytest.raises((ConfigError, ValidationError)):
        ChatFrame.model_validate(_frame(**changes)).check_pixels(blobs)
    ChatFrame.model_validate(_frame()).check_pixels([bytes(6)])  # the same frame, within bounds


class _CountingBatcher:
    def __init__(self) -> None:
        self.expected = 0

    def expect(self) -> None:
        self.expected += 1

    def cancel_expected(self) -> None:
        self.expected = max(0, self.expected - 1)


def _backend(batcher: _CountingBatcher, link: socket.socket) -> Any:
    """The service's side of a link without a model: its frame handling only."""
    from client.service.front_link import FrameWriter
    from client.service.http_backend import HttpBackend

    backend = HttpBackend.__new__(HttpBackend)
    backend.batcher = batcher  # type: ignore[assignment]
    backend._link, backend._announced = link, 0
    backend._writer = FrameWriter(link, name="test-link-writer")
    backend._handlers = {"expect": backend._expect, "cancel_expected": backend._cancel_expected,
                         "chat": backend._chat}  # fmt: skip
    return backend


def test_rows_a_front_announced_and_never_sent_are_withdrawn_when_its_link_ends():
    # Arrange
    ours, theirs = socket.socketpair()
    batcher = _CountingBatcher()
    backend = _backend(batcher, ours)
    batcher.expected = 5  # rows announced by others (an earlier front)

    # Act: three announced and four withdrawn (one not this front's to withdraw), two more
    # announced, then the front dies
    with ours, theirs:
        for kind in ["expect"] * 3 + ["cancel_expected"] * 4 + ["expect"] * 2:
            theirs.sendall(encode_frame({"kind": kind}))
        theirs.close()
        backend.serve(on_ready=lambda: None)

    # Assert: only the others' are left for the batcher to wait for
    assert batcher.expected == 5


@pytest.mark.parametrize(
    ("changes", "blobs"),
    [
        ({"max_new_tokens": 10**6}, [bytes(6)]),
        ({}, [bytes(5)]),  # pixels that do not fit the size
    ],
)
def test_a_chat_frame_beyond_a_request_s_bounds_is_refused_by_the_service(changes, blobs):
    # Arrange: an announced chat frame that no checked request could be
    ours, theirs = socket.socketpair()
    batcher = _CountingBatcher()
    backend = _backend(batcher, ours)

    # Act
    with ours, theirs:
        backend._dispatch((_frame(**changes) | {"id": 3}, blobs), lambda: None)  # unannounced
        backend._dispatch(({"kind": "expect"}, []), lambda: None)
        backend._dispatch((_frame(**changes) | {"id": 4}, blobs), lambda: None)
        backend.close()  # what it queued is written first
        replies = [read_frame(theirs), read_frame(theirs)]

    # Assert: answered 400 before any release is named or row queued; its announcement gone
    assert [(r[0]["id"], r[0]["kind"], r[0]["status"]) for r in replies if r] == [
        (3, "error", 400), (4, "error", 400)
    ]  # fmt: skip
    assert batcher.expected == 0


@pytest.mark.timeout(30)  # a writer that blocks on the socket hangs here: fail, not wait
def test_the_writer_never_waits_on_a_peer_that_does_not_read():
    # Arrange: a peer that reads nothing, and more frames than the socket's buffers hold
    ours, theirs = socket.socketpair()
    writer = FrameWriter(ours, name="test-link-writer")
    frame = {"kind": "token", "id": 1, "text": "x" * 4096}

    # Act
    with ours, theirs:
        started = time.monotonic()
        for _ in range(2000):  # 8 MB: far beyond a socket pair's buffers
            writer.send(frame)
        took = time.monotonic() - started

        # Assert: queued at once; all of it arrives, whole and in order, once the peer reads
        assert took < 2.0, took
        got = [read_frame(theirs) for _ in range(2000)]
        writer.close()
    assert all(g is not None and g[0] == frame for g in got)


def test_the_writer_keeps_each_thread_s_order_and_writes_what_is_queued_before_closing():
    # Arrange
    ours, theirs = socket.socketpair()
    writer = FrameWriter(ours, name="test-link-writer")

    def send(thread: int) -> None:
        for n in range(300):
            writer.send({"kind": "token", "id": thread, "n": n}, (bytes([thread]) * n,))

    # Act: three threads at once, then close with frames still queued
    with ours, theirs:
        threads = [threading.Thread(target=send, args=(t,)) for t in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        writer.close()
        ours.shutdown(socket.SHUT_WR)
        frames = []
        while (frame := read_frame(theirs)) is not None:
            frames.append(frame)

    # Assert: every frame, whole, each thread's in its order
    assert len(frames) == 900
    for sender in range(3):
        mine = [(m["n"], blobs) for m, blobs in frames if m["id"] == sender]
        assert mine == [(n, [bytes([sender]) * n]) for n in range(300)]


def test_the_writer_drops_frames_once_its_peer_is_gone_and_raises_nothing():
    ours, theirs = socket.socketpair()
    writer = FrameWriter(ours, name="test-link-writer")
    theirs.close()
    with ours:
        for _ in range(100):
            writer.send({"kind": "token", "id": 1, "text": "x" * 4096})
        writer.close()
    assert not writer._thread.is_alive()


@pytest.mark.timeout(30)
def test_the_writer_shuts_a_peer_that_stops_reading_out_instead_of_holding_more_than_its_bound():
    # Arrange: a peer that reads nothing, and a writer bounded at 1 MiB
    ours, theirs = socket.socketpair()
    bound = 1 << 20
    writer = FrameWriter(ours, name="test-link-writer", max_queued=bound)
    frame = {"kind": "token", "id": 1, "text": "x" * 4096}
    size = len(encode_frame(frame))

    buffers = ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) + theirs.getsockopt(
        socket.SOL_SOCKET, socket.SO_RCVBUF
    )

    # Act: frames until the writer gives up (at most far more than the bound and the buffers)
    with ours, theirs:
        accepted = 0
        while not writer._closed and accepted < 4 * (bound + buffers) // size:
            writer.send(frame)
            accepted += 1
        writer._thread.join(10)

        # Assert: it gave up once what it held passed the bound (the socket's buffers took
        # the rest): it never held more
        assert writer._closed
        assert (accepted - 1) * size <= bound + buffers

        # and shut the link: the peer reads what was written (a frame the shutdown cut ends the
        # link, as any cut frame does), then the link's end
        assert not writer._thread.is_alive()
        assert writer._queued == 0
        theirs.settimeout(10)
        got = []
        with contextlib.suppress(LinkError):
            while (received := read_frame(theirs)) is not None:
                got.append(received[0])
    assert got == [frame] * len(got)
    assert len(got) * size <= 2 * bound  # what was written, and no more than that


def test_a_frame_beyond_the_link_s_bounds_is_refused_by_the_writer_and_queues_nothing():
    ours, theirs = socket.socketpair()
    writer = FrameWriter(ours, name="test-link-writer")
    with ours, theirs:
        with pytest.raises(LinkError, match="must stay within"):
            writer.send({"kind": "finish", "id": 1, "text": "x" * (2 << 20)})
        assert writer._queued == 0
        writer.send({"kind": "finish", "id": 2, "text": "ok"})  # the link goes on
        writer.close()
        assert read_frame(theirs) == ({"kind": "finish", "id": 2, "text": "ok"}, [])


def test_an_answer_too_large_for_the_link_reaches_the_front_as_a_server_error_not_silence():
    # Arrange
    ours, theirs = socket.socketpair()
    backend = _backend(_CountingBatcher(), ours)

    # Act: a row's answer beyond the link's bounds, then a small one
    with ours, theirs:
        backend.send({"kind": "finish", "id": 9, "reason": "stop", "text": "x" * (2 << 20)})
        backend.send({"kind": "finish", "id": 10, "reason": "stop", "text": "ok", "tokens": 1})
        backend.close()
        first, second = read_frame(theirs), read_frame(theirs)

    # Assert: request 9 is answered (500, its type only), request 10 as sent
    assert first is not None
    assert second is not None
    assert (first[0]["kind"], first[0]["id"], first[0]["status"]) == ("fail", 9, 500)
    assert first[0]["message"] == "LinkError (see the site service's log)"
    assert (second[0]["kind"], second[0]["text"]) == ("finish", "ok")
