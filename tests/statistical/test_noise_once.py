"""Central mode adds the Gaussian exactly once, on the sum, whatever the number of sites.

The coordinator's real path runs: ``FederatedSums`` (the secure sum over an in-process grid,
ChaCha20 masks) feeding ``protocol.run_release`` in selection mode ``all``. The sites are the
site service's real handlers on stand-in sites (``tests.flower_harness.StandInSite``) that
answer like ``client.release.site.Site.contribution`` — ``[flattened sum, [m_i]]`` — with an
all-zero sum, so the released sum (mean times m) minus the exact sum (0) is the noise alone. Its std
must be σ = z·2C·√L_scope for n ∈ {2, 5, 10} sites (notes/dp.md §4.3 test 3); per-site noise
would give √n·σ, and a second central draw √2·σ.

The σ checked against is computed here, independently of the project's calibration: the
analytic Gaussian mechanism (Balle & Wang 2018, Theorem 8) solved for z at the plan's (ε, δ)
with scipy, times the replace-one sensitivity 2·C·√L_scope. The release's σ must lie in
[σ_ref, 1.01·σ_ref] (never less noise than the tight bound allows; at most 1 % more from a
looser accountant), and the residuals must have the std the release states.

Statistics. With the exact sum known (0), S = Σ r²/σ² over N residuals is χ²_N; the check
accepts iff S lies between the χ²_N quantiles at FALSE_FAILURE_RATE/2 and 1 − that, and
|mean| < z·σ/√N with z = 4.89 (two-sided 1e-6). For N = 2^18 the std band is ±0.68 %, for
N = 2^17 ±0.96 %: both within the ±1 % of notes/dp.md §4.3 and far inside the √2 (+41 %)
a noise-once bug produces.

The secure sum's own error is negligible: each site's rounding to the grid moves a coordinate
by at most c/Q, so the sum is exact up to n·c/Q (here at most 10·256/2^30 ≈ 2.4e-6, and
exactly 0 for all-zero inputs, which sit on the grid), against σ ≈ 21.
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is first imported

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from scipy import optimize, stats

from dpmtv_common.aliases import Float64Array, Int64Array
from dpmtv_common.heads import HeadLayout, HeadSet
from dpmtv_common.privacy.noise import NoiseSource, secure_noise
from dpmtv_common.privacy.testing import SeededNoise
from protocol import (
    ReleaseOutcome,
    ReleasePlan,
    SecureSumRequest,
    plan_calibration,
    ranges_for,
    run_release,
)
from server.coordinator import build_plan
from server.federated_sums import FederatedSums
from server.messaging import Exchange
from server.settings import RunConfig
from server.simulation import InProcessGrid
from tests.flower_harness import (
    advertised_keys,
    flower_process_state,
    stand_in_apps,
    stand_in_sites,
)

pytestmark = pytest.mark.statistical

FALSE_FAILURE_RATE = 1e-6
Z_BOUND = float(stats.norm.isf(FALSE_FAILURE_RATE / 2))  # 4.89
NUM_LAYERS, NUM_HEADS = 8, 32  # L_scope = 8: sigma = z * 2C * sqrt(8) ~ 21 at eps = 1
LARGE_HEAD_DIM = 1024  # 8 * 32 * 1024 = 2^18 = 262144 coordinates
PRODUCTION_HEAD_DIM = 512  # 2^17 coordinates: OpenDP's exact sampler costs ~60-150 us a draw
CLIP_NORM = 1.0


@dataclass(frozen=True)
class ZeroSites:
    """The stand-in sites' answer: zeros, their m_i, and (the planted bug) their own noise."""

    head_dim: int
    chunk_counts: list[int]
    site_noise_std: float = 0.0

    def __call__(self, index: int, request: SecureSumRequest) -> list[np.ndarray]:
        rows = NUM_LAYERS * NUM_HEADS if request.heads is None else len(request.heads)
        total = np.zeros(rows * self.head_dim)
        if self.site_noise_std > 0:  # the planted bug: every site noises its own sum fully
            total = SeededNoise(index).add_gaussian(total, noise_std=self.site_noise_std)
        return [total, np.array([float(self.chunk_counts[index])])]


