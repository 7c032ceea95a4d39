"""The embedded default model: a small LLaVA trained here to learn tasks in context.

It is a real ``LlavaForConditionalGeneration`` (CLIP-style vision tower, projector, Llama
decoder) with a word-level tokenizer over the synthetic tasks' vocabulary, so it goes through
the same adapter, prompt, hook and loading code as any other LLaVA checkpoint. Its weights are
trained by ``scripts/train_embedded_model.py`` on episodes of the four ``client.data.synthetic``
tasks (colour, shape, count, position) that share one question: the task can only be told
from the demonstrations' answers, which is what in-context learning and task vectors are for.
Training sees only the ``train`` scenes of ``client.data.synthetic``'s content split.

Two sizes ship: ``small`` (3 layers x 4 heads = 12 heads; the fast default) and ``deep``
(8 layers x 8 heads = 64 heads; the benchmark of selection among many heads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import transformers as tf
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from client.data.synthetic import COLOURS, IMAGE_SIZE, POSITIONS, QUESTION, SHAPES
from client.models._own_tokenizers import wrap_tokenizer
from dpmtv_common.errors import ConfigError

__all__ = [
    "ANSWER_WORDS",
    "ARCHITECTURES",
    "EMBEDDED_MODEL_DIR",
    "EMBEDDED_MODEL_DIRS",
    "build_embedded_model",
    "clip_vision_config",
    "embedded_model_path",
]

EMBEDDED_MODEL_DIR = Path(__file__).resolve().parent / "weights" / "shapes-vlm"
"""Where the shipped default (small) weights live (inside the package, so a wheel carries them)."""

EMBEDDED_MODEL_DIRS = {
    "small": EMBEDDED_MODEL_DIR,
    "deep": EMBEDDED_MODEL_DIR.parent / "shapes-vlm-deep",
}
"""Every shipped size and its folder."""

ANSWER_WORDS = (*COLOURS, *SHAPES, "1", "2", "3", "4", *POSITIONS)
_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>", "<image>")
_WORDS = ("USER", "ASSISTANT", ":", "?", ".", ",", *QUESTION.rstrip("?").split(), *ANSWER_WORDS)
PATCH_SIZE = 16
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2

# A LLaVA-style chat format whose assistant turns end with </s>, so generation stops there.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'].upper() }}: "
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>"
    "{% else %}{{ c['text'] }} {% endif %}{% endfor %}"
    "{% if m['role'] == 'assistant' %}</s> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

_VISION: dict[str, Any] = {"vision_hidden": 64, "vision_layers": 2, "vision_heads": 4}
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "small": {"text_hidden": 96, "text_layers": 3, "text_heads": 4, **_VISION},
    # Many narrow heads (head_dim 8): what selection among many heads needs, and still small.
    "deep": {"text_hidden": 64, "text_layers": 8, "text_heads": 8, **_VISION},
}
ARCHITECTURE = ARCHITECTURES["small"]


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: index for index, token in enumerate(dict.fromkeys((*_SPECIALS, *_WORDS)))}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))  # noqa: S106 (a token, not a secret)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    return wrap_tokenizer(backend, {"image_token": "<image>"})


def _image_token_id(tok: PreTrainedTokenizerFast) -> int:
    token_id = tok.convert_tokens_to_ids("<image>")
    if not isinstance(token_id, int):
        raise ConfigError(f"<image> must be one token, got ids {token_id!r}.")
    return token_id


def clip_vision_config(
    *, hidden: int, layers: int, heads: int, image_size: int, patch_size: int
) -> dict[str, Any]:
    """A small CLIP-style vision tower's config, as the models trained here use it."""
    return {
        "model_type": "clip_vision_model",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "image_size": image_size,
        "patch_size": patch_size,
        "projection_dim": hidden,
    }


def build_embedded_model(
    size: str = "small",
) -> tuple[tf.LlavaForConditionalGeneration, tf.LlavaProcessor]:
    """A fresh model of ``size`` and its processor (untrained; the seed is the caller's)."""
    if size not in ARCHITECTURES:
        raise ConfigError(f"size must be one of {list(ARCHITECTURES)}, got {size!r}.")
    tok = _tokenizer()
    arch = ARCHITECTURES[size]
    config = tf.LlavaConfig(
        vision_config=clip_vision_config(
            hidden=arch["vision_hidden"],
            layers=arch["vision_layers"],
            heads=arch["vision_heads"],
            image_size=IMAGE_SIZE,
            patch_size=PATCH_SIZE,
        ),
        text_config={
            "model_type": "llama",
            "hidden_size": arch["text_hidden"],
            "intermediate_size": 4 * arch["text_hidden"],
            "num_hidden_layers": arch["text_layers"],
            "num_attention_heads": arch["text_heads"],
            "num_key_value_heads": arch["text_heads"],
            "max_position_embeddings": 1024,
            "vocab_size": len(tok),
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
        },
        image_token_index=_image_token_id(tok),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        image_seq_length=IMAGE_TOKENS,
    )
    images = tf.CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = tf.LlavaProcessor(  # type: ignore[no-untyped-call]
        images,
        tok,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    model = tf.LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, processor


def embedded_model_path(size: str = "small") -> Path:
    """The shipped model directory of ``size``, or a clear error saying how to make it."""
    if size not in EMBEDDED_MODEL_DIRS:
        raise ConfigError(f"size must be one of {list(EMBEDDED_MODEL_DIRS)}, got {size!r}.")
    directory = EMBEDDED_MODEL_DIRS[size]
    if not (directory / "config.json").is_file():
        raise ConfigError(
            f"the embedded model must be at {directory}, got nothing there; "
            f"train it with scripts/train_embedded_model.py --size {size}."
        )
    return directory
