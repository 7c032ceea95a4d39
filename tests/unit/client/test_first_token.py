"""First-token accuracy: the prefix-cached step gives the full passes' answers, or is not used."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from client.evaluation.first_token import QuerySet
from client.models import (
    ALL_TINY_ARCHITECTURES,
    Example,
    LoadedModel,
    Prompt,
    adapter_for,
    build_tiny_model,
)
from dpmtv_common.heads import HeadSet
from tests.unit.client.conftest import SEED, Tiny, draw

COLOURS = ("red", "blue", "green", "yellow", "purple", "orange")


def _prompts() -> tuple[list[Prompt], list[str]]:
    """Prompts of different lengths (one or two shots), so the batch is left-padded."""
    prompts, answers = [], []
    for index, colour in enumerate(COLOURS):
        shots = [Example(draw(c, "square"), "What colour?", c) for c in COLOURS[: 1 + index % 2]]
        query = Example(draw(colour, "circle"), "What colour?")
        prompts.append(Prompt.of(shots, query))
        answers.append(colour)
    return prompts, answers


def _patch(tiny, scale: float) -> tuple[HeadSet, torch.Tensor]:
    shape = tiny.adapter.head_shape(tiny.model)
    heads = HeadSet.of([(shape.head_layers[0], 0), (shape.head_layers[-1], 1)])
    values = torch.as_tensor(
        np.random.default_rng(0).normal(size=(2, shape.head_dim)) * scale, dtype=torch.float32
    )
    return heads, values


@pytest.mark.parametrize("arch", ALL_TINY_ARCHITECTURES)
def test_the_cached_step_predicts_what_full_passes_predict_on_every_architecture(arch):
    # Arrange: two query sets over the same prompts, one forced onto full passes
    model, processor = build_tiny_model(arch, seed=SEED)
    tiny = Tiny(arch, SEED, model, processor, adapter_for(model))
    loaded = LoadedModel(model, processor, tiny.adapter, f"sha256:test-{arch}")
    prompts, answers = _prompts()
    cached = QuerySet.build(loaded, prompts, answers, size=4)
    full = QuerySet.build(loaded, prompts, answers, size=4)
    full.cached = False

    # Act / Assert: unpatched and under patches of several sizes, the same greedy tokens
    for patch in (None, _patch(tiny, 0.1), _patch(tiny, 10.0)):
        assert torch.equal(cached.predictions(loaded, patch)[0], full.predictions(loaded, patch)[0])
    assert cached.cached is not None  # the check ran (and chose a path)


@pytest.mark.parametrize("tiny", ["llava"], indirect=True)
def test_the_cache_is_used_where_it_agrees_and_dropped_where_it_does_not(tiny, loaded, monkeypatch):
    # Arrange
    prompts, answers = _prompts()
    agrees = QuerySet.build(loaded, prompts, answers, size=4)
    differs = QuerySet.build(loaded, prompts, answers, size=4)
    agrees.predictions(loaded, _patch(tiny, 1.0))
    shifted = QuerySet._cached_logits

    def wrong(self, loaded, index, patch):  # a step that disagrees with the full passes
        logits = shifted(self, loaded, index, patch)
        return torch.roll(logits, 1, dims=-1)

    monkeypatch.setattr(QuerySet, "_cached_logits", wrong)

    # Act
    predicted = differs.predictions(loaded, _patch(tiny, 1.0))[0]

    # Assert
    assert agrees.cached is True
    assert differs.cached is False
    differs_full = QuerySet.build(loaded, prompts, answers, size=4)
    differs_full.cached = False
    assert torch.equal(predicted, differs_full.predictions(loaded, _patch(tiny, 1.0))[0])
