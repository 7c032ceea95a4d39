"""Per-chunk head scores for private selection: each chunk votes for its top-r heads.

A chunk's vote vector has one entry per (layer, head) slot of the model, 1 for its r best
heads and 0 elsewhere, so it lies in [0, 1] per head: replacing one chunk moves any head's
summed score by at most 1 (Δ∞ = 1, the sensitivity the Gumbel top-k is calibrated to). A
chunk votes only among the heads the model carries (``HeadShape.layout().candidates()``): the
slots of a hybrid's headless layers never get a vote. Two ways to rank:

* ``shift`` — ‖z_h(K-shot prompt) − z_h(zero-shot query)‖: heads whose last-token output the
  demonstrations change most (two forward passes a chunk).
* ``attribution`` — attribution patching (Nanda 2023; Syed et al. 2023): the first-order gain
  in log p(first answer token) of the zero-shot query when head h is overwritten with a
  reference value, (ref_h − z_h)·∂log p/∂z_h. One forward and one backward pass a chunk. The
  reference is the chunk's own K-shot activation (select-first) or the released noisy vector
  (release-first, where selection happens after the Gaussian release).

As in extraction (``client.activations.extraction``), no chunk's prompt can move another's scores
(``shift`` runs in its fixed-shape batches, ``attribution`` one chunk a pass), and a chunk
that fails (an image that no longer decodes, a pass that raises, non-finite scores) casts
zero votes and still counts in m: the fixed public fallback, logged locally with the count.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from client.activations.chunking import Chunk
from client.activations.extraction import (
    chunk_prompt,
    forward_last_token_heads,
    log_replaced_chunks,
    zero_shot_prompt,
)
from client.activations.fixed_shape import fixed_shape_heads
from client.activations.hooks import registered_pre_hooks
from client.models import HeadShape, LoadedModel, Prompt
from dpmtv_common.aliases import Float64Array
from dpmtv_common.errors import ConfigError, DataError, ModelError

_log = logging.getLogger(__name__)

__all__ = [
    "HeadVotes",
    "ScoreMethod",
    "answer_token_ids",
    "attribution_scores",
    "check_answer_vocabulary",
    "chunk_head_votes",
    "chunk_votes",
    "last_token_attribution",
    "shift_scores",
    "top_r_votes",
    "votes_among",
]


class ScoreMethod(StrEnum):
    """How a chunk ranks heads before voting for its top r."""

    SHIFT = "shift"
    ATTRIBUTION = "attribution"


@dataclass(frozen=True)
class HeadVotes:
    """Summed votes: ``total[l * H + h]`` counts the chunks that voted for head (l, h).

    Attributes:
        total: float64, shape ``(L * H,)``.
        num_chunks: m, every chunk counted (failed ones included).
        num_replaced: Chunks that failed and cast zero votes (local bookkeeping only).
    """

    total: Float64Array
    num_chunks: int
    num_replaced: int = 0


def top_r_votes(scores: np.ndarray, top_r: int) -> Float64Array:
    """1.0 for the ``top_r`` largest entries of each row of ``scores`` (B, n), else 0.0."""
    if not 1 <= top_r <= scores.shape[1]:
        raise ConfigError(f"top_r must lie in [1, {scores.shape[1]}], got {top_r!r}.")
    votes = np.zeros(scores.shape, dtype=np.float64)
    best = np.argsort(-scores, axis=1, kind="stable")[:, :top_r]
    np.put_along_axis(votes, best, 1.0, axis=1)
    return votes


def votes_among(scores: np.ndarray, candidates: Sequence[int], top_r: int) -> Float64Array:
    """Top-r votes ``(B, n)`` of each row of ``scores`` ``(B, n)``, cast among ``candidates`` only.

    The slots outside ``candidates`` (a hybrid's headless layers) never get a vote.
    """
    votes = np.zeros(scores.shape, dtype=np.float64)
    votes[:, candidates] = top_r_votes(scores[:, candidates], top_r)
    return votes


def attribution_scores(
    activations: torch.Tensor, gradients: torch.Tensor, target: torch.Tensor
) -> np.ndarray:
    """First-order gains ``(B, L * H)`` of overwriting each head with ``target``.

    ``(target_h − z_h)·∂log p/∂z_h`` summed over the head's dims, for zero-shot activations z
    and gradients ``(B, L, H, D)`` from :func:`last_token_attribution`.
    """
    scores = ((target - activations) * gradients).sum(dim=-1)
    return np.asarray(scores.reshape(len(activations), -1).to(torch.float64).numpy())


def answer_token_ids(loaded: LoadedModel, answers: Sequence[str]) -> torch.Tensor:
    """The first token of each answer, as MTV scores its first answer token."""
    tokenizer = loaded.processor.tokenizer
    ids = []
    for answer in answers:
        encoded = tokenizer(answer, add_special_tokens=False)["input_ids"]
        if not encoded:
            raise ConfigError(f"answer must tokenize to at least one token, got {answer!r}.")
        ids.append(int(encoded[0]))
    return torch.tensor(ids)


def check_answer_vocabulary(loaded: LoadedModel, answers: Sequence[str]) -> float:
    """Refuse answers the model cannot read; return the share whose first token is unknown.

    Head scores and votes read the probability of each query's first answer token. An answer
    that tokenizes to the unknown token would make selection score p(<unk>) for every task:
    all of them unknown is refused (nothing useful can be released), some is logged.

    Raises:
        DataError: Every answer's first token is the unknown token.
    """
    unknown_id = loaded.processor.tokenizer.unk_token_id
    if unknown_id is None or not answers:
        return 0.0
    first = answer_token_ids(loaded, answers)
    share = float((first == unknown_id).float().mean())
    if share == 1.0:
        raise DataError(
            f"answers must be in the model's vocabulary, got all {len(answers)} answers starting "
            "with the unknown token: head scores would measure p(<unk>). Check the labels against "
            "the model with 'dpmtv-site data check DIR --model M'."
        )
    if share > 0:
        _log.warning(
            "%.0f%% of answers start with the unknown token: their chunks vote for p(<unk>) "
            "('dpmtv-site data check' lists them)",
            100 * share,
        )
    return share


@contextmanager
def _frozen_parameters(model: nn.Module) -> Iterator[None]:
    """Gradients flow to activations only; parameters keep their flags afterwards."""
    flags = [p.requires_grad for p in model.parameters()]
    try:
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        yield
    finally:
        for parameter, flag in zip(model.parameters(), flags, strict=True):
            parameter.requires_grad_(flag)


def last_token_attribution(
    loaded: LoadedModel,
    prompts: Sequence[Prompt],
    answers: Sequence[str],
    *,
    instruction: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Last-token head activations and ∂ log p(first answer token)/∂ activation.

    Returns:
        ``(activations, gradients)``, both float32 ``(B, L, H, D)``.
    """
    model, adapter = loaded.model, loaded.adapter
    shape = adapter.head_shape(model)
    projections = adapter.projections_by_layer(model)  # the layers that carry heads
    inputs = adapter.build_batch_inputs(loaded.processor, prompts, instruction=instruction)
    inputs = inputs.to(model.device)
    offsets: list[torch.Tensor] = []
    values: list[torch.Tensor] = []

    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0]
        offset = torch.zeros_like(hidden[:, -1], requires_grad=True)
        offsets.append(offset)
        values.append(hidden[:, -1].detach())
        patched = torch.cat([hidden[:, :-1], (hidden[:, -1] + offset).unsqueeze(1)], dim=1)
        return (patched, *args[1:])

    targets = answer_token_ids(loaded, answers).to(model.device)
    with _frozen_parameters(model), torch.enable_grad():
        with registered_pre_hooks((p, hook) for p in projections.values()):
            logits = model(**inputs).logits[:, -1].float()
        logits.log_softmax(-1).gather(1, targets[:, None]).sum().backward()
    if len(offsets) != len(projections) or any(o.grad is None for o in offsets):
        raise ModelError(
            "attribution must see one gradient per layer that carries heads; the model "
            "skipped some."
        )
    grads = [o.grad for o in offsets if o.grad is not None]
    return _dense_heads(values, shape), _dense_heads(grads, shape)


