"""How much accelerator memory a model needs, computed from its config alone (no weights read).

:func:`estimate_memory` builds the model on PyTorch's ``meta`` device (shapes, no storage) to
count its parameters exactly, and reads the text model's attention shape from the config:

* **weights**: parameters x bytes per value (bfloat16/float16: 2, float32: 4);
* **KV cache**: 2 (keys and values) x layers x KV heads x head size x bytes, per token of a
  prompt; a K-shot chunk's prompt holds K+1 images' tokens (``dpmtv-site data check --model``
  prints them);
* **captured heads**: what dpmtv itself keeps per chunk, layers x heads x head size float32.

Activations inside one forward pass (attention scores, MLP intermediates) come on top and
depend on the kernel (``sdpa`` and flash attention keep no full score matrix); the figures are
a floor to plan a device with, not a guarantee.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpmtv_common.errors import ModelError

__all__ = ["GIB", "MemoryEstimate", "estimate_memory", "memory_of_folder"]

GIB = 1024**3
"""Bytes in a GiB."""


@dataclass(frozen=True)
class MemoryEstimate:
    """A model's size and attention shape, from its config.

    Attributes:
        model_type: The config's ``model_type``.
        parameters: Every parameter, vision tower and projector included.
        layers: Decoder layers of the text model.
        heads: Query heads a layer.
        kv_heads: Key/value heads a layer (fewer than ``heads`` under grouped-query attention).
        head_dim: Width of one head.
    """

    model_type: str
    parameters: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    def weights_gib(self, bytes_per_value: int = 2) -> float:
        """Weights in GiB (2 bytes a value: bfloat16 or float16; 4: float32)."""
        return self.parameters * bytes_per_value / GIB

    def kv_cache_gib(self, tokens: int, *, batch: int = 1, bytes_per_value: int = 2) -> float:
        """The KV cache of ``batch`` prompts of ``tokens`` tokens each, in GiB."""
        per_token = 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value
        return per_token * tokens * batch / GIB

    def capture_bytes(self) -> int:
        """What dpmtv keeps of one chunk: every head's activation, float32."""
        return self.layers * self.heads * self.head_dim * 4


def estimate_memory(config: Any) -> MemoryEstimate:
    """Count ``config``'s parameters on the meta device and read its attention shape.

    Raises:
        ModelError: transformers cannot build a vision-language model from the config.
    """
    # Imported here: torch and transformers take seconds to import.
    import torch
    from transformers import AutoModelForImageTextToText

    try:
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config)  # type: ignore[no-untyped-call]
    except (ValueError, KeyError, ImportError) as exc:
        raise ModelError(
            f"config must describe a vision-language model transformers can build, got "
            f"model_type {getattr(config, 'model_type', None)!r}: {exc}"
        ) from exc
    parameters = sum(parameter.numel() for parameter in model.parameters())
    text = config.get_text_config()
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return MemoryEstimate(
        model_type=str(config.model_type),
        parameters=int(parameters),
        layers=int(text.num_hidden_layers),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
    )


def memory_of_folder(path: str | os.PathLike[str]) -> MemoryEstimate:
    """:func:`estimate_memory` of the config saved in a local model folder (no weights read)."""
    from transformers import AutoConfig

    folder = Path(path)
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"path must hold a model config, got {str(path)!r}: {exc}") from exc
    return estimate_memory(config)
