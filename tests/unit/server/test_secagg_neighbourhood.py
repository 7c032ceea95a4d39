"""SecAgg+ neighbourhoods meet the protocol's privacy and correctness bounds, and no more."""

from __future__ import annotations

import math

import pytest

from dpmtv_common.errors import ConfigError
from server.secagg_neighbourhood import (
    CORRECTNESS_FAILURE,
    DEFAULT_CORRUPT_FRACTION,
    DEFAULT_DROPOUT_FRACTION,
    PRIVACY_FAILURE,
    neighbourhood,
)

SIZES = [11, 12, 30, 100, 300, 1000, 3000]


def hypergeometric_tail(population: int, marked: int, draws: int, at_least: int) -> float:
    hits = sum(
        math.comb(marked, count) * math.comb(population - marked, draws - count)
        for count in range(max(at_least, 0), min(marked, draws) + 1)
    )
    return hits / math.comb(population, draws)


def failures(sites: int, size: int, threshold: int) -> tuple[float, float]:
    corrupt = math.ceil(DEFAULT_CORRUPT_FRACTION * sites)
    dropped = math.ceil(DEFAULT_DROPOUT_FRACTION * sites)
    others = sites - 1
    leak = sites * hypergeometric_tail(others, corrupt, size - 1, threshold)
    stuck = sites * (1 - hypergeometric_tail(others, others - dropped, size - 1, threshold - 1))
    return leak, stuck


def meets_bounds(sites: int, size: int, threshold: int) -> bool:
    leak, stuck = failures(sites, size, threshold)
    return leak <= PRIVACY_FAILURE and stuck <= CORRECTNESS_FAILURE


@pytest.mark.parametrize("sites", [1, 2, 3, 10])
def test_up_to_ten_sites_everyone_is_everyones_neighbour(sites: int) -> None:
    # Act / Assert
    assert neighbourhood(sites) == (1.0, 0.67)


@pytest.mark.parametrize("sites", SIZES)
def test_a_sparse_neighbourhood_is_odd_with_a_majority_threshold(sites: int) -> None:
    # Act
    size, threshold = neighbourhood(sites)

    # Assert
    assert isinstance(size, int)
    assert isinstance(threshold, int)
    assert size % 2 == 1
    assert 3 <= size < sites
    assert size / 2 < threshold <= size


@pytest.mark.parametrize("sites", SIZES)
def test_the_neighbourhood_meets_both_bounds_and_no_smaller_one_does(sites: int) -> None:
    # Act
    size, threshold = neighbourhood(sites)
    assert isinstance(size, int)
    assert isinstance(threshold, int)
    smaller = size - 2

    # Assert
    assert meets_bounds(sites, size, threshold)
    assert smaller < 3 or not any(
        meets_bounds(sites, smaller, t) for t in range(smaller // 2 + 1, smaller + 1)
    )


def test_the_neighbourhood_grows_like_log_n() -> None:
    # Act
    sizes = {sites: neighbourhood(sites)[0] for sites in (100, 1000, 10_000)}

    # Assert: a tenfold consortium adds a bounded number of neighbours, not ten times as many
    assert sizes[100] < sizes[1000] < sizes[10_000] <= 3 * sizes[100]


def test_more_collusion_needs_larger_neighbourhoods() -> None:
    # Act
    cautious = neighbourhood(1000, corrupt_fraction=0.2)[0]
    default = neighbourhood(1000)[0]

    # Assert
    assert cautious > default


@pytest.mark.parametrize(
    ("sites", "options", "match"),
    [
        (0, {}, "sites must be a positive int, got 0"),
        (True, {}, "sites must be a positive int, got True"),
        (100, {"corrupt_fraction": 0.5}, r"corrupt_fraction must be in \[0, 0.5\), got 0.5"),
        (100, {"dropout_fraction": -0.1}, r"dropout_fraction must be in \[0, 0.5\), got -0.1"),
    ],
)
def test_bad_arguments_are_refused(sites: object, options: dict[str, float], match: str) -> None:
    # Act / Assert
    with pytest.raises(ConfigError, match=match):
        neighbourhood(sites, **options)  # type: ignore[arg-type]