def _dense_heads(per_layer: Sequence[torch.Tensor], shape: HeadShape) -> torch.Tensor:
    """``(B, H * D)`` per carried layer -> float32 ``(B, L, H, D)``, zeros in headless layers.

    The same layout the capture hooks record, so scores index heads by decoder layer.
    """
    batch = per_layer[0].shape[0]
    stacked = torch.stack(list(per_layer), dim=1).float().cpu()
    stacked = stacked.reshape(batch, len(per_layer), shape.num_heads, shape.head_dim)
    dense = torch.zeros(batch, shape.num_layers, shape.num_heads, shape.head_dim)
    dense[:, list(shape.head_layers)] = stacked
    return dense


def _chunk_scores(
    loaded: LoadedModel,
    batch: Sequence[Chunk],
    method: ScoreMethod,
    reference: torch.Tensor | None,
    instruction: str | None,
) -> np.ndarray:
    """Scores ``(B, L * H)`` of the heads for each chunk of ``batch``."""
    zero_shot = [zero_shot_prompt(chunk.query) for chunk in batch]
    if method is ScoreMethod.SHIFT or reference is None:
        shots = forward_last_token_heads(
            loaded, [chunk_prompt(c) for c in batch], instruction=instruction
        )
    if method is ScoreMethod.SHIFT:
        plain = forward_last_token_heads(loaded, zero_shot, instruction=instruction)
        scores = (shots - plain).norm(dim=-1)
    else:
        answers = [chunk.query.answer for chunk in batch]
        acts, grads = last_token_attribution(loaded, zero_shot, answers, instruction=instruction)
        target = shots if reference is None else reference.expand_as(acts)
        return attribution_scores(acts, grads, target)
    return np.asarray(scores.reshape(len(batch), -1).to(torch.float64).numpy())


