"""Shared pieces of the tiny offline builds: sizes, a trained-on-the-fly tokenizer, configs."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import PreTrainedModel, PreTrainedTokenizerFast, ProcessorMixin

from client.models._own_tokenizers import wrap_tokenizer
from dpmtv_common.errors import ConfigError

TINY_IMAGE_SIZE = 56
"""Side in pixels of the images the tiny processors produce (4 x 4 patches of 14)."""

TEXT: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}
VISION: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}
CORPUS = [
    "User: What is in the image? Assistant: a cat, a dog, a red square, a blue circle. "
    "Answer: one two three four five six seven eight nine ten yes no left right up down."
] * 20
QWEN_SPECIALS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")
IDEFICS_SPECIALS = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>")

Built = tuple[PreTrainedModel, ProcessorMixin]


def tokenizer(specials: tuple[str, ...], extra: dict[str, str]) -> PreTrainedTokenizerFast:
    """Train a 400-token byte-level BPE on a fixed corpus (deterministic) and wrap it."""
    backend = Tokenizer(BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>", *specials, *extra.values()],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    return wrap_tokenizer(backend, extra)


def token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int):
        raise ConfigError(f"token must map to one id, got {token!r} -> {token_id!r}.")
    return token_id


def text_config(tokenizer: PreTrainedTokenizerFast, **overrides: Any) -> dict[str, Any]:
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    return {**TEXT, "vocab_size": len(tokenizer), **ids, **overrides}
