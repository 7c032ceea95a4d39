"""A clip norm C chosen on PUBLIC data by what the clipped mean still does to the model.

Why not simply the median of the public per-layer norms: clipping shrinks every chunk's
vector whose norm exceeds C, so the clipped mean is a biased, shorter vector. On a model
whose in-context behaviour lives in a few large heads (a pretrained decoder) the clipped mean
at the median no longer steers the model at all, even with no noise; on a small model trained
for the task it does. No single quantile is right for both, so the choice is made the way it
is judged: for C = f x (public median) with f = 1, 2, 4, 8, 16, the noise-free clipped mean
of the public chunks is patched into the chosen heads and scored on public zero-shot queries
(first answer token). The suggestion is the smallest C whose clipped mean keeps
``keep`` (default 90 %) of the unclipped mean's gain over zero-shot: the smallest, because
the Gaussian noise of a release scales with C (sensitivity 2·C·√L under replace-one).

Everything here reads public data only; it costs no privacy budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from client.data import Record
from client.evaluation.first_token import QuerySet
from client.extraction import zero_shot_prompt
from client.models import LoadedModel
from client.public_selection import suggested_clip_norm
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.mechanisms import clip_per_layer

__all__ = ["CLIP_FACTORS", "ClipCandidate", "ClipChoice", "choose_clip_norm", "clipped_mean"]

CLIP_FACTORS = (1.0, 2.0, 4.0, 8.0, 16.0)


@dataclass(frozen=True)
class ClipCandidate:
    """One tried C: its factor over the public median and the public accuracy it kept."""

    factor: float
    clip_norm: float
    accuracy: float


@dataclass(frozen=True)
class ClipChoice:
    """The suggested C, and the evidence it was chosen on.

    Attributes:
        clip_norm: The suggestion.
        median: The public median per-layer norm (factor 1).
        zero_shot: Public accuracy with no patch.
        unclipped: Public accuracy of the unclipped public mean.
        candidates: Every C tried, smallest first.
        kept_gain: Whether the suggestion keeps the asked share of the unclipped gain (False:
            none did, and the largest C tried is suggested).
    """

    clip_norm: float
    median: float
    zero_shot: float
    unclipped: float
    candidates: tuple[ClipCandidate, ...]
    kept_gain: bool

    def as_record(self) -> dict[str, object]:
        """JSON-ready fields for the heads file."""
        return {
            "clip_norm_rule": "smallest f x median keeping the public gain of the unclipped mean",
            "clip_norm_median": self.median,
            "clip_norm_public_accuracy": {
                "zero_shot": self.zero_shot,
                "unclipped": self.unclipped,
                **{f"{c.factor:g}x": c.accuracy for c in self.candidates},
            },
        }


def clipped_mean(activations: torch.Tensor, heads: HeadSet, clip_norm: float) -> np.ndarray:
    """Mean over chunks of each chunk's rows on ``heads``, clipped per layer at ``clip_norm``.

    The same clipping a release applies (``dpmtv_common.clip_per_layer``), without noise.
    """
    index = heads.to_array()
    rows = activations[:, index[:, 0], index[:, 1]].double().numpy()  # (m, n, D)
    layers = heads.row_layers()
    clipped = [clip_per_layer(chunk, row_layers=layers, clip_norm=clip_norm) for chunk in rows]
    return np.asarray(np.mean(clipped, axis=0), dtype=np.float64)


def choose_clip_norm(
    loaded: LoadedModel,
    activations: torch.Tensor,
    heads: HeadSet,
    queries: Sequence[Record],
    *,
    instruction: str | None = None,
    factors: Sequence[float] = CLIP_FACTORS,
    keep: float = 0.9,
) -> ClipChoice:
    """The smallest tried C keeping ``keep`` of the unclipped public mean's gain.

    Args:
        activations: Public chunks' last-token activations, ``(m, L, H, D)``.
        heads: The heads the release will carry.
        queries: Public records (``client.data.Record``) scored zero-shot, first token.
        factors: Multiples of the public median to try, tried smallest first.
        keep: Share of (unclipped − zero-shot) accuracy the clipped mean must keep.

    Raises:
        ConfigError: no query, no factor, or ``keep`` outside (0, 1].
    """
    if not queries:
        raise ConfigError("queries must hold at least one public query, got none.")
    if not factors or min(factors) <= 0:
        raise ConfigError(f"factors must be positive and not empty, got {list(factors)!r}.")
    if not 0 < keep <= 1:
        raise ConfigError(f"keep must lie in (0, 1], got {keep!r}.")
    prompts = [zero_shot_prompt(record) for record in queries]
    answers = [record.answer for record in queries]
    scored = QuerySet.build(loaded, prompts, answers, size=8, instruction=instruction)
    median = suggested_clip_norm(activations, heads)
    index = heads.to_array()
    unclipped_values = activations[:, index[:, 0], index[:, 1]].double().mean(0).numpy()
    zero = scored.accuracy(loaded)
    unclipped = scored.accuracy(loaded, (heads, unclipped_values))
    # No gain to keep (the unclipped mean does no better than zero-shot): every C keeps it,
    # so the smallest is suggested; the record shows why.
    target = zero + keep * (unclipped - zero)
    tried: list[ClipCandidate] = []
    for factor in sorted(factors):
        clip = factor * median
        accuracy = scored.accuracy(loaded, (heads, clipped_mean(activations, heads, clip)))
        tried.append(ClipCandidate(factor, clip, accuracy))
        if accuracy >= target:
            return ClipChoice(clip, median, zero, unclipped, tuple(tried), kept_gain=True)
    return ClipChoice(tried[-1].clip_norm, median, zero, unclipped, tuple(tried), kept_gain=False)
