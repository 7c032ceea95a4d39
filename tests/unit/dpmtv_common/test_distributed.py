"""Distributed noise on the secure sum's integer grid: headroom, encoding, decoding, exactness."""

import math
from typing import Any

import numpy as np
import pytest

from dpmtv_common.errors import ConfigError, IntegrityError
from dpmtv_common.privacy.distributed import (
    MAX_QUANTIZATION_RANGE,
    XI_RESERVE,
    DistributedNoise,
    SecAggRangeError,
    activation_noise,
    check_min_honest,
    decode_noisy_sum,
    distributed_noise_for,
    encode_site_share,
    kls21_tau_upper_bound,
    top_k_from_noisy_votes,
    vote_noise,
)
from dpmtv_common.privacy.noise import secure_uniform
from dpmtv_common.privacy.testing import SeededNoise
from protocol import SumRanges, dequantise, quantise

DIM = 64


def params(**overrides) -> DistributedNoise:
    settings: dict[str, Any] = {
        "clip_norm": 1.0,
        "num_layers_in_scope": 4,
        "dimension": DIM,
        "max_chunks_per_site": 50,
        "noise_multiplier": 4.5,
        "min_honest": 2,
        "max_sites": 10,
    }
    settings.update(overrides)
    return activation_noise(**settings)


def seeded_rounding(seed: int):
    return np.random.default_rng(seed).random


def site_sums(num_sites: int, *, peak: float, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-peak, peak, size=DIM) for _ in range(num_sites)]


def grid_of(p: DistributedNoise) -> SumRanges:
    """The secure sum's grid for these parameters (what the coordinator sends the sites)."""
    return SumRanges(
        clipping_range=p.clipping_range,
        quantization_range=p.quantization_range,
        modulus_range=p.modulus_range,
    )


def secure_sum(encoded: list[np.ndarray], p: DistributedNoise) -> np.ndarray:
    """What the coordinator gets: each share quantised, summed mod M, dequantised.

    ``protocol.secure_sum``'s arithmetic; the masks cancel mod M and are left out.
    """
    ranges = grid_of(p)
    total = np.zeros(encoded[0].size, dtype=np.int64)
    for y in encoded:
        total = (total + quantise(y, ranges)) % p.modulus_range
    return dequantise(total, ranges, len(encoded))


# --- headroom and parameters ---------------------------------------------------------------


def test_parameters_fit_the_secure_sum_grid_and_grid_step_is_one():
    # Act
    p = params()
    # Assert
    assert p.quantization_range <= MAX_QUANTIZATION_RANGE
    assert p.clipping_range == p.quantization_range / 2  # step 2c/Q = 1
    assert p.modulus_range > p.max_sites * p.quantization_range
    assert p.modulus_range & (p.modulus_range - 1) == 0
    assert p.modulus_range == 2**p.modulus_bits
    assert math.log2(p.scale).is_integer()
    grid_of(p).check_no_wrap(p.max_sites)


def test_worst_site_value_fits_the_clipping_range():
    p = params()
    tail = math.sqrt(2 * math.log(2 * p.max_sites * p.dimension / p.overflow_probability))
    worst = p.scale * p.max_abs_site_coordinate + 1 + tail * p.share_noise_std
    assert worst <= p.clipping_range


def test_grid_sensitivity_is_inflated_by_rounding():
    p = params()
    assert p.grid_l2_sensitivity >= p.scale * p.l2_sensitivity + math.sqrt(DIM)
    assert p.l2_sensitivity == pytest.approx(2.0 * math.sqrt(4))
    # At the 2^30 grid the inflation is tiny: the noise barely grows.
    assert p.effective_noise_multiplier(2) == pytest.approx(4.5, rel=1e-3)
    assert p.effective_noise_multiplier(2) > 4.5


def test_share_std_is_sized_for_min_honest():
    for t in (1, 2, 5):
        p = params(min_honest=t)
        summed_at_t = p.share_noise_std * math.sqrt(t)
        assert summed_at_t == pytest.approx(4.5 * p.grid_l2_sensitivity)