def _checked_reference(loaded: LoadedModel, reference: np.ndarray | None) -> torch.Tensor | None:
    if reference is None:
        return None
    shape = loaded.adapter.head_shape(loaded.model)
    expected = (shape.num_layers, shape.num_heads, shape.head_dim)
    ref = torch.as_tensor(np.asarray(reference), dtype=torch.float32)
    if tuple(ref.shape) != expected or not torch.isfinite(ref).all():
        raise ConfigError(
            f"reference must be finite with shape (L, H, D) = {expected}, "
            f"got shape {tuple(ref.shape)}."
        )
    return ref


def _shift_scores(
    loaded: LoadedModel, chunks: Sequence[Chunk], batch_size: int, instruction: str | None
) -> Iterator[np.ndarray | Exception]:
    """Each chunk's shift scores ``(L * H,)`` from fixed-shape batches, or its failure."""
    shots = fixed_shape_heads(
        loaded,
        [functools.partial(chunk_prompt, c) for c in chunks],
        batch_size=batch_size,
        instruction=instruction,
    )
    plain = fixed_shape_heads(
        loaded,
        [functools.partial(zero_shot_prompt, c.query) for c in chunks],
        batch_size=batch_size,
        instruction=instruction,
    )
    for with_shots, zero_shot in zip(shots, plain, strict=True):
        if isinstance(with_shots, Exception):
            yield with_shots
        elif isinstance(zero_shot, Exception):
            yield zero_shot
        else:
            yield (with_shots - zero_shot).norm(dim=-1).reshape(-1).to(torch.float64).numpy()


def shift_scores(
    loaded: LoadedModel,
    chunks: Sequence[Chunk],
    *,
    batch_size: int = 4,
    instruction: str | None = None,
) -> Float64Array:
    """Every chunk's shift scores ``(m, L * H)`` as :func:`chunk_votes` ranks them.

    A failed chunk's row is NaN (``chunk_votes`` gives it zero votes): for callers that vote
    with several r from one set of passes.
    """
    shape = loaded.adapter.head_shape(loaded.model)
    rows = []
    for scores in _shift_scores(loaded, chunks, batch_size, instruction):
        failed = isinstance(scores, Exception) or not np.isfinite(scores).all()
        rows.append(np.full(shape.num_layers * shape.num_heads, np.nan) if failed else scores)
    return np.asarray(rows, dtype=np.float64).reshape(len(chunks), -1)


