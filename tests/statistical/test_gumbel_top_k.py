"""One-shot Gumbel top-k against the exact Plackett-Luce law (notes/dp.md §2.1, §4.3 test 7).

The chi-square test fails only when p < 1e-6 (the stated false-failure rate). A planted
scale error (beta halved) is caught by the same check, and the privacy claim itself is
checked at formula level: for neighbouring score vectors the exact ordered-output log-ratio
never exceeds k * eps0 at beta = 2 / eps0.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from dpmtv_common.privacy.mechanisms import GumbelTopKMechanism
from dpmtv_common.privacy.noise import secure_noise
from dpmtv_common.privacy.testing import SeededNoise

pytestmark = pytest.mark.statistical

FALSE_FAILURE_RATE = 1e-6
DRAWS = 50_000
SCORES = np.array([0.0, 1.0, 2.0, 3.0, 4.0])


def plackett_luce(scores: np.ndarray, order: tuple[int, ...], scale: float) -> float:
    """Exact probability of the ordered output ``order``."""
    weights = np.exp(scores / scale)
    remaining = set(range(len(scores)))
    probability = 1.0
    for index in order:
        probability *= weights[index] / sum(weights[i] for i in remaining)
        remaining.remove(index)
    return probability


def chi_square_p_value(mechanism: GumbelTopKMechanism, noise, scale: float) -> float:
    orders = list(itertools.permutations(range(len(SCORES)), mechanism.picks))
    counts = dict.fromkeys(orders, 0)
    for _ in range(DRAWS):
        counts[mechanism.select(SCORES, noise=noise)] += 1
    expected = np.array([plackett_luce(SCORES, o, scale) for o in orders]) * DRAWS
    observed = np.array([counts[o] for o in orders])
    return float(stats.chisquare(observed, expected).pvalue)


def test_secure_top_k_follows_plackett_luce():
    mechanism = GumbelTopKMechanism(picks=2, epsilon_per_pick=1.0)
    p_value = chi_square_p_value(mechanism, secure_noise(), mechanism.gumbel_scale)
    assert p_value > FALSE_FAILURE_RATE


def test_planted_scale_error_is_caught():
    # Claim beta = 2/eps0 = 2 while the sampler runs at eps0 = 2 (beta = 1).
    mechanism = GumbelTopKMechanism(picks=2, epsilon_per_pick=2.0)
    p_value = chi_square_p_value(mechanism, SeededNoise(5), scale=2.0)
    assert p_value < FALSE_FAILURE_RATE


@pytest.mark.parametrize("seed", range(5))
def test_ordered_output_log_ratio_is_bounded_by_k_eps0(seed):
    # Arrange: neighbouring scores differ by at most Delta_inf = 1 per head, in any direction.
    rng = np.random.default_rng(seed)
    scores = rng.uniform(0, 10, size=5)
    neighbour = scores + rng.choice([-1.0, 1.0], size=5) * rng.uniform(0, 1, size=5)
    mechanism = GumbelTopKMechanism(picks=2, epsilon_per_pick=0.5)
    # Act
    worst = max(
        abs(
            math.log(plackett_luce(scores, order, mechanism.gumbel_scale))
            - math.log(plackett_luce(neighbour, order, mechanism.gumbel_scale))
        )
        for order in itertools.permutations(range(5), 2)
    )
    # Assert
    assert worst <= mechanism.picks * mechanism.epsilon_per_pick + 1e-12
