"""Tests of ``client.service.batching``: continuous batching, passes, a patch per row, a queue.

The reference for every answer is plain ``generate()`` on the same prompt alone (patched with
``client.activations.hooks.patch_heads`` where the row is patched): greedy answers must equal it
whatever the row's batch-mates, and bit-identically so in the batch-invariant mode.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest
import torch

from client.activations.hooks import PatchPolicy, patch_first_decoding_step, patch_heads
from client.models import (
    ALL_TINY_ARCHITECTURES,
    Example,
    LoadedModel,
    Prompt,
    adapter_for,
    build_tiny_model,
    get_adapter,
)
from client.service.batching import Batcher, OverloadedError
from client.service.decoding import BatchStats, ContinuousBatch, steps_continuously
from client.service.pass_costs import PassCosts
from client.service.rows import Row, RowPatch, Step, Ticket, _patch_tables, prepare_row
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet
from tests.unit.client.conftest import draw

ONE_ARCH = pytest.mark.parametrize("tiny", ["llava"], indirect=True)
ALL_HEADS = HeadSet.all_heads(num_layers=2, num_heads=4)
CONTINUOUS_FAMILIES = [a for a in ALL_TINY_ARCHITECTURES if get_adapter(a).continuous_batching]
QUESTIONS = ("What colour is the shape?", "Which shape?", "Describe the picture in a few words.")


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


def release(
    name: str, seed: int, policy: PatchPolicy = PatchPolicy.PROMPT_LAST_TOKEN, heads=ALL_HEADS
) -> RowPatch:
    generator = torch.Generator().manual_seed(seed)
    values = 4 * torch.randn(len(heads), 16, generator=generator)
    return RowPatch(name, heads, values, policy)


def row(loaded: LoadedModel, colour: str, patch: RowPatch | None, question=0, **kwargs) -> Row:
    settings = {"max_new_tokens": 6, "temperature": 0.0, "seed": 0} | kwargs
    prompt = Prompt.of([], Example(draw(colour, "circle"), QUESTIONS[question]))
    return prepare_row(loaded, prompt, instruction=None, patch=patch, **settings)


def plain_generate(loaded: LoadedModel, item: Row) -> list[int]:
    """What plain ``generate()`` answers to the row's prompt alone (patched as the row is)."""
    with ExitStack() as stack, torch.no_grad():
        if item.patch is not None:
            patch = item.patch
            stack.enter_context(
                patch_heads(
                    loaded.model, loaded.adapter, patch.heads, patch.values, policy=patch.policy
                )
            )
            if patch.answer_end is not None:
                stack.enter_context(
                    patch_first_decoding_step(
                        loaded.model, loaded.adapter, patch.heads, patch.answer_end
                    )
                )
        output = loaded.model.generate(  # type: ignore[operator]
            **item.inputs,
            max_new_tokens=item.max_new_tokens,
            do_sample=False,
            pad_token_id=loaded.processor.tokenizer.pad_token_id,
        )
    tokens: list[int] = output[0, item.prompt_tokens :].tolist()
    eos = loaded.model.generation_config.eos_token_id
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


@contextmanager
def forward_rows(loaded: LoadedModel) -> Iterator[list[tuple[int, int]]]:
    """``(rows, positions)`` of every forward pass of the model in the block."""
    seen: list[tuple[int, int]] = []

    def hook(module, args, kwargs) -> None:
        ids = kwargs["input_ids"]
        seen.append((int(ids.shape[0]), int(ids.shape[1])))

    handle = loaded.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


@contextmanager
def paused_before_pass(loaded: LoadedModel, number: int) -> Iterator[threading.Event]:
    """The worker stops before the model's ``number``-th forward pass until the event is set."""
    go, calls = threading.Event(), [0]

    def hook(module, args, kwargs) -> None:
        calls[0] += 1
        if calls[0] == number:
            assert go.wait(120)

    handle = loaded.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield go
    finally:
        go.set()
        handle.remove()