def test_headroom_refuses_a_site_whose_worst_value_cannot_fit():
    # 2^40 chunks at C = 1 need 2^40 grid units even at scale 1.
    with pytest.raises(SecAggRangeError, match="2\\^30"):
        vote_noise(
            top_r=1,
            num_heads=8,
            max_chunks_per_site=2**40,
            noise_multiplier=1.0,
            min_honest=2,
            max_sites=4,
        )


def test_headroom_refuses_noise_that_alone_overflows():
    with pytest.raises(SecAggRangeError, match="rounding noise alone"):
        params(dimension=2**40, noise_multiplier=1e3)


def test_headroom_refuses_sums_beyond_float64_exactness():
    with pytest.raises(SecAggRangeError, match="2\\^52"):
        params(max_sites=2**23)


def test_headroom_refuses_shares_too_small_for_kls21_at_every_scale():
    # z = 1e-8: even votes x 2^20 leave shares of 0.007 grid units, where no bound holds.
    with pytest.raises((SecAggRangeError, ConfigError), match="KLS21"):
        distributed_noise_for(
            l2_sensitivity=1.0,
            max_abs_site_coordinate=3.0,
            dimension=10,
            noise_multiplier=1e-8,
            min_honest=2,
            max_sites=4,
            integral=True,
        )


def _coarse_votes(**overrides: Any) -> Any:
    # Shares of z*sqrt(2)/sqrt(t) ~ 0.8 grid units at scale 1: too coarse for KLS21's tau.
    arguments: dict[str, Any] = {
        "l2_sensitivity": math.sqrt(2.0),
        "max_abs_site_coordinate": 4.0,
        "dimension": 12,
        "noise_multiplier": 9.0,
        "min_honest": 150,
        "max_sites": 300,
        "integral": True,
    }
    return distributed_noise_for(**{**arguments, **overrides})


def test_votes_of_many_honest_shares_get_the_smallest_power_of_two_scale_that_passes_tau():
    p = _coarse_votes()
    tau = kls21_tau_upper_bound
    assert p.scale > 1.0
    assert math.log2(p.scale).is_integer()
    assert tau(share_noise_std=p.share_noise_std, max_shares=300) * 12 <= XI_RESERVE
    half = p.share_noise_std / 2  # the next smaller power of two would not pass
    assert tau(share_noise_std=half, max_shares=300) * 12 > XI_RESERVE


def test_scaling_the_votes_keeps_their_privacy():
    # Delta~ = gamma * Delta exactly (integers need no rounding), so the released noise over
    # the real sensitivity is z at t honest shares, as at scale 1.
    p = _coarse_votes()
    assert p.grid_l2_sensitivity == pytest.approx(p.scale * math.sqrt(2.0), rel=1e-15)
    assert p.effective_noise_multiplier(150) == pytest.approx(9.0, rel=1e-12)


def test_scaled_votes_encode_to_integers_and_decode_to_vote_units():
    p = _coarse_votes()
    votes = np.array([4.0, 0.0, 3.0, 1.0] * 3)
    encoded = [encode_site_share(votes, params=p, noise=SeededNoise(seed)) for seed in range(300)]
    assert all(np.array_equal(share, np.rint(share)) for share in encoded)
    decoded = decode_noisy_sum(np.sum(encoded, axis=0), params=p, num_sites=300)
    # 300 shares, each of std sigma_l / gamma in vote units: 300 x votes within 6 sd
    spread = p.released_noise_std(300)
    assert np.all(np.abs(decoded - 300 * votes) < 6 * spread)


@pytest.mark.parametrize(
    ("name", "value"),
    [("noise_multiplier", 0.0), ("min_honest", 0), ("dimension", 0), ("clip_norm", -1.0)],
)
def test_parameters_refuse_bad_arguments(name, value):
    with pytest.raises(ConfigError, match=name):
        params(**{name: value})


def test_overflow_probability_must_be_below_one():
    with pytest.raises(ConfigError, match="overflow_probability"):
        params(overflow_probability=1.0)


