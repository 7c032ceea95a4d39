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
from dpmtv_common.privacy.auditing import clopper_pearson_epsilon, epsilon_of_gdp, mu_estimate


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