def staggered(loaded: LoadedModel, rows: list[Row], joins: dict[int, list[int]]) -> list[Collected]:
    """Rows joining a continuous batch at the given steps; each row's sink."""
    batch = ContinuousBatch(loaded, threading.Lock(), BatchStats())
    sinks = [Collected() for _ in rows]
    pending, step = dict(joins), 0
    while batch.size or pending:
        if step in pending:
            batch.join([Ticket(rows[i], sinks[i]) for i in pending.pop(step)])
        batch.step()
        step += 1
    return sinks


def run(loaded: LoadedModel, rows: list[Row], **settings) -> tuple[list[Collected], Batcher]:
    """Queue every row before the worker starts; return the sinks and the stopped batcher."""
    batcher = Batcher(loaded, threading.Lock(), **({"rows": 4, "max_queue": 16} | settings))
    sinks = [Collected() for _ in rows]
    for item, sink in zip(rows, sinks, strict=True):
        batcher.submit(item, sink)
    batcher.start()
    for sink in sinks:
        assert sink.done.wait(120)
    batcher.stop()
    return sinks, batcher


def mixed_rows(loaded: LoadedModel, heads: HeadSet = ALL_HEADS, dim: int = 16) -> list[Row]:
    """Six rows of three prompt lengths: two releases (one patched every call) and none."""
    r1 = RowPatch("r1", heads, 4 * torch.randn(len(heads), dim, generator=torch.manual_seed(1)))
    r2 = dataclasses.replace(r1, release_id="r2", policy=PatchPolicy.EVERY_CALL)
    patches = [None, r1, r2, r1, None, r2]
    colours = ("red", "blue", "green", "yellow", "purple", "orange")
    return [
        row(loaded, colours[i], patches[i], question=i % 3, max_new_tokens=4 + i) for i in range(6)
    ]


@ONE_ARCH
def test_greedy_answers_equal_plain_generate_whatever_joins_and_leaves_around_them(loaded):
    # Arrange: rows of three prompt lengths and six answer lengths, patched or not, joining
    # a running batch at four different steps (so the cache is padded on both sides).
    rows = mixed_rows(loaded)
    # Act
    sinks = staggered(loaded, rows, {0: [0, 1], 2: [2], 3: [3, 4], 6: [5]})
    # Assert
    for item, sink in zip(rows, sinks, strict=True):
        assert sink.error is None
        assert sink.tokens == plain_generate(loaded, item)
    assert len({tuple(s.tokens) for s in sinks}) > 2  # the rows really differ


@pytest.mark.parametrize("arch", CONTINUOUS_FAMILIES)
def test_every_continuously_batched_family_answers_as_plain_generate(arch):
    # Arrange: one head a layer, so the patch changes the answer without swamping it
    model, processor = build_tiny_model(arch, seed=1234)
    loaded = LoadedModel(model, processor, adapter_for(model), "sha256:test")
    shape = loaded.adapter.head_shape(model)
    heads = HeadSet.of([(layer, 0) for layer in shape.head_layers])
    rows = mixed_rows(loaded, heads, shape.head_dim)
    # Act
    sinks = staggered(loaded, rows, {0: [0, 1], 1: [2, 3], 4: [4, 5]})
    # Assert
    assert steps_continuously(loaded)
    assert [s.tokens for s in sinks] == [plain_generate(loaded, item) for item in rows]


@ONE_ARCH
def test_a_row_joins_the_running_batch_and_leaves_it_without_waiting(loaded):
    # Arrange: a long answer under way, held before its fourth pass (three tokens made)
    batcher = Batcher(loaded, threading.Lock(), rows=4, max_queue=4)
    long_row, short_row = Collected(), Collected()
    batcher.start()
    with forward_rows(loaded) as seen, paused_before_pass(loaded, 4) as go:
        batcher.submit(row(loaded, "red", None, max_new_tokens=40), long_row)
        while len(long_row.tokens) < 3:
            threading.Event().wait(0.001)
        # Act: a short row arrives mid-answer
        batcher.submit(row(loaded, "blue", None, max_new_tokens=3), short_row)
        go.set()
        assert short_row.done.wait(120)
        assert long_row.done.wait(120)
    batcher.stop()
    # Assert: the short row joined at the next step and left after its 3 tokens, while the
    # long one ran on: its steps held 1, then 2, then 1 row, and none was added for it.
    steps = [rows for rows, positions in seen if positions == 1]
    assert short_row.reason == long_row.reason == "length"
    assert len(long_row.tokens) == 40
    assert len(short_row.tokens) == 3
    assert steps.count(2) == 2  # its prefill gave its first token, two steps the others
    assert steps[0] == steps[-1] == 1
    assert len(steps) == 39  # every step of the short row was also one of the long row's


