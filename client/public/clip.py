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

That rule sees only the clipping's bias, not the noise, so it picks the same C for 60 chunks
as for 6,000. When the release's size and budget are known (a :class:`PlannedNoise`: the
plan's noise multiplier z, the chunk count m and the layers in scope, all public), each C is
instead scored as the release would come out: the clipped public mean plus Gaussian noise of
the planned std 2·z·C·√L / m per coordinate, averaged over a few draws, and the smallest C
keeping ``keep`` of the best one's gain over zero-shot is suggested. Few chunks then favour a
small C (less noise), many chunks a large one (less bias); taking the smallest near-best
rather than the best keeps a noisy estimate from drifting to a large C when all score alike.

Everything here reads public data and public plan numbers only; it costs no privacy budget.
The simulated noise is drawn from ``dpmtv_common.privacy.noise`` and never leaves the site.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from client.activations.extraction import zero_shot_prompt
from client.data.records import Record
from client.evaluation.first_token import QuerySet
from client.models import LoadedModel
from client.public.selection import suggested_clip_norm
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.mechanisms import clip_per_layer
from dpmtv_common.privacy.noise import NoiseSource, secure_noise
from protocol import ReleasePlan, plan_noise_multiplier

__all__ = [
    "CLIP_FACTORS",
    "ClipCandidate",
    "ClipChoice",
    "PlannedNoise",
    "choose_clip_norm",
    "clipped_mean",
]

CLIP_FACTORS = (1.0, 2.0, 4.0, 8.0, 16.0)


@dataclass(frozen=True)
class PlannedNoise:
    """The Gaussian a planned release adds to its mean, from public plan numbers only.

    The release adds N(0, σ²) to every coordinate of the clipped sum with σ = z·Δ₂ and
    Δ₂ = 2·C·√L (replace-one, per-layer clipping, L layers in scope), then divides by m: the
    mean carries std 2·z·C·√L / m. ``draws`` simulated releases score each C.

    Attributes:
        noise_multiplier: z of the plan (``protocol.predict_signal_to_noise`` reports it).
        num_chunks: m, the chunks the release will sum.
        layers_in_scope: L, the layers of the heads the Gaussian covers.
        draws: Simulated releases a tried C is scored on.
    """

    noise_multiplier: float
    num_chunks: int
    layers_in_scope: int
    draws: int = 8

    def __post_init__(self) -> None:
        if not self.noise_multiplier > 0 or self.num_chunks < 1:
            raise ConfigError(
                "planned noise needs noise_multiplier > 0 and num_chunks >= 1, got "
                f"{self.noise_multiplier!r} and {self.num_chunks!r}."
            )
        if self.layers_in_scope < 1 or self.draws < 1:
            raise ConfigError(
                "planned noise needs layers_in_scope >= 1 and draws >= 1, got "
                f"{self.layers_in_scope!r} and {self.draws!r}."
            )

    @classmethod
    def for_plan(
        cls, plan: ReleasePlan, *, num_chunks: int, layers_in_scope: int, draws: int = 8
    ) -> PlannedNoise:
        """The noise ``plan`` adds to a release of ``num_chunks`` over ``layers_in_scope``."""
        return cls(plan_noise_multiplier(plan), num_chunks, layers_in_scope, draws)

    def mean_std(self, clip_norm: float) -> float:
        """Std of the noise on each coordinate of the released mean at ``clip_norm``."""
        sensitivity = 2.0 * clip_norm * math.sqrt(self.layers_in_scope)
        return self.noise_multiplier * sensitivity / self.num_chunks


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
        candidates: Every C tried, smallest first (accuracies with the planned noise, when
            one was given).
        kept_gain: Whether the suggestion keeps the asked share of the unclipped gain (False:
            none did, and the largest C tried, or the best with planned noise, is suggested).
        planned: The planned noise the C were scored with, or None (noise-free rule).
    """

    clip_norm: float
    median: float
    zero_shot: float
    unclipped: float
    candidates: tuple[ClipCandidate, ...]
    kept_gain: bool
    planned: PlannedNoise | None = None

    def as_record(self) -> dict[str, object]:
        """JSON-ready fields for the heads file."""
        rule = "smallest f x median keeping the public gain of the unclipped mean"
        if self.planned is not None:
            rule = (
                f"best public accuracy of the clipped mean plus the planned noise (z = "
                f"{self.planned.noise_multiplier:.4g}, m = {self.planned.num_chunks}, L = "
                f"{self.planned.layers_in_scope}, {self.planned.draws} draws)"
            )
        return {
            "clip_norm_rule": rule,
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
    planned: PlannedNoise | None = None,
    noise: NoiseSource | None = None,
    clipped_scope: HeadSet | None = None,
) -> ClipChoice:
    """The smallest tried C keeping ``keep`` of the gain, or the best under ``planned`` noise.

    Args:
        activations: Public chunks' last-token activations, ``(m, L, H, D)``.
        heads: The heads the release will carry.
        clipped_scope: The heads the release clips per layer (and its Gaussian covers), of
            which ``heads`` are kept: every carried head in release-first order, where C
            bounds whole layers; default ``heads`` (select-first).
        queries: Public records (``client.data.records.Record``) scored zero-shot, first token.
        factors: Multiples of the public median to try, tried smallest first.
        keep: Share of (unclipped − zero-shot) accuracy the clipped mean must keep.
        planned: The planned release's noise: every factor is then scored with it (module
            docstring) and the smallest keeping ``keep`` of the best one's gain is suggested.
        noise: Source of the simulated noise (default: the CSPRNG-backed one).

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
    scope = _ClippedScope(heads, clipped_scope or heads)
    median = suggested_clip_norm(activations, scope.clipped)
    index = heads.to_array()
    unclipped_values = activations[:, index[:, 0], index[:, 1]].double().mean(0).numpy()
    zero = scored.accuracy(loaded)
    unclipped = scored.accuracy(loaded, (heads, unclipped_values))
    # No gain to keep (the unclipped mean does no better than zero-shot): every C keeps it,
    # so the smallest is suggested; the record shows why.
    target = zero + keep * (unclipped - zero)
    evidence = (median, zero, unclipped)
    if planned is not None:
        source = noise if noise is not None else secure_noise()
        return _best_under_noise(
            loaded, activations, scope, scored, factors, evidence,
            target=target, keep=keep, planned=planned, noise=source,
        )  # fmt: skip
    tried: list[ClipCandidate] = []
    for factor in sorted(factors):
        clip = factor * median
        accuracy = scored.accuracy(loaded, (heads, scope.kept_mean(activations, clip)))
        tried.append(ClipCandidate(factor, clip, accuracy))
        if accuracy >= target:
            return ClipChoice(clip, *evidence, tuple(tried), kept_gain=True)
    return ClipChoice(tried[-1].clip_norm, *evidence, tuple(tried), kept_gain=False)


