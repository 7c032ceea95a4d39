"""Per-chunk head activations: forward K-shot prompts, read the last token, clip, sum.

How this connects: a site's chunks (``client.chunking``) become prompts here; the hooks of
``client.hooks`` read every head's ``o_proj`` input at the last prompt token; the heads in
scope are clipped per layer (``dpmtv_common.clip_per_layer``) chunk by chunk and summed in
float64. The clipped sum and the public chunk count are all that leaves this module: they go
into a secure sum (federated) or straight to the Gaussian mechanism (single holder).

Data independence (design §6), the two rules every private sum here follows:

* **Fixed-shape batches.** A batch padded to its longest prompt lets one record's prompt
  length move its batch-mates' activations (measured: ~2e-7 relative in float32, ~2e-3 in
  bfloat16), while the sensitivity argument assumes one record moves one chunk only. Here
  each chunk's prompt is left-padded (attention mask 0) to the next multiple of
  :data:`PAD_MULTIPLE` tokens, chunks share a pass only with chunks of the same padded
  length and the same image-tensor shapes, each chunk sits in the row of its position in
  its window of ``batch_size`` consecutive chunks, and the other rows hold copies. So every
  pass a chunk takes part in has a shape and a row fixed by its own prompt, its (public)
  index and the public batch size, and no kernel reduces across rows: a chunk's
  contribution is bit-identical whoever its batch-mates are (tested in float32 and
  bfloat16 on every tiny architecture). Kept over one chunk a pass because it is faster:
  ms a chunk, 24 chunks of K = 4, all heads, 1 CPU thread of a shared machine, medians of 5:

  ======================  ============  ==============  ================================
  model, dtype            one a pass    fixed shape, 4  padded to longest, 4 (not safe)
  ======================  ============  ==============  ================================
  tiny LLaVA, float32     44.0          30.8            26.2
  tiny LLaVA, bfloat16    35.4          22.2            21.0
  embedded, float32       31.2          18.5            14.3
  embedded, bfloat16      11.9          6.7             6.3
  ======================  ============  ==============  ================================

* **A chunk that fails keeps its place.** When a chunk's images cannot be decoded any more,
  its forward pass raises or its activations are not finite, its contribution is the fixed
  public one, zero, and it still counts in m; the number of such chunks goes to the local log.
  Refusing the whole site instead would make m, and the set of sites, depend on one record.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
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
    "PAD_MULTIPLE",
    "ClippedSum",
    "batched",
    "check_heads_in_model",
    "chunk_contributions",
    "chunk_prompt",
    "extract_clipped_sum",
    "fixed_shape_heads",
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


# ---------------------------------------------------------------- fixed-shape batches

PAD_MULTIPLE = 16
"""Public padding unit: each chunk's prompt is left-padded to the next multiple of this many
tokens, so the length it runs at depends on its own prompt only (16 keeps the waste small
against the speed of batching; measured in the module docstring)."""

_Inputs = dict[str, torch.Tensor]
# (run length, position if the chunk must run alone else -1, other inputs' shapes)
_Signature = tuple[int, int, tuple[tuple[str, tuple[int, ...]], ...]]


def _prompt_inputs(loaded: LoadedModel, prompt: Prompt, instruction: str | None) -> _Inputs:
    """One prompt's unpadded model inputs (batch of one)."""
    built = loaded.adapter.build_batch_inputs(loaded.processor, [prompt], instruction=instruction)
    inputs = {key: value for key, value in built.items() if isinstance(value, torch.Tensor)}
    if len(inputs) != len(built):
        raise ConfigError("processor outputs must all be tensors to be batched.")
    return inputs


def _token_keys(inputs: _Inputs) -> list[str]:
    """The per-token inputs (``(1, seq)``, like ``input_ids``): these get left-padded."""
    length = inputs["input_ids"].shape[1]
    return [k for k, v in inputs.items() if v.ndim == 2 and v.shape == (1, length)]


