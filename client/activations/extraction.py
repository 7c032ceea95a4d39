"""Per-chunk head activations: forward K-shot prompts, read the last token, clip, sum.

How this connects: a site's chunks (``client.activations.chunking``) become prompts here; the hooks
of ``client.activations.hooks`` read every head's ``o_proj`` input at the last prompt token; the
heads in scope are clipped per layer (``dpmtv_common.clip_per_layer``) chunk by chunk and summed in
float64. The clipped sum and the public chunk count are all that leaves this module: they go
into a secure sum (federated) or straight to the Gaussian mechanism (single holder).

Data independence (design §6), the two rules every private sum here follows:

* **Fixed-shape batches** (:mod:`client.activations.fixed_shape`): a chunk runs in a pass whose
  shape and row are fixed by its own prompt, its public index and the public batch size, so its
  contribution is bit-identical whoever its batch-mates are.
* **A chunk that fails keeps its place.** When a chunk's images cannot be decoded any more,
  its forward pass raises or its activations are not finite, its contribution is the fixed
  public one, zero, and it still counts in m; the number of such chunks goes to the local log.
  Refusing the whole site instead would make m, and the set of sites, depend on one record.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from client.activations.chunking import Chunk
from client.activations.fixed_shape import fixed_shape_heads
from client.activations.hooks import capture_last_token_heads
from client.data.records import Record
from client.models import Example, LoadedModel, Prompt
from dpmtv_common.aliases import Float64Array
from dpmtv_common.centre import ActivationCentre
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.mechanisms import clip_per_layer

__all__ = [
    "ClippedSum",
    "batched",
    "check_centre_shape",
    "check_heads_in_model",
    "chunk_contributions",
    "chunk_prompt",
    "extract_clipped_sum",
    "forward_last_token_heads",
    "log_replaced_chunks",
    "record_example",
    "select_heads",
    "zero_shot_prompt",
]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClippedSum:
    """A site's contribution: the sum of per-layer-clipped chunk activations.

    Attributes:
        heads: The heads in scope; row ``i`` of ``total`` belongs to ``heads.heads[i]``.
        total: float64, shape ``(len(heads), D)``.
        num_chunks: m, how many chunks were summed (failed ones included).
        num_replaced: Chunks that failed and contributed zeros (local bookkeeping only).
    """

    heads: HeadSet
    total: Float64Array
    num_chunks: int
    num_replaced: int = 0


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
    """Consecutive slices of at most ``size`` items (public data only: see module docstring)."""
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


def check_heads_in_model(loaded: LoadedModel, heads: HeadSet) -> None:
    """Raise ConfigError unless ``heads`` is non-empty and lies within the model."""
    shape = loaded.adapter.head_shape(loaded.model)
    if len(heads) == 0:
        raise ConfigError("heads must hold at least one head, got an empty HeadSet.")
    outside = [
        (layer, head)
        for layer, head in heads.heads
        if layer >= shape.num_layers or head >= shape.num_heads
    ]
    if outside:
        raise ConfigError(
            f"heads must lie within {shape.num_layers} layers x {shape.num_heads} heads, "
            f"got {outside[0]!r}."
        )


def log_replaced_chunks(stage: str, failures: Counter[str], num_chunks: int) -> None:
    """Warn in the local log how many chunks failed and contributed the public fallback.

    When every chunk failed the cause is almost surely the setup (model, processor), not
    the data: that is logged as an error for the admin, while the contribution itself
    stays the public fallback, so the site's participation never depends on its records.
    """
    if not failures:
        return
    failed = sum(failures.values())
    kinds = ", ".join(f"{kind} x{count}" for kind, count in sorted(failures.items()))
    level = logging.ERROR if failed == num_chunks else logging.WARNING
    _log.log(
        level,
        "%s: %d of %d chunks failed (%s); each contributes zeros and still counts in m%s",
        stage,
        failed,
        num_chunks,
        kinds,
        "; every chunk failed: check the model and the data (dpmtv-site data check)"
        if failed == num_chunks
        else "",
    )


def _clipped(
    acts: torch.Tensor | Exception,
    heads: HeadSet,
    clip_norm: float,
    centre_rows: Float64Array | None,
) -> Float64Array | Exception:
    if isinstance(acts, Exception):
        return acts
    rows = select_heads(acts.unsqueeze(0), heads)[0]
    if not np.isfinite(rows).all():
        return FloatingPointError("non-finite activations")
    if centre_rows is not None:  # a centred plan clips the shift from the public centre
        rows = rows - centre_rows
    return clip_per_layer(rows, row_layers=heads.row_layers(), clip_norm=clip_norm)


def chunk_contributions(
    loaded: LoadedModel,
    chunks: Sequence[Chunk],
    *,
    heads: HeadSet,
    clip_norm: float,
    instruction: str | None = None,
    batch_size: int = 4,
    failures: Counter[str] | None = None,
    centre: ActivationCentre | None = None,
) -> Iterator[Float64Array]:
    """Each chunk's clipped contribution ``(len(heads), D)``, in chunk order.

    With a ``centre`` (a centred plan), a chunk contributes ``clip(a - r)``: the same bound C
    per layer, so the same sensitivity (``dpmtv_common.centre``); a failed chunk's zeros then
    stand for "exactly the centre".

    Chunks run in fixed-shape batches (module docstring): ``batch_size`` consecutive chunks
    at a time, grouped by :func:`_signature`, each group one pass of shape
    ``(batch_size, padded length)``. A chunk that fails yields zeros; the exception's type
    is counted in ``failures`` when given. Configuration is checked before any chunk runs,
    so a wrong head set or clip norm is an error, never m silent zeros.

    Raises:
        ConfigError: ``heads`` outside the model, ``clip_norm`` not finite and positive, or
            ``batch_size`` < 1.
    """
    check_heads_in_model(loaded, heads)
    head_dim = loaded.adapter.head_shape(loaded.model).head_dim
    clip_per_layer(
        np.zeros((len(heads), head_dim)), row_layers=heads.row_layers(), clip_norm=clip_norm
    )
    centre_rows = None if centre is None else _centre_rows(loaded, centre, heads)
    builders = [functools.partial(chunk_prompt, chunk) for chunk in chunks]
    for acts in fixed_shape_heads(loaded, builders, batch_size=batch_size, instruction=instruction):
        result = _clipped(acts, heads, clip_norm, centre_rows)
        if isinstance(result, Exception):
            # Whatever goes wrong inside one chunk (a decoder, the processor, the model) is
            # a function of that chunk's records: it must cost that chunk only.
            if failures is not None:
                failures[type(result).__name__] += 1
            yield np.zeros((len(heads), head_dim))
        else:
            yield result


def check_centre_shape(loaded: LoadedModel, centre: ActivationCentre) -> None:
    """Refuse a centre made for another model shape than ``loaded``'s ``(L, H, D)``.

    Raises:
        ConfigError: The shapes differ.
    """
    shape = loaded.adapter.head_shape(loaded.model)
    expected = (shape.num_layers, shape.num_heads, shape.head_dim)
    if centre.shape != expected:
        raise ConfigError(
            f"centre must have the model's shape (layers, heads, head_dim) = {expected}, got "
            f"{centre.shape}."
        )


def _centre_rows(loaded: LoadedModel, centre: ActivationCentre, heads: HeadSet) -> Float64Array:
    check_centre_shape(loaded, centre)
    return centre.rows(heads)


def extract_clipped_sum(
    loaded: LoadedModel,
    chunks: Sequence[Chunk],
    *,
    heads: HeadSet,
    clip_norm: float,
    batch_size: int = 4,
    instruction: str | None = None,
    progress: bool = True,
    centre: ActivationCentre | None = None,
) -> ClippedSum:
    """Run every chunk's K-shot prompt once, clip its in-scope heads per layer, sum them.

    Each chunk is clipped on its own before the sum, so one chunk moves the sum by at most
    ``clip_norm`` per layer (the sensitivity the Gaussian mechanism is calibrated to); a
    failed chunk adds zeros and still counts in ``num_chunks`` (module docstring). A centred
    plan's ``centre`` is subtracted from each chunk before its clip.
    """
    head_dim = loaded.adapter.head_shape(loaded.model).head_dim
    total = np.zeros((len(heads), head_dim))
    failures: Counter[str] = Counter()
    contributions = chunk_contributions(
        loaded,
        chunks,
        heads=heads,
        clip_norm=clip_norm,
        instruction=instruction,
        batch_size=batch_size,
        failures=failures,
        centre=centre,
    )
    for contribution in tqdm(
        contributions, total=len(chunks), desc="extract", unit="chunk", disable=not progress
    ):
        total += contribution
    log_replaced_chunks("extract", failures, len(chunks))
    return ClippedSum(heads, total, len(chunks), num_replaced=sum(failures.values()))