@ONE_ARCH
def test_a_row_arriving_as_the_batch_ends_starts_with_the_next_one(loaded):
    # Arrange: a row of 5 tokens, held before its fourth pass (the last but one)
    batcher = Batcher(loaded, threading.Lock(), rows=4, max_queue=4, gather_s=0.5, join_horizon=2)
    ending, late, next_one = Collected(), Collected(), Collected()
    batcher.start()
    with forward_rows(loaded) as seen, paused_before_pass(loaded, 4) as go:
        batcher.submit(row(loaded, "red", None, max_new_tokens=5), ending)
        while len(ending.tokens) < 3:
            threading.Event().wait(0.001)
        # Act: one row arrives now, another just after the batch ends
        batcher.submit(row(loaded, "blue", None), late)
        go.set()
        assert ending.done.wait(120)
        batcher.submit(row(loaded, "green", None), next_one)
        assert late.done.wait(120)
        assert next_one.done.wait(120)
    batcher.stop()
    # Assert: the late row did not join the ending batch; it started with the next row
    prefills = [rows for rows, positions in seen if positions > 1]
    assert prefills == [1, 2]
    assert late.tokens == plain_generate(loaded, row(loaded, "blue", None))


@ONE_ARCH
def test_a_lone_row_runs_alone_with_no_filler_rows(loaded):
    # Act
    with forward_rows(loaded) as seen:
        (sink,), batcher = run(loaded, [row(loaded, "red", release("r1", 1))])
    # Assert
    assert sink.error is None
    assert {rows for rows, _ in seen} == {1}
    assert batcher.mode == "continuous"
    assert batcher.stats.passes == len(seen) == 6  # the prefill, then five steps


@ONE_ARCH
def test_batch_invariant_answers_are_bit_identical_to_plain_generate_alone(loaded):
    # Arrange
    rows = mixed_rows(loaded)
    # Act
    with forward_rows(loaded) as seen:
        sinks, batcher = run(loaded, rows, batch_invariant=True)
    # Assert: every pass held one row, every answer is generate()'s own
    assert batcher.mode == "invariant"
    assert {rows for rows, _ in seen} == {1}
    assert [s.tokens for s in sinks] == [plain_generate(loaded, item) for item in rows]


def with_answer_end(rows: list[Row]) -> list[Row]:
    """The rows, each prompt-last-token patch given an answer's end (a strong one)."""
    ended = []
    for item in rows:
        patch = item.patch
        if patch is not None and patch.policy is PatchPolicy.PROMPT_LAST_TOKEN:
            end = 8 * torch.randn(patch.values.shape, generator=torch.manual_seed(7))
            patch = dataclasses.replace(patch, answer_end=end)
        ended.append(dataclasses.replace(item, patch=patch))
    return ended


@ONE_ARCH
def test_an_answer_end_is_patched_at_each_rows_own_first_step_as_plain_generate(loaded):
    # Arrange: rows with an answer's end joining at different steps, beside rows without
    rows = with_answer_end(mixed_rows(loaded))
    # Act
    sinks = staggered(loaded, rows, {0: [0, 1], 2: [2], 3: [3, 4], 6: [5]})
    # Assert: each as plain generate() under both hooks; the answer's end changed answers
    assert [s.tokens for s in sinks] == [plain_generate(loaded, item) for item in rows]
    without = [plain_generate(loaded, item) for item in mixed_rows(loaded)]
    assert [s.tokens for s in sinks] != without


