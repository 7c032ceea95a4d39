"""The stage sequence of one release, shared by the single-holder command and the coordinator.

How this connects: whoever runs a release supplies a :class:`ReleaseSums` — local extraction
for a single data holder (``client.release``), SecAgg+ secure sums over the sites for the
federated coordinator (``server``). :func:`run_release` then does everything that touches
privacy in exactly one place: it calibrates the plan, runs private selection (Gumbel top-k)
and the single Gaussian draw in the plan's order, calls ``on_first_noise`` right before the
first noisy output exists (ledgers mark the release exposed there), and returns the released
heads and mean activations. Exactly one Gaussian draw happens per release, on the sum.
What the outcome states (manifest fields) and what a plan reserves are in
:mod:`protocol.release_manifest`.

Orders (design §1 step 6):

* ``select-first``: votes → Gumbel top-k → S → clipped sum over S → one Gaussian draw.
* ``release-first``: clipped sum over all heads → one Gaussian draw → votes scored against the
  noisy vector (private mode) or the public list → keep the rows of S (post-processing).

Distributed noise mode (``plan.noise_mode``): the sums arrive already noisy — every site added
its own discrete-Gaussian share inside SecAgg+ (:mod:`protocol.distributed`) — so no Gaussian
is drawn here and selection is the top k of the noisy vote histogram (post-processing); the
order and the ledger marks are the same.

Head scope: "all heads" is ``layout.all_heads()``, the heads of the decoder layers that carry
them (a hybrid's linear-attention or convolution layers carry none). The Gaussian of an
all-heads sum is calibrated to those layers only (L_scope), public heads elsewhere are
refused, and selection's candidate set is exactly those heads: the layout is read from the
public model, never from data, so restricting the candidates changes no privacy map.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dpmtv_common.aliases import Float64Array, LayerHead
from dpmtv_common.errors import ConfigError, InsufficientSharesError
from dpmtv_common.heads import HeadLayout, HeadSet
from dpmtv_common.privacy.accounting import EpsilonBound
from dpmtv_common.privacy.calibration import ReleaseCalibration
from dpmtv_common.privacy.distributed import top_k_from_noisy_votes
from dpmtv_common.privacy.noise import NoiseSource
from protocol.calibration import plan_calibration
from protocol.distributed import DistributedRelease
from protocol.errors import PlanMismatchError
from protocol.plan import NoiseMode, ReleaseOrder, ReleasePlan, SelectionMode

__all__ = [
    "ActivationSum",
    "ReleaseOutcome",
    "ReleaseSums",
    "DistributedOutcome",
    "VoteSum",
    "check_candidate_picks",
    "check_plan_scope",
    "run_release",
]


@dataclass(frozen=True)
class ActivationSum:
    """Σ over chunks of per-layer-clipped activations of ``heads``: ``(len(heads), D)``."""

    heads: HeadSet
    total: Float64Array
    num_chunks: int
    num_sites: int | None = None


@dataclass(frozen=True)
class VoteSum:
    """Σ over chunks of top-r head votes, ``(L * H,)`` in (layer, head) order.

    Dense over every decoder layer; the slots of headless layers hold no votes (no chunk
    votes for a head the model does not carry) and are never candidates.
    """

    total: Float64Array
    num_chunks: int


class ReleaseSums(Protocol):
    """Where a release's sums come from (local extraction, or secure sums over sites)."""

    def activation_sum(self, heads: HeadSet) -> ActivationSum:
        """Clipped activation sum over ``heads`` (clip norm from the plan)."""
        ...

    def vote_sum(self, reference: Float64Array | None) -> VoteSum:
        """Top-r vote sum; ``reference`` is the noisy all-head vector ``(L, H, D)`` or None."""
        ...