@dataclass(frozen=True)
class _ClippedScope:
    """The heads a release keeps, within the (possibly larger) scope it clips per layer."""

    kept: HeadSet
    clipped: HeadSet

    def kept_mean(self, activations: torch.Tensor, clip_norm: float) -> np.ndarray:
        """The clipped mean over the clipped scope, on the kept heads."""
        return clipped_mean(activations, self.clipped, clip_norm)[self.clipped.rows_of(self.kept)]


def _best_under_noise(
    loaded: LoadedModel,
    activations: torch.Tensor,
    scope: _ClippedScope,
    scored: QuerySet,
    factors: Sequence[float],
    evidence: tuple[float, float, float],
    *,
    target: float,
    keep: float,
    planned: PlannedNoise,
    noise: NoiseSource,
) -> ClipChoice:
    """Every factor scored on ``planned.draws`` simulated releases; the smallest near-best.

    Near-best: keeping ``keep`` of the best factor's gain over zero-shot.
    """
    median = evidence[0]
    tried = []
    for factor in sorted(factors):
        clip = factor * median
        mean = scope.kept_mean(activations, clip)
        std = planned.mean_std(clip)
        accuracy = float(
            np.mean(
                [
                    scored.accuracy(loaded, (scope.kept, noise.add_gaussian(mean, noise_std=std)))
                    for _ in range(planned.draws)
                ]
            )
        )
        tried.append(ClipCandidate(factor, clip, accuracy))
    zero = evidence[1]
    best = max(c.accuracy for c in tried)
    near_best = zero + keep * (best - zero)
    chosen = next(c for c in tried if c.accuracy >= near_best)
    return ClipChoice(
        chosen.clip_norm,
        *evidence,
        tuple(tried),
        kept_gain=chosen.accuracy >= target,
        planned=planned,
    )
