"""Tiny random-weight builds of each supported architecture, made offline for tests and demos.

Each build is the real transformers model class and the real processor class, from a
configuration of a few hundred thousand parameters (text: hidden 64, 2 layers, 4 heads of 16;
vision: hidden 32, 2 layers; 56-pixel images), with a byte-level BPE tokenizer trained on the
fly and the architecture's chat template. Nothing is downloaded. The weights are random: the
outputs mean nothing, but shapes, hooks, prompts and save/load behave as for a real checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import transformers as tf
from transformers import PreTrainedModel, ProcessorMixin

from client.models import _tiny_families
from client.models._tiny_parts import (
    IDEFICS_SPECIALS,
    QWEN_SPECIALS,
    TINY_IMAGE_SIZE,
    VISION,
    Built,
    text_config,
    token_id,
    tokenizer,
)
from client.models.adapters import get_adapter
from client.models.loading import ensure_processor_shim
from dpmtv_common.errors import ConfigError

__all__ = [
    "ALL_TINY_ARCHITECTURES",
    "TINY_ARCHITECTURES",
    "TINY_IMAGE_SIZE",
    "build_tiny_model",
    "save_tiny_model",
]


def _llava() -> Built:
    tok = tokenizer((), {"image_token": "<image>"})
    config = tf.LlavaConfig(
        vision_config={
            **VISION,
            "model_type": "clip_vision_model",
            "image_size": TINY_IMAGE_SIZE,
            "patch_size": 14,
            "projection_dim": 32,
        },
        text_config=text_config(tok, model_type="llama"),
        image_token_index=token_id(tok, "<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_seq_length=16,
    )
    size = TINY_IMAGE_SIZE
    images = tf.CLIPImageProcessorPil(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    )
    processor = tf.LlavaProcessor(  # type: ignore[no-untyped-call]
        images,
        tok,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    return tf.LlavaForConditionalGeneration(config), processor


def _qwen(config_class: Any, model_class: Any, processor_class: Any, vision: Any) -> Built:
    tok = tokenizer(QWEN_SPECIALS, {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})
    ids = {s: token_id(tok, s) for s in (*QWEN_SPECIALS, "<|image_pad|>")}
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
    config = config_class(
        text_config=text_config(tok, head_dim=16, rope_parameters=rope),
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=token_id(tok, "<|video_pad|>"),
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    images = tf.Qwen2VLImageProcessorPil(
        min_pixels=14 * 14 * 16, max_pixels=14 * 14 * 16, patch_size=14
    )
    processor = processor_class(image_processor=images, tokenizer=tok, video_processor=None)
    return model_class(config), processor


def _qwen2_vl() -> Built:
    vision = {
        "depth": 2,
        "embed_dim": 32,
        "hidden_size": 64,
        "num_heads": 4,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    return _qwen(tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration, tf.Qwen2VLProcessor, vision)


def _qwen2_5_vl() -> Built:
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": 64,
        "num_heads": 4,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,
        "fullatt_block_indexes": [1],
    }
    return _qwen(
        tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration, tf.Qwen2_5_VLProcessor, vision
    )


def _idefics(
    config_class: Any, model_class: Any, processor_class: Any, specials: Any, **extra: Any
) -> Built:
    tok = tokenizer(specials, {"image_token": "<image>"})
    config = config_class(
        vision_config={**VISION, "image_size": TINY_IMAGE_SIZE, "patch_size": 14},
        text_config=text_config(tok, model_type="llama"),
        image_token_id=token_id(tok, "<image>"),
        scale_factor=2,
    )
    edge = {"longest_edge": TINY_IMAGE_SIZE}
    images = tf.Idefics3ImageProcessorPil(do_image_splitting=False, size=edge, max_image_size=edge)
    # image_seq_len = (56 / 14) ** 2 / scale_factor ** 2 = 4 tokens an image.
    processor = processor_class(images, tok, image_seq_len=4, **extra)
    return model_class(config), processor


def _idefics3() -> Built:
    return _idefics(
        tf.Idefics3Config,
        tf.Idefics3ForConditionalGeneration,
        tf.Idefics3Processor,
        IDEFICS_SPECIALS,
    )


def _smolvlm() -> Built:
    return _idefics(
        tf.SmolVLMConfig,
        tf.SmolVLMForConditionalGeneration,
        tf.SmolVLMProcessor,
        ("<|im_start|>", *IDEFICS_SPECIALS),
        video_processor=None,
    )


_BUILDERS: dict[str, Callable[[], Built]] = {
    "idefics3": _idefics3,
    "llava": _llava,
    "qwen2_5_vl": _qwen2_5_vl,
    "qwen2_vl": _qwen2_vl,
    "smolvlm": _smolvlm,
}
_BUILDERS.update(_tiny_families.FAMILY_BUILDERS)
ALL_TINY_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_BUILDERS))
"""Every ``model_type`` :func:`build_tiny_model` can build (one a registered family)."""
TINY_ARCHITECTURES: tuple[str, ...] = ("idefics3", "llava", "qwen2_5_vl", "qwen2_vl", "smolvlm")
"""The representative subset the pipeline tests run on (extraction, scoring, release...).

Registry coverage (the exact no-op patch) is tested on :data:`ALL_TINY_ARCHITECTURES`; running
every pipeline test on all of them would multiply CI time for little extra assurance.
"""


def build_tiny_model(arch: str, *, seed: int) -> tuple[PreTrainedModel, ProcessorMixin]:
    """Build a tiny random-weight model of ``arch`` and its processor, in eval mode on CPU.

    The global torch RNG is forked around weight initialisation, so building a model does
    not disturb the caller's random state; equal seeds give equal weights.

    Args:
        arch: One of :data:`TINY_ARCHITECTURES` (a ``config.model_type``).
        seed: Seed for the weight initialisation.
    """
    try:
        builder = _BUILDERS[arch]
    except KeyError:
        raise ConfigError(
            f"arch must be one of {list(ALL_TINY_ARCHITECTURES)}, got {arch!r}."
        ) from None
    ensure_processor_shim()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, processor = builder()
    processor.chat_template = get_adapter(arch).chat_template
    model.train(False)  # eval mode; .eval() is untyped in transformers
    return model, processor


def save_tiny_model(arch: str, directory: str | os.PathLike[str], *, seed: int) -> None:
    """Build a tiny ``arch`` model and save it and its processor where ``load_model`` reads."""
    model, processor = build_tiny_model(arch, seed=seed)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