@dataclass
class CountingNoise:
    """Delegates to ``inner`` and records the size of every Gaussian draw."""

    inner: NoiseSource
    gaussian_sizes: list[int] = field(default_factory=list)

    @property
    def is_cryptographic(self) -> bool:
        return self.inner.is_cryptographic

    def add_gaussian(self, values: Float64Array, *, noise_std: float) -> Float64Array:
        self.gaussian_sizes.append(int(values.size))
        return self.inner.add_gaussian(values, noise_std=noise_std)

    def discrete_gaussian(self, size: int, *, noise_std: float) -> Int64Array:
        raise AssertionError("central mode draws no discrete Gaussian")

    def gumbel_top_k(self, scores: Float64Array, *, k: int, scale: float) -> tuple[int, ...]:
        raise AssertionError("selection mode 'all' draws no Gumbel noise")


class NoCentralNoise(CountingNoise):
    """The planted bug's coordinator: it trusts the sites' noise and adds none."""

    def add_gaussian(self, values: Float64Array, *, noise_std: float) -> Float64Array:
        self.gaussian_sizes.append(int(values.size))
        return np.array(values, dtype=np.float64)


@dataclass(frozen=True)
class Released:
    outcome: ReleaseOutcome
    chunk_counts: list[int]
    exposures: int

    def noise_on_sum(self) -> Float64Array:
        """Released sum minus the exact sum (zero): mean times m."""
        return np.asarray(self.outcome.values, dtype=np.float64).ravel() * self.outcome.num_chunks


@pytest.fixture(autouse=True)
def _restore_process_state() -> Iterator[None]:
    with flower_process_state():
        yield


def plan_for(num_sites: int) -> ReleasePlan:
    run = RunConfig(
        model_fingerprint="sha256:stub",
        release_id=f"noise-once-{num_sites}",
        selection="all",
        clip_norm=CLIP_NORM,
        min_sites=2,
        expected_sites=num_sites,
    )
    return build_plan(run)


def reference_noise_std(*, epsilon: float, delta: float, clip_norm: float, layers: int) -> float:
    """σ of the analytic Gaussian (Balle & Wang 2018) at (ε, δ), sensitivity 2·C·√L."""

    def delta_of(z: float) -> float:  # z = σ/Δ₂; δ(ε) of N(0, z²) against a unit shift
        return float(
            stats.norm.cdf(0.5 / z - epsilon * z)
            - math.exp(epsilon) * stats.norm.cdf(-0.5 / z - epsilon * z)
        )

    z = optimize.brentq(lambda z: delta_of(z) - delta, 1e-2, 1e3, xtol=1e-14, rtol=1e-14)
    return float(z) * 2.0 * clip_norm * math.sqrt(layers)


def reference_for(plan: ReleasePlan) -> float:
    return reference_noise_std(
        epsilon=plan.epsilon, delta=plan.delta, clip_norm=plan.clip_norm, layers=NUM_LAYERS
    )


def planned_noise_std(plan: ReleasePlan) -> float:
    all_heads = HeadSet.all_heads(num_layers=NUM_LAYERS, num_heads=NUM_HEADS)
    return plan_calibration(plan).gaussian(clip_norm=CLIP_NORM, heads=all_heads).noise_std


def release_zeros(
    folder: Path,
    num_sites: int,
    *,
    head_dim: int,
    noise: NoiseSource,
    site_noise_std: float = 0.0,
) -> Released:
    """One mode-'all' release over stand-in sites with all-zero sums; m_i = 200 + i."""
    plan = plan_for(num_sites)
    # c = 256 >= m_max * C: the planted bug's site noise (sigma ~ 21) is never refused.
    chunk_counts = [200 + index for index in range(num_sites)]
    contribute = ZeroSites(head_dim, chunk_counts, site_noise_std)
    sites = stand_in_sites(folder, num_sites, contribute, num_chunks=chunk_counts)
    grid = InProcessGrid(stand_in_apps(sites), num_nodes=num_sites)
    sums = FederatedSums(
        Exchange(grid, timeout=60.0),
        plan,
        dict(zip(grid.get_node_ids(), chunk_counts, strict=True)),
        advertised_keys(grid, plan),
        head_dim,
        HeadLayout(NUM_LAYERS, NUM_HEADS),
    )
    exposures: list[None] = []
    outcome = run_release(
        plan,
        sums=sums,
        layout=HeadLayout(NUM_LAYERS, NUM_HEADS),
        noise=noise,
        on_first_noise=lambda: exposures.append(None),
    )
    return Released(outcome, chunk_counts, len(exposures))


def std_matches(residuals: Float64Array, noise_std: float) -> bool:
    """χ² test of the known-mean variance, plus the mean, at FALSE_FAILURE_RATE each."""
    n = residuals.size
    statistic = float(np.sum((residuals / noise_std) ** 2))
    low = float(stats.chi2.ppf(FALSE_FAILURE_RATE / 2, n))
    high = float(stats.chi2.isf(FALSE_FAILURE_RATE / 2, n))
    mean_ok = abs(float(residuals.mean())) < Z_BOUND * noise_std / math.sqrt(n)
    return low < statistic < high and mean_ok


