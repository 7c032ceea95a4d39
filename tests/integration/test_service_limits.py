"""The site service cannot be worn down by whoever reaches its socket (the relay included).

A real ``SiteService`` serves a real Unix socket in a thread (no model is loaded: every limit
here must hold before the model, the data or the ledger is touched). The tests speak the wire
protocol by hand, as a hostile relay would: oversized frames, a flood of connections, a frame
that never finishes, oversized or "bomb" images, and look at what the replies give away.
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is first imported

import base64
import contextlib
import io
import json
import select
import socket
import stat
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from flwr.app import Context, Message, RecordDict
from flwr.common.serde import message_to_proto
from PIL import Image

from client.service.inference import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_IMAGES,
    MAX_REQUEST_BYTES,
)
from client.service.relay import SOCKET_KEY, unix_socket_transport
from client.service.server import SMALL_FRAME_BYTES, SiteService
from client.service.wire import MAGIC, WIRE_VERSION, FrameKind, read_frame, write_frame
from client.settings import SiteSettings, service_status_file
from dpmtv_common.errors import ServiceError
from protocol import AbortNotice, message_to_record
from server.simulation import set_task_identity
from tests.flower_harness import flower_process_state

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

_HEADER = struct.Struct(">4sBBHI")
READ_TIMEOUT_S = 2.0
PATIENT_READ_TIMEOUT_S = 60.0
FAST_S = 10.0  # a refusal from the header: far under the patient deadline, even on a busy host


@dataclass
class Running:
    service: SiteService
    path: Path
    state: Path
    thread: threading.Thread

    def connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10.0)
        sock.connect(str(self.path))
        return sock

    def exchange(self, kind: FrameKind, payload: bytes) -> tuple[FrameKind, bytes]:
        with self.connect() as sock:
            write_frame(sock, kind, payload)
            return read_frame(sock)


@contextlib.contextmanager
def _serving(tmp_path: Path, read_timeout_s: float) -> Iterator[Running]:
    settings = SiteSettings(
        name="limits-site",
        state_dir=tmp_path / "state",
        socket_path=tmp_path / "s.sock",  # AF_UNIX paths must stay under ~100 bytes
        device="cpu",
    )
    service = SiteService(settings, max_connections=2, read_timeout_s=read_timeout_s)
    ready = threading.Event()
    thread = threading.Thread(
        target=service.serve, args=(settings.socket_file,), kwargs={"ready": ready}, daemon=True
    )
    thread.start()
    assert ready.wait(30)
    try:
        yield Running(service, settings.socket_file, settings.state_dir, thread)
    finally:
        service.stop()
        thread.join(30)


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    with _serving(tmp_path, READ_TIMEOUT_S) as served:
        yield served


@pytest.fixture
def patient(tmp_path: Path) -> Iterator[Running]:
    """A service whose read deadline is a minute: a refusal within seconds is the bound's."""
    with _serving(tmp_path, PATIENT_READ_TIMEOUT_S) as served:
        yield served


def _refused_fast(running: Running, header: bytes) -> tuple[FrameKind, bytes, float]:
    """Send only a frame header; the answer and how long it took."""
    with running.connect() as sock:
        sock.settimeout(PATIENT_READ_TIMEOUT_S + 10)
        started = time.monotonic()
        sock.sendall(header)
        kind, payload = read_frame(sock)
    return kind, payload, time.monotonic() - started


def _header(kind: FrameKind, length: int) -> bytes:
    return _HEADER.pack(MAGIC, WIRE_VERSION, int(kind), 0, length)


