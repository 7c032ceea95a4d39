"""The HTTP front's coalesced writes: same bytes, same order, fewer sends, none left behind."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from client.service.write_coalescing import HeadHeldTransport, IdleSelector, TurnWriter

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


class RecordingTransport:
    """A transport that records each write (one entry a send)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


async def _next_turn() -> None:
    await asyncio.sleep(0)
    await asyncio.sleep(0)


def test_a_response_head_leaves_with_its_body_in_one_send():
    async def run() -> list[bytes]:
        inner = RecordingTransport()
        held = HeadHeldTransport(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
        held.write(HEAD)
        assert inner.writes == []  # held for the body
        held.write(b"{}")
        await _next_turn()
        return inner.writes

    assert asyncio.run(run()) == [HEAD + b"{}"]


@pytest.mark.parametrize("then", ["nothing", "close"])
def test_a_head_nothing_follows_leaves_by_the_end_of_its_turn(then):
    async def run() -> RecordingTransport:
        inner = RecordingTransport()
        held = HeadHeldTransport(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
        held.write(HEAD)
        if then == "close":
            held.close()  # written before the connection closes
            assert inner.writes == [HEAD]
            assert inner.closed
        await _next_turn()
        return inner

    inner = asyncio.run(run())
    assert inner.writes == [HEAD]


def test_writes_that_are_not_heads_pass_at_once_and_the_rest_is_the_transport_s():
    async def run() -> tuple[RecordingTransport, HeadHeldTransport]:
        inner = RecordingTransport()
        held = HeadHeldTransport(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
        held.write(b"data: {}\n\n")
        held.write(memoryview(b"5\r\nhello\r\n"))
        return inner, held

    inner, held = asyncio.run(run())
    assert inner.writes == [b"data: {}\n\n", b"5\r\nhello\r\n"]
    assert held.get_extra_info("peername") == "info:peername"
    held.abort()
    assert inner.aborted


def test_bytes_written_as_lines_after_a_held_head_follow_it_in_one_send():
    async def run() -> list[bytes]:
        inner = RecordingTransport()
        held = HeadHeldTransport(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
        held.write(HEAD)
        held.writelines([b"{", memoryview(b"}")])
        await _next_turn()
        return inner.writes

    assert asyncio.run(run()) == [HEAD + b"{}"]


def test_a_head_held_on_a_connection_that_closed_under_it_is_not_written():
    async def run() -> RecordingTransport:
        inner = RecordingTransport()
        held = HeadHeldTransport(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
        held.write(HEAD)
        inner.closed = True  # the peer went away before the turn ended
        await _next_turn()
        return inner

    assert asyncio.run(run()).writes == []


def test_an_aborted_connection_drops_its_held_head():
    async def run() -> RecordingTransport:
        inner = RecordingTransport()
        held = HeadHeldTransport(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
        held.write(HEAD)
        held.abort()
        await _next_turn()
        return inner

    assert asyncio.run(run()).writes == []


def test_frames_of_one_turn_leave_in_one_send_in_order_and_later_ones_apart():
    async def run() -> list[bytes]:
        inner = RecordingTransport()
        writer = TurnWriter(inner)  # type: ignore[arg-type]
        for frame in (b"a", b"bb", b"ccc"):
            writer.send(frame)
        assert inner.writes == []
        await _next_turn()
        writer.send(b"d")
        await _next_turn()
        return inner.writes

    assert asyncio.run(run()) == [b"abbccc", b"d"]


def test_frames_sent_ahead_leave_before_those_queued_without_each_kind_in_order():
    async def run() -> list[bytes]:
        inner = RecordingTransport()
        writer = TurnWriter(inner)  # type: ignore[arg-type]
        writer.send(b"e1", ahead=True)
        writer.send(b"c1")
        writer.send(b"c2")
        writer.send(b"e2", ahead=True)  # an announcement after two requests were queued
        writer.send(b"c3")
        await _next_turn()
        writer.send(b"c4")
        writer.send(b"e3", ahead=True)
        await _next_turn()
        return inner.writes

    assert asyncio.run(run()) == [b"e1e2c1c2c3", b"e3c4"]


def test_frames_queued_for_a_link_that_closed_are_not_written():
    async def run() -> list[bytes]:
        inner = RecordingTransport()
        writer = TurnWriter(inner)  # type: ignore[arg-type]
        writer.send(b"a")
        inner.close()
        await _next_turn()
        return inner.writes

    assert asyncio.run(run()) == []


def test_a_frame_sent_where_no_loop_runs_is_written_at_once():
    inner = RecordingTransport()
    writer = TurnWriter(inner)  # type: ignore[arg-type]
    writer.send(b"a")
    writer.send(b"b")
    assert inner.writes == [b"a", b"b"]


def _on_idle_loop(
    body: Callable[[TurnWriter, RecordingTransport], Coroutine[Any, Any, Any]],
    max_hold_s: float = 0.001,
) -> tuple[Any, RecordingTransport]:
    """``body`` run on a loop whose selector defers the writer's writes until it goes idle."""
    selector = IdleSelector(max_hold_s=max_hold_s)
    inner = RecordingTransport()
    writer = TurnWriter(inner, defer=selector.defer)  # type: ignore[arg-type]
    with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(selector)) as runner:
        result: Any = runner.run(body(writer, inner))
    return result, inner


def test_frames_of_several_busy_turns_leave_in_one_send_once_the_loop_goes_idle():
    # Arrange: three handlers, each sending a frame a turn for three turns (as requests parsed
    # one after another, each awaiting between its steps)
    async def handler(writer: TurnWriter, name: bytes) -> None:
        for step in range(3):
            writer.send(name + str(step).encode())
            await asyncio.sleep(0)

    async def body(writer: TurnWriter, inner: RecordingTransport) -> list[bytes]:
        await asyncio.gather(*(handler(writer, name) for name in (b"a", b"b", b"c")))
        held = list(inner.writes)
        await asyncio.sleep(0.01)  # the loop waits: idle
        return held

    # Act
    held, inner = _on_idle_loop(body, max_hold_s=60)

    # Assert: nothing left while the loop had work; then every frame, in order, in one send
    assert held == []
    assert inner.writes == [b"a0b0c0a1b1c1a2b2c2"]


def test_a_loop_that_never_goes_idle_still_writes_within_the_hold_bound():
    # Arrange: a loop kept busy (a callback ready at every turn) for 50 ms
    async def body(writer: TurnWriter, inner: RecordingTransport) -> list[float]:
        seen: list[float] = []
        began = time.monotonic()
        writer.send(b"a")
        while True:
            if inner.writes and not seen:
                seen.append(time.monotonic() - began)
            if time.monotonic() - began >= 0.05:
                return seen
            await asyncio.sleep(0)

    # Act
    seen, inner = _on_idle_loop(body, max_hold_s=0.005)

    # Assert: written once while the loop was still busy, not before the bound
    assert inner.writes == [b"a"]
    assert len(seen) == 1
    assert seen[0] >= 0.005


def test_a_write_that_schedules_work_does_not_leave_it_behind_a_blocking_wait():
    # Arrange: a deferred write that schedules a callback (as a failed write closes its
    # transport), on a loop with nothing else to do for a long while
    selector = IdleSelector()

    async def body() -> float:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        began = time.monotonic()

        def write() -> None:  # as a failed write closes its transport: work for the loop
            loop.call_soon(done.set_result, None)

        selector.defer(write)
        loop.call_later(5, lambda: None)  # a timer far off: the loop would wait 5 s for it
        await done
        return time.monotonic() - began

    # Act
    with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(selector)) as runner:
        waited = runner.run(body())

    # Assert: the scheduled callback ran at once, not after the 5 s wait
    assert waited < 1.0


def test_a_deferred_write_that_raises_is_logged_and_the_others_still_run(caplog):
    selector = IdleSelector()
    ran: list[str] = []

    def broken() -> None:
        raise RuntimeError("a bug in a write")

    async def body() -> None:
        selector.defer(broken)
        selector.defer(lambda: ran.append("second"))
        await asyncio.sleep(0.01)  # the loop waits: idle
        ran.append("loop went on")

    with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(selector)) as runner:
        runner.run(body())

    assert ran == ["second", "loop went on"]
    assert "a deferred write failed" in caplog.text