def test_the_plan_s_sigma_is_the_analytic_gaussian_s_for_its_budget() -> None:
    # Arrange: the reference, from scipy alone (checked: ~21.1 at eps = 1, delta = 1e-5, L = 8).
    plan = plan_for(5)
    reference = reference_for(plan)
    # Act
    planned = planned_noise_std(plan)
    # Assert
    assert 21.0 < reference < 21.2
    assert reference * (1 - 1e-9) <= planned <= 1.01 * reference


def test_the_secure_sum_error_is_far_below_sigma() -> None:
    # Arrange: the ranges FederatedSums picks for 10 sites of at most 209 chunks (C = 1).
    ranges = ranges_for(209.0, 10)
    # Act: c / Q per site and coordinate
    bound = 10 * ranges.clipping_range / ranges.quantization_range
    # Assert: under a millionth of sigma, so it cannot move the std checks (band 0.68 %).
    assert bound < 1e-6 * planned_noise_std(plan_for(10))


@pytest.mark.parametrize("num_sites", [2, 5, 10])
def test_central_noise_on_the_sum_has_std_sigma_for_any_number_of_sites(
    tmp_path: Path, num_sites: int
) -> None:
    # Arrange: a seeded sampler stands in for OpenDP's exact one, which costs 60-150 us a
    # draw here (50-120 s for these 3 x 2^18 draws). The production sampler runs the same
    # path below (10 sites, 2^17 draws); its std alone is checked in test_gaussian_noise.py.
    noise = CountingNoise(SeededNoise(num_sites))
    # Act
    released = release_zeros(tmp_path, num_sites, head_dim=LARGE_HEAD_DIM, noise=noise)
    # Assert
    coordinates = NUM_LAYERS * NUM_HEADS * LARGE_HEAD_DIM
    assert noise.gaussian_sizes == [coordinates]  # one draw, over every coordinate
    assert released.exposures == 1
    assert released.outcome.num_chunks == sum(released.chunk_counts)
    reference = reference_for(plan_for(num_sites))
    sigma = released.outcome.noise_std
    assert reference * (1 - 1e-9) <= sigma <= 1.01 * reference
    assert std_matches(released.noise_on_sum(), sigma)


def test_the_production_sampler_is_drawn_once_on_the_sum(tmp_path: Path) -> None:
    # Arrange: OpenDP's exact, CSPRNG-backed Gaussian, as the ServerApp uses it.
    noise = CountingNoise(secure_noise())
    # Act
    released = release_zeros(tmp_path, 10, head_dim=PRODUCTION_HEAD_DIM, noise=noise)
    # Assert
    assert noise.gaussian_sizes == [NUM_LAYERS * NUM_HEADS * PRODUCTION_HEAD_DIM]
    reference = reference_for(plan_for(10))
    assert reference * (1 - 1e-9) <= released.outcome.noise_std <= 1.01 * reference
    assert std_matches(released.noise_on_sum(), released.outcome.noise_std)


def test_the_check_catches_sites_that_each_add_the_full_noise(tmp_path: Path) -> None:
    # Arrange: the planted bug on the fewest sites (hardest to see: sqrt(2) sigma).
    sigma = planned_noise_std(plan_for(2))
    # Act
    released = release_zeros(
        tmp_path,
        2,
        head_dim=LARGE_HEAD_DIM,
        noise=NoCentralNoise(SeededNoise(0)),
        site_noise_std=sigma,
    )
    # Assert
    residuals = released.noise_on_sum()
    assert float(residuals.std()) == pytest.approx(math.sqrt(2) * sigma, rel=0.01)
    assert not std_matches(residuals, sigma)


def test_the_check_catches_a_second_central_draw(tmp_path: Path) -> None:
    # Arrange: a coordinator that noises the sum twice.
    class TwiceNoise(CountingNoise):
        def add_gaussian(self, values: Float64Array, *, noise_std: float) -> Float64Array:
            once = super().add_gaussian(values, noise_std=noise_std)
            return super().add_gaussian(once, noise_std=noise_std)

    # Act
    released = release_zeros(tmp_path, 5, head_dim=LARGE_HEAD_DIM, noise=TwiceNoise(SeededNoise(1)))
    # Assert
    assert not std_matches(released.noise_on_sum(), planned_noise_std(plan_for(5)))
