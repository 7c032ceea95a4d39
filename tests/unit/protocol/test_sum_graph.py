"""The secure sum's graph: its numbers meet the stated bound, and its draw is unbiased.

The bound is recomputed here independently (floating-point hypergeometric tails, not the
module's integer arithmetic) and the drawn graphs are checked for what the bound assumes:
d-regular, symmetric, each site's neighbourhood a uniformly random d-subset (statistical,
false-failure rate stated), and an expander that a few removed sites do not cut.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import Counter

import pytest

from dpmtv_common.errors import ConfigError
from protocol.sum_graph import (
    COMPLETE_UP_TO,
    CORRECTNESS_FAILURE,
    PRIVACY_FAILURE,
    GraphShape,
    build_graph,
    graph_seed,
    graph_shape,
)
from protocol.sum_keys import nonce_commitment

SIZES = [11, 12, 30, 100, 300, 1000]
MINIMA = [2, 3, 4, 12]


def seed_of(label: object) -> bytes:
    return hashlib.sha256(repr(label).encode()).digest()


def hypergeometric_tail(population: int, marked: int, draws: int, at_least: int) -> float:
    """P[X >= at_least] for X ~ Hypergeometric(population, marked, draws)."""
    hits = sum(
        math.comb(marked, count) * math.comb(population - marked, draws - count)
        for count in range(max(at_least, 0), min(marked, draws) + 1)
    )
    return hits / math.comb(population, draws)


def failures(sites: int, minimum: int, degree: int) -> tuple[float, float, GraphShape]:
    """(privacy, correctness) failure of a degree, with the ĉ, t and r it implies."""
    colluders, dropped, others = sites // 10, math.ceil(sites / 10), sites - 1
    bound = next(
        c
        for c in range(colluders + 1)
        if sites * hypergeometric_tail(others, colluders, degree, c + 1) <= PRIVACY_FAILURE
    )
    threshold = max(bound + 1, (degree + 1) // 2 + 1)
    shape = GraphShape(sites, minimum, degree, threshold, bound)
    need = shape.required_neighbours()
    leak = sites * hypergeometric_tail(others, colluders, degree, bound + 1)
    stuck = sites * (1 - hypergeometric_tail(others, others - dropped, degree, need))
    return leak, (stuck if need <= degree else 1.0), shape


# ----------------------------------------------------------------- the shape


@pytest.mark.parametrize("sites", range(2, COMPLETE_UP_TO + 1))
@pytest.mark.parametrize("minimum", [2, 3])
def test_up_to_ten_sites_the_graph_is_complete_with_a_majority_threshold(
    sites: int, minimum: int
) -> None:
    # Act
    shape = graph_shape(sites, minimum=minimum)

    # Assert: every colluder (one at ten sites) is a neighbour: ĉ is exact.
    assert shape.complete
    assert (shape.degree, shape.threshold) == (sites - 1, max(2, sites // 2 + 1))
    assert shape.colluding_neighbours == sites // 10
    assert shape.required_neighbours() == max(shape.threshold - 1, minimum - 1 + sites // 10)


@pytest.mark.parametrize("sites", SIZES)
@pytest.mark.parametrize("minimum", MINIMA)
def test_a_sparse_shape_meets_both_bounds_and_no_smaller_degree_does(
    sites: int, minimum: int
) -> None:
    # Act
    shape = graph_shape(sites, minimum=minimum)

    # Assert
    if shape.complete:  # only where no sparse degree qualifies
        assert all(
            failures(sites, minimum, d)[1] > CORRECTNESS_FAILURE
            for d in range(2, sites - 1)
            if sites * d % 2 == 0
        )
        return
    leak, stuck, expected = failures(sites, minimum, shape.degree)
    assert shape == expected
    assert leak <= PRIVACY_FAILURE
    assert stuck <= CORRECTNESS_FAILURE
    assert (sites * shape.degree) % 2 == 0
    assert shape.threshold > (shape.degree + 1) / 2
    assert shape.threshold > shape.colluding_neighbours
    smaller = [d for d in range(2, shape.degree) if sites * d % 2 == 0]
    assert all(failures(sites, minimum, d)[1] > CORRECTNESS_FAILURE for d in smaller)


@pytest.mark.parametrize("sites", SIZES)
def test_a_site_needs_its_minimum_of_honest_neighbours_beyond_the_colluders(sites: int) -> None:
    # Arrange
    shape = graph_shape(sites, minimum=3)

    # Act
    need = shape.required_neighbours()
    own = shape.required_neighbours(5)

    # Assert: even with ĉ of them colluding, m - 1 honest survivors are tied to the site.
    assert need - shape.colluding_neighbours >= 3 - 1
    assert own - shape.colluding_neighbours >= 5 - 1
    assert need >= shape.threshold - 1


def test_the_degree_grows_slowly_with_the_consortium() -> None:
    # Act
    degrees = {sites: graph_shape(sites, minimum=3).degree for sites in (100, 1000, 10_000)}

    # Assert: a hundredfold consortium needs a few times the neighbours, not a hundred.
    assert degrees[100] < degrees[1000] < degrees[10_000] <= 4 * degrees[100]


def test_more_collusion_needs_more_neighbours() -> None:
    # Act
    cautious = graph_shape(1000, minimum=3, corrupt_fraction=0.2).degree
    default = graph_shape(1000, minimum=3).degree

    # Assert
    assert cautious > default


@pytest.mark.parametrize(
    ("sites", "options", "match"),
    [
        (1, {}, "sites must be an int >= 2 .* got 1"),
        (True, {}, "sites must be an int >= 2 .* got True"),
        (3.0, {}, "sites must be an int >= 2 .* got 3.0"),
        (5, {"minimum": 0}, "minimum must be an int >= 1 .* got 0"),
        (100, {"corrupt_fraction": 0.5}, r"corrupt_fraction must be in \[0, 0.5\), got 0.5"),
        (100, {"dropout_fraction": -0.1}, r"dropout_fraction must be in \[0, 0.5\), got -0.1"),
    ],
)
def test_bad_arguments_are_refused(sites: object, options: dict[str, float], match: str) -> None:
    # Act / Assert
    with pytest.raises(ConfigError, match=match):
        graph_shape(sites, **{"minimum": 3, **options})  # type: ignore[arg-type]


# ----------------------------------------------------------------- the draw


@pytest.mark.parametrize("sites", [11, 12, 30, 100])
def test_a_drawn_graph_is_simple_symmetric_and_regular(sites: int) -> None:
    # Arrange
    shape = graph_shape(sites, minimum=3)
    nodes = [7 * i + 3 for i in range(sites)]

    # Act
    graph = build_graph(nodes, shape, seed_of(sites))

    # Assert
    assert graph.nodes == tuple(nodes)
    for node, near in graph.neighbours.items():
        assert len(near) == shape.degree
        assert node not in near
        assert list(near) == sorted(set(near))
        assert all(node in graph.of(other) for other in near)


def test_the_draw_is_fixed_by_the_seed_and_any_other_seed_gives_another() -> None:
    # Arrange
    shape = graph_shape(30, minimum=3)
    nodes = list(range(1000, 1030))

    # Act
    first = build_graph(nodes, shape, seed_of("a"))
    again = build_graph(list(reversed(nodes)), shape, seed_of("a"))
    other = build_graph(nodes, shape, seed_of("b"))

    # Assert
    assert again.neighbours == first.neighbours
    assert other.neighbours != first.neighbours


def test_each_neighbourhood_is_a_uniform_subset_pairs_and_joint_memberships_alike() -> None:
    # Arrange: 2,000 draws of a 4-regular graph on 12 sites. The bound needs each site's
    # neighbourhood to be a uniform 4-subset of the other 11: a pair is joined with p = 4/11
    # (count Binomial(2000, p), sd 21.5) and sites 1 and 2 are both near site 0 with
    # q = 4 * 3 / (11 * 10) (sd 13.9). A 6.5-sd band fails one count with probability 8e-11;
    # all 67 counts (union bound) fail together with probability below 1e-8.
    shape = graph_shape(12, minimum=2)
    draws, joined, both = 2000, Counter[tuple[int, int]](), 0
    nodes = list(range(12))

    # Act
    for index in range(draws):
        graph = build_graph(nodes, shape, seed_of(("uniform", index)))
        joined.update((a, b) for a in nodes for b in graph.of(a) if a < b)
        both += 1 in graph.of(0) and 2 in graph.of(0)

    # Assert
    assert shape.degree == 4
    p, q = 4 / 11, 12 / 110
    for a in nodes:
        for b in nodes[a + 1 :]:
            assert abs(joined[a, b] - draws * p) <= 6.5 * math.sqrt(draws * p * (1 - p))
    assert abs(both - draws * q) <= 6.5 * math.sqrt(draws * q * (1 - q))


@pytest.mark.parametrize("sites", [30, 100])
def test_few_removed_sites_do_not_cut_the_graph_and_small_sets_have_large_boundaries(
    sites: int,
) -> None:
    # Arrange: a ring of nearest neighbours is cut by removing d sites around any arc, and
    # an arc longer than d has a boundary of d; an expander's balls have boundaries at least
    # as large as themselves, and a random tenth of the sites removed leaves it connected.
    shape = graph_shape(sites, minimum=3)
    chooser = random.Random(sites)  # test-only draws of which sites to remove
    nodes = list(range(sites))

    for index in range(20):
        graph = build_graph(nodes, shape, seed_of(("expansion", sites, index)))

        # Act
        kept = set(nodes) - set(chooser.sample(nodes, sites // 10))
        start = min(kept)
        reached = graph.component(start, kept)
        ball = [start]
        for node in ball:  # breadth-first, up to a quarter of the sites
            ball += [o for o in graph.of(node) if o not in ball][: sites // 4 - len(ball)]
        boundary = {o for node in ball for o in graph.of(node)} - set(ball)

        # Assert
        assert reached == kept
        assert len(boundary) >= len(ball)


def test_a_sparse_graph_needs_a_seed_and_the_right_nodes() -> None:
    # Arrange
    shape = graph_shape(30, minimum=3)

    # Act / Assert
    with pytest.raises(ConfigError, match="needs a 32-byte seed"):
        build_graph(list(range(30)), shape, None)
    with pytest.raises(ConfigError, match="nodes must be 30 distinct ids, got 29"):
        build_graph(list(range(29)), shape, seed_of(1))
    with pytest.raises(ConfigError, match="nodes must be 30 distinct ids"):
        build_graph([0, *range(29)], shape, seed_of(1))


def test_a_complete_graph_needs_no_seed() -> None:
    # Act
    graph = build_graph([3, 1, 2], graph_shape(3, minimum=3), None)

    # Assert
    assert dict(graph.neighbours) == {1: (2, 3), 2: (1, 3), 3: (1, 2)}


def test_a_component_is_what_a_site_reaches_inside_a_set() -> None:
    # Arrange
    graph = build_graph([1, 2, 3, 4], graph_shape(4, minimum=2), None)

    # Act / Assert
    assert graph.component(1, [1, 3]) == {1, 3}
    assert graph.component(1, [2, 3]) == frozenset()
    with pytest.raises(ConfigError, match="node must be one of the 4 participants, got 9"):
        graph.of(9)


# ----------------------------------------------------------------- seed and commitment


def test_the_seed_covers_the_transcript_and_every_nonce_in_node_order() -> None:
    # Arrange
    nonces = {5: b"a" * 32, 1: b"b" * 32}

    # Act
    seed = graph_seed(b"transcript", nonces)

    # Assert
    assert graph_seed(b"transcript", dict(reversed(nonces.items()))) == seed
    assert graph_seed(b"transcript!", nonces) != seed
    assert graph_seed(b"transcript", {**nonces, 5: b"c" * 32}) != seed
    assert graph_seed(b"transcript", {1: b"b" * 32}) != seed


def test_a_commitment_binds_the_nonce_to_its_release_member_and_node() -> None:
    # Arrange
    fields = {"release_id": "r1", "member": "a", "node_id": 1, "nonce": b"n" * 32}

    # Act
    base = nonce_commitment(**fields)  # type: ignore[arg-type]

    # Assert
    for name, other in (
        ("release_id", "r2"),
        ("member", "b"),
        ("node_id", 2),
        ("nonce", b"m" * 32),
    ):
        assert nonce_commitment(**{**fields, name: other}) != base  # type: ignore[arg-type]