@dataclass(frozen=True)
class ReleaseOutcome:
    """What a release produced and what it cost.

    Attributes:
        heads: The released heads.
        values: Their noisy mean activations, float64 ``(len(heads), D)``.
        num_chunks: m of the Gaussian sum (the divisor of the mean).
        noise_std: σ of the Gaussian draw.
        gaussian_heads: The heads the Gaussian ran on (all heads in release-first order).
        calibration: The calibrated mechanisms and the (ε, δ) bound they meet (central mode).
        signal_to_noise: ‖mean‖ / (σ/m · √(coordinates)) of the released vector, a
            diagnostic computed from released (noisy) values only.
        distributed: The grids and the ε bounds of a distributed-noise release, else None.
    """

    heads: HeadSet
    values: Float64Array
    num_chunks: int
    noise_std: float
    gaussian_heads: HeadSet
    calibration: ReleaseCalibration | None
    signal_to_noise: float
    distributed: DistributedOutcome | None = None

    @property
    def bound(self) -> EpsilonBound:
        """The (ε, δ) the release states (central: calibrated; distributed: at t shares)."""
        if self.distributed is not None:
            return self.distributed.bound
        if self.calibration is None:
            raise ConfigError("a central release outcome must carry its calibration, got None.")
        return self.calibration.bound


@dataclass(frozen=True)
class DistributedOutcome:
    """What a distributed-noise release states beyond the central fields.

    Attributes:
        release: The plan's grids for the model's shape.
        bound: ε at t = ``plan.min_honest`` honest shares: the guarantee the sites rely on.
        survivors: Sites whose shares are in the activation sum.
        bound_if_all_honest: ε if every survivor is honest (more shares, less ε).
    """

    release: DistributedRelease
    bound: EpsilonBound
    survivors: int
    bound_if_all_honest: EpsilonBound


def _noisy_mean(
    summed: ActivationSum, plan: ReleasePlan, calibration: ReleaseCalibration, noise: NoiseSource
) -> tuple[Float64Array, float]:
    mechanism = calibration.gaussian(clip_norm=plan.clip_norm, heads=summed.heads)
    mean = mechanism.noisy_mean(summed.total, num_chunks=summed.num_chunks, noise=noise)
    return mean, mechanism.noise_std


def _require_chunks(summed: ActivationSum) -> ActivationSum:
    # Checked before the release is marked exposed: nothing noisy exists yet, so an abort
    # here refunds every ledger.
    if summed.num_chunks < 1:
        raise InsufficientSharesError(
            f"a release needs at least one chunk, got {summed.num_chunks}."
        )
    return summed


def _rows(heads: HeadSet, subset: HeadSet) -> list[int]:
    index = {head: row for row, head in enumerate(heads.heads)}
    return [index[head] for head in subset.heads]


def _candidates(plan: ReleasePlan, layout: HeadLayout) -> list[int]:
    """Dense slots selection picks among: the plan's candidate set, else every carried head.

    Both are fixed before any private data is read (the layout by the public model, the
    candidate list by the plan), so either is a public domain of the same mechanism.
    """
    if plan.candidate_heads is None:
        return layout.candidates()
    return sorted(layout.dense_indices(HeadSet(plan.candidate_heads)))


def _candidate_votes(
    votes: VoteSum, plan: ReleasePlan, layout: HeadLayout
) -> tuple[list[int], Float64Array]:
    """The dense slots of the candidate heads and their vote sums, in (layer, head) order."""
    if votes.total.shape != (layout.dense_size,):
        raise ConfigError(
            f"vote sum must have shape (L * H,) = ({layout.dense_size},), "
            f"got {votes.total.shape!r}."
        )
    candidates = _candidates(plan, layout)
    return candidates, votes.total[candidates]