def _signature(inputs: _Inputs, position: int) -> _Signature:
    """What a chunk's batch-mates must share: its padded length and its other tensors' shapes.

    Both are functions of the chunk's own prompt, so the shape of every forward pass a chunk
    takes part in is fixed by itself and the public batch size. A chunk whose other inputs
    have a dimension as long as its prompt (a per-token tensor we would not know how to pad,
    such as a cross-attention mask) runs alone and unpadded at ``position``: slower, never
    wrong, and still a function of its own prompt only.
    """
    length = inputs["input_ids"].shape[1]
    tokens = set(_token_keys(inputs))
    others = tuple(sorted((k, tuple(v.shape)) for k, v in inputs.items() if k not in tokens))
    if any(length in shape[1:] for _, shape in others):
        return length, position, others
    return -(-length // PAD_MULTIPLE) * PAD_MULTIPLE, -1, others


def _stacked(rows: list[_Inputs], length: int, pad_id: int) -> _Inputs:
    """Left-pad each row's per-token inputs to ``length`` and concatenate every input."""
    tokens = set(_token_keys(rows[0]))
    out: _Inputs = {}
    for key in rows[0]:
        values = [row[key] for row in rows]
        if key in tokens:
            # Masked (attention_mask 0) positions get exactly zero attention weight; the pad
            # id only has to be a valid token.
            fill = pad_id if key == "input_ids" else 0
            values = [
                torch.cat([torch.full((1, length - v.shape[1]), fill, dtype=v.dtype), v], dim=1)
                for v in values
            ]
        out[key] = torch.cat(values, dim=0)
    return out


@torch.no_grad()
def _forward_fixed(
    loaded: LoadedModel, rows: dict[int, _Inputs], length: int, batch_size: int
) -> dict[int, torch.Tensor]:
    """Last-token heads ``(L, H, D)`` of each row, from ONE pass of ``(batch_size, length)``.

    ``rows`` maps a position in the window to a chunk's inputs: each chunk runs in the row
    of its position, and the other rows are filled with a copy of a member (outputs
    discarded). The row matters as much as the shape: a matrix kernel may treat its last,
    partial block of rows differently, so a chunk moved to another row can change bits.
    """
    filler = next(iter(rows.values()))
    filled = [rows.get(position, filler) for position in range(batch_size)]
    pad_id = getattr(loaded.processor.tokenizer, "pad_token_id", None) or 0
    inputs = {k: v.to(loaded.model.device) for k, v in _stacked(filled, length, pad_id).items()}
    with capture_last_token_heads(loaded.model, loaded.adapter) as capture:
        loaded.model(**inputs)
    acts = capture.activations()
    return {position: acts[position] for position in rows}


def _group_heads(
    loaded: LoadedModel, rows: dict[int, _Inputs], length: int, batch_size: int
) -> dict[int, torch.Tensor | Exception]:
    """Each row's activations, or the exception that stops that row alone."""
    try:
        return dict(_forward_fixed(loaded, rows, length, batch_size))
    # A pass that raises names no row: rerun each row alone, in its own row at the same
    # shape, so the rows that work get exactly the bits they would have had.
    except Exception:
        results: dict[int, torch.Tensor | Exception] = {}
        for position, inputs in rows.items():
            try:
                results.update(_forward_fixed(loaded, {position: inputs}, length, batch_size))
            except Exception as exc:
                results[position] = exc
        return results


def _window_heads(
    loaded: LoadedModel,
    window: Sequence[Callable[[], Prompt]],
    batch_size: int,
    instruction: str | None,
) -> list[torch.Tensor | Exception]:
    """Activations ``(L, H, D)`` (or the failure) of each prompt of one window, in order."""
    results: list[torch.Tensor | Exception | None] = [None] * len(window)
    groups: dict[_Signature, dict[int, _Inputs]] = {}
    for position, build in enumerate(window):
        try:
            inputs = _prompt_inputs(loaded, build(), instruction)
            groups.setdefault(_signature(inputs, position), {})[position] = inputs
        except Exception as exc:
            results[position] = exc
    for (length, alone, _), members in groups.items():
        if alone >= 0:
            results[alone] = _group_heads(loaded, {0: members[alone]}, length, 1)[0]
            continue
        for position, output in _group_heads(loaded, members, length, batch_size).items():
            results[position] = output
    return [r if r is not None else RuntimeError("prompt was not run") for r in results]


def fixed_shape_heads(
    loaded: LoadedModel,
    prompts: Sequence[Callable[[], Prompt]],
    *,
    batch_size: int,
    instruction: str | None,
) -> Iterator[torch.Tensor | Exception]:
    """Last-token heads ``(L, H, D)`` of each prompt, in order, in fixed-shape batches.

    ``prompts`` are builders, called inside the batch loop so that a record that fails to
    load (an image that no longer decodes) yields its exception in its place instead of
    raising: what to do with a failed item is the caller's (a chunk's fallback). See the
    module docstring for why a result does not depend on the other prompts by a single bit.

    Raises:
        ConfigError: ``batch_size`` < 1.
    """
    for start in range(0, len(prompts), _positive_batch_size(batch_size)):
        window = prompts[start : start + batch_size]
        yield from _window_heads(loaded, window, batch_size, instruction)


def _positive_batch_size(batch_size: int) -> int:
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size!r}.")
    return batch_size


def _clipped(
    acts: torch.Tensor | Exception, heads: HeadSet, clip_norm: float
) -> Float64Array | Exception:
    if isinstance(acts, Exception):
        return acts
    rows = select_heads(acts.unsqueeze(0), heads)[0]
    if not np.isfinite(rows).all():
        return FloatingPointError("non-finite activations")
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
) -> Iterator[Float64Array]:
    """Each chunk's clipped contribution ``(len(heads), D)``, in chunk order.

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
    builders = [functools.partial(chunk_prompt, chunk) for chunk in chunks]
    for acts in fixed_shape_heads(loaded, builders, batch_size=batch_size, instruction=instruction):
        result = _clipped(acts, heads, clip_norm)
        if isinstance(result, Exception):
            # Whatever goes wrong inside one chunk (a decoder, the processor, the model) is
            # a function of that chunk's records: it must cost that chunk only.
            if failures is not None:
                failures[type(result).__name__] += 1
            yield np.zeros((len(heads), head_dim))
        else:
            yield result


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
    ``clip_norm`` per layer (the sensitivity the Gaussian mechanism is calibrated to); a
    failed chunk adds zeros and still counts in ``num_chunks`` (module docstring).
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
    )
    for contribution in tqdm(
        contributions, total=len(chunks), desc="extract", unit="chunk", disable=not progress
    ):
        total += contribution
    log_replaced_chunks("extract", failures, len(chunks))
    return ClippedSum(heads, total, len(chunks), num_replaced=sum(failures.values()))
