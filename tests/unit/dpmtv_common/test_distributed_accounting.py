"""Accounting of distributed discrete-Gaussian shares, checked against independent computations."""

import itertools
import math

import numpy as np
import pytest
from scipy import special, stats

from dpmtv_common.errors import CalibrationError, ConfigError
from dpmtv_common.privacy.composition import epsilon_bound
from dpmtv_common.privacy.distributed import (
    DistributedGaussianEvent,
    activation_noise,
    calibrate_distributed,
    combined_epsilon_bound,
    distributed_epsilon_bound,
    distributed_event_from_json,
    distributed_event_to_json,
    kls21_tau,
    mechanism_delta,
    release_epsilon,
    vote_noise,
)
from dpmtv_common.privacy.events import ReleaseEvent

EPSILON, DELTA = 1.0, 1e-5


def event(z=4.5, t=2, n=2, share_std=1e4, d=1) -> DistributedGaussianEvent:
    return DistributedGaussianEvent(
        noise_multiplier=z, min_honest=t, honest_shares=n, share_noise_std=share_std, dimension=d
    )


def release(selection_share: float | None, t: int = 2, max_sites: int = 10):
    cal = calibrate_distributed(epsilon=EPSILON, delta=DELTA, selection_share=selection_share)
    act = activation_noise(
        clip_norm=1.0,
        num_layers_in_scope=8,
        dimension=1024,
        max_chunks_per_site=100,
        noise_multiplier=cal.activation_noise_multiplier,
        min_honest=t,
        max_sites=max_sites,
        overflow_probability=cal.overflow_probability_per_sum,
    )
    votes = None
    if cal.selection_noise_multiplier is not None:
        votes = vote_noise(
            top_r=4,
            num_heads=64,
            max_chunks_per_site=100,
            noise_multiplier=cal.selection_noise_multiplier,
            min_honest=t,
            max_sites=max_sites,
            overflow_probability=cal.overflow_probability_per_sum,
        )
    return cal, act, votes


# --- independent references ----------------------------------------------------------------


def summed_discrete_gaussian_log_pmf(
    share_std: float, shares: int
) -> tuple[np.ndarray, np.ndarray]:
    """Exact log-pmf of the sum of ``shares`` iid N_Z(0, share_std²), on its integer support.

    Each share's pmf is normalised over ±(30σ + 30), where the mass left out is below
    exp(-450); the sum is their n-fold convolution (float64, entries above ~1e-200).
    """
    half = int(30 * share_std + 30)
    support = np.arange(-half, half + 1)
    log_weights = -(support.astype(np.float64) ** 2) / (2 * share_std**2)
    pmf = np.exp(log_weights - special.logsumexp(log_weights))
    total = pmf
    for _ in range(shares - 1):
        total = np.convolve(total, pmf)
    values = np.arange(total.size) - (total.size - 1) // 2
    with np.errstate(divide="ignore"):
        return values, np.log(total)


def renyi_divergence_of_shift(log_pmf: np.ndarray, shift: int, alpha: float) -> float:
    """D_α(Z + shift ‖ Z) by direct summation over the common support."""
    p = log_pmf[:-shift] if shift else log_pmf  # P(Z + shift = x) = P(Z = x - shift)
    q = log_pmf[shift:] if shift else log_pmf
    keep = np.isfinite(p) & np.isfinite(q) & (p > -600) & (q > -600)
    terms = alpha * p[keep] + (1 - alpha) * q[keep]
    return float(special.logsumexp(terms) / (alpha - 1))


def hockey_stick_delta(log_pmf: np.ndarray, shift: int, epsilon: float) -> float:
    """Exact δ(ε) of adding Z to a 1-d integer query with sensitivity ``shift``: both directions."""
    p = np.exp(log_pmf[:-shift])
    q = np.exp(log_pmf[shift:])
    forward = np.sum(np.maximum(p - math.exp(epsilon) * q, 0.0))
    backward = np.sum(np.maximum(q - math.exp(epsilon) * p, 0.0))
    return float(max(forward, backward))


def analytic_gaussian_delta(noise_multiplier: float, epsilon: float) -> float:
    """δ(ε) of the continuous Gaussian with σ/Δ = z (Balle & Wang 2018, Thm 8)."""
    a, b = 1 / (2 * noise_multiplier), epsilon * noise_multiplier
    return float(stats.norm.cdf(a - b) - math.exp(epsilon) * stats.norm.cdf(-a - b))


