"""What a distributed-noise release costs: KLS21 zCDP of a sum of discrete-Gaussian shares.

Mechanism (all in grid units, after the sites scaled by γ and rounded): n_h honest sites each
add an independent N_Z(0, σ_l²)^d share to an integer vector whose replace-one L2 sensitivity
is Δ̃ (the rounding-inflated sensitivity, see ``_codec``). Kairouz, Liu & Steinke (ICML 2021,
arXiv 2102.06387, Thm 1) bound the Rényi divergence of the summed noise Z shifted by any
integer Δ with ‖Δ‖₂ ≤ Δ̃, for σ_l ≥ 1/2 and every α ≥ 1:

    D_α(Z + Δ ‖ Z) ≤ α·Δ̃²/(2·n_h·σ_l²) + τ·d,   τ = 10·Σ_{k=1}^{n_h−1} exp(−2π²σ_l²·k/(k+1)),

i.e. (ξ = τ·d, ρ = Δ̃²/(2·n_h·σ_l²))-zCDP, a dp-accounting ``ZCDpEvent(rho, xi)``. Shares are
sized as σ_l = z·Δ̃/√t for the site's assumed number t of honest participants, so
ρ = t/(2·n_h·z²): z is the noise multiplier of the summed noise when exactly t honest shares
land in the sum, and extra honest shares only lower ρ. Coordinator-side division by γ is
post-processing. At grid-unit σ_l ≥ 2, τ < 1e-15·n_h, so the bound is the continuous Gaussian's
RDP curve; ``_params`` refuses parameters whose τ·d exceeds ``XI_RESERVE``.

Why RDP only, no PLD: dp-accounting's PLDs are for the continuous Gaussian or a 1-d discrete
Gaussian; the privacy-loss distribution of a d-dimensional sum of discrete Gaussians under an
L2 ball is not dominated by either on any result we could cite, so claiming the Gaussian PLD
would be unproven. The RDP route costs about 8 % more noise than the analytic Gaussian for a
lone release (notes/dp.md §1.1); that is the price of an honest bound.

Selection in this mode is a second distributed sum of the same kind: each chunk's top-r
vote vector (r ones) changes by at most √(2r) in L2 under replace-one, the noisy histogram's
top k is post-processing. Both releases are zCDP events, so their composition is the sum of
(ρ, ξ) whatever the order (select-first or release-first): adaptive composition of zCDP
(Bun & Steinke 2016, Lemma 2.3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from dpmtv_common.errors import CalibrationError, ConfigError
from dpmtv_common.privacy._search import last_met_level
from dpmtv_common.privacy.accounting import EpsilonBound

__all__ = [
    "DistributedCalibration",
    "DistributedGaussianEvent",
    "XI_RESERVE",
    "calibrate_distributed",
    "distributed_epsilon_bound",
    "kls21_tau",
    "kls21_tau_upper_bound",
    "mechanism_delta",
]

XI_RESERVE = 1e-9
"""Largest ξ = τ·d one distributed sum may carry; calibration sets this much aside per sum."""

_BISECTION_STEPS = 60
_RHO_MIN, _RHO_MAX = 1e-10, 1e4


def kls21_tau(*, share_noise_std: float, num_shares: int) -> float:
    """τ of KLS21 Thm 1 for ``num_shares`` shares of std ``share_noise_std`` (grid units).

    Raises:
        ConfigError: if σ_l < 1/2 (outside the theorem) or num_shares < 1.
    """
    _check_share_std(share_noise_std)
    if num_shares < 1:
        raise ConfigError(f"num_shares must be >= 1, got {num_shares!r}.")
    variance = share_noise_std**2
    return 10.0 * math.fsum(
        math.exp(-2.0 * math.pi**2 * variance * k / (k + 1)) for k in range(1, num_shares)
    )


def kls21_tau_upper_bound(*, share_noise_std: float, max_shares: int) -> float:
    """τ ≤ 10·(n − 1)·exp(−π²σ_l²), valid for every number of shares up to ``max_shares``.

    Every term of τ has k/(k+1) ≥ 1/2, which gives the bound; it is monotone in n, so it
    covers any dropout pattern below ``max_shares``.
    """
    _check_share_std(share_noise_std)
    return 10.0 * max(max_shares - 1, 0) * math.exp(-(math.pi**2) * share_noise_std**2)


def _check_share_std(share_noise_std: float) -> None:
    if not (math.isfinite(share_noise_std) and share_noise_std >= 0.5):
        raise ConfigError(
            f"share_noise_std must be finite and >= 1/2 grid unit (KLS21 Thm 1), "
            f"got {share_noise_std!r}."
        )


@dataclass(frozen=True, kw_only=True)
class DistributedGaussianEvent:
    """One secure sum to which ``honest_shares`` honest discrete-Gaussian shares were added.

    Sensitivity: Δ̃, the rounding-inflated replace-one L2 sensitivity in grid units (one
    chunk, i.e. one privacy unit, changes). Noise: each honest share is N_Z(0, σ_l²)^d with
    σ_l = z·Δ̃/√t. Privacy: (ρ = t/(2·n_h·z²), ξ = τ·d)-zCDP (KLS21 Thm 1).

    Attributes:
        noise_multiplier: z, std of the summed noise over Δ̃ when exactly t shares are summed.
        min_honest: t, the number of honest shares each share was sized for.
        honest_shares: n_h, honest shares actually in the sum (after dropouts, fakes removed).
        share_noise_std: σ_l in grid units (enters τ).
        dimension: d, coordinates of the summed vector.
    """

    noise_multiplier: float
    min_honest: int
    honest_shares: int
    share_noise_std: float
    dimension: int

    def __post_init__(self) -> None:
        z = self.noise_multiplier
        if not (math.isfinite(z) and z > 0):
            raise ConfigError(f"noise_multiplier must be finite and > 0, got {z!r}.")
        for name in ("min_honest", "honest_shares", "dimension"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}.")
        _check_share_std(self.share_noise_std)

    @property
    def rho(self) -> float:
        """ρ = Δ̃²/(2·n_h·σ_l²) = t/(2·n_h·z²)."""
        return self.min_honest / (2.0 * self.honest_shares * self.noise_multiplier**2)

    @property
    def xi(self) -> float:
        """ξ = τ·d (KLS21); negligible once σ_l is a few grid units."""
        tau = kls21_tau(share_noise_std=self.share_noise_std, num_shares=self.honest_shares)
        return tau * self.dimension


def _check_delta(delta: float) -> None:
    if not (0.0 < delta < 1.0):
        raise ConfigError(f"delta must lie in (0, 1), got {delta!r}.")


def _epsilon_zcdp(terms: Sequence[tuple[float, float]], delta: float) -> float:
    from dp_accounting import dp_event, rdp

    accountant = rdp.RdpAccountant()
    for rho, xi in terms:
        accountant.compose(dp_event.ZCDpEvent(rho=rho, xi=xi))
    return float(accountant.get_epsilon(delta))


def distributed_epsilon_bound(
    events: Sequence[DistributedGaussianEvent], *, delta: float
) -> EpsilonBound:
    """ε at ``delta`` of the composition of ``events`` (RDP; the order does not matter).

    ``delta`` is the δ of the mechanisms alone; :func:`mechanism_delta` says how much of a
    total δ is left for them once the sums' overflow aborts are counted.
    """
    _check_delta(delta)
    if not events:
        raise ConfigError("events must not be empty, got [].")
    epsilon = _epsilon_zcdp([(event.rho, event.xi) for event in events], delta)
    return EpsilonBound(epsilon, delta, "rdp", {"rdp": epsilon})


@dataclass(frozen=True)
class DistributedCalibration:
    """Noise multipliers of a distributed-noise release, valid when t honest shares land.

    Attributes:
        epsilon: total ε target.
        delta: total δ target (mechanisms plus the overflow aborts).
        mechanism_delta: δ left for the mechanisms, ``delta − (1 + e^ε)·overflow_probability``.
        overflow_probability: total probability, over the release's sums, that a share
            leaves its SecAgg+ range (then the round aborts; counted in δ). Pass
            ``overflow_probability_per_sum`` to every ``DistributedNoise`` of the release.
        selection_share: fraction of the zCDP budget ρ spent on the vote histogram, or None
            when no private selection runs.
        activation_noise_multiplier: z of the activation sum (std / Δ̃ at t shares).
        selection_noise_multiplier: z of the vote sum, or None.
        bound: the (ε, δ) the calibrated release achieves at t honest shares and ξ at its
            reserve (the real ξ is smaller, so the real ε is too).
    """

    epsilon: float
    delta: float
    mechanism_delta: float
    overflow_probability: float
    selection_share: float | None
    activation_noise_multiplier: float
    selection_noise_multiplier: float | None
    bound: EpsilonBound

    @property
    def overflow_probability_per_sum(self) -> float:
        """Overflow probability of each secure sum (the total split over one or two sums)."""
        return self.overflow_probability / (1 if self.selection_share is None else 2)


@lru_cache(maxsize=64)
def calibrate_distributed(
    *,
    epsilon: float,
    delta: float,
    selection_share: float | None,
    overflow_probability_per_sum: float = 1e-12,
) -> DistributedCalibration:
    """Smallest noise that keeps the distributed release within (epsilon, delta).

    The release is one activation sum and, unless ``selection_share`` is None, one vote sum.
    The total zCDP budget ρ is the largest whose RDP conversion, with ξ = ``XI_RESERVE`` per
    sum, stays within ``epsilon`` at :func:`mechanism_delta` (bisection, rounded towards
    privacy); the votes get ``selection_share·ρ``, the activations the rest, and
    z = 1/√(2ρ_part) for each (ρ = t/(2·n_h·z²) at n_h = t honest shares). Cached: a pure
    function of its arguments whose bisection takes about half a second, asked for again by
    every sum of a release (and every run of an audit).

    Raises:
        ConfigError: on an argument out of range.
        CalibrationError: if no ρ in [1e-10, 1e4] meets the target.
    """
    _check_delta(delta)
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ConfigError(f"epsilon must be finite and > 0, got {epsilon!r}.")
    if selection_share is not None and not (0.0 < selection_share < 1.0):
        raise ConfigError(
            f"selection_share must lie in (0, 1) or be None, got {selection_share!r}."
        )
    sums = 1 if selection_share is None else 2
    overflow_probability = sums * overflow_probability_per_sum
    left = mechanism_delta(epsilon=epsilon, delta=delta, overflow_probability=overflow_probability)
    # The margin keeps the split (ρ_a + ρ_s in float) from landing an ulp above the target.
    rho = _largest_rho(epsilon, left, sums) * (1.0 - 1e-9)
    share = 0.0 if selection_share is None else selection_share
    z_act = 1.0 / math.sqrt(2.0 * (1.0 - share) * rho)
    z_sel = None if selection_share is None else 1.0 / math.sqrt(2.0 * share * rho)
    parts = [((1.0 - share) * rho, XI_RESERVE)]
    if selection_share is not None:
        parts.append((share * rho, XI_RESERVE))
    achieved = _epsilon_zcdp(parts, left)
    bound = EpsilonBound(achieved, left, "rdp", {"rdp": achieved})
    return DistributedCalibration(
        epsilon, delta, left, overflow_probability, selection_share, z_act, z_sel, bound
    )


def mechanism_delta(*, epsilon: float, delta: float, overflow_probability: float) -> float:
    """δ left for the mechanisms when the sums abort with total probability p: δ − (1 + e^ε)·p.

    Why (1 + e^ε): the real protocol M' equals the analysed mechanism M except on the abort
    event, so TV(M(D), M'(D)) ≤ p on every dataset, and
    P[M'(D) ∈ S] ≤ P[M(D) ∈ S] + p ≤ e^ε·(P[M'(D') ∈ S] + p) + δ_M + p.

    Raises:
        ConfigError: if p is not in (0, 1) or (1 + e^ε)·p exceeds δ/10.
    """
    _check_delta(delta)
    cost = (1.0 + math.exp(min(epsilon, 700.0))) * overflow_probability
    if not (0.0 < overflow_probability < 1.0 and cost <= delta / 10):
        raise ConfigError(
            f"overflow_probability must be in (0, 1) with (1 + e^epsilon)*p <= delta/10 = "
            f"{delta / 10!r}, got p={overflow_probability!r} (cost {cost!r} at "
            f"epsilon={epsilon!r}); lower the overflow probability."
        )
    return delta - cost


def _largest_rho(epsilon: float, delta: float, sums: int) -> float:
    def spent(rho: float) -> float:
        return _epsilon_zcdp([(rho, sums * XI_RESERVE)], delta)

    lo, hi = _RHO_MIN, _RHO_MAX
    if spent(lo) > epsilon:
        raise CalibrationError(
            f"epsilon must allow at least rho={lo!r} zCDP at delta={delta!r}, got {epsilon!r}."
        )
    if spent(hi) <= epsilon:
        return hi
    # Less ρ is more noise: the met side is the low one.
    return last_met_level(
        lambda rho: spent(rho) <= epsilon, met=lo, unmet=hi, steps=_BISECTION_STEPS
    )
