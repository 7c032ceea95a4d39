from __future__ import annotations

import functools
import hashlib
import operator

import numpy as np
import pytest
from scipy import stats

from dpmtv_common.crypto.mask_prg import derive_mask_key, expand_mask
from dpmtv_common.errors import ConfigError

SEED = bytes(range(32))
# Two-sided false-failure rate of every statistical check below.
FALSE_FAILURE_RATE = 1e-6


def test_known_answer_pins_the_construction():
    # Sites and coordinator must expand identically; a change here needs a new protocol version.
    (mask,) = expand_mask(SEED, 2**32, [(4,)])
    assert mask.tolist() == [1069306745, 3310889627, 3136363543, 1440590921]


def test_same_seed_gives_the_same_masks():
    first = expand_mask(SEED, 2**40, [(100,), (3, 4)])
    second = expand_mask(SEED, 2**40, [(100,), (3, 4)])
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)


def test_different_seeds_give_unrelated_masks():
    (a,) = expand_mask(SEED, 2**32, [(10_000,)])
    (b,) = expand_mask(SEED[:-1] + b"\xff", 2**32, [(10_000,)])
    # Independent uniform 32-bit values collide with probability 2^-32 per entry.
    assert np.count_nonzero(a == b) <= 1


def test_the_whole_seed_matters_not_a_32_bit_fold_of_it():
    # Arrange: two seeds whose 32-bit XOR folds agree (flwr 1.42's expansion, flwr
    # issue #7522, seeded its PRG with that fold, so they gave one mask there).
    seed_a = bytes(32)
    seed_b = b"\x01\x00\x00\x00" * 2 + bytes(24)
    folds = [
        functools.reduce(operator.xor, np.frombuffer(seed, dtype="<u4").tolist())
        for seed in (seed_a, seed_b)
    ]
    assert folds == [0, 0]
    # Act
    (mask_a,) = expand_mask(seed_a, 2**32, [(8,)])
    (mask_b,) = expand_mask(seed_b, 2**32, [(8,)])
    # Assert
    assert not np.array_equal(mask_a, mask_b)


def test_masks_have_the_requested_shapes_dtype_and_range():
    shapes = [(1,), (5, 7), (), (0,)]

    masks = expand_mask(SEED, 2**20, shapes)

    assert [m.shape for m in masks] == shapes
    for mask in masks:
        assert mask.dtype == np.int64
        assert mask.size == 0 or (mask.min() >= 0 and mask.max() < 2**20)


def test_arrays_are_consecutive_slices_of_one_stream():
    split = expand_mask(SEED, 2**32, [(3,), (2, 2)])
    (whole,) = expand_mask(SEED, 2**32, [(7,)])
    np.testing.assert_array_equal(np.concatenate([split[0], split[1].ravel()]), whole)


def test_a_smaller_range_keeps_the_low_bits():
    (wide,) = expand_mask(SEED, 2**63, [(1000,)])
    (narrow,) = expand_mask(SEED, 2**24, [(1000,)])
    np.testing.assert_array_equal(narrow, wide & (2**24 - 1))


@pytest.mark.statistical
def test_small_range_masks_pass_a_chi_square_uniformity_test():
    # Arrange
    num_range, draws = 16, 160_000
    (mask,) = expand_mask(b"chi-square seed, 32 bytes long..", num_range, [(draws,)])
    # Act
    counts = np.bincount(mask, minlength=num_range)
    statistic = float(np.sum((counts - draws / num_range) ** 2 / (draws / num_range)))
    # Assert
    assert statistic < stats.chi2.isf(FALSE_FAILURE_RATE, df=num_range - 1)


@pytest.mark.statistical
def test_the_top_bit_of_a_wide_range_is_fair():
    draws = 100_000
    (mask,) = expand_mask(b"top-bit seed, also 32 bytes long", 2**62, [(draws,)])

    share_high = np.count_nonzero(mask >= 2**61) / draws

    z = stats.norm.isf(FALSE_FAILURE_RATE / 2)
    assert abs(share_high - 0.5) <= z * 0.5 / np.sqrt(draws)


def test_mask_key_is_domain_separated_from_a_plain_hash():
    assert derive_mask_key(SEED) != hashlib.sha256(SEED).digest()
    assert len(derive_mask_key(SEED)) == 32


@pytest.mark.parametrize("num_range", [0, 1, 3, 2**32 + 1, 2**64, True, 2.0**32])
def test_a_range_that_is_not_a_power_of_two_in_bounds_is_refused(num_range):
    with pytest.raises(ConfigError, match="num_range must be a power of two"):
        expand_mask(SEED, num_range, [(1,)])


def test_a_short_seed_is_refused():
    with pytest.raises(ConfigError, match="seed must be at least 16 bytes, got 8"):
        expand_mask(bytes(8), 2**32, [(1,)])


def test_a_negative_dimension_is_refused():
    with pytest.raises(ConfigError, match="non-negative ints"):
        expand_mask(SEED, 2**32, [(2, -1)])
