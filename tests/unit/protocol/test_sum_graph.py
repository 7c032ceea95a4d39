"""Secure-sum neighbourhoods meet the privacy and correctness bounds; the ring is unchosen."""

from __future__ import annotations

import hashlib
import math

import pytest

from dpmtv_common.errors import ConfigError
from protocol.sum_graph import (
    CORRECTNESS_FAILURE,
    DEFAULT_CORRUPT_FRACTION,
    DEFAULT_DROPOUT_FRACTION,
    PRIVACY_FAILURE,
    neighbourhood,
    neighbours,
    ring_order,
)

SIZES = [11, 12, 30, 100, 300, 1000, 3000]
TRANSCRIPT = hashlib.sha256(b"key transcript").digest()


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


# ----------------------------------------------------------------- neighbourhood


@pytest.mark.parametrize(
    ("sites", "threshold"), [(2, 2), (3, 2), (4, 3), (5, 3), (6, 4), (9, 5), (10, 6)]
)
def test_up_to_ten_sites_the_graph_is_complete_with_a_majority_threshold(
    sites: int, threshold: int
) -> None:
    # Act
    size, got = neighbourhood(sites)

    # Assert
    assert (size, got) == (sites, threshold)
    assert got == max(2, sites // 2 + 1)


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
        (1, {}, "sites must be an int >= 2 .* got 1"),
        (0, {}, "sites must be an int >= 2 .* got 0"),
        (True, {}, "sites must be an int >= 2 .* got True"),
        (3.0, {}, "sites must be an int >= 2 .* got 3.0"),
        (100, {"corrupt_fraction": 0.5}, r"corrupt_fraction must be in \[0, 0.5\), got 0.5"),
        (100, {"dropout_fraction": -0.1}, r"dropout_fraction must be in \[0, 0.5\), got -0.1"),
    ],
)
def test_bad_arguments_are_refused(sites: object, options: dict[str, float], match: str) -> None:
    # Act / Assert
    with pytest.raises(ConfigError, match=match):
        neighbourhood(sites, **options)  # type: ignore[arg-type]


# ----------------------------------------------------------------- ring order


def test_the_ring_is_a_permutation_of_the_nodes_fixed_by_the_transcript() -> None:
    # Arrange
    nodes = list(range(1000, 1020))

    # Act
    ring = ring_order(nodes, TRANSCRIPT)

    # Assert
    assert sorted(ring) == nodes
    assert ring_order(list(reversed(nodes)), TRANSCRIPT) == ring  # input order is irrelevant
    assert ring != tuple(nodes)


def test_another_transcript_gives_another_ring() -> None:
    # Arrange: one fresh key more or less changes the transcript.
    nodes = list(range(1000, 1020))
    other = hashlib.sha256(b"another key transcript").digest()

    # Act
    first, second = ring_order(nodes, TRANSCRIPT), ring_order(nodes, other)

    # Assert: two of 20! orders coincide with probability 1 / 20!
    assert first != second
    assert sorted(first) == sorted(second)


def test_the_ring_is_the_nodes_sorted_by_a_hash_of_transcript_and_node() -> None:
    # Arrange
    nodes = [3, 1, 2**63, 7]

    # Act
    ring = ring_order(nodes, TRANSCRIPT)

    # Assert
    def position(node: int) -> bytes:
        return hashlib.sha256(TRANSCRIPT + node.to_bytes(8, "big")).digest()

    assert ring == tuple(sorted(nodes, key=position))


# ----------------------------------------------------------------- neighbours


@pytest.mark.parametrize(("count", "size"), [(5, 5), (11, 5), (12, 5), (30, 11), (31, 3)])
def test_neighbours_are_a_symmetric_relation_of_size_k_minus_one(count: int, size: int) -> None:
    # Arrange
    ring = ring_order(list(range(100, 100 + count)), TRANSCRIPT)

    # Act
    graph = {node: neighbours(ring, node, size) for node in ring}

    # Assert
    for node, near in graph.items():
        assert len(near) == size - 1
        assert node not in near
        assert list(near) == sorted(near)
        assert all(node in graph[other] for other in near)


def test_sparse_neighbours_are_the_nearest_on_the_ring() -> None:
    # Arrange
    ring = tuple(range(10))

    # Act
    near = neighbours(ring, 0, 5)

    # Assert: two on each side, wrapping around
    assert near == (1, 2, 8, 9)


def test_the_complete_graph_holds_every_other_node() -> None:
    # Arrange
    ring = ring_order([5, 6, 7, 8], TRANSCRIPT)

    # Act / Assert
    assert neighbours(ring, 7, 4) == (5, 6, 8)


@pytest.mark.parametrize("size", [2, 4, 10, 1, 13, 0])
def test_an_even_or_out_of_range_sparse_size_is_refused(size: int) -> None:
    # Arrange: an even k would make the relation asymmetric.
    ring = tuple(range(12))

    # Act / Assert
    with pytest.raises(ConfigError, match="a neighbourhood must be odd in"):
        neighbours(ring, 0, size)


def test_a_node_off_the_ring_is_refused() -> None:
    # Act / Assert
    with pytest.raises(ConfigError, match="node must be on the ring of 3 participants, got 9"):
        neighbours((1, 2, 3), 9, 3)
