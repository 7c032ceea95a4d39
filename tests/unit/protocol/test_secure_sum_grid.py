"""A secure sum's integer grid: exact to c / Q per site, refuses beyond ±c, never wraps."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpmtv_common.errors import ConfigError, IntegrityError
from protocol.secure_sum import (
    MAX_QUANTIZATION_RANGE,
    MAX_SUM_SITES,
    SumRanges,
    dequantise,
    quantise,
    ranges_for,
)

GRID = SumRanges(clipping_range=4.0, quantization_range=2**20, modulus_range=2**24)
STEP_ONE = SumRanges(clipping_range=2.0**29, quantization_range=2**30, modulus_range=2**33)


def site_sum(vectors: list[np.ndarray], ranges: SumRanges) -> np.ndarray:
    """What unmasking yields: the quantised inputs added mod M."""
    total = np.zeros(vectors[0].size, dtype=np.int64)
    for vector in vectors:
        total = (total + quantise(vector, ranges)) % ranges.modulus_range
    return total


# ----------------------------------------------------------------- ranges_for


@pytest.mark.parametrize(
    ("max_abs_coordinate", "clipping_range"),
    [(3.0, 4.0), (4.0, 4.0), (4.000001, 8.0), (0.3, 0.5), (1.0, 1.0), (700.0, 1024.0)],
)
def test_ranges_for_rounds_the_bound_up_to_a_power_of_two(
    max_abs_coordinate: float, clipping_range: float
) -> None:
    # Act
    ranges = ranges_for(max_abs_coordinate, 3)

    # Assert
    assert ranges.clipping_range == clipping_range
    assert ranges.clipping_range >= max_abs_coordinate


@pytest.mark.parametrize("sites", [2, 3, 1000, MAX_SUM_SITES])
def test_ranges_for_takes_the_finest_grid_that_cannot_wrap(sites: int) -> None:
    # Act
    ranges = ranges_for(1.0, sites)

    # Assert
    assert ranges.quantization_range == MAX_QUANTIZATION_RANGE
    assert ranges.modulus_range == 2**62
    assert sites * ranges.quantization_range < ranges.modulus_range
    ranges.check_no_wrap(sites)


@pytest.mark.parametrize(
    ("bound", "sites", "match"),
    [
        (0.0, 3, "max_abs_coordinate must be finite and > 0, got 0.0"),
        (-1.0, 3, "max_abs_coordinate must be finite and > 0, got -1.0"),
        (math.inf, 3, "max_abs_coordinate must be finite and > 0, got inf"),
        (math.nan, 3, "max_abs_coordinate must be finite and > 0, got nan"),
        (1.0, 1, r"sites must be an int in \[2, 100000\], got 1"),
        (1.0, MAX_SUM_SITES + 1, r"sites must be an int in \[2, 100000\], got 100001"),
        (1.0, 3.0, r"sites must be an int in \[2, 100000\], got 3.0"),
    ],
)
def test_ranges_for_refuses_bad_arguments(bound: float, sites: object, match: str) -> None:
    # Act / Assert
    with pytest.raises(ConfigError, match=match):
        ranges_for(bound, sites)  # type: ignore[arg-type]


def test_a_bound_beyond_the_largest_power_of_two_is_refused() -> None:
    # Act / Assert
    with pytest.raises(ConfigError, match="max_abs_coordinate"):
        ranges_for(1.5 * 2.0**1023, 3)


# ----------------------------------------------------------------- SumRanges


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"quantization_range": 1000}, "quantization_range must be a power of two, got 1000"),
        ({"modulus_range": 3 * 2**22}, "modulus_range must be a power of two"),
        ({"modulus_range": 2**20}, "modulus_range must exceed quantization_range=1048576"),
        ({"quantization_range": 2**31, "modulus_range": 2**40}, "quantization_range"),
        ({"modulus_range": 2**63}, "modulus_range"),
        ({"clipping_range": 0.0}, "clipping_range"),
        ({"clipping_range": math.inf}, "clipping_range"),
    ],
)
def test_a_grid_out_of_bounds_is_refused(fields: dict[str, float], match: str) -> None:
    # Arrange
    values = {**GRID.model_dump(), **fields}

    # Act / Assert
    with pytest.raises(ValueError, match=match):
        SumRanges(**values)


def test_check_no_wrap_refuses_sites_whose_inputs_could_reach_the_modulus() -> None:
    # Arrange: M / Q = 16, so 15 sites fit and 16 do not.
    GRID.check_no_wrap(15)

    # Act / Assert
    with pytest.raises(ConfigError, match=r"16 \* Q < M, got Q = 1048576, M = 16777216"):
        GRID.check_no_wrap(16)


def test_the_refused_grid_would_indeed_wrap() -> None:
    # Arrange: 16 sites at +c each reach 16 * Q = M, which wraps to 0.
    vectors = [np.full(3, GRID.clipping_range)] * 16

    # Act
    total = site_sum(vectors, GRID)

    # Assert: the decoded "sum" would be -16c instead of +16c; the check refuses it first.
    assert total.tolist() == [0, 0, 0]
    with pytest.raises(ConfigError):
        GRID.check_no_wrap(16)


# ----------------------------------------------------------------- quantise / dequantise


def test_quantise_maps_the_range_onto_zero_to_q() -> None:
    # Act
    values = quantise([-4.0, 0.0, 4.0, -2.0], GRID)

    # Assert
    assert values.dtype == np.int64
    assert values.tolist() == [0, 2**19, 2**20, 2**18]


def test_quantise_flattens_its_input() -> None:
    # Act / Assert
    assert quantise(np.zeros((2, 3)), GRID).shape == (6,)


@pytest.mark.parametrize("offender", [4.000001, -4.5, 1e9])
def test_a_coordinate_beyond_c_is_refused_without_its_value(offender: float) -> None:
    # Arrange
    values = np.array([0.0, offender, 1.0])

    # Act
    with pytest.raises(ConfigError, match=r"within ±c = 4.0 per coordinate") as info:
        quantise(values, GRID)

    # Assert: the reason may travel; the value must not
    assert str(offender) not in str(info.value)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_coordinate_that_is_not_finite_is_refused(bad: float) -> None:
    # Act / Assert
    with pytest.raises(ConfigError, match="must be finite"):
        quantise([0.0, bad], GRID)


@given(
    st.lists(
        st.lists(st.floats(min_value=-4.0, max_value=4.0), min_size=5, max_size=5),
        min_size=2,
        max_size=15,
    )
)
def test_the_decoded_sum_is_within_c_over_q_per_site_of_the_plain_sum(
    inputs: list[list[float]],
) -> None:
    # Arrange
    vectors = [np.array(values) for values in inputs]
    n = len(vectors)

    # Act
    decoded = dequantise(site_sum(vectors, GRID), GRID, n)

    # Assert: each site's rounding is at most half a step, c / Q.
    bound = n * GRID.clipping_range / GRID.quantization_range
    assert np.max(np.abs(decoded - np.sum(vectors, axis=0))) <= bound * (1 + 1e-9)


def test_integers_on_a_grid_of_step_one_are_summed_exactly() -> None:
    # Arrange: the distributed mode's grid, Q = 2c; values up to ±c at the extremes.
    c = STEP_ONE.clipping_range
    rng = np.random.default_rng(0)
    vectors = [np.rint(rng.uniform(-c, c, size=64)) for _ in range(5)]
    vectors.append(np.array([c, -c] * 32))

    # Act
    decoded = dequantise(site_sum(vectors, STEP_ONE), STEP_ONE, 6)

    # Assert: bit for bit
    assert np.array_equal(decoded, np.sum(vectors, axis=0))


def test_the_largest_sum_that_fits_does_not_wrap() -> None:
    # Arrange: 15 sites at +c reach 15 Q < M = 16 Q.
    vectors = [np.full(4, GRID.clipping_range)] * 15

    # Act
    decoded = dequantise(site_sum(vectors, GRID), GRID, 15)

    # Assert
    assert decoded.tolist() == [15 * GRID.clipping_range] * 4


@pytest.mark.parametrize("coordinate", [-1, 3 * 2**20 + 1])
def test_dequantise_refuses_a_total_outside_zero_to_n_q(coordinate: int) -> None:
    # Arrange: 3 sites can reach at most 3 Q; anything else is a mask that did not cancel.
    total = np.array([0, coordinate], dtype=np.int64)

    # Act / Assert
    with pytest.raises(IntegrityError, match=r"must lie in \[0, 3 \* Q\]"):
        dequantise(total, GRID, 3)
