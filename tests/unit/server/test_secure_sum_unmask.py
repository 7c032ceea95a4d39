"""The coordinator's unmask arithmetic, against masked inputs built here from the protocol's rule.

Each site u of the participants P masks ``x_u + PRG(b_u) + Σ_{v ∈ N(u) ∩ P} ±PRG(s_uv)`` (mod M,
+ when u < v), shares ``b_u`` among N(u) and u (any t rebuild it), and at unmask reveals its
shares of the survivors' seeds and its pair seeds with its dropped neighbours. The inputs are
built from ``mask_prg`` and ``shamir`` directly, not by the site's session, so the test pins
the rule both sides must follow.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pytest

from dpmtv_common.crypto import mask_prg, shamir
from dpmtv_common.errors import InsufficientSharesError, IntegrityError
from protocol import NodeBytes, UnmaskReply, build_graph, graph_shape
from server.secure_sum.unmask import unmask_total

MODULUS = 2**40
SIZE = 50


@dataclass
class Sum:
    """One secure sum built by hand: what the coordinator holds before and after unmask."""

    inputs: dict[int, np.ndarray]
    masked: dict[int, np.ndarray]
    graph: dict[int, tuple[int, ...]]
    threshold: int
    seeds: dict[int, bytes]
    shares: dict[int, dict[int, bytes]]  # owner -> holder -> share of the owner's seed
    pair_seeds: dict[frozenset[int], bytes]

    @property
    def participants(self) -> list[int]:
        return sorted(self.graph)

    def reply(self, holder: int, survivors: Collection[int]) -> UnmaskReply:
        """What an honest ``holder`` reveals for ``survivors``."""
        owners = [o for o in (*self.graph[holder], holder) if o in survivors]
        dropped = [v for v in self.graph[holder] if v not in survivors]
        return UnmaskReply(
            release_id="r",
            sum_index=0,
            seed_shares=[NodeBytes(node_id=o, value=self.shares[o][holder]) for o in owners],
            pair_seeds=[
                NodeBytes(node_id=v, value=self.pair_seeds[frozenset((holder, v))]) for v in dropped
            ],
        )

    def unmask(
        self,
        survivors: Collection[int],
        replies: Mapping[int, UnmaskReply] | None = None,
    ) -> np.ndarray:
        if replies is None:
            replies = {node: self.reply(node, survivors) for node in survivors}
        return unmask_total(
            masked={node: self.masked[node] for node in survivors},
            replies=replies,
            participants=self.participants,
            neighbours=self.graph,
            threshold=self.threshold,
            modulus=MODULUS,
        )

    def plain(self, survivors: Collection[int]) -> np.ndarray:
        total: np.ndarray = np.sum([self.inputs[node] for node in survivors], axis=0) % MODULUS
        return total


def expand(seed: bytes) -> np.ndarray:
    return mask_prg.expand_mask(seed, MODULUS, [(SIZE,)])[0]


def build_sum(nodes: Sequence[int], *, seed: int = 0) -> Sum:
    """Every site's masked input under the protocol's rule, on the graph of ``nodes``."""
    rng = np.random.default_rng(seed)
    shape = graph_shape(len(nodes), minimum=2)
    drawn = build_graph(nodes, shape, hashlib.sha256(bytes([seed])).digest())
    graph, threshold = dict(drawn.neighbours), shape.threshold
    seeds = {node: rng.bytes(32) for node in nodes}
    pair_seeds = {frozenset((u, v)): rng.bytes(32) for u in nodes for v in graph[u] if u < v}
    inputs = {node: rng.integers(0, 2**20, size=SIZE) for node in nodes}
    masked: dict[int, np.ndarray] = {}
    shares: dict[int, dict[int, bytes]] = {}
    for u in nodes:
        total = (inputs[u] + expand(seeds[u])) % MODULUS
        for v in graph[u]:
            pair = expand(pair_seeds[frozenset((u, v))])
            total = (total + pair if u < v else total - pair) % MODULUS
        masked[u] = total
        holders = sorted((*graph[u], u))
        made = shamir.create_shares(seeds[u], threshold, len(holders))
        shares[u] = dict(zip(holders, made, strict=True))
    return Sum(inputs, masked, graph, threshold, seeds, shares, pair_seeds)


COMPLETE = list(range(1, 6))  # 5 sites: every other site a neighbour, t = 3
SPARSE = list(range(100, 112))  # 12 sites: 4 neighbours each, t = 3


@pytest.mark.parametrize("nodes", [COMPLETE, SPARSE])
def test_without_dropouts_the_total_is_the_plain_sum(nodes: list[int]) -> None:
    # Arrange
    built = build_sum(nodes)

    # Act
    total = built.unmask(nodes)

    # Assert
    assert total.dtype == np.int64
    np.testing.assert_array_equal(total, built.plain(nodes))


@pytest.mark.parametrize(("nodes", "lost"), [(COMPLETE, [3]), (SPARSE, [101, 107])])
def test_sites_that_sent_nothing_are_cancelled_by_their_neighbours_pair_seeds(
    nodes: list[int], lost: list[int]
) -> None:
    # Arrange
    built = build_sum(nodes)
    survivors = [node for node in nodes if node not in lost]

    # Act
    total = built.unmask(survivors)

    # Assert
    np.testing.assert_array_equal(total, built.plain(survivors))


def test_a_survivor_lost_at_unmask_is_rebuilt_from_t_shares() -> None:
    # Arrange: site 104's input arrived; its four neighbours hold shares, t = 3 answer.
    built = build_sum(SPARSE)
    lost = (104, built.graph[104][0])
    answering = [node for node in SPARSE if node not in lost]
    replies = {node: built.reply(node, SPARSE) for node in answering}

    # Act
    total = built.unmask(SPARSE, replies)

    # Assert
    np.testing.assert_array_equal(total, built.plain(SPARSE))


def test_a_mask_that_is_not_removed_leaves_noise_not_the_sum() -> None:
    # Arrange: the checks above are not vacuous: the masked inputs alone sum to noise.
    built = build_sum(COMPLETE)
    raw = np.sum([built.masked[node] for node in COMPLETE], axis=0) % MODULUS

    # Act / Assert
    assert np.count_nonzero(raw == built.plain(COMPLETE)) <= 1


def test_fewer_than_t_shares_of_a_survivor_s_seed_are_refused() -> None:
    # Arrange: only two of site 3's holders answer; t = 3.
    built = build_sum(COMPLETE)
    replies = {node: built.reply(node, COMPLETE) for node in (1, 2)}

    # Act / Assert
    with pytest.raises(InsufficientSharesError, match="needs t = 3 shares, got 2"):
        built.unmask(COMPLETE, replies)


def test_a_survivor_that_withholds_a_dropped_neighbour_s_pair_seed_is_refused() -> None:
    # Arrange
    built = build_sum(COMPLETE)
    survivors = [1, 2, 4, 5]
    replies = {node: built.reply(node, survivors) for node in survivors}
    replies[2] = replies[2].model_copy(update={"pair_seeds": []})

    # Act / Assert
    with pytest.raises(InsufficientSharesError, match="survivor 2 must reveal its pair seed"):
        built.unmask(survivors, replies)


def test_a_pair_seed_revealed_twice_is_refused() -> None:
    # Arrange
    built = build_sum(COMPLETE)
    survivors = [1, 2, 4, 5]
    replies = {node: built.reply(node, survivors) for node in survivors}
    twice = replies[1].pair_seeds * 2
    replies[1] = replies[1].model_copy(update={"pair_seeds": twice})

    # Act / Assert
    with pytest.raises(InsufficientSharesError, match="once, got 2"):
        built.unmask(survivors, replies)


def test_masked_inputs_of_different_lengths_are_refused() -> None:
    # Arrange
    built = build_sum(COMPLETE)
    built.masked[2] = built.masked[2][:-1]

    # Act / Assert
    with pytest.raises(IntegrityError, match="one length"):
        built.unmask(COMPLETE)


def test_a_survivor_lost_at_unmask_beside_a_dropped_site_aborts_the_sum() -> None:
    # Arrange: site 3 sent nothing; survivor 5 then misses the unmask. Enough shares of every
    # seed come back (t = 3 of 1, 2, 4), but only 5 (and 3) hold their pair seed: the
    # design reveals pair seeds instead of rebuilding a dropped site's key, so it fails closed.
    built = build_sum(COMPLETE)
    survivors = [1, 2, 4, 5]
    replies = {node: built.reply(node, survivors) for node in (1, 2, 4)}

    # Act / Assert
    with pytest.raises(InsufficientSharesError, match="survivor 5 must reveal its pair seed"):
        built.unmask(survivors, replies)