def _select(
    votes: VoteSum,
    calibration: ReleaseCalibration,
    noise: NoiseSource,
    plan: ReleasePlan,
    layout: HeadLayout,
) -> HeadSet:
    """Gumbel top-k (central mode) over the candidate set.

    Mechanism: ``calibration.gumbel()`` (Δ∞ = 1 per head under replace-one of one privacy
    unit's chunk, β = 2/ε₀, k picks). The candidate set is the plan's public
    ``candidate_heads``, or else ``layout.all_heads()``: both are fixed before any data is
    read, so running the mechanism over those heads' vote sums only is the same mechanism on
    a smaller public domain: same sensitivity, same ε₀ per pick. No head of a headless layer
    can be picked.
    """
    candidates, scores = _candidate_votes(votes, plan, layout)
    picked = calibration.gumbel().select(scores, noise=noise)
    return layout.heads_at(candidates[index] for index in picked)


def _top_k_noisy(votes: VoteSum, plan: ReleasePlan, layout: HeadLayout) -> HeadSet:
    """Top k of the already-noisy vote histogram over the candidate set (post-processing).

    The candidate set is as in :func:`_select`: a public restriction of a noisy output, so it
    costs nothing beyond the histogram's own noise.
    """
    k = plan.num_selected_heads
    candidates, scores = _candidate_votes(votes, plan, layout)
    return layout.heads_at(candidates[index] for index in top_k_from_noisy_votes(scores, k=k))


def _snr(values: Float64Array, noise_std: float, num_chunks: int) -> float:
    """Debiased ‖signal‖/‖noise‖ of a released mean, from the released values alone."""
    expected_noise_sq = (noise_std / num_chunks) ** 2 * values.size
    ratio_sq = float(np.sum(values**2)) / expected_noise_sq - 1.0
    return math.sqrt(max(ratio_sq, 0.0))


def _once(callback: Callable[[], None]) -> Callable[[], None]:
    called = False

    def call() -> None:
        nonlocal called
        if not called:
            called = True
            callback()

    return call


def check_candidate_picks(plan: ReleasePlan, heads: Iterable[LayerHead], name: str) -> None:
    """Refuse private picks outside the plan's public candidate set (when it names one).

    Raises:
        PlanMismatchError: How many of ``heads`` lie outside, and a few of them.
    """
    if plan.candidate_heads is None:
        return
    outside = sorted(set(heads) - set(plan.candidate_heads))
    if outside:
        raise PlanMismatchError(
            f"{name} must be among the plan's {len(plan.candidate_heads)} candidate heads, "
            f"got {len(outside)} outside them ({[list(h) for h in outside[:4]]})."
        )


def check_plan_scope(plan: ReleasePlan, layout: HeadLayout) -> None:
    """Refuse a plan whose heads do not fit the model's carried heads (before any spending).

    Public and candidate heads must lie in layers that carry heads; in private selection k and
    top-r can be at most the number of carried heads (the candidates of each vote).

    Raises:
        ConfigError: What did not fit, and the carried layers.
    """
    layout.check_carried(plan.public_heads or (), "plan public heads")
    layout.check_carried(plan.candidate_heads or (), "plan candidate heads")
    if plan.selection is not SelectionMode.PRIVATE:
        return
    carried = len(layout.all_heads())
    where = f"{carried} heads (layers {list(layout.carried_layers)} x {layout.num_heads})"
    if plan.num_selected_heads > carried:
        raise ConfigError(
            f"heads (num_selected_heads) must be at most the model's {where}, "
            f"got {plan.num_selected_heads}."
        )
    if plan.score_top_r > carried:
        raise ConfigError(
            f"top-r (score_top_r) must be at most the model's {where}, got {plan.score_top_r}."
        )