def test_more_votes_per_chunk_than_heads_is_refused():
    with pytest.raises(ConfigError, match="top_r"):
        vote_noise(
            top_r=9,
            num_heads=8,
            max_chunks_per_site=1,
            noise_multiplier=9.0,
            min_honest=2,
            max_sites=4,
        )


def test_min_honest_above_max_sites_is_refused():
    with pytest.raises(ConfigError, match="max_sites"):
        params(min_honest=11, max_sites=10)


def test_vote_parameters_are_integral_and_unscaled():
    p = vote_noise(
        top_r=4,
        num_heads=32,
        max_chunks_per_site=100,
        noise_multiplier=9.0,
        min_honest=2,
        max_sites=10,
    )
    assert p.integral
    assert p.scale == 1.0
    assert p.grid_l2_sensitivity == pytest.approx(math.sqrt(8))


# --- site encoding -------------------------------------------------------------------------


def test_encoded_share_is_integer_valued_and_within_range():
    p = params()
    encoded = encode_site_share(
        site_sums(1, peak=50.0)[0], params=p, noise=SeededNoise(1), rounding=seeded_rounding(2)
    )
    assert np.array_equal(encoded, np.rint(encoded))
    assert np.max(np.abs(encoded)) <= p.clipping_range


def test_randomised_rounding_is_unbiased_and_within_one_step():
    # Arrange: a huge noise multiplier is irrelevant here; isolate rounding with a zero-noise
    # source that returns zeros.
    class ZeroShare(SeededNoise):
        def discrete_gaussian(self, size, *, noise_std):
            return np.zeros(size, dtype=np.int64)

    p = params()
    x = np.full(DIM, 0.3 / p.scale)  # 0.3 grid units
    # Act
    draws = np.stack(
        [
            encode_site_share(x, params=p, noise=ZeroShare(0), rounding=seeded_rounding(s))
            for s in range(400)
        ]
    )
    # Assert: every value is 0 or 1, and the mean is 0.3 (binomial, 25600 draws, se 0.0029;
    # 0.02 is 7 se: false-failure rate < 1e-11).
    assert set(np.unique(draws)) <= {0.0, 1.0}
    assert float(draws.mean()) == pytest.approx(0.3, abs=0.02)


def test_encoding_refuses_a_site_sum_beyond_its_bound():
    p = params()
    with pytest.raises(ConfigError, match="max_abs_site_coordinate"):
        encode_site_share(np.full(DIM, 51.0), params=p, noise=SeededNoise(0))


def test_encoding_refuses_wrong_dimension_and_non_finite_input():
    p = params()
    with pytest.raises(ConfigError, match="dimension"):
        encode_site_share(np.zeros(DIM + 1), params=p, noise=SeededNoise(0))
    with pytest.raises(ConfigError, match="finite"):
        encode_site_share(np.full(DIM, np.nan), params=p, noise=SeededNoise(0))


def test_vote_encoding_refuses_fractions():
    p = vote_noise(
        top_r=2,
        num_heads=DIM,
        max_chunks_per_site=10,
        noise_multiplier=9.0,
        min_honest=2,
        max_sites=4,
    )
    with pytest.raises(ConfigError, match="integers"):
        encode_site_share(np.full(DIM, 0.5), params=p, noise=SeededNoise(0))


def test_a_share_beyond_the_clipping_range_aborts_instead_of_being_clipped():
    class HugeShare(SeededNoise):
        def discrete_gaussian(self, size, *, noise_std):
            return np.full(size, 2**40, dtype=np.int64)

    with pytest.raises(SecAggRangeError, match="abort"):
        encode_site_share(np.zeros(DIM), params=params(), noise=HugeShare(0))


def test_secure_uniform_is_in_unit_interval_and_varies():
    draws = secure_uniform(1000)
    assert draws.dtype == np.float64
    assert np.all((draws >= 0.0) & (draws < 1.0))
    assert len(np.unique(draws)) == 1000
    assert secure_uniform(0).shape == (0,)


# --- exactness on the secure sum's grid, and decoding --------------------------------------


