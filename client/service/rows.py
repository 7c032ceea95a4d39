"""One query of a batch: its tensors, its release's patch, its own sampling and stop.

How this connects: the HTTP endpoint prepares each request as one :class:`Row`
(:func:`prepare_row`: its prompt tokenised alone) and the batcher
(:mod:`client.service.batching`) runs rows together, either stepped by the continuous batch
(:mod:`client.service.decoding`) or in passes through ``generate()``
(:mod:`client.service.passes`). Both apply this module's per-row controls: :func:`row_patches`
and, in passes, :class:`RowSampler` and :class:`RowLimit`. Each control acts on a row from
that row's own settings only.

**The patch is per row.** Each row carries its own release's heads and values (or none: the
plain model), so one batch may mix releases. A forward pre-hook on every patched layer's
``o_proj`` overwrites, in each patched row, that row's heads at the last position, with
``torch.where`` (elementwise: a row's patch cannot touch another row). Under the
``prompt-last-token`` policy (the default, what was measured) a row is patched in its
prefill only, at its prompt's last token: the generated tokens then attend to the patched
position through the KV cache, and each decoding step itself runs unpatched. Under
``every-call`` (MTV's code) the row is patched at every step's position as well. A
``prompt-last-token`` row whose patch carries an answer's end (learnt from public data,
:mod:`client.inference.answer_end`) takes it at its own first decoding step. This is what
:func:`client.activations.hooks.patch_heads` and ``patch_first_decoding_step`` do to a whole
batch (tested equal).

**Sampling is per row.** A row with ``temperature > 0`` draws its tokens from its own
``torch.Generator``, seeded by the request (or at random): its draws never depend on its
batch-mates' draws. ``temperature == 0`` is greedy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

import torch
from torch import nn
from transformers import LogitsProcessor, StoppingCriteria

from client.activations.hooks import PatchPolicy, registered_pre_hooks
from client.models import LoadedModel, Prompt, check_prompt_length
from client.models.inputs import left_padded_stack, token_keys
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet

__all__ = [
    "Row",
    "RowLimit",
    "RowPatch",
    "RowSampler",
    "RowSink",
    "Step",
    "Ticket",
    "draw_token",
    "eos_ids",
    "needs_patch",
    "prepare_row",
    "row_of",
    "row_generators",
    "row_patches",
    "stack_rows",
    "tensor_inputs",
]

_Inputs = dict[str, torch.Tensor]
_StackKey = tuple[tuple[str, tuple[int, ...]], ...]


class Step(Enum):
    """Which forward call a row is in: its prompt, its first decoding step, or a later one."""

    PROMPT = "prompt"
    FIRST_DECODING = "first decoding step"
    LATER_DECODING = "later decoding step"


@dataclass(frozen=True)
class RowPatch:
    """One release's patch for one row.

    Attributes:
        release_id: The release whose verified artifact gave the values.
        heads: The released heads; row ``i`` of ``values`` belongs to ``heads.heads[i]``.
        values: float32 ``(len(heads), D)``, the released mean activations.
        policy: When the row is patched (see the module docstring).
        answer_end: float32 ``(len(heads), D)`` patched at the row's first decoding step,
            where a one-token answer ends (``client.inference.answer_end``: public data),
            or None; ``prompt-last-token`` only.
    """

    release_id: str
    heads: HeadSet
    values: torch.Tensor
    policy: PatchPolicy = PatchPolicy.PROMPT_LAST_TOKEN
    answer_end: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.answer_end is not None and self.policy is not PatchPolicy.PROMPT_LAST_TOKEN:
            raise ConfigError(
                "an answer's end is patched at the first decoding step, which the policy must "
                f"leave alone: policy must be 'prompt-last-token' with it, got "
                f"{self.policy.value!r}."
            )


@dataclass(frozen=True)
class Row:
    """One prepared query: its unpadded tensors and how to answer it.

    Attributes:
        inputs: The processor's tensors for this prompt alone (a batch of one).
        prompt_tokens: Tokens of the prompt.
        stack_key: The shapes of its tensors that are not per token (the images'): rows
            share a prefill only if equal (per-token tensors are padded to the longest).
        patch: The release's patch, or None for the plain model.
        max_new_tokens: Most tokens to generate.
        temperature: 0 for greedy, else the sampling temperature.
        seed: Seed of this row's own sampling generator.
    """

    inputs: _Inputs
    prompt_tokens: int
    stack_key: _StackKey
    patch: RowPatch | None
    max_new_tokens: int
    temperature: float
    seed: int

    def step_patch(self, step: Step) -> torch.Tensor | None:
        """The values this row's heads take in a forward call of kind ``step``, or None."""
        patch = self.patch
        if patch is None:
            return None
        if step is Step.PROMPT or patch.policy is PatchPolicy.EVERY_CALL:
            return patch.values
        return patch.answer_end if step is Step.FIRST_DECODING else None


class RowSink(Protocol):
    """Receives one row's generation, from the worker thread (so: thread-safe)."""

    def token(self, token_id: int) -> None:
        """One generated token (an end-of-sequence token is never sent)."""

    def finish(self, reason: str) -> None:
        """The row is done: ``stop`` (end of sequence) or ``length`` (``max_new_tokens``)."""

    def fail(self, error: Exception) -> None:
        """The row's generation failed; no more calls follow."""


@dataclass
class Ticket:
    """A queued row, where its tokens go, and when it was queued (``time.monotonic()``)."""

    row: Row
    sink: RowSink
    queued: float = 0.0


def prepare_row(
    loaded: LoadedModel,
    prompt: Prompt,
    *,
    instruction: str | None,
    patch: RowPatch | None,
    max_new_tokens: int,
    temperature: float,
    seed: int,
) -> Row:
    """Tokenise one prompt and check it fits the model before it is queued.

    Raises:
        ConfigError: The prompt plus ``max_new_tokens`` exceeds the model's context, or the
            processor returns something other than tensors.
    """
    built = loaded.adapter.build_batch_inputs(loaded.processor, [prompt], instruction=instruction)
    inputs = tensor_inputs(built)
    if inputs is None:
        raise ConfigError("processor outputs must all be tensors to be batched.")
    return row_of(
        loaded, inputs, patch=patch, max_new_tokens=max_new_tokens, temperature=temperature,
        seed=seed,
    )  # fmt: skip


def tensor_inputs(built: Mapping[str, Any]) -> _Inputs | None:
    """The processor's outputs, if every one is a tensor (rows are stacked tensor by tensor)."""
    inputs = {key: value for key, value in built.items() if isinstance(value, torch.Tensor)}
    return inputs if len(inputs) == len(built) else None


def row_of(
    loaded: LoadedModel,
    inputs: _Inputs,
    *,
    patch: RowPatch | None,
    max_new_tokens: int,
    temperature: float,
    seed: int,
) -> Row:
    """The row of one prompt's own tensors (a batch of one), checked to fit the model.

    Raises:
        ConfigError: The prompt plus ``max_new_tokens`` exceeds the model's context.
    """
    prompt_tokens = int(inputs["input_ids"].shape[1])
    check_prompt_length(loaded.model, prompt_tokens + max_new_tokens)
    return Row(
        inputs=inputs,
        prompt_tokens=prompt_tokens,
        stack_key=_stack_key(inputs),
        patch=patch,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
    )


def _stack_key(inputs: _Inputs) -> _StackKey:
    """The shapes of the tensors that are not per token, which rows must share to stack."""
    tokens = set(token_keys(inputs))
    return tuple(sorted((k, tuple(v.shape)) for k, v in inputs.items() if k not in tokens))


def stack_rows(rows: Sequence[Row], pad_id: int) -> _Inputs:
    """Left-pad each row's per-token tensors to the longest prompt's length; stack them all.

    Rows must share their :attr:`Row.stack_key`. A single row comes back as it was prepared.
    """
    length = max(row.prompt_tokens for row in rows)
    return left_padded_stack([row.inputs for row in rows], length, pad_id)


def eos_ids(loaded: LoadedModel) -> frozenset[int]:
    """The tokens that end an answer: the generation config's, where ``generate()`` stops."""
    eos = getattr(loaded.model.generation_config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


class RowLimit(StoppingCriteria):
    """Each row stops at its own ``max_new_tokens`` (end of sequence is generate()'s own)."""

    def __init__(self, rows: Sequence[Row], prompt_length: int) -> None:
        self._limits = torch.tensor([row.max_new_tokens for row in rows])
        self._prompt_length = prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        """Which rows have made their ``max_new_tokens``, ``(batch,)`` bool."""
        made = input_ids.shape[1] - self._prompt_length
        return (made >= self._limits).to(input_ids.device)


def row_generators(rows: Sequence[Row]) -> dict[int, torch.Generator]:
    """A generator seeded by its row for each sampling row, by position in ``rows``."""
    return {
        index: torch.Generator().manual_seed(row.seed)
        for index, row in enumerate(rows)
        if row.temperature > 0
    }


def draw_token(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    """One token drawn from ``softmax(logits / temperature)`` with the row's own generator."""
    probs = torch.softmax(logits.detach().to(device="cpu", dtype=torch.float32) / temperature, -1)
    return int(torch.multinomial(probs, 1, generator=generator))


class RowSampler(LogitsProcessor):
    """Sampling rows draw from their own generator; greedy rows are left as they are.

    ``generate()`` runs greedy (argmax); a sampling row's scores become one-hot on its draw,
    so the argmax picks the drawn token.
    """

    def __init__(self, rows: Sequence[Row]) -> None:
        self._rows = list(rows)
        self._generators = row_generators(rows)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Scores with each sampling row one-hot on its own draw."""
        if not self._generators:
            return scores
        out = scores.clone()
        for index, generator in self._generators.items():
            token = draw_token(scores[index], self._rows[index].temperature, generator)
            out[index] = float("-inf")
            out[index, token] = 0.0
        return out


def _patch_tables(
    loaded: LoadedModel, rows: Sequence[Row], steps: Sequence[Step]
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``{layer: (mask (batch, H), values (batch, H, D))}`` of the rows patched at ``steps``.

    Rows that take the same values (a release's rows at the same step) are written together:
    a batch of one release costs a table write a layer, not one a row and layer.
    """
    shape = loaded.adapter.head_shape(loaded.model)
    batch = len(rows)
    together: dict[tuple[int, int], tuple[HeadSet, torch.Tensor, list[int]]] = {}
    for index, (row, step) in enumerate(zip(rows, steps, strict=True)):
        vector = row.step_patch(step)
        if row.patch is None or vector is None:
            continue
        heads = row.patch.heads
        together.setdefault((id(heads), id(vector)), (heads, vector, []))[2].append(index)
    tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for heads, vector, indices in together.values():
        pairs = torch.as_tensor(heads.to_array())
        members = torch.tensor(indices)[:, None]
        for layer in heads.layers:
            if layer not in tables:
                mask = torch.zeros(batch, shape.num_heads, dtype=torch.bool)
                values = torch.zeros(batch, shape.num_heads, shape.head_dim)
                tables[layer] = (mask, values)
            in_layer = pairs[:, 0] == layer
            columns = pairs[in_layer, 1][None, :]
            tables[layer][0][members, columns] = True
            tables[layer][1][members, columns] = vector[in_layer]
    return tables


def needs_patch(rows: Sequence[Row], steps: Sequence[Step]) -> bool:
    """Whether any row is patched in a forward call where each row is at its ``steps``."""
    return any(row.step_patch(step) is not None for row, step in zip(rows, steps, strict=True))


@contextmanager
def row_patches(
    loaded: LoadedModel, rows: Sequence[Row], *, steps: Sequence[Step] | None = None
) -> Iterator[None]:
    """Each patched row's heads overwritten at the last position, per its own policy.

    Args:
        loaded: The model.
        rows: The rows of the batch, in batch order.
        steps: Where each row is in the forward calls of the block (:class:`Step`). None:
            every row at the same step, decided per call, for ``generate()``: a call of more
            than one position is the prompt, the next call the first decoding step.
    """
    shape = loaded.adapter.head_shape(loaded.model)
    kinds = [[step] * len(rows) for step in Step] if steps is None else [list(steps)]
    by_kind = [_patch_tables(loaded, rows, kind) for kind in kinds]
    layers = sorted({layer for tables in by_kind for layer in tables})
    calls = {layer: 0 for layer in layers}  # generate()'s calls since its prompt, a layer

    def tables_for(layer: int, positions: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        if steps is not None:
            return by_kind[0]
        calls[layer] = 0 if positions > 1 else calls[layer] + 1
        return by_kind[min(calls[layer], 2)]  # Step order: prompt, first, later

    def make_hook(layer: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            hidden = args[0]
            table = tables_for(layer, hidden.shape[1]).get(layer)
            if table is None:
                return None
            on, values = table
            patched = hidden.clone(memory_format=torch.contiguous_format)
            per_head = patched.view(*hidden.shape[:2], shape.num_heads, shape.head_dim)
            where = on.to(hidden.device)[..., None]
            per_head[:, -1] = torch.where(where, values.to(hidden), per_head[:, -1])
            return (patched, *args[1:])

        return hook

    projections = loaded.adapter.projections_by_layer(loaded.model)
    hooks = [(projections[layer], make_hook(layer)) for layer in layers]
    with registered_pre_hooks(hooks):
        yield