@ONE_ARCH
def test_an_answer_end_in_passes_through_generate_is_plain_generates(loaded):
    rows = with_answer_end(mixed_rows(loaded))

    sinks, batcher = run(loaded, rows, batch_invariant=True)

    assert batcher.mode == "invariant"
    assert [s.tokens for s in sinks] == [plain_generate(loaded, item) for item in rows]


def test_a_row_patch_with_an_answer_end_must_leave_the_steps_alone():
    values = torch.zeros(len(ALL_HEADS), 16)

    with pytest.raises(ConfigError, match="policy must be 'prompt-last-token' with it"):
        RowPatch("r1", ALL_HEADS, values, PatchPolicy.EVERY_CALL, answer_end=values)


@ONE_ARCH
def test_the_row_patch_equals_the_whole_batch_patch_of_client_hooks(loaded):
    # Arrange
    patch = release("r1", 3)
    patched_row = row(loaded, "red", patch)
    plain_row = row(loaded, "red", None)
    # Act: the per-row hook, then the plain row under client.activations.hooks.patch_heads.
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
def test_patch_tables_hold_each_rows_own_heads_and_values_at_its_step(loaded):
    # Arrange: releases of other heads and values, rows at every step, some sharing values
    one = release("one", 1)
    some = release("some", 2, heads=HeadSet.of([(0, 1), (1, 0), (1, 3)]))
    every = release("every", 3, policy=PatchPolicy.EVERY_CALL, heads=HeadSet.of([(1, 2)]))
    ended = dataclasses.replace(one, answer_end=torch.randn(one.values.shape))
    rows = [row(loaded, "red", patch) for patch in (one, None, some, one, every, ended, one)]
    steps = [Step.PROMPT, Step.PROMPT, Step.PROMPT, Step.LATER_DECODING, Step.LATER_DECODING,
             Step.FIRST_DECODING, Step.PROMPT]  # fmt: skip
    # Act
    tables = _patch_tables(loaded, rows, steps)
    # Assert: what each row's own heads and values say, row by row, and nothing else
    expected: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for index, (item, step) in enumerate(zip(rows, steps, strict=True)):
        vector = item.step_patch(step)
        if vector is None or item.patch is None:
            continue
        for (layer, head), value in zip(item.patch.heads.heads, vector, strict=True):
            mask, values = expected.setdefault(
                layer, (torch.zeros(len(rows), 4, dtype=torch.bool), torch.zeros(len(rows), 4, 16))
            )
            mask[index, head] = True
            values[index, head] = value
    assert sorted(tables) == sorted(expected) == [0, 1]
    for layer, (mask, values) in expected.items():
        assert torch.equal(tables[layer][0], mask)
        assert torch.equal(tables[layer][1], values)


@ONE_ARCH
def test_a_sampling_row_repeats_with_its_seed_whatever_its_batch_mates(loaded):
    # Arrange
    sampled = row(loaded, "red", None, temperature=0.9, seed=7, max_new_tokens=8)
    others = [row(loaded, c, release("r1", 1)) for c in ("blue", "green")]
    # Act
    (alone,), _ = run(loaded, [sampled])
    together, _ = run(loaded, [*others, sampled])
    (reseeded,), _ = run(loaded, [dataclasses.replace(sampled, seed=8)])
    # Assert
    assert together[2].tokens == alone.tokens
    assert reseeded.tokens != alone.tokens


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
def test_a_row_whose_prefill_fails_fails_alone(loaded):
    # Arrange: a row whose image tensor the model cannot take (its own prefill group)
    good = row(loaded, "red", None)
    bad_inputs = dict(good.inputs) | {"pixel_values": torch.zeros(1, 3, 5, 5)}
    bad = dataclasses.replace(good, inputs=bad_inputs, stack_key=(("pixel_values", (1, 3, 5, 5)),))
    # Act
    (ok, failed), batcher = run(loaded, [good, bad])
    # Assert
    assert ok.error is None
    assert ok.tokens == plain_generate(loaded, good)
    assert failed.error is not None
    assert batcher.stats.failures == 1


