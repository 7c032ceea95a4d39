"""Per-chunk head activations: forward K-shot prompts, read the last token, clip, sum.

How this connects: a site's chunks (``client.chunking``) become prompts here; the hooks of
``client.hooks`` read every head's ``o_proj`` input at the last prompt token; the heads in
scope are clipped per layer (``dpmtv_common.clip_per_layer``) chunk by chunk and summed in
float64. The clipped sum and the public chunk count are all that leaves this module: they go
into a secure sum (federated) or straight to the Gaussian mechanism (single holder).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from client.chunking import Chunk
from client.data import Record
from client.hooks import capture_last_token_heads
from client.models import Example, LoadedModel, Prompt
from dpmtv_common.aliases import Float64Array
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.mechanisms import clip_per_layer

__all__ = [
    "ClippedSum",
    "batched",
    "chunk_prompt",
    "extract_clipped_sum",
    "forward_last_token_heads",
    "record_example",
    "select_heads",
    "zero_shot_prompt",
]


@dataclass(frozen=True)
class ClippedSum:
    """A site's contribution: the sum of per-layer-clipped chunk activations.

    Attributes:
        heads: The heads in scope; row ``i`` of ``total`` belongs to ``heads.heads[i]``.
        total: float64, shape ``(len(heads), D)``.
        num_chunks: m, how many chunks were summed.
    """

    heads: HeadSet
    total: Float64Array
    num_chunks: int


def record_example(record: Record, *, with_answer: bool = True) -> Example:
    """An ``Example`` for the prompt builder, with the image loaded."""
    return Example(record.load_image(), record.question, record.answer if with_answer else None)


def chunk_prompt(chunk: Chunk) -> Prompt:
    """The chunk's K-shot prompt: its demonstrations, then its query without the answer."""
    demonstrations = [record_example(r) for r in chunk.demonstrations]
    return Prompt.of(demonstrations, record_example(chunk.query, with_answer=False))


def zero_shot_prompt(record: Record) -> Prompt:
    """The zero-shot prompt of one record (no demonstrations, answer withheld)."""
    return Prompt.of([], record_example(record, with_answer=False))


def batched(items: Sequence[Chunk], size: int) -> Iterator[Sequence[Chunk]]:
    """Consecutive slices of at most ``size`` items."""
    if size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {size!r}.")
    for start in range(0, len(items), size):
        yield items[start : start + size]


@torch.no_grad()
def forward_last_token_heads(
    loaded: LoadedModel, prompts: Sequence[Prompt], *, instruction: str | None
) -> torch.Tensor:
    """Every head's activation at each prompt's last token, float32 ``(B, L, H, D)``."""
    inputs = loaded.adapter.build_batch_inputs(loaded.processor, prompts, instruction=instruction)
    inputs = inputs.to(loaded.model.device)
    with capture_last_token_heads(loaded.model, loaded.adapter) as capture:
        loaded.model(**inputs)
    return capture.activations()


def select_heads(activations: torch.Tensor, heads: HeadSet) -> np.ndarray:
    """Rows of ``heads`` from ``(B, L, H, D)`` activations, as float64 ``(B, n, D)``."""
    index = heads.to_array()
    return activations[:, index[:, 0], index[:, 1]].to(torch.float64).numpy()


def extract_clipped_sum(
    loaded: LoadedModel,
    chunks: Sequence[Chunk],
    *,
    heads: HeadSet,
    clip_norm: float,
    batch_size: int = 4,
    instruction: str | None = None,
    progress: bool = True,
) -> ClippedSum:
    """Run every chunk's K-shot prompt once, clip its in-scope heads per layer, sum them.

    Each chunk is clipped on its own before the sum, so one chunk moves the sum by at most
    ``clip_norm`` per layer (the sensitivity the Gaussian mechanism is calibrated to).
    """
    row_layers = heads.row_layers()
    total = np.zeros((len(heads), loaded.adapter.head_shape(loaded.model).head_dim))
    with ExitStack() as stack:
        bar = stack.enter_context(
            tqdm(total=len(chunks), desc="extract", unit="chunk", disable=not progress)
        )
        for batch in batched(chunks, batch_size):
            prompts = [chunk_prompt(chunk) for chunk in batch]
            acts = forward_last_token_heads(loaded, prompts, instruction=instruction)
            for chunk_heads in select_heads(acts, heads):
                total += clip_per_layer(chunk_heads, row_layers=row_layers, clip_norm=clip_norm)
            bar.update(len(batch))
    return ClippedSum(heads, total, len(chunks))