def _png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` and whose pixels never come."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        body = tag + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 9))


def _infer(running: Running, images: list[bytes]) -> tuple[FrameKind, str]:
    request = {
        "release_id": "r1",
        "questions": ["What colour is it?"] * len(images),
        "images": [base64.b64encode(image).decode() for image in images],
    }
    kind, payload = running.exchange(FrameKind.INFER, json.dumps(request).encode())
    return kind, payload.decode()


# ---------------------------------------------------------------- frames and connections


def test_a_message_frame_over_the_small_bound_is_refused_before_its_payload(
    patient: Running,
) -> None:
    # Arrange: no plan is open, so a MESSAGE may carry at most the small bound.
    # Act: announce one byte more, send none of it.
    kind, payload, took = _refused_fast(patient, _header(FrameKind.MESSAGE, SMALL_FRAME_BYTES + 1))
    # Assert: refused from the header alone: the service never waited for the payload (the
    # read deadline, a minute here, would have answered the same words much later).
    assert kind is FrameKind.ERROR
    assert payload == b"request refused by the site service"
    assert took < FAST_S


def test_the_message_bound_grows_only_with_an_open_plan(running: Running) -> None:
    # Arrange / Act: with nothing open the bound is the small one...
    before = running.service.frame_limit(FrameKind.MESSAGE)
    # Assert: and a frame at that bound is read (then refused as not a Flower Message).
    assert before == SMALL_FRAME_BYTES
    assert running.service.frame_limit(FrameKind.PING) == 0
    kind, _ = running.exchange(FrameKind.MESSAGE, b"\xff" * 64)
    assert kind is FrameKind.ERROR


def test_connections_beyond_the_cap_are_answered_busy_at_once(running: Running) -> None:
    # Arrange: two idle connections hold both slots (they never send a header).
    idle = [running.connect() for _ in range(2)]
    time.sleep(0.3)  # let the server accept both
    try:
        # Act
        started = time.monotonic()
        with running.connect() as third:
            kind, payload = read_frame(third)
        waited = time.monotonic() - started
    finally:
        for sock in idle:
            sock.close()
    # Assert: refused without waiting for a slot (the read timeout is two minutes).
    assert kind is FrameKind.ERROR
    assert b"busy" in payload
    assert waited < 5.0
    # A slot frees when a connection ends: the service answers again. Until the server has
    # seen the idle peers go, a new connection is still refused busy, and the refusal may
    # close the socket before the ping is written (a broken pipe): both mean "not yet".
    deadline = time.monotonic() + 10
    while True:
        try:
            kind, _ = running.exchange(FrameKind.PING, b"")
        except (BrokenPipeError, ConnectionResetError):
            kind = FrameKind.ERROR
        if kind is FrameKind.STATUS or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert kind is FrameKind.STATUS


def test_a_frame_that_never_finishes_loses_its_slot(running: Running) -> None:
    # Arrange: both slots taken by peers that announce a small payload and trickle it.
    stalled = [running.connect() for _ in range(2)]
    for sock in stalled:
        sock.sendall(_header(FrameKind.MESSAGE, 1000) + b"x")
    cut_at: dict[int, float] = {}
    started = time.monotonic()
    try:
        # Act: a byte every quarter second (each recv is quick); only a whole-frame
        # deadline cuts them off.
        while len(cut_at) < len(stalled) and time.monotonic() - started < 4 * READ_TIMEOUT_S:
            time.sleep(0.25)
            for index, sock in enumerate(stalled):
                if index in cut_at:
                    continue
                if select.select([sock], [], [], 0)[0]:  # the service answered
                    cut_at[index] = time.monotonic() - started
                    continue
                with contextlib.suppress(OSError):  # the service may just have cut it off
                    sock.sendall(b"x")
        answers = [read_frame(sock) for sock in stalled]
    finally:
        for sock in stalled:
            sock.close()
    # Assert
    assert len(cut_at) == len(stalled)
    assert max(cut_at.values()) < 1.5 * READ_TIMEOUT_S
    assert all(kind is FrameKind.ERROR for kind, _ in answers)
    kind, _ = running.exchange(FrameKind.PING, b"")
    assert kind is FrameKind.STATUS


def test_a_ping_must_carry_nothing(running: Running) -> None:
    kind, payload = running.exchange(FrameKind.PING, b"x")
    assert kind is FrameKind.ERROR
    assert payload == b"request refused by the site service"


# ---------------------------------------------------------------- what replies give away


def test_a_ping_answers_only_that_the_service_is_alive(running: Running) -> None:
    # Act
    kind, payload = running.exchange(FrameKind.PING, b"")
    # Assert: no pid, no site name, no count, no path: whoever shares the socket may ask.
    assert kind is FrameKind.STATUS
    assert json.loads(payload) == {"status": "ok"}


def test_the_admin_s_status_is_a_file_only_the_service_s_user_reads(running: Running) -> None:
    # Arrange
    status_file = service_status_file(running.path)
    # Act
    status = json.loads(status_file.read_text(encoding="utf-8"))
    # Assert
    assert stat.S_IMODE(status_file.stat().st_mode) == 0o600
    assert status["pid"] == os.getpid()
    assert status["site"] == "limits-site"
    assert status["open_releases"] == 0
    assert status["socket"] == str(running.path)


def test_an_inference_failure_past_the_request_checks_names_no_path(running: Running) -> None:
    # Arrange: a valid request for an artifact; the service has no model (a ConfigError deep
    # inside, whose text would name the site's settings).
    kind, text = _infer(running, [_png(8, 8)])
    # Assert
    assert kind is FrameKind.ERROR
    assert "/" not in text
    assert "ConfigError" in text


def test_the_socket_is_open_to_the_site_s_group_only(running: Running) -> None:
    # The SuperNode's user reaches it through a shared group; nobody else.
    mode = stat.S_IMODE(os.stat(running.path).st_mode)
    assert mode == running.service.settings.socket_mode == 0o660
    assert mode & 0o007 == 0


# ---------------------------------------------------------------- inference limits


def test_an_image_with_too_many_pixels_is_refused_from_its_header(running: Running) -> None:
    # Arrange: a header that claims 4096 x 4096 and carries (almost) no pixels: decoding it
    # would fail with a "truncated" error; only a check of the header says "pixels".
    bomb = _png_header_only(4096, 4096)
    # Act
    kind, text = _infer(running, [_png(8, 8), bomb])
    # Assert
    assert kind is FrameKind.ERROR
    assert f"image 1 must have at most {MAX_IMAGE_PIXELS} pixels, got 4096x4096" in text


def test_an_image_just_over_the_pixel_bound_is_refused(running: Running) -> None:
    side = int(MAX_IMAGE_PIXELS**0.5) + 1  # a real, decodable picture, one row too large
    kind, text = _infer(running, [_png(side, side)])
    assert kind is FrameKind.ERROR
    assert "must have at most" in text


def test_too_many_images_or_bytes_are_refused_when_parsed(running: Running) -> None:
    # Too many images.
    kind, text = _infer(running, [_png(8, 8)] * (MAX_IMAGES + 1))
    assert kind is FrameKind.ERROR
    assert "at most 8 items" in text
    # One image over the byte bound (zero padding after a valid PNG: the header is fine).
    kind, text = _infer(running, [_png(8, 8) + b"\0" * MAX_IMAGE_BYTES])
    assert kind is FrameKind.ERROR
    assert f"at most {MAX_IMAGE_BYTES} bytes" in text


def test_an_inference_frame_over_its_bound_is_refused_before_its_payload(
    patient: Running,
) -> None:
    kind, payload, took = _refused_fast(patient, _header(FrameKind.INFER, MAX_REQUEST_BYTES + 1))
    assert kind is FrameKind.ERROR
    assert payload == b"request refused by the site service"
    assert took < FAST_S  # the bound refused it, not the minute-long read deadline


def test_a_ping_with_a_payload_is_refused_from_its_header(patient: Running) -> None:
    kind, payload, took = _refused_fast(patient, _header(FrameKind.PING, 1))
    assert kind is FrameKind.ERROR
    assert payload == b"request refused by the site service"
    assert took < FAST_S


# ---------------------------------------------------------------- the relay


def _reply_bytes() -> bytes:
    with flower_process_state():
        set_task_identity()
        request = Message(
            message_to_record(AbortNotice(release_id="r1", reason="x", noisy_output=False)),
            dst_node_id=7,
            message_type="query.abort",
        )
        request.metadata.__dict__["_message_id"] = "m1"
        reply = Message(RecordDict(), reply_to=request)
        return bytes(message_to_proto(reply).SerializeToString())


@pytest.mark.parametrize("kind", [FrameKind.STATUS, FrameKind.ERROR, FrameKind.ANSWERS])
def test_the_relay_accepts_only_a_reply_frame(tmp_path: Path, kind: FrameKind) -> None:
    # Arrange: a peer on the socket that answers with a well-formed Message, in a frame of
    # another kind (a service that refused, or something else listening there).
    path = tmp_path / "peer.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    answer = _reply_bytes()

    def serve_once() -> None:
        connection, _ = listener.accept()
        with connection:
            read_frame(connection)
            write_frame(connection, kind, answer)

    peer = threading.Thread(target=serve_once, daemon=True)
    peer.start()
    context = Context(
        run_id=1, node_id=7, node_config={SOCKET_KEY: str(path)}, state=RecordDict(), run_config={}
    )
    # Act / Assert
    try:
        with pytest.raises(ServiceError, match=f"site service answered {kind.name}"):
            unix_socket_transport(context, b"request")
    finally:
        peer.join(10)
        listener.close()
