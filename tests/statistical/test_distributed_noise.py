"""Distributed mode: the summed shares carry exactly the claimed noise, and fakes cannot remove it.

Every share here comes from the production sampler (``secure_noise()``: OpenDP's exact discrete
Gaussian over OpenSSL) and goes through the production encode/decode path; the secure sum is
exact on the integer grid (tests/unit/dpmtv_common/test_distributed.py checks Flower's
quantiser bit for bit), so it is a plain integer sum here.

Statistics. The residual r = decoded sum − exact sum is the honest shares' noise over γ plus
the rounding error (variance ≤ n/4 grid units², below 1e-12 of the noise variance here). For a
claimed std σ, S = Σ r²/σ² over N residuals is χ²_N (the sum of ≥ 2 discrete Gaussians of std
≥ 10⁶ grid units is Gaussian to far better than the test resolves). Two-sided checks accept
iff S lies between the χ²_N quantiles at a/2 and 1 − a/2; the one-sided "at least" check
accepts iff S is above the a quantile; |mean| < z_a·σ/√N. The false-failure rate of the whole
file is at most FALSE_FAILURE_RATE = 1e-6, split evenly over its CHECKS checks (Bonferroni).
With N = 2^13 a two-sided std band is about ±4 %: a share of σ/n instead of σ/√n, or a
full σ per site (√n too much), is off by a factor ≥ √2 and fails with certainty.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dpmtv_common.privacy.distributed import (
    DistributedNoise,
    activation_noise,
    calibrate_distributed,
    decode_noisy_sum,
    encode_site_share,
    release_epsilon,
    vote_noise,
)
from dpmtv_common.privacy.noise import require_cryptographic, secure_noise

pytestmark = pytest.mark.statistical

FALSE_FAILURE_RATE = 1e-6
CHECKS = 2 * 3 + 2 + 1 + 1  # (std, mean) x 3 site counts; fakes (std, mean); votes; correlation
PER_CHECK = FALSE_FAILURE_RATE / CHECKS
Z_BOUND = float(stats.norm.isf(PER_CHECK / 2))
DIM = 2**13
VOTE_DIM = 2**12  # heads: a band of about ±5.5 %
MAX_SITES = 10
CAL = calibrate_distributed(epsilon=1.0, delta=1e-5, selection_share=0.2)


def activations(min_honest: int) -> DistributedNoise:
    return activation_noise(
        clip_norm=1.0,
        num_layers_in_scope=8,
        dimension=DIM,
        max_chunks_per_site=100,
        noise_multiplier=CAL.activation_noise_multiplier,
        min_honest=min_honest,
        max_sites=MAX_SITES,
    )


def site_sums(num_sites: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)  # data, not noise: any values within m_max·C
    return [rng.uniform(-100.0, 100.0, size=DIM) for _ in range(num_sites)]


def noisy_residual(params: DistributedNoise, xs: list[np.ndarray], senders: int) -> np.ndarray:
    """Encode the first ``senders`` sites' sums with production noise; the rest send zeros."""
    noise = secure_noise()
    require_cryptographic(noise)
    encoded = [encode_site_share(x, params=params, noise=noise) for x in xs[:senders]]
    secure_sum = np.sum(encoded, axis=0)  # the fakes' contribution is 0 and noise-free
    decoded = decode_noisy_sum(secure_sum, params=params, num_sites=len(xs))
    exact = np.sum(xs[:senders], axis=0, dtype=np.float64)
    residual: np.ndarray = decoded - exact
    return residual


def chi_square(residual: np.ndarray, noise_std: float) -> float:
    return float(np.sum((residual / noise_std) ** 2))


def assert_std_matches(residual: np.ndarray, noise_std: float) -> None:
    n = residual.size
    s = chi_square(residual, noise_std)
    lo, hi = stats.chi2.ppf(PER_CHECK / 2, n), stats.chi2.isf(PER_CHECK / 2, n)
    band = f"[{math.sqrt(lo / n):.4f}, {math.sqrt(hi / n):.4f}]"
    assert lo <= s <= hi, f"std ratio {math.sqrt(s / n):.4f} outside {band}"
    assert abs(float(residual.mean())) < Z_BOUND * noise_std / math.sqrt(n)


@pytest.mark.parametrize("num_sites", [2, 5, 10])
def test_std_of_the_summed_shares_matches_the_claim(num_sites):
    # Arrange: every site honest, shares sized for t = 2.
    params = activations(min_honest=2)
    xs = site_sums(num_sites, seed=num_sites)
    # Act
    residual = noisy_residual(params, xs, senders=num_sites)
    # Assert: std σ_l·√n/γ, i.e. z·Δ̃/γ·√(n/t): σ_t at n = t, more with more honest sites.
    claimed = params.released_noise_std(num_sites)
    assert claimed == pytest.approx(
        CAL.activation_noise_multiplier
        * params.grid_l2_sensitivity
        / params.scale
        * math.sqrt(num_sites / 2)
    )
    assert_std_matches(residual, claimed)


def test_fakes_that_send_zeros_leave_at_least_the_honest_sites_noise():
    # Arrange: 5 sites of which t = 2 are the coordinator's fakes (zeros, no share).
    t, num_sites = 2, 5
    honest = num_sites - t
    params = activations(min_honest=t)
    xs = site_sums(num_sites, seed=99)
    # Act: the coordinator subtracts everything it knows (the honest sums, as a worst case)
    residual = noisy_residual(params, xs, senders=honest)
    # Assert: at least σ_site·√honest/γ remains (one-sided), and its ε is within the target.
    floor = params.share_noise_std * math.sqrt(honest) / params.scale
    s = chi_square(residual, floor)
    assert s >= stats.chi2.ppf(PER_CHECK, residual.size), (
        f"std ratio {math.sqrt(s / residual.size):.4f}"
    )
    assert abs(float(residual.mean())) < Z_BOUND * floor / math.sqrt(residual.size)
    assert release_epsilon(params, None, honest_shares=honest, delta=1e-5).epsilon < 1.0


def test_vote_histogram_noise_matches_the_claim():
    # Integral path: votes are not scaled or rounded; 5 honest sites, t = 2.
    assert CAL.selection_noise_multiplier is not None
    params = vote_noise(
        top_r=4,
        num_heads=VOTE_DIM,
        max_chunks_per_site=100,
        noise_multiplier=CAL.selection_noise_multiplier,
        min_honest=2,
        max_sites=MAX_SITES,
    )
    rng = np.random.default_rng(7)
    xs = [rng.integers(0, 101, size=VOTE_DIM).astype(np.float64) for _ in range(5)]
    residual = noisy_residual(params, xs, senders=5)
    claimed = CAL.selection_noise_multiplier * math.sqrt(8) * math.sqrt(5 / 2)
    assert params.released_noise_std(5) == pytest.approx(claimed)
    s = chi_square(residual, claimed)
    lo, hi = stats.chi2.ppf(PER_CHECK / 2, VOTE_DIM), stats.chi2.isf(PER_CHECK / 2, VOTE_DIM)
    assert lo <= s <= hi


def test_shares_of_two_sites_are_uncorrelated():
    # |corr| of two independent shares: N(0, 1/N) approximately; Z_BOUND/√N is the band.
    params = activations(min_honest=2)
    zeros = np.zeros(DIM)
    noise = secure_noise()
    a = encode_site_share(zeros, params=params, noise=noise)
    b = encode_site_share(zeros, params=params, noise=noise)
    assert abs(float(np.corrcoef(a, b)[0, 1])) < Z_BOUND / math.sqrt(DIM)