# --- tests ---------------------------------------------------------------------------------


def test_kls21_tau_matches_the_formula_and_vanishes_for_one_share():
    assert kls21_tau(share_noise_std=0.6, num_shares=1) == 0.0
    expected = 10 * (
        math.exp(-2 * math.pi**2 * 0.36 / 2) + math.exp(-2 * math.pi**2 * 0.36 * 2 / 3)
    )
    assert kls21_tau(share_noise_std=0.6, num_shares=3) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ConfigError, match="1/2"):
        kls21_tau(share_noise_std=0.4, num_shares=3)


@pytest.mark.parametrize(("share_std", "shares", "shift"), [(0.6, 3, 1), (1.0, 2, 2), (0.8, 4, 3)])
@pytest.mark.parametrize("alpha", [1.5, 2.0, 4.0, 10.0])
def test_kls21_bound_covers_the_exact_renyi_divergence_of_the_summed_shares(
    share_std, shares, shift, alpha
):
    # Arrange: small shares, where τ is large enough to matter.
    _, log_pmf = summed_discrete_gaussian_log_pmf(share_std, shares)
    z = share_std * math.sqrt(shares) / shift  # std of the n shares over Δ (t = n)
    bound_event = event(z=z, t=shares, n=shares, share_std=share_std, d=1)
    # Act
    exact = renyi_divergence_of_shift(log_pmf, shift, alpha)
    claimed = bound_event.rho * alpha + bound_event.xi
    # Assert: a valid bound is never below the truth.
    assert exact <= claimed * (1 + 1e-9)


@pytest.mark.parametrize("alpha", [2.0, 8.0, 32.0])
def test_kls21_bound_is_tight_once_shares_are_a_few_grid_units(alpha):
    # σ_l = 4 grid units, 3 shares, shift 5: τ ~ 1e-68, so the bound is the Gaussian's αΔ²/(2nσ²).
    _, log_pmf = summed_discrete_gaussian_log_pmf(4.0, 3)
    z = 4.0 * math.sqrt(3) / 5  # std of 3 shares over Δ
    bound_event = event(z=z, t=3, n=3, share_std=4.0, d=1)
    exact = renyi_divergence_of_shift(log_pmf, 5, alpha)
    claimed = bound_event.rho * alpha + bound_event.xi
    assert exact <= claimed * (1 + 1e-9)
    assert exact == pytest.approx(claimed, rel=1e-6)


def test_claimed_epsilon_holds_for_the_exact_privacy_curve_of_the_discrete_mechanism():
    # Arrange: 1-d integer query with Δ = 10, shares sized for t = 2 at z = 4.5, 2 shares.
    z, t, shift = 4.5, 2, 10
    share_std = z * shift / math.sqrt(t)
    _, log_pmf = summed_discrete_gaussian_log_pmf(share_std, t)
    claimed = distributed_epsilon_bound([event(z=z, t=t, n=t, share_std=share_std)], delta=DELTA)
    # Act
    exact_delta = hockey_stick_delta(log_pmf, shift, claimed.epsilon)
    # Assert: the exact δ at the claimed ε is within the claim, and it is the continuous
    # Gaussian's (the discrete sum of 2 shares of std 22 is Gaussian to 1e-3 relative).
    assert exact_delta <= DELTA
    assert exact_delta == pytest.approx(analytic_gaussian_delta(z, claimed.epsilon), rel=1e-3)


def test_large_shares_give_the_continuous_gaussian_rdp_epsilon():
    from dp_accounting import dp_event, rdp

    accountant = rdp.RdpAccountant()
    accountant.compose(dp_event.GaussianDpEvent(noise_multiplier=4.5))
    expected = accountant.get_epsilon(DELTA)
    bound = distributed_epsilon_bound([event(z=4.5, t=2, n=2, share_std=1e4, d=10**6)], delta=DELTA)
    assert bound.epsilon == pytest.approx(expected, rel=1e-9)
    assert bound.accountant == "rdp"


