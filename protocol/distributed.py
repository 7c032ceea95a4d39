"""A distributed-noise plan's public numbers, derived identically by every site and the coordinator.

How this connects: in ``distributed`` noise mode every secure sum carries the sites' own
discrete-Gaussian shares (``dpmtv_common.privacy.distributed``), so both sides need the same
SecAgg+ grid (c, Q, M), scale γ and share size for each sum. They are functions of the plan
and the model's shape only — never of a site's data — so a site recomputes them and refuses a
secure sum whose SecAgg+ ranges differ, and recomputes the ε and σ an artifact must state.

Privacy unit and relation: the plan's (one example or group; replace-one). Sensitivities:
Δ₂ = 2·C·√L_scope for activations, √(2r) for top-r votes. Noise: each share sized for
``plan.min_honest`` honest shares (σ_site² = σ²/t).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.accounting import EpsilonBound
from dpmtv_common.privacy.distributed import (
    XI_RESERVE,
    DistributedCalibration,
    DistributedNoise,
    activation_noise,
    calibrate_distributed,
    release_epsilon,
    vote_noise,
)
from dpmtv_common.privacy.events import ReleaseEvent
from protocol.plan import ReleasePlan, SelectionMode

__all__ = [
    "DistributedRelease",
    "plan_distributed_calibration",
    "plan_distributed_event",
]


def plan_distributed_calibration(plan: ReleasePlan) -> DistributedCalibration:
    """Z of the activation sum (and of the vote sum in private mode) meeting the plan's (ε, δ)."""
    share = plan.selection_share if plan.selection is SelectionMode.PRIVATE else None
    return calibrate_distributed(epsilon=plan.epsilon, delta=plan.delta, selection_share=share)


def plan_distributed_event(plan: ReleasePlan) -> ReleaseEvent:
    """What ledgers reserve: the plan's sums as (ρ, ξ)-zCDP at t honest shares."""
    calibration = plan_distributed_calibration(plan)
    multipliers = [calibration.activation_noise_multiplier]
    if calibration.selection_noise_multiplier is not None:
        multipliers.append(calibration.selection_noise_multiplier)
    # ρ = t/(2·n_h·z²) at n_h = t honest shares; ξ at the calibration's reserve per sum.
    rho = sum(1.0 / (2.0 * z * z) for z in multipliers)
    return ReleaseEvent(
        noise_multiplier=None,
        distributed_rho=rho,
        distributed_xi=XI_RESERVE * len(multipliers),
        overflow_probability=calibration.overflow_probability,
    )


@dataclass(frozen=True)
class DistributedRelease:
    """The grids of one distributed release, for a given head scope and model shape.

    Attributes:
        plan: The plan.
        num_heads_total: L·H of the model (the vote histogram's length).
        head_dim: D.
    """

    plan: ReleasePlan
    num_heads_total: int
    head_dim: int

    @cached_property
    def calibration(self) -> DistributedCalibration:
        """The plan's noise multipliers (a bisection: computed once per instance)."""
        return plan_distributed_calibration(self.plan)

    def activations(self, heads: HeadSet) -> DistributedNoise:
        """The activation sum over ``heads``: Δ₂ = 2·C·√L_scope, |X_j| ≤ m_max·C."""
        plan, calibration = self.plan, self.calibration
        return activation_noise(
            clip_norm=plan.clip_norm,
            num_layers_in_scope=heads.num_layers_in_scope,
            dimension=len(heads) * self.head_dim,
            max_chunks_per_site=_required(plan.max_chunks_per_site),
            noise_multiplier=calibration.activation_noise_multiplier,
            min_honest=plan.min_honest,
            max_sites=_required(plan.max_sites),
            overflow_probability=calibration.overflow_probability_per_sum,
        )

    def votes(self) -> DistributedNoise | None:
        """The vote histogram (private selection only): Δ₂ = √(2r), |X_j| ≤ m_max."""
        plan, calibration = self.plan, self.calibration
        z = calibration.selection_noise_multiplier
        if z is None:
            return None
        return vote_noise(
            top_r=plan.score_top_r,
            num_heads=self.num_heads_total,
            max_chunks_per_site=_required(plan.max_chunks_per_site),
            noise_multiplier=z,
            min_honest=plan.min_honest,
            max_sites=_required(plan.max_sites),
            overflow_probability=calibration.overflow_probability_per_sum,
        )

    def bound(self, gaussian_heads: HeadSet, *, honest_shares: int) -> EpsilonBound:
        """ε at the plan's δ when ``honest_shares`` honest shares land in each sum."""
        return release_epsilon(
            self.activations(gaussian_heads),
            self.votes(),
            honest_shares=honest_shares,
            delta=self.plan.delta,
        )

    def noise_std(self, gaussian_heads: HeadSet) -> float:
        """σ of the released activation sum at t honest shares, in real units."""
        return self.activations(gaussian_heads).released_noise_std(self.plan.min_honest)


def _required(value: int | None) -> int:
    if value is None:  # ReleasePlan refuses a distributed plan without it
        raise ConfigError("a distributed plan must set max_sites and max_chunks_per_site.")
    return value
