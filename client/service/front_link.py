"""The link between the HTTP front process and the site service: framed data, never pickles.

How this connects: the site service (:mod:`client.service.http_server`) starts the HTTP
front (:mod:`client.service.http_front`) as a process of its own, so that HTTP parsing, JSON,
base64 and image decoding run beside the model's decoding loop instead of sharing its
interpreter lock, and talks to it over one Unix socket pair. Each message is a frame:

* 8 bytes: the JSON part's length and the binary part's length (big-endian, 4 bytes each);
* the JSON object (UTF-8), whose ``"blobs"`` lists the binary parts' lengths in order;
* the binary parts, concatenated (decoded images' pixels, in the front's chat frames).

Neither side trusts a frame's lengths beyond :data:`MAX_FRAME_BYTES`: a frame that claims
more, or whose blobs do not add up, ends the link (the front is our own process, so this is
a bug or a compromise, and both end the endpoint rather than guess).

Light on purpose (no model): the front imports it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import threading
from collections.abc import Sequence
from typing import Any

from client.service.request_limits import MAX_IMAGE_PIXELS, MAX_IMAGES
from dpmtv_common.errors import ServiceError

__all__ = [
    "MAX_FRAME_BYTES", "Frame", "FrameReader", "FrameWriter", "LinkError", "encode_frame",
    "read_frame",
]  # fmt: skip

_log = logging.getLogger(__name__)

_HEAD = struct.Struct("!II")
_MAX_JSON_BYTES = 1 << 20  # questions, instruction and answers of one request, with room
MAX_FRAME_BYTES = _MAX_JSON_BYTES + MAX_IMAGES * MAX_IMAGE_PIXELS * 3
"""Largest frame: the JSON part and every image of a request decoded to RGB."""
MAX_QUEUED_BYTES = 64 << 20
"""Most bytes a :class:`FrameWriter` holds for a peer that does not read (written or not)."""

Frame = tuple[dict[str, Any], list[bytes]]
"""A frame's JSON object and its binary parts."""


class LinkError(ServiceError):
    """A frame broke the link's format (a bug or a compromised peer): the link ends."""


def encode_frame(message: dict[str, Any], blobs: Sequence[bytes] = ()) -> bytes:
    """One frame of ``message`` and ``blobs`` (their lengths recorded under ``"blobs"``)."""
    text = json.dumps({**message, "blobs": [len(blob) for blob in blobs]}).encode()
    size = sum(len(blob) for blob in blobs)
    if len(text) > _MAX_JSON_BYTES or len(text) + size > MAX_FRAME_BYTES:
        raise LinkError(
            f"a frame must stay within {_MAX_JSON_BYTES} JSON bytes and {MAX_FRAME_BYTES} in "
            f"all, got {len(text)} and {len(text) + size}."
        )
    return b"".join((_HEAD.pack(len(text), size), text, *blobs))


def _lengths(head: bytes) -> tuple[int, int]:
    text, size = _HEAD.unpack(head)
    if text > _MAX_JSON_BYTES or text + size > MAX_FRAME_BYTES:
        raise LinkError(f"a frame must stay within {MAX_FRAME_BYTES} bytes, got {text + size}.")
    return text, size


def _decode(text: bytes, data: bytes) -> Frame:
    try:
        message = json.loads(text)
        lengths = [int(n) for n in message.pop("blobs")]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LinkError(f"a frame must hold a JSON object with its blobs: {exc}") from None
    if sum(lengths) != len(data) or min(lengths, default=0) < 0:
        raise LinkError(f"a frame's blobs must add up to {len(data)} bytes, got {lengths}.")
    blobs, start = [], 0
    for length in lengths:
        blobs.append(data[start : start + length])
        start += length
    return message, blobs


def read_frame(link: socket.socket) -> Frame | None:
    """The next frame from a blocking socket; None when the peer closed the link."""
    head = _read_exactly(link, _HEAD.size)
    if head is None:
        return None
    text, size = _lengths(head)
    body = _read_exactly(link, text + size) if text + size else b""
    if body is None:
        raise LinkError("the link closed inside a frame.")
    return _decode(body[:text], body[text:])


