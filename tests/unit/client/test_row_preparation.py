"""Tests of ``client.service.preparation``: requests prepared together equal each prepared alone.

The reference is :func:`client.service.rows.prepare_row` on each request by itself: a row the
batcher prepares beside others must carry exactly its tensors (the served answer then equals
plain ``generate()`` on the prompt alone, which test_batching.py checks for rows).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from client.models import (
    ALL_TINY_ARCHITECTURES,
    Example,
    LoadedModel,
    Prompt,
    adapter_for,
    build_tiny_model,
    get_adapter,
)
from client.models.errors import PromptTooLongError
from client.service.batching import Batcher
from client.service.preparation import RowRequest, prepare_rows, split_batch
from client.service.rows import Row
from dpmtv_common.errors import ServiceError
from tests.unit.client.conftest import draw
from tests.unit.client.test_batching import Collected, plain_generate, release

CONTINUOUS_FAMILIES = [a for a in ALL_TINY_ARCHITECTURES if get_adapter(a).continuous_batching]
QUESTIONS = ("What colour is the shape?", "Which shape?", "Describe the picture in a few words.")


def request(
    loaded: LoadedModel,
    colour: str,
    question: int = 0,
    *,
    size: tuple[int, int] = (56, 56),
    shots: int = 0,
    instruction: str | None = None,
    **settings: object,
) -> RowRequest:
    demos = [Example(draw("green", "square", size), "Which shape?", "square")] * shots
    prompt = Prompt.of(demos, Example(draw(colour, "circle", size), QUESTIONS[question]))
    fields = {"patch": None, "max_new_tokens": 5, "temperature": 0.0, "seed": 0} | settings
    return RowRequest(loaded, prompt, instruction, **fields)  # type: ignore[arg-type]


def assert_same_row(prepared: Row | Exception, alone: Row) -> None:
    assert isinstance(prepared, Row), prepared
    assert prepared.inputs.keys() == alone.inputs.keys()
    for key, value in alone.inputs.items():
        assert prepared.inputs[key].dtype == value.dtype, key
        assert torch.equal(prepared.inputs[key], value), key
    assert (prepared.prompt_tokens, prepared.stack_key) == (alone.prompt_tokens, alone.stack_key)


@contextmanager
def processor_calls(loaded: LoadedModel) -> Iterator[list[int]]:
    """The number of prompts of each call to the adapter's ``build_batch_inputs``."""
    calls: list[int] = []
    adapter_type = type(loaded.adapter)
    original = adapter_type.build_batch_inputs

    def counted(self, processor, prompts, **kwargs):
        calls.append(len(prompts))
        return original(self, processor, prompts, **kwargs)

    adapter_type.build_batch_inputs = counted  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        adapter_type.build_batch_inputs = original  # type: ignore[method-assign]


@pytest.mark.parametrize("arch", CONTINUOUS_FAMILIES)
def test_requests_prepared_together_carry_exactly_their_tensors_alone(arch):
    # Arrange: prompts of three lengths (one padded to the longest), images of one size, and
    # two-image prompts beside them; one model of the family
    model, processor = build_tiny_model(arch, seed=1234)
    loaded = LoadedModel(model, processor, adapter_for(model), "sha256:test")
    requests = [
        request(loaded, "red", 0),
        request(loaded, "blue", 1),
        request(loaded, "green", 2),
        request(loaded, "red", 1, shots=1),
        request(loaded, "blue", 2, shots=1),
    ]
    alone = [r.alone() for r in requests]
    # Act
    with processor_calls(loaded) as calls:
        prepared = prepare_rows(requests)
    # Assert: one call a group of alike requests, and every row as if prepared alone
    assert sorted(calls) == [2, 3]
    for row, reference in zip(prepared, alone, strict=True):
        assert_same_row(row, reference)
    assert len({r.prompt_tokens for r in alone}) >= 3  # the batch really was padded


def test_requests_that_would_tokenise_differently_are_not_prepared_together(loaded):
    # Arrange: another image size, another instruction, another model copy
    other = LoadedModel(loaded.model, loaded.processor, loaded.adapter, loaded.fingerprint)
    requests = [
        request(loaded, "red"),
        request(loaded, "blue", size=(70, 56)),
        request(loaded, "green", instruction="Answer in one word."),
        request(other, "red"),
        request(loaded, "blue", 1),
    ]
    # Act
    with processor_calls(loaded) as calls:
        prepared = prepare_rows(requests)
    # Assert: only the first and the last share a call (in a family tested that way)
    together = loaded.adapter.continuous_batching
    assert sorted(calls) == ([1, 1, 1, 2] if together else [1] * 5)
    for row, item in zip(prepared, requests, strict=True):
        assert_same_row(row, item.alone())


def test_a_request_too_long_for_the_model_is_refused_alone(loaded):
    requests = [request(loaded, "red"), request(loaded, "blue", max_new_tokens=10**7)]
    prepared = prepare_rows(requests)
    assert_same_row(prepared[0], requests[0].alone())
    assert isinstance(prepared[1], PromptTooLongError)


