"""The secret chunk permutation is uniform: every order of n items equally likely.

Chi-square goodness of fit over all n! orders (n = 3, 4, 5) and over the integers of
``KeyStream.below`` for bounds that are not powers of two (where a modulo reduction would be
biased). Each test fails only when p < 1e-6, the stated false-failure rate; a planted bias
(the naive shuffle that swaps with any position, whose order counts are provably unequal)
is caught by the same check with the same sample size, so the test can fail.

The seeds here are fixed so the tests are reproducible; production seeds come from
``secret_seed()`` and never repeat.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
from scipy import stats

from dpmtv_common.rng import KeyStream

pytestmark = pytest.mark.statistical

FALSE_FAILURE_RATE = 1e-6
DRAWS_PER_CELL = 300  # 300 expected draws an order: far above chi-square's 5-a-cell rule


def order_counts(draw, n: int, draws: int) -> list[int]:
    counts = Counter(tuple(draw()) for _ in range(draws))
    return [counts[order] for order in itertools.permutations(range(n))]


def p_value(counts: list[int]) -> float:
    return float(stats.chisquare(counts).pvalue)


def naive_shuffle(stream: KeyStream, n: int) -> list[int]:
    """The classic wrong shuffle: swap each slot with ANY slot (n**n paths onto n! orders)."""
    order = list(range(n))
    for i in range(n):
        j = stream.below(n)
        order[i], order[j] = order[j], order[i]
    return order


@pytest.mark.parametrize("n", [3, 4, 5])
def test_every_order_of_n_items_is_equally_likely(n):
    # Arrange
    stream = KeyStream(0x5EED + n, b"uniformity")
    draws = DRAWS_PER_CELL * math.factorial(n)

    # Act
    counts = order_counts(lambda: stream.permutation(n), n, draws)

    # Assert
    assert min(counts) > 0
    assert p_value(counts) > FALSE_FAILURE_RATE


def test_the_check_catches_a_biased_shuffle():
    # Arrange: same n and sample size as above, but the naive shuffle (n = 4: 256 paths
    # onto 24 orders, counts from 8 to 15 paths an order)
    stream = KeyStream(0xBAD, b"uniformity")
    draws = DRAWS_PER_CELL * math.factorial(4)

    # Act
    counts = order_counts(lambda: naive_shuffle(stream, 4), 4, draws)

    # Assert
    assert p_value(counts) < FALSE_FAILURE_RATE


@pytest.mark.parametrize("bound", [3, 6, 7, 100, 257])
def test_below_is_uniform_for_bounds_that_are_not_powers_of_two(bound):
    # Arrange
    stream = KeyStream(bound, b"below")

    # Act
    counts = Counter(stream.below(bound) for _ in range(400 * bound))

    # Assert
    assert set(counts) == set(range(bound))
    assert p_value([counts[v] for v in range(bound)]) > FALSE_FAILURE_RATE


def test_the_first_chunk_position_of_each_record_is_uniform_over_seeds():
    # Over many secret seeds, which record lands first is uniform over the n records: the
    # seed, not the file order, decides the chunks.
    n, draws = 7, 7 * 400

    firsts = Counter(
        KeyStream(seed, b"chunking/example-order").permutation(n)[0] for seed in range(draws)
    )

    assert p_value([firsts[i] for i in range(n)]) > FALSE_FAILURE_RATE
