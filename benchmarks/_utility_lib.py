"""Building blocks of the utility benchmark: cached sums, predictions, one DP release."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

import numpy as np

from client.evaluation.first_token import QuerySet
from client.models import LoadedModel
from client.release.single_holder import LocalSums
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.mechanisms import clip_per_layer
from dpmtv_common.privacy.noise import NoiseSource
from protocol import (
    PROTOCOL_VERSION,
    ActivationSum,
    ReleaseOrder,
    ReleaseOutcome,
    ReleasePlan,
    SelectionMode,
    VoteSum,
    run_release,
)


@dataclass
class CachedSums:
    """LocalSums whose noise-free sums are computed once (only the noise differs per draw).

    ``votes`` may be shared between instances that differ only in C: votes do not depend on C.
    """

    inner: LocalSums
    activations: dict[HeadSet, ActivationSum] = field(default_factory=dict)
    votes: dict[str, VoteSum] = field(default_factory=dict)

    def activation_sum(self, heads: HeadSet) -> ActivationSum:
        if heads not in self.activations:
            self.activations[heads] = self.inner.activation_sum(heads)
        return self.activations[heads]

    def vote_sum(self, reference):
        if reference is not None:  # scored against this draw's noisy vector: not cacheable
            return self.inner.vote_sum(reference)
        if "plain" not in self.votes:
            self.votes["plain"] = self.inner.vote_sum(None)
        return self.votes["plain"]


def make_plan(
    *,
    epsilon: float,
    selection: SelectionMode,
    order: ReleaseOrder,
    shots: int,
    clip_norm: float,
    heads: int,
    public_heads: HeadSet | None,
    fingerprint: str,
    share: float = 0.3,
) -> ReleasePlan:
    public = public_heads.heads if selection is SelectionMode.PUBLIC and public_heads else None
    return ReleasePlan(
        protocol_version=PROTOCOL_VERSION,
        release_id="benchmark",
        task="benchmark",
        model_fingerprint=fingerprint,
        epsilon=epsilon,
        delta=1e-5,
        shots=shots,
        clip_norm=clip_norm,
        selection=selection,
        order=order,
        num_selected_heads=len(public) if public else heads,
        public_heads=public,
        selection_share=share,
        score_top_r=heads,
        min_sites=1,
        max_chunks_per_site=None,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
    )


def release(plan: ReleasePlan, sums, loaded: LoadedModel, noise: NoiseSource) -> ReleaseOutcome:
    shape = loaded.adapter.head_shape(loaded.model)
    return run_release(
        plan,
        sums=sums,
        layout=shape.layout(),
        noise=noise,
        on_first_noise=lambda: None,
    )


@dataclass(frozen=True)
class Scored:
    """Accuracy, and the share of queries given the most frequent prediction (1.0: collapse)."""

    accuracy: float
    modal_share: float


def score(loaded: LoadedModel, queries: QuerySet, patch=None) -> Scored:
    """Greedy first-token predictions on ``queries``, optionally patched (heads, values)."""
    predicted, expected = queries.predictions(loaded, patch)
    guesses, answers = predicted.numpy(), expected.numpy()
    _, counts = np.unique(guesses, return_counts=True)
    return Scored(float(np.mean(guesses == answers)), float(counts.max() / len(guesses)))


def _gain_ratio(value: float, zero: float, reference: float) -> float:
    """(value - zero) / (reference - zero); NaN when the reference gains nothing over zero-shot."""
    return (value - zero) / (reference - zero) if reference > zero else float("nan")


def headline_ratios(*, zero: float, dp: float, own_selection: float, same_heads: float) -> dict:
    """The headline ratio and its diagnostic, from four accuracies on the same test queries.

    ``ratio`` divides DP-MTV's gain over zero-shot by the gain of **MTV with its own head
    selection** (the paper's method: attribution on validation queries, non-private, the
    same k). ``ratio_same_heads`` divides by MTV patched into the heads DP picked: a diagnostic
    only, since a bad private pick lowers its numerator and denominator together.
    """
    return {
        "zero": zero,
        "dp": dp,
        "own_selection": own_selection,
        "same_heads": same_heads,
        "ratio": _gain_ratio(dp, zero, own_selection),
        "ratio_same_heads": _gain_ratio(dp, zero, same_heads),
    }


@dataclass
class PerChunkSums:
    """Release sums from per-chunk activations taken once (any head scope, any clip norm).

    Each chunk's last-token activations ``(m, L, H, D)`` come from the production hooks
    (``client.public.selection.public_activations``, the extraction path); a scope's sum
    clips every chunk's in-scope heads per layer with the production ``clip_per_layer``.
    Votes are the production vote sum (``LocalSums.vote_sum``), computed once. One forward
    pass a chunk serves every draw and head set: what makes a 270-head model affordable.
    """

    inner: LocalSums
    clip_norm: float
    chunk_activations: np.ndarray
    votes: VoteSum | None = None
    cache: dict[HeadSet, ActivationSum] = field(default_factory=dict)

    def activation_sum(self, heads: HeadSet) -> ActivationSum:
        if heads not in self.cache:
            index = heads.to_array()
            rows = self.chunk_activations[:, index[:, 0], index[:, 1], :]
            total = sum(
                clip_per_layer(chunk, row_layers=index[:, 0], clip_norm=self.clip_norm)
                for chunk in rows
            )
            self.cache[heads] = ActivationSum(heads, np.asarray(total), len(rows))
        return self.cache[heads]

    def vote_sum(self, reference):
        if reference is not None:  # scored against this draw's noisy vector: not cacheable
            return self.inner.vote_sum(reference)
        if self.votes is None:
            self.votes = self.inner.vote_sum(None)
        return self.votes