def _attribution_scores(
    loaded: LoadedModel,
    chunks: Sequence[Chunk],
    reference: torch.Tensor | None,
    instruction: str | None,
) -> Iterator[np.ndarray | Exception]:
    """Each chunk's attribution scores ``(L * H,)``, one unpadded pass a chunk, or its failure."""
    for chunk in chunks:
        try:
            yield _chunk_scores(loaded, [chunk], ScoreMethod.ATTRIBUTION, reference, instruction)[0]
        except Exception as exc:
            yield exc


def chunk_votes(
    loaded: LoadedModel,
    chunks: Sequence[Chunk],
    *,
    top_r: int,
    method: ScoreMethod = ScoreMethod.SHIFT,
    reference: np.ndarray | None = None,
    batch_size: int = 4,
    instruction: str | None = None,
    failures: Counter[str] | None = None,
    among: Sequence[int] | None = None,
) -> Iterator[Float64Array]:
    """Each chunk's top-r vote vector ``(L * H,)``, zeros for a failed one.

    The r votes go to the best of ``among`` (dense slots: a plan's candidate heads,
    ``protocol.vote_slots``), or of every head the model carries when None; every other
    slot, headless ones included, stays 0.

    ``shift`` runs in the fixed-shape batches of ``client.activations.extraction`` (``batch_size``
    chunks a pass); ``attribution`` runs one unpadded forward and backward pass a chunk.
    Either way no chunk's scores depend on another chunk by a single bit. The exception
    type of each failed chunk is counted in ``failures`` when given.

    Raises:
        ConfigError: ``top_r`` outside ``[1, heads voted among]``, a slot of ``among`` the
            model does not carry, a bad ``reference`` or ``batch_size`` < 1 (checked before
            any chunk runs).
    """
    method = ScoreMethod(method)
    layout = loaded.adapter.head_shape(loaded.model).layout()
    num_heads, candidates = layout.dense_size, layout.candidates()
    if among is not None:
        layout.heads_at(among)  # refuses a slot outside the carried heads
        candidates = sorted(int(slot) for slot in among)
    if not 1 <= top_r <= len(candidates):
        raise ConfigError(
            f"top_r must lie in [1, {len(candidates)}] (the heads voted among), got {top_r!r}."
        )
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size!r}.")
    ref = _checked_reference(loaded, reference)
    if method is ScoreMethod.SHIFT:
        scores = _shift_scores(loaded, chunks, batch_size, instruction)
    else:
        scores = _attribution_scores(loaded, chunks, ref, instruction)
    for chunk_scores in scores:
        if not isinstance(chunk_scores, Exception) and not np.isfinite(chunk_scores).all():
            chunk_scores = FloatingPointError("non-finite head scores")
        if isinstance(chunk_scores, Exception):
            # As in extraction: a failure inside one chunk costs that chunk's votes only.
            if failures is not None:
                failures[type(chunk_scores).__name__] += 1
            yield np.zeros(num_heads)
        else:
            yield votes_among(chunk_scores[None], candidates, top_r)[0]


def chunk_head_votes(
    loaded: LoadedModel,
    chunks: Sequence[Chunk],
    *,
    top_r: int,
    method: ScoreMethod = ScoreMethod.SHIFT,
    reference: np.ndarray | None = None,
    batch_size: int = 4,
    instruction: str | None = None,
    progress: bool = True,
    among: Sequence[int] | None = None,
) -> HeadVotes:
    """Sum every chunk's top-r vote among ``among`` (see :func:`chunk_votes`).

    Args:
        among: Dense slots the chunks vote among (a plan's candidate heads); None: every
            head the model carries.
        reference: For ``attribution``: values ``(L, H, D)`` to score against (the released
            noisy vector in release-first order); None scores against each chunk's own
            K-shot activation.
    """
    shape = loaded.adapter.head_shape(loaded.model)
    total = np.zeros(shape.num_layers * shape.num_heads)
    failures: Counter[str] = Counter()
    votes = chunk_votes(
        loaded,
        chunks,
        top_r=top_r,
        method=method,
        reference=reference,
        batch_size=batch_size,
        instruction=instruction,
        failures=failures,
        among=among,
    )
    for vote in tqdm(votes, total=len(chunks), desc="score", unit="chunk", disable=not progress):
        total += vote
    log_replaced_chunks("score", failures, len(chunks))
    return HeadVotes(total, len(chunks), num_replaced=sum(failures.values()))
