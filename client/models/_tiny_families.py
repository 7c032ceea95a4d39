"""Tiny offline builds of the families beyond the first five (see ``client.models.tiny``).

Configurations follow ``notes/models.md`` §1.3 (measured on transformers 5.2x): text hidden 64,
2 layers (Mllama 3, one of them cross-attention), 4 heads of 16; vision hidden 32; 56-pixel
images; a few image tokens an image.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers as tf

from client.models._tiny_parts import (
    QWEN_SPECIALS,
    TINY_IMAGE_SIZE,
    VISION,
    Built,
    text_config,
    token_id,
    tokenizer,
)

__all__ = ["FAMILY_BUILDERS"]

_S = TINY_IMAGE_SIZE


def _idefics2() -> Built:
    specials = ("<fake_token_around_image>", "<image>", "<end_of_utterance>")
    extra = {"image_token": "<image>", "image_boundary_token": "<fake_token_around_image>"}
    tok = tokenizer(specials, extra)
    config = tf.Idefics2Config(
        vision_config={**VISION, "image_size": _S, "patch_size": 14},
        perceiver_config={
            "hidden_size": 64,
            "resampler_n_latents": 4,
            "resampler_depth": 1,
            "resampler_n_heads": 2,
            "resampler_head_dim": 8,
            "num_key_value_heads": 1,
        },
        text_config=text_config(tok, model_type="mistral"),
        image_token_id=token_id(tok, "<image>"),
    )
    edges = {"shortest_edge": _S, "longest_edge": _S}
    images = tf.Idefics2ImageProcessorPil(do_image_splitting=False, size=edges)
    # image_seq_len must equal the perceiver's resampler_n_latents.
    processor = tf.Idefics2Processor(images, tok, image_seq_len=4)
    return tf.Idefics2ForConditionalGeneration(config), processor


def _clip_vision() -> dict[str, Any]:
    return {
        **VISION,
        "model_type": "clip_vision_model",
        "image_size": _S,
        "patch_size": 14,
        "projection_dim": 32,
    }


def _llava_next() -> Built:
    tok = tokenizer((), {"image_token": "<image>"})
    config = tf.LlavaNextConfig(
        vision_config=_clip_vision(),
        text_config=text_config(tok, model_type="llama"),
        image_token_index=token_id(tok, "<image>"),
        image_grid_pinpoints=[[_S, _S]],
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_seq_length=16,
    )
    images = tf.LlavaNextImageProcessorPil(
        size={"shortest_edge": _S},
        crop_size={"height": _S, "width": _S},
        image_grid_pinpoints=[[_S, _S]],
    )
    processor = tf.LlavaNextProcessor(  # type: ignore[no-untyped-call]
        images,
        tok,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    return tf.LlavaNextForConditionalGeneration(config), processor


def _llava_onevision() -> Built:
    extra = {"image_token": "<image>", "video_token": "<video>"}
    tok = tokenizer(("<|im_start|>", "<|im_end|>"), extra)
    config = tf.LlavaOnevisionConfig(
        vision_config={
            **VISION,
            "model_type": "siglip_vision_model",
            "image_size": _S,
            "patch_size": 14,
        },
        text_config=text_config(tok, model_type="qwen2"),
        image_token_index=token_id(tok, "<image>"),
        video_token_index=token_id(tok, "<video>"),
        image_grid_pinpoints=[[_S, _S]],
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
    )
    images = tf.LlavaOnevisionImageProcessorPil(
        size={"height": _S, "width": _S}, image_grid_pinpoints=[[_S, _S]]
    )
    processor = tf.LlavaOnevisionProcessor(  # type: ignore[no-untyped-call]
        images, tok, None, num_image_tokens=16, vision_feature_select_strategy="full"
    )
    return tf.LlavaOnevisionForConditionalGeneration(config), processor


def _paligemma() -> Built:
    tok = tokenizer((), {"image_token": "<image>"})
    vision = {
        **VISION,
        "model_type": "siglip_vision_model",
        "image_size": _S,
        "patch_size": 14,
        "projection_dim": 64,
    }
    config = tf.PaliGemmaConfig(
        vision_config=vision,
        text_config=text_config(tok, model_type="gemma", head_dim=16),
        image_token_index=token_id(tok, "<image>"),
        projection_dim=64,
        hidden_size=64,
        vocab_size=len(tok),
    )
    images = tf.SiglipImageProcessorPil(size={"height": _S, "width": _S})
    images.image_seq_length = 16  # type: ignore[attr-defined]  # PaliGemmaProcessor reads it
    processor = tf.PaliGemmaProcessor(images, tok)  # type: ignore[no-untyped-call]
    return tf.PaliGemmaForConditionalGeneration(config), processor


def _gemma3() -> Built:
    extra = {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    }
    tok = tokenizer(("<start_of_turn>", "<end_of_turn>"), extra)
    config = tf.Gemma3Config(
        text_config=text_config(tok, head_dim=16, query_pre_attn_scalar=16, sliding_window=32),
        vision_config={
            **VISION,
            "model_type": "siglip_vision_model",
            "image_size": _S,
            "patch_size": 14,
        },
        mm_tokens_per_image=4,
        boi_token_index=token_id(tok, "<start_of_image>"),
        eoi_token_index=token_id(tok, "<end_of_image>"),
        image_token_index=token_id(tok, "<image_soft_token>"),
    )
    images = tf.Gemma3ImageProcessorPil(size={"height": _S, "width": _S})
    processor = tf.Gemma3Processor(images, tok, image_seq_length=4)
    return tf.Gemma3ForConditionalGeneration(config), processor


def _mllama() -> Built:
    specials = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    tok = tokenizer(specials, {"image_token": "<|image|>"})
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_global_layers": 1,
        "attention_heads": 4,
        "image_size": _S,
        "patch_size": 14,
        "max_num_tiles": 2,
        "vision_output_dim": 64,
        "intermediate_layers_indices": [0],
        "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]],
    }
    config = tf.MllamaConfig(
        vision_config=vision,
        text_config=text_config(tok, num_hidden_layers=3, cross_attention_layers=[1]),
        image_token_index=token_id(tok, "<|image|>"),
    )
    model = tf.MllamaForConditionalGeneration(config)
    # A fresh cross-attention layer is gated shut (tanh(0) = 0), as in Llama-3.2-Vision's
    # initialisation; open the gates so that its heads influence the logits, as trained ones do.
    for name, parameter in model.named_parameters():
        if name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate")):
            torch.nn.init.constant_(parameter, 0.5)
    images = tf.MllamaImageProcessorPil(size={"height": _S, "width": _S}, max_image_tiles=2)
    return model, tf.MllamaProcessor(images, tok)  # type: ignore[no-untyped-call]


def _internvl() -> Built:
    extra = {
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>",
    }
    tok = tokenizer(("<|im_start|>", "<|im_end|>"), extra)
    config = tf.InternVLConfig(
        vision_config={**VISION, "image_size": [_S, _S], "patch_size": [14, 14]},
        text_config=text_config(tok, model_type="qwen2"),
        image_token_id=token_id(tok, "<IMG_CONTEXT>"),
        image_seq_length=4,
        downsample_ratio=0.5,
    )
    images = tf.GotOcr2ImageProcessorPil(size={"height": _S, "width": _S}, crop_to_patches=False)
    processor = tf.InternVLProcessor(images, tok, None, image_seq_length=4)
    return tf.InternVLForConditionalGeneration(config), processor


def _qwen3(config_class: Any, model_class: Any, text: dict[str, Any], **vision: Any) -> Built:
    tok = tokenizer(QWEN_SPECIALS, {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})
    rope = {
        "rope_type": "default",
        "rope_theta": 1e4,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    }
    config = config_class(
        text_config=text_config(tok, head_dim=16, rope_parameters=rope, **text),
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 4,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,
            **vision,
        },
        image_token_id=token_id(tok, "<|image_pad|>"),
        video_token_id=token_id(tok, "<|video_pad|>"),
        vision_start_token_id=token_id(tok, "<|vision_start|>"),
        vision_end_token_id=token_id(tok, "<|vision_end|>"),
    )
    pixels = 16 * 16 * 16  # 4 x 4 patches of 16 -> 4 image tokens after the 2 x 2 merge
    images = tf.Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels, patch_size=16)
    processor = tf.Qwen3VLProcessor(  # type: ignore[no-untyped-call]
        image_processor=images, tokenizer=tok, video_processor=None
    )
    return model_class(config), processor


def _qwen3_vl() -> Built:
    return _qwen3(
        tf.Qwen3VLConfig,
        tf.Qwen3VLForConditionalGeneration,
        {},
        deepstack_visual_indexes=[1],
    )


def _qwen3_5() -> Built:
    # Hybrid: layer 0 is Gated DeltaNet (linear attention, no softmax heads), layer 1 attention.
    text = {
        "layer_types": ["linear_attention", "full_attention"],
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
    }
    return _qwen3(tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration, text)


FAMILY_BUILDERS = {
    "gemma3": _gemma3,
    "idefics2": _idefics2,
    "internvl": _internvl,
    "llava_next": _llava_next,
    "llava_onevision": _llava_onevision,
    "mllama": _mllama,
    "paligemma": _paligemma,
    "qwen3_5": _qwen3_5,
    "qwen3_vl": _qwen3_vl,
}
