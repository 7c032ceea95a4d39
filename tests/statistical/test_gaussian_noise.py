"""The production Gaussian against theory, with a stated false-failure rate.

Every threshold below is a two-sided z-bound at false-failure rate 1e-6 per check
(z = 4.89), derived from the sampling distribution of the statistic; KS checks fail only
when p < 1e-6. Each test also plants a bug and shows the same check catches it, so the
checks cannot pass vacuously.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dpmtv_common.privacy.accounting import analytic_noise_multiplier
from dpmtv_common.privacy.mechanisms import GaussianSumMechanism
from dpmtv_common.privacy.noise import secure_noise
from dpmtv_common.privacy.testing import SeededNoise

pytestmark = pytest.mark.statistical

FALSE_FAILURE_RATE = 1e-6
Z_BOUND = float(stats.norm.isf(FALSE_FAILURE_RATE / 2))  # 4.89
NUM_DRAWS = 500_000


def matches_standard_normal(residuals: np.ndarray) -> bool:
    """True when residuals look N(0, 1): std, mean and KS at the stated false-failure rate."""
    n = residuals.size
    # The sample std of n normals has relative standard error ~ 1/sqrt(2n).
    std_ok = abs(residuals.std() - 1.0) < Z_BOUND / math.sqrt(2 * n)
    mean_ok = abs(residuals.mean()) < Z_BOUND / math.sqrt(n)
    ks_ok = stats.kstest(residuals, "norm").pvalue > FALSE_FAILURE_RATE
    return bool(std_ok and mean_ok and ks_ok)


def _residuals(mechanism: GaussianSumMechanism, claimed_std: float, noise, size: int):
    clipped_sum = np.full(size, 0.25)
    noisy = mechanism.privatize_sum(clipped_sum, noise=noise)
    return (noisy - clipped_sum) / claimed_std


def test_secure_gaussian_noise_has_the_claimed_std_over_half_a_million_draws():
    # Arrange: z = 1.5, C = 0.5, L = 4, so sigma = 1.5 * 2 * 0.5 * 2 = 3.0.
    mechanism = GaussianSumMechanism(clip_norm=0.5, num_layers_in_scope=4, noise_multiplier=1.5)
    assert mechanism.noise_std == pytest.approx(3.0)
    # Act
    residuals = _residuals(mechanism, 3.0, secure_noise(), NUM_DRAWS)
    # Assert
    assert matches_standard_normal(residuals)


class _DoubledNoise(GaussianSumMechanism):
    @property
    def noise_std(self) -> float:
        return 2.0 * super().noise_std


def test_planted_double_sigma_is_caught():
    mechanism = _DoubledNoise(clip_norm=0.5, num_layers_in_scope=4, noise_multiplier=1.5)
    residuals = _residuals(mechanism, 3.0, SeededNoise(11), NUM_DRAWS)
    assert not matches_standard_normal(residuals)


def test_planted_classical_formula_is_caught():
    # The classical sigma at eps=1, delta=1e-5 is 1.30x the analytic one.
    classical = math.sqrt(2 * math.log(1.25 / 1e-5)) / 1.0
    analytic = analytic_noise_multiplier(epsilon=1.0, delta=1e-5)
    mechanism = GaussianSumMechanism(
        clip_norm=0.5, num_layers_in_scope=1, noise_multiplier=classical
    )
    claimed = analytic * mechanism.l2_sensitivity
    residuals = _residuals(mechanism, claimed, SeededNoise(12), NUM_DRAWS)
    assert not matches_standard_normal(residuals)


def test_secure_discrete_gaussian_has_the_claimed_std():
    draws = secure_noise().discrete_gaussian(200_000, noise_std=1000.0).astype(np.float64)
    # At std 1000 the discrete Gaussian's variance equals the continuous one to ~1e-400.
    n = draws.size
    assert abs(draws.std() / 1000.0 - 1.0) < Z_BOUND / math.sqrt(2 * n)
    assert abs(draws.mean() / 1000.0) < Z_BOUND / math.sqrt(n)