def test_lone_activation_calibration_equals_the_rdp_gaussian_calibration():
    # notes/dp.md §1.2: dp_accounting RDP calibration at ε = 1, δ = 1e-5 gives z = 4.0454.
    cal = calibrate_distributed(epsilon=EPSILON, delta=DELTA, selection_share=None)
    assert cal.activation_noise_multiplier == pytest.approx(4.0454, abs=2e-4)
    assert cal.selection_noise_multiplier is None


@pytest.mark.parametrize("selection_share", [None, 0.1, 0.5])
def test_calibrated_release_meets_the_target_at_t_honest_shares(selection_share):
    # Arrange
    _, act, votes = release(selection_share)
    # Act
    bound = release_epsilon(act, votes, honest_shares=2, delta=DELTA)
    # Assert: within the target, and not wastefully below it.
    assert bound.epsilon <= EPSILON
    assert bound.epsilon == pytest.approx(EPSILON, abs=1e-6)
    assert bound.delta == DELTA


def test_selection_share_splits_the_zcdp_budget():
    cal, _, _ = release(0.25)
    rho_act = 1 / (2 * cal.activation_noise_multiplier**2)
    rho_sel = 1 / (2 * cal.selection_noise_multiplier**2)
    assert rho_sel / (rho_act + rho_sel) == pytest.approx(0.25, rel=1e-9)


def test_composition_is_the_same_in_both_orders():
    _, act, votes = release(0.3)
    first = distributed_epsilon_bound([act.event(3), votes.event(3)], delta=DELTA)
    second = distributed_epsilon_bound([votes.event(3), act.event(3)], delta=DELTA)
    assert first.epsilon == pytest.approx(second.epsilon, rel=1e-12)


def test_dropouts_raise_epsilon_and_extra_honest_shares_lower_it():
    _, act, votes = release(0.2, t=4)
    by_shares = [
        release_epsilon(act, votes, honest_shares=n, delta=DELTA).epsilon for n in range(1, 11)
    ]
    assert all(a > b for a, b in itertools.pairwise(by_shares))
    assert by_shares[3] <= EPSILON  # 4 honest shares: the calibrated target
    assert by_shares[2] > EPSILON  # one honest share fewer: the guarantee is weaker


def test_one_share_sized_for_t_1_protects_the_site_alone():
    _, act, votes = release(0.2, t=1)
    assert release_epsilon(act, votes, honest_shares=1, delta=DELTA).epsilon <= EPSILON


def test_release_epsilon_refuses_delta_below_the_overflow_probability():
    _, act, votes = release(0.2)
    with pytest.raises(ConfigError, match="delta"):
        release_epsilon(act, votes, honest_shares=2, delta=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"selection_share": 1.0}, "selection_share"),
        ({"selection_share": None, "overflow_probability_per_sum": 1e-6}, "overflow"),
        ({"selection_share": None, "epsilon": -1.0}, "epsilon"),
    ],
)
def test_calibration_refuses_bad_arguments(kwargs, match):
    settings = {"epsilon": EPSILON, "delta": DELTA, **kwargs}
    with pytest.raises(ConfigError, match=match):
        calibrate_distributed(**settings)


def test_event_refuses_bad_fields():
    with pytest.raises(ConfigError, match="honest_shares"):
        event(n=0)
    with pytest.raises(ConfigError, match="noise_multiplier"):
        event(z=0.0)


def test_the_tau_term_is_needed_for_small_shares():
    # Without ξ = τ·d the zCDP claim would be false here (exact 4.656 > ρα = 4.630):
    # the comparison above can fail, and does for a bound that drops τ.
    _, log_pmf = summed_discrete_gaussian_log_pmf(0.6, 3)
    small = event(z=0.6 * math.sqrt(3), t=3, n=3, share_std=0.6, d=1)
    assert renyi_divergence_of_shift(log_pmf, 1, 10.0) > small.rho * 10.0


def test_overflow_aborts_cost_one_plus_e_to_the_epsilon_times_p_of_delta():
    left = mechanism_delta(epsilon=2.0, delta=1e-5, overflow_probability=1e-9)
    assert left == pytest.approx(1e-5 - (1 + math.exp(2.0)) * 1e-9, rel=1e-12)
    with pytest.raises(ConfigError, match="overflow_probability"):
        mechanism_delta(epsilon=8.0, delta=1e-5, overflow_probability=1e-9)