def test_a_joint_call_that_fails_falls_back_to_one_call_a_request(loaded, monkeypatch):
    # Arrange: the processor fails on any batch of more than one prompt
    adapter_type = type(loaded.adapter)
    original = adapter_type.build_batch_inputs

    def alone_only(self, processor, prompts, **kwargs):
        if len(prompts) > 1:
            raise ValueError("no batches here")
        return original(self, processor, prompts, **kwargs)

    monkeypatch.setattr(adapter_type, "build_batch_inputs", alone_only)
    requests = [request(loaded, "red"), request(loaded, "blue", 1)]
    # Act
    prepared = prepare_rows(requests)
    # Assert
    for row, item in zip(prepared, requests, strict=True):
        assert_same_row(row, item.alone())


def _batch(mask: list[list[int]], pixels: int) -> dict[str, torch.Tensor]:
    ids = torch.arange(len(mask) * len(mask[0])).reshape(len(mask), -1)
    return {
        "input_ids": ids,
        "attention_mask": torch.tensor(mask),
        "pixel_values": torch.zeros(pixels, 3, 4, 4),
    }


def test_a_left_padded_batch_is_cut_into_each_prompts_own_tensors():
    parts = split_batch(_batch([[0, 1, 1], [1, 1, 1]], pixels=4), 2)
    assert parts is not None
    assert parts[0]["input_ids"].tolist() == [[1, 2]]
    assert parts[1]["input_ids"].tolist() == [[3, 4, 5]]
    assert [p["attention_mask"].tolist() for p in parts] == [[[1, 1]], [[1, 1, 1]]]
    assert [p["pixel_values"].shape[0] for p in parts] == [2, 2]


@pytest.mark.parametrize(
    ("mask", "pixels"),
    [
        ([[1, 1, 0], [1, 1, 1]], 2),  # right padding
        ([[1, 0, 1], [1, 1, 1]], 2),  # a hole
        ([[0, 0, 0], [1, 1, 1]], 2),  # an empty prompt
        ([[0, 1, 1], [1, 1, 1]], 3),  # images that do not divide between the prompts
    ],
)
def test_a_batch_that_does_not_cut_cleanly_is_not_cut(mask, pixels):
    assert split_batch(_batch(mask, pixels), 2) is None


def test_a_batch_without_an_attention_mask_is_not_cut():
    inputs = _batch([[1, 1], [1, 1]], pixels=2)
    del inputs["attention_mask"]
    assert split_batch(inputs, 2) is None


def test_the_batcher_prepares_waiting_requests_together_and_answers_as_plain_generate(loaded):
    # Arrange: three requests (one patched) and one too long, queued before the worker starts
    requests = [
        request(loaded, "red"),
        request(loaded, "blue", 1, patch=release("r1", 1)),
        request(loaded, "green", 2),
        request(loaded, "red", max_new_tokens=10**7),
    ]
    batcher = Batcher(loaded, threading.Lock(), rows=4, max_queue=8)
    sinks = [Collected() for _ in requests]
    futures = [batcher.submit(r, s) for r, s in zip(requests, sinks, strict=True)]
    # Act
    batcher.start()
    try:
        with pytest.raises(PromptTooLongError):
            futures[3].result(timeout=60)
        for sink in sinks[:3]:
            assert sink.done.wait(60)
    finally:
        batcher.stop()
    # Assert: one preparation round; the refused request's sink never heard of it
    assert (batcher.stats.prepare_calls, batcher.stats.prepared) == (1, 4)
    for future, sink in zip(futures[:3], sinks[:3], strict=True):
        assert sink.error is None
        assert sink.tokens == plain_generate(loaded, future.result())
    assert not sinks[3].done.is_set()
    assert sinks[3].tokens == []


def test_stopping_refuses_the_requests_not_yet_prepared_without_calling_their_sinks(loaded):
    batcher = Batcher(loaded, threading.Lock(), rows=2, max_queue=4)  # never started
    sink = Collected()
    future = batcher.submit(request(loaded, "red"), sink)
    batcher.stop()
    with pytest.raises(ServiceError, match="stopping"):
        future.result(timeout=5)
    assert not sink.done.is_set()
    assert not future.cancel()  # a caller cannot withdraw a request the worker may run


def test_requests_announced_together_are_prepared_in_one_call_as_they_trickle_in(loaded):
    # Arrange: three requests announced at once (their heads arrived), submitted 30 ms apart
    # as the HTTP front parses them one by one, with nothing running
    batcher = Batcher(loaded, threading.Lock(), rows=4, max_queue=8, gather_s=1.0)
    sinks = [Collected() for _ in range(3)]
    batcher.start()
    try:
        for _ in sinks:
            batcher.expect()
        # Act
        for colour, sink in zip(("red", "blue", "green"), sinks, strict=True):
            batcher.submit(request(loaded, colour), sink, expected=True)
            threading.Event().wait(0.03)
        for sink in sinks:
            assert sink.done.wait(60)
        # ... and one not announced: prepared at once (nothing awaited)
        alone = Collected()
        batcher.submit(request(loaded, "red"), alone)
        assert alone.done.wait(60)
    finally:
        batcher.stop()
    # Assert: one preparation call for the three, one for the last
    assert (batcher.stats.prepare_calls, batcher.stats.prepared) == (2, 4)
    assert batcher.stats.prefills == 2
