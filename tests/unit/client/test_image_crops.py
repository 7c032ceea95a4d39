"""The plan's cap on crops an image, applied to each family's real (tiny) processor."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from PIL import Image

from client.models import (
    Example,
    LoadedModel,
    ModelAdapter,
    Prompt,
    build_tiny_model,
    get_adapter,
)
from client.models.image_crops import cap_image_crops, llava_next_max_crops
from dpmtv_common.errors import ConfigError

SMALL = Image.new("RGB", (28, 28), (200, 40, 40))  # the case: a tiny image upscaled
WIDE = Image.new("RGB", (600, 200), (40, 200, 40))  # an aspect ratio that pans and patches


def _idefics_tiles(processor: Any) -> None:
    # As SmolVLM ships: resize to 4 tiles a side, cut, add a global view (17 crops).
    processor.image_processor.do_image_splitting = True
    processor.image_processor.size = {"longest_edge": 4 * 56}


def _idefics2_four(processor: Any) -> None:
    processor.image_processor.do_image_splitting = True


def _internvl_patches(processor: Any) -> None:
    processor.image_processor.max_patches = 12  # InternVL's default; the processor crops


def _gemma3_pan_and_scan(processor: Any) -> None:
    processor.images_kwargs = {
        **processor.images_kwargs,
        "do_pan_and_scan": True,
        "pan_and_scan_min_crop_size": 8,
        "pan_and_scan_max_num_crops": 6,
    }


# (model type, how its shipped processor is set to split, an image it splits, crops shipped)
SPLITTING: list[tuple[str, Callable[[Any], None], Image.Image, int]] = [
    ("smolvlm", _idefics_tiles, SMALL, 17),
    ("idefics3", _idefics_tiles, SMALL, 17),
    ("idefics2", _idefics2_four, SMALL, 5),
    ("internvl", _internvl_patches, WIDE, 13),
    ("gemma3", _gemma3_pan_and_scan, WIDE, 4),
]


def splitting_model(arch: str, setup: Callable[[Any], None]) -> LoadedModel:
    model, processor = build_tiny_model(arch, seed=0)
    setup(processor)
    return LoadedModel(model, processor, get_adapter(arch), "fingerprint")


def prompt_shape(loaded: LoadedModel, image: Image.Image) -> tuple[int, int, torch.Tensor]:
    """(crops, image tokens in the prompt, input ids) of a zero-shot prompt on ``image``."""
    inputs = loaded.adapter.build_batch_inputs(
        loaded.processor, [Prompt.of([], Example(image, "What is it?"))]
    )
    pixels = inputs["pixel_values"]
    crops = pixels.numel() // (3 * pixels.shape[-2] * pixels.shape[-1])
    image_token = getattr(loaded.processor, "image_token_id", None)
    if image_token is None:
        token = getattr(loaded.processor, "image_token")  # noqa: B009 (ProcessorMixin lacks it)
        image_token = loaded.processor.tokenizer.convert_tokens_to_ids(token)
    ids = inputs["input_ids"]
    return crops, int((ids == image_token).sum()), ids


@pytest.mark.parametrize(("arch", "setup", "image", "shipped"), SPLITTING)
def test_a_cap_bounds_crops_and_image_tokens_of_every_splitting_family(arch, setup, image, shipped):
    # Arrange
    loaded = splitting_model(arch, setup)
    one_crop_tokens = prompt_shape(loaded.with_image_crops(1), image)[1]

    # Act
    crops_shipped, tokens_shipped, _ = prompt_shape(loaded, image)
    capped = {n: prompt_shape(loaded.with_image_crops(n), image) for n in (1, 2, 3, 4, 5, 10)}

    # Assert: N crops appear without a cap, at most the cap with it, and image tokens follow.
    assert crops_shipped == shipped
    assert tokens_shipped > one_crop_tokens
    for cap, (crops, tokens, _) in capped.items():
        assert 1 <= crops <= cap, (arch, cap, crops)
        assert tokens <= cap * one_crop_tokens, (arch, cap, tokens)
    assert capped[1][0] == 1
    assert max(crops for crops, _, _ in capped.values()) > 1  # a cap is a cap, not "off"


@pytest.mark.parametrize(("arch", "setup", "image", "shipped"), SPLITTING)
def test_capping_leaves_the_loaded_processor_as_shipped(arch, setup, image, shipped):
    # Arrange
    loaded = splitting_model(arch, setup)

    # Act
    loaded.with_image_crops(1)
    loaded.with_image_crops(3)

    # Assert
    assert prompt_shape(loaded, image)[0] == shipped
    assert loaded.max_image_crops is None


@pytest.mark.parametrize(("arch", "setup", "image", "shipped"), SPLITTING)
def test_a_cap_at_or_above_the_shipped_crops_changes_no_prompt(arch, setup, image, shipped):
    loaded = splitting_model(arch, setup)

    crops, _, ids = prompt_shape(loaded.with_image_crops(shipped), image)

    assert crops == shipped
    assert torch.equal(ids, prompt_shape(loaded, image)[2])


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl", "paligemma", "qwen3_vl"])
def test_a_family_that_never_splits_prompts_alike_under_any_cap(arch):
    loaded = splitting_model(arch, lambda processor: None)
    _, _, shipped = prompt_shape(loaded, WIDE)

    for cap in (1, 2, 17):
        assert torch.equal(prompt_shape(loaded.with_image_crops(cap), WIDE)[2], shipped)


@pytest.mark.parametrize(("arch", "fixed", "config_key"), [
    ("llava_next", 2, "image_grid_pinpoints"),
    ("llava_onevision", 2, "image_grid_pinpoints"),
    ("mllama", 2, "max_num_tiles"),
])  # fmt: skip
def test_a_family_whose_model_fixes_its_crops_refuses_a_lower_cap_in_one_line(
    arch, fixed, config_key
):
    # Arrange
    loaded = splitting_model(arch, lambda processor: None)

    # Act
    with pytest.raises(ConfigError) as refused:
        loaded.with_image_crops(fixed - 1)
    kept = loaded.with_image_crops(fixed)

    # Assert: what was asked, what the processor makes and why, and how to fix it.
    message = str(refused.value)
    assert "\n" not in message
    assert f"got {fixed - 1}" in message
    assert f"at least {fixed}" in message
    assert type(loaded.processor.image_processor).__name__ in message
    assert config_key in message
    assert torch.equal(prompt_shape(kept, SMALL)[2], prompt_shape(loaded, SMALL)[2])


def test_the_anyres_count_is_the_most_crops_the_processor_makes():
    # Arrange: LLaVA-NeXT with a 2 x 2 pinpoint; a large square image uses all of it
    loaded = splitting_model("llava_next", lambda processor: None)
    loaded.processor.image_processor.image_grid_pinpoints = [[56, 112], [112, 112]]
    big = Image.new("RGB", (600, 600), "blue")

    # Act
    counted = llava_next_max_crops(loaded.processor)

    # Assert: 4 patches and the base image, as the processor makes them
    assert counted == 5
    assert prompt_shape(loaded, big)[0] == counted
    with pytest.raises(ConfigError, match="at least 5"):
        loaded.with_image_crops(4)


def test_an_adapter_that_declares_no_crop_knob_refuses_every_cap():
    # Arrange: a plugin-style adapter for a splitting processor, without image_crops
    loaded = splitting_model("smolvlm", _idefics_tiles)
    undeclared = dataclasses.replace(loaded.adapter, image_crops=None)
    plugin = dataclasses.replace(loaded, adapter=undeclared)

    # Act
    with pytest.raises(ConfigError) as refused:
        plugin.with_image_crops(4)

    # Assert
    message = str(refused.value)
    assert "max_image_crops must be unset for model type 'smolvlm', got 4" in message
    assert "Idefics3ImageProcessorPil" in message
    assert "\n" not in message
    assert plugin.with_image_crops(None) is plugin  # no cap asked: nothing to refuse


def test_lfm2_vl_declares_no_crop_knob_so_a_cap_is_refused_not_ignored():
    adapter: ModelAdapter = get_adapter("lfm2_vl")

    assert adapter.image_crops is None
    with pytest.raises(ConfigError, match="declares no way to cap"):
        cap_image_crops(object(), adapter.image_crops, max_crops=2, family="lfm2_vl")  # type: ignore[arg-type]


def test_the_cap_in_force_is_kept_and_a_second_cap_is_refused():
    loaded = splitting_model("smolvlm", _idefics_tiles)
    capped = loaded.with_image_crops(5)

    assert loaded.with_image_crops(None) is loaded
    assert capped.with_image_crops(5) is capped
    assert capped.max_image_crops == 5
    with pytest.raises(ConfigError, match="already capped at 5"):
        capped.with_image_crops(1)


@pytest.mark.parametrize("bad", [0, -1])
def test_a_cap_below_one_is_refused(bad):
    loaded = splitting_model("smolvlm", _idefics_tiles)

    with pytest.raises(ConfigError, match="max_image_crops must be >= 1"):
        loaded.with_image_crops(bad)