@pytest.mark.parametrize("num_sites", [2, 3, 10])
def test_quantisation_round_trip_of_encoded_shares_is_exact(num_sites):
    # Arrange
    p = params()
    encoded = [
        encode_site_share(x, params=p, noise=SeededNoise(i), rounding=seeded_rounding(i))
        for i, x in enumerate(site_sums(num_sites, peak=50.0))
    ]
    # Act: each site's quantised vector, and the coordinator's decoded sum
    quantized = [quantise(y, grid_of(p)) for y in encoded]
    total = secure_sum(encoded, p)
    # Assert: the grid maps every integer y to y + c exactly (step 2c/Q = 1), and the
    # decoded sum equals the exact integer sum divided by γ, bit for bit.
    for y, q in zip(encoded, quantized, strict=True):
        assert np.array_equal(q.astype(np.float64), y + p.clipping_range)
    exact = np.sum(encoded, axis=0) / p.scale
    assert np.array_equal(decode_noisy_sum(total, params=p, num_sites=num_sites), exact)


def test_round_trip_is_exact_at_the_extremes_of_the_range():
    # Arrange
    p = params()
    c = p.clipping_range
    encoded = [np.full(DIM, c), np.full(DIM, -c), np.full(DIM, c), np.full(DIM, c - 1)]
    # Act
    decoded = decode_noisy_sum(secure_sum(encoded, p), params=p, num_sites=4)
    # Assert
    assert np.array_equal(decoded, np.full(DIM, (3 * c - 1 - c) / p.scale))


def test_rounding_error_of_the_decoded_sum_is_below_one_step_per_site():
    # Arrange: no noise, so decoded - exact is the rounding alone.
    class ZeroShare(SeededNoise):
        def discrete_gaussian(self, size, *, noise_std):
            return np.zeros(size, dtype=np.int64)

    p = params()
    xs = site_sums(5, peak=50.0)
    encoded = [
        encode_site_share(x, params=p, noise=ZeroShare(0), rounding=seeded_rounding(i))
        for i, x in enumerate(xs)
    ]
    # Act
    decoded = decode_noisy_sum(secure_sum(encoded, p), params=p, num_sites=5)
    # Assert
    assert np.max(np.abs(decoded - np.sum(xs, axis=0))) < 5 / p.scale


def test_decoding_refuses_a_sum_that_is_not_integral():
    p = params()
    with pytest.raises(IntegrityError, match="integers"):
        decode_noisy_sum(np.full(DIM, 0.5), params=p, num_sites=2)


def test_decoding_refuses_a_wrapped_sum():
    p = params()
    with pytest.raises(IntegrityError, match="wrapped"):
        decode_noisy_sum(np.full(DIM, 3 * p.clipping_range), params=p, num_sites=2)


def test_top_k_of_noisy_votes_is_best_first_with_ties_by_index():
    assert top_k_from_noisy_votes(np.array([1.0, 5.0, 3.0, 5.0]), k=3) == (1, 3, 2)
    with pytest.raises(ConfigError, match="k must"):
        top_k_from_noisy_votes(np.array([1.0, 2.0]), k=3)
    with pytest.raises(ConfigError, match="1-d"):
        top_k_from_noisy_votes(np.ones((2, 2)), k=1)


# --- plan acceptance -----------------------------------------------------------------------


def test_a_site_accepts_shares_sized_for_at_most_its_own_honest_count():
    check_min_honest(plan_min_honest=2, site_min_honest=3, min_sites=4)
    check_min_honest(plan_min_honest=3, site_min_honest=3, min_sites=3)


def test_a_site_refuses_shares_sized_for_more_honest_sites_than_it_trusts():
    with pytest.raises(ConfigError, match="site's min_honest=2"):
        check_min_honest(plan_min_honest=3, site_min_honest=2, min_sites=5)


def test_a_plan_sized_for_more_shares_than_min_sites_is_refused():
    with pytest.raises(ConfigError, match="min_sites=2"):
        check_min_honest(plan_min_honest=3, site_min_honest=5, min_sites=2)
