"""Fixed-shape batched forward passes: a chunk's activations never depend on its batch-mates.

A batch padded to its longest prompt lets one record's prompt
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

How this connects: ``client.activations.extraction`` (private sums) and
``client.activations.scoring`` (public head scores) call :func:`fixed_shape_heads` with prompt
builders; it yields each prompt's last-token heads ``(L, H, D)`` (read by
``client.activations.hooks``), or the exception that stopped that prompt alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from client.activations.hooks import capture_last_token_heads
from client.models import LoadedModel, Prompt
from client.models.inputs import left_padded_stack, token_keys
from dpmtv_common.errors import ConfigError

__all__ = ["PAD_MULTIPLE", "fixed_shape_heads", "positive_batch_size"]


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


def _signature(inputs: _Inputs, position: int) -> _Signature:
    """What a chunk's batch-mates must share: its padded length and its other tensors' shapes.

    Both are functions of the chunk's own prompt, so the shape of every forward pass a chunk
    takes part in is fixed by itself and the public batch size. A chunk whose other inputs
    have a dimension as long as its prompt (a per-token tensor we would not know how to pad,
    such as a cross-attention mask) runs alone and unpadded at ``position``: slower, never
    wrong, and still a function of its own prompt only.
    """
    length = inputs["input_ids"].shape[1]
    tokens = set(token_keys(inputs))
    others = tuple(sorted((k, tuple(v.shape)) for k, v in inputs.items() if k not in tokens))
    if any(length in shape[1:] for _, shape in others):
        return length, position, others
    return -(-length // PAD_MULTIPLE) * PAD_MULTIPLE, -1, others


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
    inputs = {
        k: v.to(loaded.model.device) for k, v in left_padded_stack(filled, length, pad_id).items()
    }
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
    for start in range(0, len(prompts), positive_batch_size(batch_size)):
        window = prompts[start : start + batch_size]
        yield from _window_heads(loaded, window, batch_size, instruction)


def positive_batch_size(batch_size: int) -> int:
    """``batch_size`` if it is at least 1.

    Raises:
        ConfigError: ``batch_size`` < 1.
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size!r}.")
    return batch_size
