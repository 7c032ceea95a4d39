"""Tests of ``client.service.batching``: fixed-shape passes, a patch per row, a bounded queue."""

from __future__ import annotations

import threading

import pytest
import torch

from client.hooks import PatchPolicy, patch_heads
from client.models import Example, LoadedModel, Prompt
from client.service.batching import Batcher, OverloadedError
from client.service.rows import Row, RowPatch, prepare_row
from dpmtv_common.heads import HeadSet
from tests.unit.client.conftest import draw

ONE_ARCH = pytest.mark.parametrize("tiny", ["llava"], indirect=True)
ALL_HEADS = HeadSet.all_heads(num_layers=2, num_heads=4)


class Collected:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.reason: str | None = None
        self.error: Exception | None = None
        self.done = threading.Event()

    def token(self, token_id: int) -> None:
        self.tokens.append(token_id)

    def finish(self, reason: str) -> None:
        self.reason = reason
        self.done.set()

    def fail(self, error: Exception) -> None:
        self.error = error
        self.done.set()


def release(name: str, seed: int, policy: PatchPolicy = PatchPolicy.PROMPT_LAST_TOKEN) -> RowPatch:
    generator = torch.Generator().manual_seed(seed)
    values = 4 * torch.randn(len(ALL_HEADS), 16, generator=generator)
    return RowPatch(name, ALL_HEADS, values, policy)


def row(loaded: LoadedModel, colour: str, patch: RowPatch | None, **kwargs) -> Row:
    settings = {"max_new_tokens": 6, "temperature": 0.0, "seed": 0} | kwargs
    prompt = Prompt.of([], Example(draw(colour, "circle"), "What colour is the shape?"))
    return prepare_row(loaded, prompt, instruction=None, patch=patch, **settings)


def run(loaded: LoadedModel, rows: list[Row], *, per_pass: int = 4) -> tuple[list[Collected], int]:
    """Queue every row before the worker starts, so they share passes; return sinks, passes."""
    batcher = Batcher(loaded, threading.Lock(), rows=per_pass, max_queue=16)
    sinks = [Collected() for _ in rows]
    for item, sink in zip(rows, sinks, strict=True):
        batcher.submit(item, sink)
    batcher.start()
    for sink in sinks:
        assert sink.done.wait(120)
    batcher.stop()
    return sinks, batcher.stats.passes


@ONE_ARCH
def test_a_rows_tokens_are_bit_identical_alone_or_batched_with_other_releases(loaded):
    # Arrange: four rows, three releases (one patched at every step) and the plain model;
    # one of them samples with its own seed.
    r1, r2 = release("r1", 1), release("r2", 2, PatchPolicy.EVERY_CALL)
    rows = [
        row(loaded, "red", r1),
        row(loaded, "blue", r2),
        row(loaded, "green", None),
        row(loaded, "yellow", r1, temperature=0.8, seed=7),
    ]
    # Act
    batched, passes = run(loaded, rows)
    alone = [run(loaded, [item])[0][0] for item in rows]
    # Assert: one pass served all four; each row's tokens are those it gets alone.
    assert passes == 1
    for together, single in zip(batched, alone, strict=True):
        assert together.error is None
        assert single.error is None
        assert together.tokens == single.tokens
        assert together.reason == single.reason
    assert len({tuple(s.tokens) for s in batched}) > 1  # rows really differ


@ONE_ARCH
def test_a_row_in_another_position_of_the_pass_gets_the_same_tokens(loaded):
    # Arrange
    target = row(loaded, "red", release("r1", 1))
    others = [row(loaded, c, release("r2", 2)) for c in ("blue", "green", "purple")]
    # Act
    first, _ = run(loaded, [target, *others])
    last, _ = run(loaded, [*others, target])
    # Assert
    assert first[0].tokens == last[3].tokens


@ONE_ARCH
def test_the_row_patch_equals_the_whole_batch_patch_of_client_hooks(loaded):
    # Arrange
    patch = release("r1", 3)
    patched_row = row(loaded, "red", patch)
    plain_row = row(loaded, "red", None)
    # Act: the per-row hook, then the plain row under client.hooks.patch_heads.
    (own,), _ = run(loaded, [patched_row])
    with patch_heads(
        loaded.model, loaded.adapter, patch.heads, patch.values, policy=patch.policy
    ) as record:
        (reference,), _ = run(loaded, [plain_row])
    (plain,), _ = run(loaded, [plain_row])
    # Assert
    assert record.total_calls > 0
    assert own.tokens == reference.tokens
    assert own.tokens != plain.tokens  # a patch of this size changes the answer


@ONE_ARCH
def test_each_row_stops_at_its_own_max_new_tokens(loaded):
    # Arrange
    rows = [row(loaded, "red", None, max_new_tokens=n) for n in (2, 5)]
    # Act
    (short, long), _ = run(loaded, rows)
    # Assert
    assert len(short.tokens) <= 2
    assert len(long.tokens) <= 5
    assert long.tokens[: len(short.tokens)] == short.tokens


@ONE_ARCH
def test_a_full_queue_refuses_the_next_row(loaded):
    # Arrange
    batcher = Batcher(loaded, threading.Lock(), rows=2, max_queue=2)
    item = row(loaded, "red", None)
    batcher.submit(item, Collected())
    batcher.submit(item, Collected())
    # Act / Assert
    with pytest.raises(OverloadedError, match="queued rows must stay below 2"):
        batcher.submit(item, Collected())
    waiting = Collected()
    batcher.stop()
    with pytest.raises(OverloadedError, match="stopping"):
        batcher.submit(item, waiting)


@ONE_ARCH
def test_stopping_fails_the_rows_still_waiting(loaded):
    # Arrange
    batcher = Batcher(loaded, threading.Lock(), rows=2, max_queue=4)
    sink = Collected()
    batcher.submit(row(loaded, "red", None), sink)
    # Act
    batcher.stop()
    # Assert
    assert sink.done.is_set()
    assert sink.error is not None


@ONE_ARCH
def test_a_pass_waits_briefly_for_an_announced_row_and_not_for_a_withdrawn_one(loaded):
    # Arrange: two rows announced; the second arrives 20 ms after the first
    batcher = Batcher(loaded, threading.Lock(), rows=2, max_queue=4, gather_s=1.0)
    first, second = Collected(), Collected()
    batcher.start()
    batcher.expect()
    batcher.expect()
    # Act
    batcher.submit(row(loaded, "red", None), first, expected=True)
    threading.Event().wait(0.02)
    batcher.submit(row(loaded, "blue", None), second, expected=True)
    assert first.done.wait(120)
    assert second.done.wait(120)
    passes_together = batcher.stats.passes
    batcher.expect()
    alone = Collected()
    batcher.submit(row(loaded, "green", None), alone)  # not the announced one
    batcher.cancel_expected()  # the announced row's request failed: the pass goes
    assert alone.done.wait(120)
    batcher.stop()
    # Assert
    assert passes_together == 1
    assert batcher.stats.passes == 2
