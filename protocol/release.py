"""The stage sequence of one release, shared by the single-holder command and the coordinator.

How this connects: whoever runs a release supplies a :class:`ReleaseSums` — local extraction
for a single data holder (``client.release``), SecAgg+ secure sums over the sites for the
federated coordinator (``server``). :func:`run_release` then does everything that touches
privacy in exactly one place: it calibrates the plan, runs private selection (Gumbel top-k)
and the single Gaussian draw in the plan's order, calls ``on_first_noise`` right before the
first noisy output exists (ledgers mark the release exposed there), and returns the released
heads and mean activations. Exactly one Gaussian draw happens per release, on the sum.

Orders (design §1 step 6):

* ``select-first``: votes → Gumbel top-k → S → clipped sum over S → one Gaussian draw.
* ``release-first``: clipped sum over all heads → one Gaussian draw → votes scored against the
  noisy vector (private mode) or the public list → keep the rows of S (post-processing).

Distributed noise mode (``plan.noise_mode``): the sums arrive already noisy — every site added
its own discrete-Gaussian share inside SecAgg+ (:mod:`protocol.distributed`) — so no Gaussian
is drawn here and selection is the top k of the noisy vote histogram (post-processing); the
order and the ledger marks are the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dpmtv_common.aliases import Float64Array
from dpmtv_common.artifact import ReleaseDescription
from dpmtv_common.errors import ConfigError, InsufficientSharesError
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.accounting import EpsilonBound, epsilon_bound
from dpmtv_common.privacy.calibration import ReleaseCalibration
from dpmtv_common.privacy.distributed import top_k_from_noisy_votes
from dpmtv_common.privacy.events import ReleaseEvent
from dpmtv_common.privacy.ledger import PrivacyLedger
from dpmtv_common.privacy.noise import NoiseSource
from protocol.calibration import plan_calibration
from protocol.distributed import DistributedRelease, plan_distributed_event
from protocol.plan import NoiseMode, ReleaseOrder, ReleasePlan, SelectionMode, plan_hash
from protocol.version import PROTOCOL_VERSION

__all__ = [
    "ActivationSum",
    "ReleaseOutcome",
    "ReleaseSums",
    "DistributedOutcome",
    "VoteSum",
    "plan_release_event",
    "release_description",
    "reserve_plan",
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
    """Σ over chunks of top-r head votes, ``(L * H,)`` in (layer, head) order."""

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


def _select(
    votes: VoteSum, calibration: ReleaseCalibration, noise: NoiseSource, num_heads: int
) -> HeadSet:
    picked = calibration.gumbel().select(votes.total, noise=noise)
    return HeadSet.of((index // num_heads, index % num_heads) for index in picked)


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


def _check_public_heads(plan: ReleasePlan, num_layers: int, num_heads: int) -> None:
    for layer, head in plan.public_heads or ():
        if layer >= num_layers or head >= num_heads:
            raise ConfigError(
                f"public heads must lie within {num_layers} layers x {num_heads} heads, got "
                f"{(layer, head)!r}."
            )


def run_release(
    plan: ReleasePlan,
    *,
    sums: ReleaseSums,
    num_layers: int,
    num_heads: int,
    noise: NoiseSource,
    on_first_noise: Callable[[], None],
) -> ReleaseOutcome:
    """Run the plan's selection and its single Gaussian draw; see the module docstring."""
    _check_public_heads(plan, num_layers, num_heads)
    if plan.noise_mode is NoiseMode.DISTRIBUTED:
        return _run_distributed(
            plan, sums=sums, num_layers=num_layers, num_heads=num_heads, exposed=on_first_noise
        )
    calibration = plan_calibration(plan)
    exposed = _once(on_first_noise)
    all_heads = HeadSet.all_heads(num_layers=num_layers, num_heads=num_heads)
    fixed_scope = HeadSet(plan.public_heads) if plan.public_heads else all_heads
    private = plan.selection is SelectionMode.PRIVATE
    if plan.order is ReleaseOrder.SELECT_FIRST or plan.selection is SelectionMode.ALL:
        scope = fixed_scope
        if private:
            votes = sums.vote_sum(None)
            exposed()
            scope = _select(votes, calibration, noise, num_heads)
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
            reference = noisy_all.reshape(num_layers, num_heads, -1)
            released = _select(sums.vote_sum(reference), calibration, noise, num_heads)
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
    num_layers: int,
    num_heads: int,
    exposed: Callable[[], None],
) -> ReleaseOutcome:
    """Selection and release on sums the sites already noised (no draw here)."""
    mark = _once(exposed)
    all_heads = HeadSet.all_heads(num_layers=num_layers, num_heads=num_heads)
    scope = HeadSet(plan.public_heads) if plan.public_heads else all_heads
    private = plan.selection is SelectionMode.PRIVATE
    k = plan.num_selected_heads
    if plan.order is ReleaseOrder.SELECT_FIRST or plan.selection is SelectionMode.ALL:
        if private:
            votes = sums.vote_sum(None)
            mark()  # the noisy histogram exists: it is the first noisy output
            scope = _heads_of(top_k_from_noisy_votes(votes.total, k=k), num_heads)
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
            reference = noisy_all.reshape(num_layers, num_heads, -1)
            votes = sums.vote_sum(reference)
            released = _heads_of(top_k_from_noisy_votes(votes.total, k=k), num_heads)
        values = noisy_all[_rows(all_heads, released)]
    return _distributed_outcome(plan, summed, released, values, num_layers * num_heads)