@ONE_ARCH
def test_rows_announced_together_share_one_prefill_and_a_withdrawn_one_is_not_awaited(loaded):
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
    prefills_together = batcher.stats.prefills
    batcher.expect()
    alone = Collected()
    batcher.submit(row(loaded, "green", None), alone)  # not the announced one
    batcher.cancel_expected()  # the announced row's request failed: the row starts
    assert alone.done.wait(120)
    batcher.stop()
    # Assert
    assert prefills_together == 1
    assert batcher.stats.prefills == 2


@ONE_ARCH
def test_a_model_whose_config_changes_greedy_scores_is_served_in_passes(loaded):
    # Arrange: a repetition penalty, which generate() applies and the stepped loop would not
    config = loaded.model.generation_config
    config.repetition_penalty = 1.5
    try:
        item = row(loaded, "red", release("r1", 1))
        # Act
        (sink,), batcher = run(loaded, [item])
        # Assert
        assert not steps_continuously(loaded)
        assert batcher.mode == "passes"
        assert sink.tokens == plain_generate(loaded, item)
    finally:
        config.repetition_penalty = 1.0


@pytest.mark.parametrize("tiny", ["qwen2_vl"], indirect=True)
def test_a_family_with_multimodal_positions_is_served_in_passes(loaded):
    # Arrange
    rows = [row(loaded, "red", None), row(loaded, "blue", None, question=2)]
    # Act
    sinks, batcher = run(loaded, rows)
    # Assert
    assert batcher.mode == "passes"
    assert all(sink.error is None and sink.reason for sink in sinks)
    assert sinks[0].tokens == plain_generate(loaded, rows[0])


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


class _PinnedCosts(PassCosts):
    """Pass costs that the passes do not move (none given: the horizon is its floor)."""

    def record(self, rows: int, seconds: float, *, prefill: bool) -> None:
        pass


def _prefills_with_a_full_queue_after_a_split(loaded: LoadedModel, costs: PassCosts) -> list[int]:
    """Rows of every prefill: 5 rows start, 3 join 4 steps later, 192 more wait behind them."""
    batcher = Batcher(loaded, threading.Lock(), rows=8, max_queue=256, join_horizon=2)
    batcher.stats.costs = costs
    rows = [row(loaded, "red", None, max_new_tokens=16) for _ in range(200)]
    sinks = [Collected() for _ in rows]
    with forward_rows(loaded) as seen:
        with paused_before_pass(loaded, 6) as go:  # the prefill of 5, then 4 steps
            for item, sink in zip(rows[:5], sinks[:5], strict=True):
                batcher.submit(item, sink)
            batcher.start()
            while len(seen) < 5:
                threading.Event().wait(0.001)
            for item, sink in zip(rows[5:], sinks[5:], strict=True):
                batcher.submit(item, sink)
            go.set()
        for sink in sinks:
            assert sink.done.wait(120)
    batcher.stop()
    assert all(len(sink.tokens) == len(sinks[0].tokens) for sink in sinks)  # one answer length
    return [count for count, positions in seen if positions > 1]


@ONE_ARCH
def test_a_batch_a_late_arrival_split_comes_back_into_step_at_full_load(loaded):
    # Act: a prefill priced at 4 steps at every size, and unpriced (the horizon is its floor)
    four_steps = _PinnedCosts(step=1.0, prefills={rows: 4.0 for rows in range(1, 9)})
    priced = _prefills_with_a_full_queue_after_a_split(loaded, four_steps)
    floor_only = _prefills_with_a_full_queue_after_a_split(loaded, _PinnedCosts())

    # Assert: priced, the 5 rows that end first wait 4 steps for the 3 that joined late, and
    # every batch after starts whole (one prefill for 8 rows); with the floor alone the split
    # stays: groups of 5 and 3 take turns, each with its own prefill
    assert priced[:2] == [5, 3]
    assert priced[2:] == [8] * 24
    assert floor_only[:2] == [5, 3]
    assert len(floor_only) > 40
    assert set(floor_only[2:-1]) == {3, 5}