def test_calibration_leaves_room_for_the_overflow_aborts():
    cal = calibrate_distributed(epsilon=EPSILON, delta=DELTA, selection_share=0.2)
    assert cal.overflow_probability == 2e-12
    assert cal.mechanism_delta == pytest.approx(DELTA - (1 + math.e) * 2e-12, rel=1e-12)
    assert cal.bound.epsilon <= EPSILON


def test_calibration_refuses_an_epsilon_no_noise_level_meets():
    with pytest.raises(CalibrationError, match="rho"):
        calibrate_distributed(epsilon=1e-5, delta=DELTA, selection_share=None)


def test_a_large_epsilon_needs_a_smaller_overflow_probability():
    # (1 + e^20)·1e-12 = 4.9e-4 > δ/10: the aborts alone would spend the δ.
    with pytest.raises(ConfigError, match="lower the overflow probability"):
        calibrate_distributed(epsilon=20.0, delta=DELTA, selection_share=None)
    cal = calibrate_distributed(
        epsilon=20.0, delta=DELTA, selection_share=None, overflow_probability_per_sum=1e-20
    )
    assert cal.bound.epsilon <= 20.0


def test_accounting_refuses_empty_events_bad_delta_and_zero_shares():
    with pytest.raises(ConfigError, match="empty"):
        distributed_epsilon_bound([], delta=DELTA)
    with pytest.raises(ConfigError, match="delta"):
        distributed_epsilon_bound([event()], delta=1.0)
    with pytest.raises(ConfigError, match="num_shares"):
        kls21_tau(share_noise_std=1.0, num_shares=0)


# --- ledger composition --------------------------------------------------------------------


def test_distributed_event_json_round_trips_and_rejects_other_keys():
    original = event(z=3.5, t=2, n=4, share_std=123.0, d=77)
    text = distributed_event_to_json(original)
    assert distributed_event_from_json(text) == original
    with pytest.raises(ConfigError, match="keys"):
        distributed_event_from_json('{"noise_multiplier": 1.0}')
    with pytest.raises(ConfigError, match="JSON"):
        distributed_event_from_json("not json")


def test_central_only_composition_is_the_central_accountant():
    central = [ReleaseEvent(5.0, picks=8, epsilon_per_pick=0.1)]
    combined = combined_epsilon_bound(central, [], delta=DELTA)
    assert combined == epsilon_bound(central, delta=DELTA)


def test_mixed_composition_adds_the_rdp_curves():
    from dp_accounting import dp_event, rdp

    # Arrange: one central release (z = 5, 8 picks at 0.1) and one distributed (z = 4.5).
    central = [ReleaseEvent(5.0, picks=8, epsilon_per_pick=0.1)]
    distributed = [event(z=4.5, t=2, n=3)]
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_event.GaussianDpEvent(noise_multiplier=5.0))
    accountant.compose(dp_event.ZCDpEvent(rho=8 * 0.1**2 / 8))
    accountant.compose(dp_event.ZCDpEvent(rho=2 / (2 * 3 * 4.5**2)))
    # Act
    combined = combined_epsilon_bound(central, distributed, delta=DELTA, overflow_probability=1e-12)
    # Assert: the same curve, at a δ smaller by the aborts' (1 + e^ε)·p.
    assert combined.accountant == "rdp"
    assert combined.epsilon == pytest.approx(accountant.get_epsilon(DELTA), rel=1e-5)
    assert combined.epsilon >= accountant.get_epsilon(DELTA)


def test_mixed_composition_needs_the_overflow_probability_and_some_event():
    with pytest.raises(ConfigError, match="overflow_probability"):
        combined_epsilon_bound([], [event()], delta=DELTA)
    with pytest.raises(ConfigError, match="empty"):
        combined_epsilon_bound([], [], delta=DELTA)


def test_an_overflow_cost_whose_fixed_point_never_settles_is_refused():
    # Arrange: a mechanism whose ε always exceeds the cap it was evaluated under by 0.01
    from dpmtv_common.privacy.distributed._composition import _with_overflow

    delta, p = 1e-5, 1e-12

    def epsilon_at(left: float) -> float:
        cap = math.log(max((delta - left) / p - 1.0, 1.0))  # the cap this δ was left under
        return cap + 0.01

    # Act / Assert: refused, never an ε below what the mechanism spends
    with pytest.raises(ConfigError, match="leave room for the overflow probability"):
        _with_overflow(epsilon_at, delta, p)