def run_release(
    plan: ReleasePlan,
    *,
    sums: ReleaseSums,
    layout: HeadLayout,
    noise: NoiseSource,
    on_first_noise: Callable[[], None],
) -> ReleaseOutcome:
    """Run the plan's selection and its single Gaussian draw; see the module docstring.

    Args:
        layout: The model's head layout; its carried heads are "all heads" of the release.

    Raises:
        ConfigError: The plan's heads do not fit the layout (:func:`check_plan_scope`),
            raised before any sum is asked for.
    """
    check_plan_scope(plan, layout)
    if plan.noise_mode is NoiseMode.DISTRIBUTED:
        return _run_distributed(plan, sums=sums, layout=layout, exposed=on_first_noise)
    calibration = plan_calibration(plan)
    exposed = _once(on_first_noise)
    all_heads = layout.all_heads()
    fixed_scope = HeadSet(plan.public_heads) if plan.public_heads else all_heads
    private = plan.selection is SelectionMode.PRIVATE
    if plan.order is ReleaseOrder.SELECT_FIRST or plan.selection is SelectionMode.ALL:
        scope = fixed_scope
        if private:
            votes = sums.vote_sum(None)
            exposed()
            scope = _select(votes, calibration, noise, plan, layout)
        summed = _require_chunks(sums.activation_sum(scope))
        exposed()
        values, noise_std = _noisy_mean(summed, plan, calibration, noise)
        released = scope
    else:
        summed = _require_chunks(sums.activation_sum(all_heads))
        exposed()
        noisy_all, noise_std = _noisy_mean(summed, plan, calibration, noise)
        released = fixed_scope
        if private:
            reference = layout.dense_rows(noisy_all)
            released = _select(sums.vote_sum(reference), calibration, noise, plan, layout)
        values = noisy_all[_rows(all_heads, released)]
    return ReleaseOutcome(
        heads=released,
        values=values,
        num_chunks=summed.num_chunks,
        noise_std=noise_std,
        gaussian_heads=summed.heads,
        calibration=calibration,
        signal_to_noise=_snr(values, noise_std, summed.num_chunks),
    )


def _run_distributed(
    plan: ReleasePlan,
    *,
    sums: ReleaseSums,
    layout: HeadLayout,
    exposed: Callable[[], None],
) -> ReleaseOutcome:
    """Selection and release on sums the sites already noised (no draw here)."""
    mark = _once(exposed)
    all_heads = layout.all_heads()
    scope = HeadSet(plan.public_heads) if plan.public_heads else all_heads
    private = plan.selection is SelectionMode.PRIVATE
    if plan.order is ReleaseOrder.SELECT_FIRST or plan.selection is SelectionMode.ALL:
        if private:
            votes = sums.vote_sum(None)
            mark()  # the noisy histogram exists: it is the first noisy output
            scope = _top_k_noisy(votes, plan, layout)
        summed = _require_chunks(sums.activation_sum(scope))
        mark()
        values = summed.total / summed.num_chunks
        released = scope
    else:
        summed = _require_chunks(sums.activation_sum(all_heads))
        mark()
        noisy_all = summed.total / summed.num_chunks
        released = scope
        if private:
            votes = sums.vote_sum(layout.dense_rows(noisy_all))
            released = _top_k_noisy(votes, plan, layout)
        values = noisy_all[_rows(all_heads, released)]
    return _distributed_outcome(plan, summed, released, values, layout.dense_size)


def _distributed_outcome(
    plan: ReleasePlan,
    summed: ActivationSum,
    released: HeadSet,
    values: Float64Array,
    num_heads_total: int,
) -> ReleaseOutcome:
    release = DistributedRelease(plan, num_heads_total, int(summed.total.shape[1]))
    survivors = summed.num_sites or plan.min_honest
    noise_std = release.noise_std(summed.heads)
    return ReleaseOutcome(
        heads=released,
        values=values,
        num_chunks=summed.num_chunks,
        noise_std=noise_std,
        gaussian_heads=summed.heads,
        calibration=None,
        signal_to_noise=_snr(values, noise_std, summed.num_chunks),
        distributed=DistributedOutcome(
            release=release,
            bound=release.bound(summed.heads, honest_shares=plan.min_honest),
            survivors=survivors,
            bound_if_all_honest=release.bound(summed.heads, honest_shares=survivors),
        ),
    )
