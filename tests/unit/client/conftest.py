"""Tiny offline models and real drawn images, built once per test session."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw
from transformers import BatchFeature, PreTrainedModel, ProcessorMixin

from client.models import (
    TINY_ARCHITECTURES,
    Example,
    ModelAdapter,
    Prompt,
    adapter_for,
    build_tiny_model,
    save_tiny_model,
)

SEED = 1234


@dataclass(frozen=True)
class Tiny:
    arch: str
    seed: int
    model: PreTrainedModel
    processor: ProcessorMixin
    adapter: ModelAdapter

    def inputs(self, prompts: list[Prompt]) -> BatchFeature:
        return self.adapter.build_batch_inputs(self.processor, prompts, instruction="Be brief.")

    def logits(self, inputs: BatchFeature) -> torch.Tensor:
        with torch.no_grad():
            logits: torch.Tensor = self.model(**inputs).logits
        return logits


def draw(colour: str, shape: str, size: tuple[int, int] = (56, 56)) -> Image.Image:
    """A white canvas with one filled ellipse or rectangle."""
    image = Image.new("RGB", size, "white")
    box = (6, 8, size[0] - 10, size[1] - 6)
    canvas = ImageDraw.Draw(image)
    if shape == "circle":
        canvas.ellipse(box, fill=colour)
    else:
        canvas.rectangle(box, fill=colour)
    return image


@pytest.fixture(scope="session", params=TINY_ARCHITECTURES)
def tiny(request: pytest.FixtureRequest) -> Tiny:
    model, processor = build_tiny_model(request.param, seed=SEED)
    return Tiny(request.param, SEED, model, processor, adapter_for(model))


@pytest.fixture(scope="session")
def demonstrations() -> tuple[Example, ...]:
    return (
        Example(draw("red", "circle"), "What colour is the shape?", "zebra red"),
        Example(draw("blue", "square", (70, 56)), "What colour is the shape?", "zebra blue"),
    )


@pytest.fixture(scope="session")
def query() -> Example:
    return Example(draw("green", "square", (56, 64)), "What colour is the shape?", "giraffe")


@pytest.fixture(scope="session")
def prompt(demonstrations: tuple[Example, ...], query: Example) -> Prompt:
    return Prompt(demonstrations, query)


@pytest.fixture(scope="session")
def saved_tiny(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding ``tiny``'s architecture saved with the same seed."""
    directory = tmp_path_factory.mktemp(f"tiny-{tiny.arch}")
    save_tiny_model(tiny.arch, directory, seed=tiny.seed)
    return directory


@pytest.fixture
def loaded(tiny):
    """The tiny model as a ``LoadedModel`` with a made-up fingerprint."""
    from client.models import LoadedModel

    return LoadedModel(tiny.model, tiny.processor, tiny.adapter, f"sha256:test-{tiny.arch}")
