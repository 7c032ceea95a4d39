"""The stage sequence of one release, shared by the single-holder command and the coordinator.

How this connects: whoever runs a release supplies a :class:`ReleaseSums` — local extraction
for a single data holder (``client.release.single_holder``), SecAgg+ secure sums over the sites for
the federated coordinator (``server``). :func:`run_release` then does everything that touches
privacy in exactly one place: it runs selection and the release in the plan's order, calls
``on_first_noise`` right before the first noisy output exists (ledgers mark the release
exposed there), and returns the released heads and mean activations. What the outcome states
(manifest fields) and what a plan reserves are in :mod:`protocol.release_manifest`.

One flow, two noise modes. The order and selection branches are walked once
(:func:`run_release`); what differs between the plan's noise modes — how a summed activation
vector becomes a noisy mean, how heads are picked from a vote sum, what the outcome states —
is a small strategy (:class:`_CentralMode`, :class:`_DistributedMode`). Both modes ask for
the same sums, in the same order, with the same arguments, and mark exposure at the same
points: after the vote sum in select-first private selection, else after the activation sum.

Orders (design §1 step 6):

* ``select-first``: votes → private selection → S → clipped sum over S → noisy mean.
* ``release-first``: clipped sum over the Gaussian's heads → noisy mean → votes scored
  against the noisy vector (private mode) or the public list → keep the rows of S
  (post-processing). The Gaussian's heads (:func:`gaussian_heads`) are the plan's public
  candidate heads when it names them, else every carried head: a head outside the
  candidates can never be released, so noising it would only add noise to the rest.

Mechanisms. Privacy unit: the plan's (one example, or one group); neighbouring relation:
replace-one (one unit is replaced, which changes one chunk's contribution to every sum).

* Central mode, activation sum: one Gaussian draw on the sum, by whoever runs the release.
  Sensitivity Δ₂ = 2·C·√L_scope (each layer of a chunk clipped to C); noise N(0, σ² I) with
  σ = z·Δ₂ from the plan's calibration. Exactly one draw per release.
* Central mode, private selection: Gumbel top-k over the candidates' vote sums. Sensitivity
  Δ∞ = 1 per head (a chunk votes 1 for each of its top-r heads); Gumbel noise of scale
  β = 2/ε₀ per pick, k picks.
* Distributed mode (``plan.noise_mode``), activation sum: no draw here — every site added its
  own discrete-Gaussian share inside SecAgg+ (:mod:`protocol.distributed`), each sized so
  that ``plan.min_honest`` honest shares carry the full noise (σ_site² = σ²/t). Sensitivity
  Δ₂ = 2·C·√L_scope, as in central mode.
* Distributed mode, private selection: the vote histogram arrives noised the same way
  (sensitivity Δ₂ = √(2r)); taking its top k is post-processing and adds no noise.

Centred plans (``plan.centre_sha256``): every chunk contributes ``clip(a - r)`` for the
public centre r the plan pins; the sensitivities above hold unchanged (each layer of a
contribution still has norm at most C), and r's rows are added back to the noisy mean, a
post-processing step (:mod:`dpmtv_common.centre`).

Head scope: "all heads" is ``layout.all_heads()``, the heads of the decoder layers that carry
them (a hybrid's linear-attention or convolution layers carry none). The noise of an
all-heads sum is calibrated to those layers only (L_scope), public heads elsewhere are
refused, and selection's candidate set is exactly those heads: the layout is read from the
public model, never from data, so restricting the candidates changes no privacy map.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from dpmtv_common.aliases import Float64Array, LayerHead
from dpmtv_common.centre import ActivationCentre
from dpmtv_common.errors import ConfigError, InsufficientSharesError
from dpmtv_common.heads import HeadLayout, HeadSet
from dpmtv_common.privacy.accounting import EpsilonBound
from dpmtv_common.privacy.calibration import ReleaseCalibration
from dpmtv_common.privacy.distributed import top_k_from_noisy_votes
from dpmtv_common.privacy.mechanisms import GaussianSumMechanism
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
    "check_plan_centre",
    "check_plan_scope",
    "gaussian_heads",
    "run_release",
    "vote_slots",
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
        """Top-r vote sum among :func:`vote_slots`, or None.

        ``reference``: the noisy vector of a release-first plan, placed dense ``(L, H, D)``
        (its :func:`gaussian_heads` rows, zeros elsewhere), or None.
        """
        ...


@dataclass(frozen=True)
class ReleaseOutcome:
    """What a release produced and what it cost.

    Attributes:
        heads: The released heads.
        values: Their noisy mean activations, float64 ``(len(heads), D)``.
        num_chunks: m of the Gaussian sum (the divisor of the mean).
        noise_std: σ of the Gaussian draw.
        gaussian_heads: The heads the Gaussian ran on (in release-first order every carried
            head, or the plan's candidates: :func:`gaussian_heads`).
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


def _require_chunks(summed: ActivationSum) -> ActivationSum:
    # Checked before the release is marked exposed: nothing noisy exists yet, so an abort
    # here refunds every ledger.
    if summed.num_chunks < 1:
        raise InsufficientSharesError(
            f"a release needs at least one chunk, got {summed.num_chunks}."
        )
    return summed


def vote_slots(plan: ReleasePlan, layout: HeadLayout) -> list[int]:
    """Dense slots a chunk votes among and selection picks among, in (layer, head) order.

    The plan's candidate set, else every carried head. Both are fixed before any private
    data is read (the layout by the public model, the candidate list by the plan), so either
    is a public domain of the same mechanisms: a chunk's top-r vote still moves any head's
    sum by at most 1 (Δ∞ = 1) and the histogram by √(2r) in L2.
    """
    if plan.candidate_heads is None:
        return layout.candidates()
    return sorted(layout.dense_indices(HeadSet(plan.candidate_heads)))


def gaussian_heads(plan: ReleasePlan, layout: HeadLayout) -> HeadSet | None:
    """The heads the plan's one Gaussian draw covers, or None: the heads picked first.

    Fixed by the plan and the public layout before any data is read, so a site can check
    every sum it is asked for and every σ it is told:

    * select-first: the public heads, every carried head (selection ``all``), or None for
      private selection (the Gaussian then covers the k heads the votes picked);
    * release-first: every carried head, or, for private selection among public candidate
      heads, those candidates (a head outside them is never released).
    """
    if plan.selection is SelectionMode.PRIVATE:
        if plan.order is ReleaseOrder.SELECT_FIRST:
            return None
        if plan.candidate_heads is not None:
            return HeadSet(plan.candidate_heads)
        return layout.all_heads()
    if plan.selection is SelectionMode.PUBLIC and plan.order is ReleaseOrder.SELECT_FIRST:
        return HeadSet(plan.public_heads or ())
    return layout.all_heads()


def _candidate_votes(
    votes: VoteSum, plan: ReleasePlan, layout: HeadLayout
) -> tuple[list[int], Float64Array]:
    """The dense slots of the candidate heads and their vote sums, in (layer, head) order."""
    if votes.total.shape != (layout.dense_size,):
        raise ConfigError(
            f"vote sum must have shape (L * H,) = ({layout.dense_size},), "
            f"got {votes.total.shape!r}."
        )
    candidates = vote_slots(plan, layout)
    return candidates, votes.total[candidates]


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


def check_plan_centre(plan: ReleasePlan, centre: ActivationCentre | None) -> None:
    """Refuse a centre that is not the one the plan pins (or one the plan does not name).

    Raises:
        PlanMismatchError: The plan names a centre and none (or another) is given, or the
            plan names none and one is given.
    """
    if plan.centre_sha256 is None:
        if centre is not None:
            raise PlanMismatchError(
                "centre must be None for a plan without centre_sha256, got a centre with digest "
                f"{centre.digest()[:16]}..."
            )
        return
    digest = None if centre is None else centre.digest()
    if digest != plan.centre_sha256:
        raise PlanMismatchError(
            f"centre must have the plan's digest {plan.centre_sha256[:16]}..., got "
            f"{'no centre' if digest is None else digest[:16] + '...'}."
        )


class _NoiseStrategy(Protocol):
    """What one noise mode does at the release flow's three private steps."""

    def noisy_mean(self, summed: ActivationSum) -> Float64Array:
        """The released mean of ``summed``, noised by this mode's activation mechanism."""
        ...

    def select(self, votes: VoteSum) -> HeadSet:
        """The k heads this mode's private selection picks from ``votes``."""
        ...

    def outcome(
        self, summed: ActivationSum, released: HeadSet, values: Float64Array
    ) -> ReleaseOutcome:
        """What the release states, given the noised sum, the released heads and rows."""
        ...


@dataclass(frozen=True)
class _CentralMode:
    """Central noise: this process draws the Gaussian and runs Gumbel top-k.

    Mechanisms: ``calibration.gaussian()`` on the activation sum (Δ₂ = 2·C·√L_scope under
    replace-one of one privacy unit's chunk, noise N(0, σ² I) with σ = z·Δ₂, one draw) and
    ``calibration.gumbel()`` for private selection (Δ∞ = 1 per head under replace-one,
    Gumbel scale β = 2/ε₀, k picks). Privacy unit: the plan's example or group.
    """

    plan: ReleasePlan
    layout: HeadLayout
    calibration: ReleaseCalibration
    noise: NoiseSource

    def _gaussian(self, heads: HeadSet) -> GaussianSumMechanism:
        # A pure function of the calibration and the scope's layers, so the outcome can ask
        # again for the σ of the draw without a second draw.
        return self.calibration.gaussian(clip_norm=self.plan.clip_norm, heads=heads)

    def noisy_mean(self, summed: ActivationSum) -> Float64Array:
        """The single Gaussian draw of the release, on the sum, divided by m."""
        mechanism = self._gaussian(summed.heads)
        return mechanism.noisy_mean(summed.total, num_chunks=summed.num_chunks, noise=self.noise)

    def select(self, votes: VoteSum) -> HeadSet:
        """Gumbel top-k over the candidate set.

        The candidate set is the plan's public ``candidate_heads``, or else
        ``layout.all_heads()``: both are fixed before any data is read, so running the
        mechanism over those heads' vote sums only is the same mechanism on a smaller public
        domain: same sensitivity, same ε₀ per pick. No head of a headless layer can be picked.
        """
        candidates, scores = _candidate_votes(votes, self.plan, self.layout)
        picked = self.calibration.gumbel().select(scores, noise=self.noise)
        return self.layout.heads_at(candidates[index] for index in picked)

    def outcome(
        self, summed: ActivationSum, released: HeadSet, values: Float64Array
    ) -> ReleaseOutcome:
        """The calibrated release: σ of the draw and the calibration's (ε, δ)."""
        noise_std = self._gaussian(summed.heads).noise_std
        return _outcome(summed, released, values, noise_std, calibration=self.calibration)


@dataclass(frozen=True)
class _DistributedMode:
    """Distributed noise: the sums arrive carrying the sites' shares, so nothing is drawn here.

    Mechanisms (:mod:`protocol.distributed`): each site adds a discrete-Gaussian share inside
    SecAgg+, sized so that ``plan.min_honest`` honest shares carry the full noise
    (σ_site² = σ²/t). Sensitivity under replace-one of one privacy unit's chunk:
    Δ₂ = 2·C·√L_scope for the activation sum, √(2r) for the top-r vote histogram. Privacy
    unit: the plan's example or group. Everything below is post-processing of those sums.
    """

    plan: ReleasePlan
    layout: HeadLayout

    def noisy_mean(self, summed: ActivationSum) -> Float64Array:
        """The already-noisy sum divided by m (post-processing)."""
        return summed.total / summed.num_chunks

    def select(self, votes: VoteSum) -> HeadSet:
        """Top k of the already-noisy vote histogram over the candidate set (post-processing).

        The candidate set is as in central mode: a public restriction of a noisy output, so
        it costs nothing beyond the histogram's own noise.
        """
        candidates, scores = _candidate_votes(votes, self.plan, self.layout)
        top = top_k_from_noisy_votes(scores, k=self.plan.num_selected_heads)
        return self.layout.heads_at(candidates[index] for index in top)

    def outcome(
        self, summed: ActivationSum, released: HeadSet, values: Float64Array
    ) -> ReleaseOutcome:
        """The grids' σ and ε at t honest shares, and at every survivor honest."""
        # D is read off the sum: the grids depend on the model's shape, never on data.
        release = DistributedRelease(
            plan=self.plan,
            num_heads_total=self.layout.dense_size,
            head_dim=int(summed.total.shape[1]),
        )
        survivors = summed.num_sites or self.plan.min_honest
        distributed = DistributedOutcome(
            release=release,
            bound=release.bound(summed.heads, honest_shares=self.plan.min_honest),
            survivors=survivors,
            bound_if_all_honest=release.bound(summed.heads, honest_shares=survivors),
        )
        noise_std = release.noise_std(summed.heads)
        return _outcome(summed, released, values, noise_std, distributed=distributed)


def _outcome(
    summed: ActivationSum,
    released: HeadSet,
    values: Float64Array,
    noise_std: float,
    *,
    calibration: ReleaseCalibration | None = None,
    distributed: DistributedOutcome | None = None,
) -> ReleaseOutcome:
    """What both modes report: the released rows, the σ on them, and their signal/noise."""
    return ReleaseOutcome(
        heads=released,
        values=values,
        num_chunks=summed.num_chunks,
        noise_std=noise_std,
        gaussian_heads=summed.heads,
        calibration=calibration,
        signal_to_noise=_snr(values, noise_std, summed.num_chunks),
        distributed=distributed,
    )


def _noise_strategy(plan: ReleasePlan, layout: HeadLayout, noise: NoiseSource) -> _NoiseStrategy:
    if plan.noise_mode is NoiseMode.DISTRIBUTED:
        return _DistributedMode(plan, layout)
    # Calibrated before any sum is asked for: a plan the accountant cannot meet fails while
    # nothing has been read.
    return _CentralMode(plan, layout, plan_calibration(plan), noise)


@dataclass(frozen=True)
class _Released:
    """The activation sum the noise ran on, the released heads and their noisy mean rows."""

    summed: ActivationSum
    heads: HeadSet
    values: Float64Array


def _recentred(
    values: Float64Array, heads: HeadSet, centre: ActivationCentre | None
) -> Float64Array:
    """The noisy mean of centred contributions plus the public centre (post-processing)."""
    return values if centre is None else values + centre.rows(heads)


def _fixed_scope(plan: ReleasePlan, layout: HeadLayout) -> HeadSet:
    """The heads released without private selection: the public list, else all heads."""
    return HeadSet(plan.public_heads) if plan.public_heads else layout.all_heads()


def _select_first(
    plan: ReleasePlan,
    sums: ReleaseSums,
    layout: HeadLayout,
    mode: _NoiseStrategy,
    exposed: Callable[[], None],
    centre: ActivationCentre | None,
) -> _Released:
    """Select (privately, or the fixed scope), then noise the sum over the selection only."""
    scope = _fixed_scope(plan, layout)
    if plan.selection is SelectionMode.PRIVATE:
        votes = sums.vote_sum(None)
        # The vote sum is the first private output to be looked at: in distributed mode it
        # is already a noisy histogram, in central mode Gumbel noise is drawn on it next.
        exposed()
        scope = mode.select(votes)
    summed = _require_chunks(sums.activation_sum(scope))
    exposed()  # a no-op when the votes were marked above
    return _Released(summed, scope, _recentred(mode.noisy_mean(summed), scope, centre))


def _release_first(
    plan: ReleasePlan,
    sums: ReleaseSums,
    layout: HeadLayout,
    mode: _NoiseStrategy,
    exposed: Callable[[], None],
    centre: ActivationCentre | None,
) -> _Released:
    """Noise the sum over the Gaussian's heads once, then keep the rows of the released heads."""
    scope = gaussian_heads(plan, layout) or layout.all_heads()
    summed = _require_chunks(sums.activation_sum(scope))
    exposed()
    noisy = _recentred(mode.noisy_mean(summed), scope, centre)
    released = _fixed_scope(plan, layout)
    if plan.selection is SelectionMode.PRIVATE:
        # Votes are scored against the noisy vector, so selection reads no raw activation.
        reference = layout.dense_rows(noisy, heads=scope)
        released = mode.select(sums.vote_sum(reference))
    return _Released(summed, released, noisy[scope.rows_of(released)])


def run_release(
    plan: ReleasePlan,
    *,
    sums: ReleaseSums,
    layout: HeadLayout,
    noise: NoiseSource,
    on_first_noise: Callable[[], None],
    centre: ActivationCentre | None = None,
) -> ReleaseOutcome:
    """Run the plan's selection and release in its order, in either noise mode.

    See the module docstring for the orders and the mechanisms of each noise mode.

    Args:
        layout: The model's head layout; its carried heads are "all heads" of the release.
        noise: The randomness of central mode's draws (unused in distributed mode, whose
            noise the sites added).
        on_first_noise: Called exactly once, right before the first noisy output exists.
        centre: The public centre of a centred plan (``plan.centre_sha256``): the sums are
            of centred contributions, and the centre's rows are added back to the noisy mean
            (post-processing; ``dpmtv_common.centre``). The signal/noise diagnostic is of the
            centred part, the part the private data carries.

    Raises:
        ConfigError: The plan's heads do not fit the layout (:func:`check_plan_scope`),
            raised before any sum is asked for.
        PlanMismatchError: The centre is not the one the plan pins.
        InsufficientSharesError: The activation sum covers no chunk, raised before the
            release is marked exposed.
    """
    check_plan_scope(plan, layout)
    check_plan_centre(plan, centre)
    mode = _noise_strategy(plan, layout, noise)
    exposed = _once(on_first_noise)
    # With every head released the two orders ask for the same sum and keep every row, so
    # all-heads selection takes the select-first path in either order.
    if plan.order is ReleaseOrder.SELECT_FIRST or plan.selection is SelectionMode.ALL:
        released = _select_first(plan, sums, layout, mode, exposed, centre)
    else:
        released = _release_first(plan, sums, layout, mode, exposed, centre)
    outcome = mode.outcome(released.summed, released.heads, released.values)
    if centre is None:
        return outcome
    centred = released.values - centre.rows(released.heads)
    return replace(outcome, signal_to_noise=_snr(centred, outcome.noise_std, outcome.num_chunks))
