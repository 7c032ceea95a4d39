"""The audit's statistics against closed forms and seeded samples.

Seeded samples make every check deterministic; the bounds quoted are what an unseeded run
would fail with probability below 1e-6 (|z| < 4.9 on a standard normal).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dpmtv_common.errors import ConfigError
from dpmtv_common.privacy.auditing import (
    clopper_pearson_epsilon,
    detection_power,
    epsilon_of_gdp,
    mu_estimate,
    runs_for_power,
)


def gdp_delta(epsilon: float, mu: float) -> float:
    """δ(ε) of a μ-GDP mechanism (Dong, Roth & Su 2019, Corollary 2.13)."""
    return float(
        stats.norm.cdf(-epsilon / mu + mu / 2)
        - math.exp(epsilon) * stats.norm.cdf(-epsilon / mu - mu / 2)
    )


@pytest.mark.parametrize("mu", [0.25, 1.0, 3.0])
def test_epsilon_of_gdp_is_where_the_gdp_delta_curve_meets_delta(mu: float) -> None:
    epsilon = epsilon_of_gdp(mu, 1e-5)

    assert epsilon > 0
    assert gdp_delta(epsilon, mu) == pytest.approx(1e-5, rel=1e-4)
    assert gdp_delta(epsilon * 0.99, mu) > 1e-5  # the smallest such ε


def test_epsilon_of_gdp_edges() -> None:
    assert epsilon_of_gdp(0.0, 1e-5) == 0.0
    assert epsilon_of_gdp(1e-4, 0.5) == 0.0  # δ(0) is already below 0.5
    assert epsilon_of_gdp(200.0, 1e-5) == math.inf
    assert epsilon_of_gdp(math.inf, 1e-5) == math.inf
    with pytest.raises(ConfigError, match="delta must lie in"):
        epsilon_of_gdp(1.0, 0.0)


def test_mu_estimate_covers_the_true_shift() -> None:
    rng = np.random.default_rng(0)
    without, with_canary = rng.normal(0, 2, 4000), rng.normal(1.0, 2, 4000)  # μ = 0.5

    mu, low, high = mu_estimate(without, with_canary, 0.95)

    assert low < 0.5 < high
    assert abs(mu - 0.5) < 4.9 * math.sqrt(2 / 4000 + 0.25 / 16000)
    assert high - low < 0.1


def test_mu_estimate_without_spread_is_infinite_or_zero() -> None:
    same = np.zeros(10)
    assert mu_estimate(same, same + 1.0, 0.95) == (math.inf, math.inf, math.inf)
    assert mu_estimate(same, same, 0.95) == (0.0, 0.0, 0.0)


def test_clopper_pearson_finds_separated_outputs_and_nothing_in_equal_ones() -> None:
    rng = np.random.default_rng(1)
    equal = clopper_pearson_epsilon(
        rng.normal(0, 1, 2000), rng.normal(0, 1, 2000), delta=1e-5, confidence=0.95
    )
    apart = clopper_pearson_epsilon(
        rng.normal(0, 1, 2000), rng.normal(6, 1, 2000), delta=1e-5, confidence=0.95
    )
    perfectly = clopper_pearson_epsilon(np.zeros(200), np.ones(200), delta=1e-5, confidence=0.95)

    assert equal < 0.3  # no real difference: no evidence beyond sampling noise
    assert apart > 3.0
    # Zero errors on 100 test runs a side: the bound is log((1 - δ - FNR⁺) / FPR⁺), finite.
    assert 2.0 < perfectly < math.inf


# ---------------------------------------------------------------- power and runs


def test_detection_power_is_one_half_when_the_true_mu_sits_z_errors_above_the_bar() -> None:
    # Arrange: mu_true - mu_bar = z * se makes the lower limit's median the bar itself
    runs, confidence, mu_true = 400, 0.95, 1.0
    se = math.sqrt(2 / runs + mu_true**2 / (2 * (2 * runs - 2)))
    z = float(stats.norm.isf(0.025))

    # Act
    power = detection_power(
        mu_true=mu_true, mu_bar=mu_true - z * se, runs=runs, confidence=confidence
    )

    # Assert
    assert power == pytest.approx(0.5, abs=1e-12)


def test_detection_power_matches_seeded_audits_of_known_mu() -> None:
    # Arrange: 2000 audits of 100 runs a side, outputs 0.8-GDP apart, bar 0.4
    rng = np.random.default_rng(7)
    runs, trials, mu_true, mu_bar = 100, 2000, 0.8, 0.4
    # Act
    flagged = sum(
        mu_estimate(rng.normal(0, 1, runs), rng.normal(mu_true, 1, runs), 0.95)[1] > mu_bar
        for _ in range(trials)
    )
    predicted = detection_power(mu_true=mu_true, mu_bar=mu_bar, runs=runs, confidence=0.95)
    # Assert: binomial sd at p ~ 0.5 over 2000 trials is 0.011; 4.9 sd plus the normal
    # approximation's own error (checked well under 0.02 here) bounds the difference
    assert abs(flagged / trials - predicted) < 4.9 * 0.0112 + 0.02


def test_runs_for_power_is_the_fewest_runs_that_reach_it() -> None:
    runs = runs_for_power(mu_true=0.9, mu_bar=0.6, power=0.8, confidence=0.95)

    assert runs is not None
    assert detection_power(mu_true=0.9, mu_bar=0.6, runs=runs, confidence=0.95) >= 0.8
    assert detection_power(mu_true=0.9, mu_bar=0.6, runs=runs - 1, confidence=0.95) < 0.8


def test_runs_for_power_is_none_when_the_bar_cannot_be_cleared() -> None:
    assert runs_for_power(mu_true=0.5, mu_bar=0.5, power=0.8, confidence=0.95) is None
    assert runs_for_power(mu_true=0.5, mu_bar=0.6, power=0.8, confidence=0.95) is None
    assert runs_for_power(mu_true=0.61, mu_bar=0.6, power=0.8, confidence=0.95, max_runs=50) is None


def test_a_large_gap_needs_only_the_fewest_runs() -> None:
    assert runs_for_power(mu_true=20.0, mu_bar=0.1, power=0.5, confidence=0.9) == 20


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: detection_power(mu_true=1, mu_bar=0, runs=19, confidence=0.95), "runs must be"),
        (lambda: detection_power(mu_true=1, mu_bar=0, runs=20, confidence=1.0), "confidence"),
        (lambda: runs_for_power(mu_true=1, mu_bar=0, power=1.0, confidence=0.95), "power must"),
        (lambda: runs_for_power(mu_true=1, mu_bar=0, power=0.8, confidence=0.4), "confidence"),
    ],
)
def test_power_arguments_are_checked(call, match) -> None:
    with pytest.raises(ConfigError, match=match):
        call()
