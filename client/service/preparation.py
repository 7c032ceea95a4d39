"""Queries prepared together: one processor call for the requests waiting side by side.

How this connects: the HTTP endpoint hands the batcher (:mod:`client.service.batching`) a
:class:`RowRequest` (the parsed prompt, its images decoded) instead of a prepared row; the
batcher's worker prepares every request waiting in its queue with :func:`prepare_rows` before
it schedules them. Rendering, tokenising and processing images cost the processor far less a
prompt in one call for several prompts than in a call for each (its per-call set-up dominates
a small prompt), and the endpoint's threads no longer contend with the decoding loop for the
interpreter lock while they prepare.

**A row prepared together is the row prepared alone.** Only requests that would tokenise the
same way share a call: the same model (and image-crop cap), the same instruction, and images
of the same sizes and modes in the same order, in a family whose stepped decoding is tested
(``continuous_batching``): every such family processes each image on its own, so equal sizes
give equal image tensors and no padding between images. The batch is then cut back into each
prompt's own tensors: the per-token tensors lose their left padding (the attention mask says
where), every other tensor is cut into equal parts along its first axis. A batch that does not
cut that way (no attention mask, padding not on the left, a first axis that does not divide)
is prepared again one prompt at a time, as is a group whose joint call fails, so one bad
request cannot fail its neighbours. Tested equal, tensor for tensor, to :func:`prepare_row`
for every continuously batched family.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from client.models import LoadedModel, Prompt
from client.models.inputs import token_keys
from client.service.rows import Row, RowPatch, prepare_row, row_of, tensor_inputs

__all__ = ["RowRequest", "prepare_rows"]

_Inputs = dict[str, torch.Tensor]


@dataclass(frozen=True)
class RowRequest:
    """One query not yet tokenised, and how to answer it (the fields of :class:`Row`).

    Attributes:
        loaded: The model whose processor prepares it (the endpoint's copy for the release's
            image-crop cap).
        prompt: The prompt, its images decoded.
        instruction: Put before the prompt, as the release's data had it (None: none).
    """

    loaded: LoadedModel
    prompt: Prompt
    instruction: str | None
    patch: RowPatch | None
    max_new_tokens: int
    temperature: float
    seed: int

    def alone(self) -> Row:
        """This request prepared by itself (:func:`prepare_row`)."""
        return prepare_row(
            self.loaded, self.prompt, instruction=self.instruction, patch=self.patch,
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, seed=self.seed,
        )  # fmt: skip

    def row(self, inputs: _Inputs) -> Row:
        """The row of this request's own tensors, checked to fit the model."""
        return row_of(
            self.loaded, inputs, patch=self.patch, max_new_tokens=self.max_new_tokens,
            temperature=self.temperature, seed=self.seed,
        )  # fmt: skip


def prepare_rows(requests: Sequence[RowRequest]) -> list[Row | Exception]:
    """Each request's row, in order, or the error that refused it (others are unaffected).

    Requests that tokenise alike (module docstring) share one processor call.
    """
    groups: dict[tuple[object, ...], list[int]] = {}
    for index, request in enumerate(requests):
        groups.setdefault(_group_key(request, index), []).append(index)
    results: dict[int, Row | Exception] = {}
    for indices in groups.values():
        results.update(zip(indices, _prepare_group([requests[i] for i in indices]), strict=True))
    return [results[index] for index in range(len(requests))]


def _group_key(request: RowRequest, index: int) -> tuple[object, ...]:
    """Requests of one key tokenise alike; a family not tested that way groups alone."""
    if not request.loaded.adapter.continuous_batching:
        return ("alone", index)
    images = tuple((image.size, image.mode) for image in request.prompt.images)
    return (id(request.loaded), request.instruction, images)


def _prepare_group(group: list[RowRequest]) -> list[Row | Exception]:
    parts = _joint_parts(group) if len(group) > 1 else None
    if parts is None:
        return [_result(request.alone) for request in group]
    return [
        _result(functools.partial(request.row, part))
        for request, part in zip(group, parts, strict=True)
    ]


def _joint_parts(group: list[RowRequest]) -> list[_Inputs] | None:
    """Each prompt's own tensors from one processor call for the group, or None."""
    first = group[0]
    try:
        built = first.loaded.adapter.build_batch_inputs(
            first.loaded.processor, [r.prompt for r in group], instruction=first.instruction
        )
    except Exception:  # each request is then prepared alone: its own error is its own
        return None
    inputs = tensor_inputs(built)
    return None if inputs is None else split_batch(inputs, len(group))


def split_batch(inputs: _Inputs, count: int) -> list[_Inputs] | None:
    """A left-padded batch of ``count`` prompts cut back into each prompt's own tensors.

    None where it does not cut that way (module docstring).
    """
    ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    if mask is None or ids.ndim != 2 or ids.shape[0] != count or mask.shape != ids.shape:
        return None
    lengths = [int(n) for n in mask.sum(dim=1)]
    width = ids.shape[1]
    for row, length in zip(mask, lengths, strict=True):  # left padding: zeros, then ones
        if length == 0 or not bool(row[width - length :].all()):
            return None
    tokens = set(token_keys(inputs))
    if any(inputs[key].shape[0] % count for key in inputs.keys() - tokens):
        return None
    parts: list[_Inputs] = []
    for index, length in enumerate(lengths):
        part = {}
        for key, value in inputs.items():
            if key in tokens:
                part[key] = value[index : index + 1, width - length :].clone()
            else:
                size = value.shape[0] // count
                part[key] = value[index * size : (index + 1) * size].clone()
        parts.append(part)
    return parts


def _result(prepare: Callable[[], Row]) -> Row | Exception:
    try:
        row = prepare()
    except Exception as error:  # the caller hands each request its own error
        return error
    return row