def _heads_of(indices: tuple[int, ...], num_heads: int) -> HeadSet:
    return HeadSet.of((index // num_heads, index % num_heads) for index in indices)


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


def release_description(
    plan: ReleasePlan, outcome: ReleaseOutcome, *, model_dtype: str | None = None
) -> ReleaseDescription:
    """The manifest fields of a finished release: plan, privacy spent, m, K, C, σ, layout.

    Every manifest states its noise mode; a distributed one also t, the grid (γ, Δ̃), the
    share's noise multiplier, the survivors and ε if every survivor is honest.
    """
    parameters = {
        **plan_release_event(plan).to_dict(),
        "noise_mode": plan.noise_mode.value,
        "neighbouring": plan.neighbouring.value,
        "privacy_unit": plan.privacy_unit.value,
        "num_layers_in_scope": outcome.gaussian_heads.num_layers_in_scope,
        "gaussian_heads": len(outcome.gaussian_heads),
        "signal_to_noise": outcome.signal_to_noise,
    }
    if outcome.distributed is not None:
        parameters |= _distributed_parameters(plan, outcome, outcome.distributed)
    bound = outcome.bound
    return ReleaseDescription(
        protocol_version=PROTOCOL_VERSION,
        release_id=plan.release_id,
        model_fingerprint=plan.model_fingerprint,
        task=plan.task,
        plan=plan.model_dump(mode="json"),
        epsilon=bound.epsilon,
        delta=plan.delta,
        accountant=bound.accountant,
        accountant_parameters=parameters,
        num_chunks=outcome.num_chunks,
        shots=plan.shots,
        clip_norm=plan.clip_norm,
        noise_std=outcome.noise_std,
        model_dtype=model_dtype,
    )


def _distributed_parameters(
    plan: ReleasePlan, outcome: ReleaseOutcome, details: DistributedOutcome
) -> dict[str, object]:
    activations = details.release.activations(outcome.gaussian_heads)
    return {
        "min_honest": plan.min_honest,
        "mechanism": "distributed discrete Gaussian (KLS21), shares sized for min_honest",
        "scale": activations.scale,
        "grid_l2_sensitivity": activations.grid_l2_sensitivity,
        "share_noise_multiplier": activations.noise_multiplier,
        "survivors": details.survivors,
        "epsilon_if_all_survivors_honest": details.bound_if_all_honest.epsilon,
    }


def plan_release_event(plan: ReleasePlan) -> ReleaseEvent:
    """The event a ledger reserves for ``plan`` (its mechanisms at the plan's noise)."""
    if plan.noise_mode is NoiseMode.DISTRIBUTED:
        return plan_distributed_event(plan)
    return plan_calibration(plan).event


def reserve_plan(ledger: PrivacyLedger, plan: ReleasePlan, *, owned_by_run: bool = False) -> None:
    """Reserve the plan's calibrated cost in a ledger (refused with the numbers if over)."""
    event = plan_release_event(plan)
    bound = epsilon_bound([event], delta=plan.delta)
    ledger.reserve(
        release_id=plan.release_id,
        plan_hash=plan_hash(plan),
        event=event,
        epsilon=bound.epsilon,
        delta=plan.delta,
        accountant=bound.accountant,
        owned_by_run=owned_by_run,
    )