def _read_exactly(link: socket.socket, count: int) -> bytes | None:
    """``count`` bytes; None at a clean end (nothing read); LinkError at an end mid-way."""
    buffer = bytearray()
    while len(buffer) < count:
        chunk = link.recv(min(count - len(buffer), 1 << 20))
        if not chunk:
            if buffer:
                raise LinkError("the link closed inside a frame.")
            return None
        buffer += chunk
    return bytes(buffer)


class FrameReader:
    """Frames from a byte stream fed piece by piece (an event loop's protocol)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._need: tuple[int, int] | None = None

    def feed(self, data: bytes) -> list[Frame]:
        """Every frame ``data`` completes, in order."""
        self._buffer += data
        frames: list[Frame] = []
        while True:
            if self._need is None:
                if len(self._buffer) < _HEAD.size:
                    return frames
                self._need = _lengths(bytes(self._buffer[: _HEAD.size]))
                del self._buffer[: _HEAD.size]
            text, size = self._need
            if len(self._buffer) < text + size:
                return frames
            body = bytes(self._buffer[: text + size])
            del self._buffer[: text + size]
            self._need = None
            frames.append(_decode(body[:text], body[text:]))


class FrameWriter:
    """Frames to one socket from any thread, written by a thread of their own, in order.

    Why a thread: the site service's batcher worker sends each row's tokens and answer; it
    must never wait on the socket (a front slow to read would stall the model). Frames
    queued while a write runs leave together in the next write, so a step that ends eight
    rows costs the link one system call and the front one wake-up, not eight.

    Bounded: at most ``max_queued`` bytes wait. A front that stays alive but stops reading
    for that long is broken (it is our own process, and it reads every frame as it comes):
    the writer then shuts the socket down instead of growing the service's memory, and the
    endpoint starts a new front (:class:`~client.service.http_server.HttpEndpoint`).

    Once the socket fails (the front is gone) the writer stops and drops what is queued and
    what comes after: the front's clients are gone with it.
    """

    def __init__(
        self, sock: socket.socket, *, name: str, max_queued: int = MAX_QUEUED_BYTES
    ) -> None:
        self._sock = sock
        self._max_queued = max_queued
        self._queue: list[bytes] = []
        self._queued = 0  # bytes in the queue
        self._ready = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, message: dict[str, Any], blobs: Sequence[bytes] = ()) -> None:
        """Queue one frame; never blocks.

        Raises:
            LinkError: The frame is beyond the link's bounds (:func:`encode_frame`); nothing
                is queued, so its sender can answer the request otherwise.
        """
        frame = encode_frame(message, blobs)
        with self._ready:
            if self._closed:
                return
            if self._queued + len(frame) > self._max_queued:
                self._give_up(len(frame))
                return
            self._queue.append(frame)
            self._queued += len(frame)
            self._ready.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued, then stop (the socket stays open: its owner closes it)."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _give_up(self, size: int) -> None:
        """The peer stopped reading: drop the queue and shut the socket (lock held)."""
        _log.error(
            "the HTTP front stopped reading its link: %d bytes wait for it, and a frame of %d "
            "more would pass the bound of %d; the link is shut down (the endpoint starts a new "
            "front).", self._queued, size, self._max_queued,
        )  # fmt: skip
        self._closed = True
        self._queue, self._queued = [], 0
        self._ready.notify()
        with contextlib.suppress(OSError):  # already shut or closed: nothing left to end
            self._sock.shutdown(socket.SHUT_RDWR)

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                batch, self._queue = self._queue, []
            if not batch:
                return
            data = b"".join(batch)
            try:
                self._sock.sendall(data)
            except OSError as exc:
                _log.debug("the link's writer stops: %s", exc)
                with self._ready:
                    self._closed = True
                    self._queue, self._queued = [], 0
                return
            with self._ready:  # counted until written: a peer that stops reading holds them
                self._queued = max(0, self._queued - len(data))
