"""The unmask oracle the hostile tests rely on finds what a coordinator can unmask, no less.

Five real ``SiteSumSession`` objects (a complete graph) run one sum in memory; the test then
hands the oracle what a coordinator would hold after different deviations, and checks the
groups it reports: the whole survivor set after an honest run, the honest sites alone when
two members collude, and a single victim once its neighbours' pair seeds are out.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from client.secure_sum import SiteSumSession
from dpmtv_common.crypto import SigningKey
from dpmtv_common.crypto import key_agreement as ka
from dpmtv_common.roster import Roster
from protocol import AddressedBox, NodeBytes, SumRanges, SurvivorsRequest, UnmaskRequest
from tests.unmask_oracle import HonestInput, KeyView, SumView, exposures, violations

RANGES = SumRanges(clipping_range=32.0, quantization_range=2**20, modulus_range=2**40)
NODES = [1, 2, 3, 4, 5]
COUNTS = {node: node + 10 for node in NODES}  # each site's chunk count, the last coordinate


def run_sum() -> tuple[dict[int, SiteSumSession], dict[int, Any], dict[int, Any]]:
    """Every site masks [its node id, its count]; all five survive and reveal."""
    keys = {f"s{n}": SigningKey.generate() for n in NODES}
    roster = Roster("oracle", {name: key.verify_key for name, key in keys.items()})
    sessions = {n: SiteSumSession("r", n, f"s{n}", roster, keys[f"s{n}"], 1, 2, 0.5) for n in NODES}
    adverts = [session.advertise() for session in sessions.values()]
    inbound: dict[int, list[AddressedBox]] = {n: [] for n in NODES}
    masked = {}
    for node, session in sessions.items():
        session.draw_graph(adverts, [])
        session.begin_sum(0)
        for box in session.seal_shares():
            inbound[box.node_id].append(AddressedBox(node_id=node, box=box.box))
        masked[node] = session.mask(np.array([float(node), float(COUNTS[node])]), RANGES)
    signatures = []
    for node, session in sessions.items():
        request = SurvivorsRequest(
            release_id="r", sum_index=0, survivors=NODES, boxes=inbound[node]
        )
        signatures.append(NodeBytes(node_id=node, value=session.sign_survivors(request).signature))
    unmask = UnmaskRequest(release_id="r", sum_index=0, survivors=NODES, signatures=signatures)
    replies = {node: session.reveal(unmask) for node, session in sessions.items()}
    return sessions, masked, replies


def view_of(
    sessions: dict[int, SiteSumSession],
    masked: dict[int, Any],
    honest: list[int],
    minimum: int,
) -> SumView:
    """What the coordinator holds of ``honest`` sites' inputs (the others collude)."""
    view = SumView("r", 0, RANGES, frozenset(set(NODES) - set(honest)))
    for node in honest:
        session = sessions[node]
        assert session.drawn is not None
        assert session.agreement is not None
        view.keys[node] = KeyView(
            session.key.public_bytes,
            {n: a.public_key for n, a in session.agreement.adverts.items()},
        )
        view.inputs[node] = HonestInput(
            node,
            masked[node],
            frozenset(NODES),
            session.drawn.neighbours,
            COUNTS[node],
            minimum,
            session.drawn.threshold,
        )
    return view


def colluders_know(view: SumView, sessions: dict[int, SiteSumSession]) -> None:
    """Every pair seed between a colluder and an honest site, and every share it holds."""
    for colluder in view.colluders:
        session = sessions[colluder]
        assert session.drawn is not None
        for node in view.inputs:
            secret = session.drawn.pair_secrets[node]
            seed = ka.pair_mask_seed(secret, release_id="r", sum_index=0, nodes=(node, colluder))
            view.pair_seeds[(node, colluder)] = seed
        for owner, shares in session.held.items():
            if owner in view.inputs:
                view.add_share(owner, shares[0])


def test_after_an_honest_sum_the_whole_survivor_set_is_the_only_group() -> None:
    # Arrange
    sessions, masked, replies = run_sum()
    view = view_of(sessions, masked, NODES, minimum=3)
    for reply in replies.values():
        for entry in reply.seed_shares:
            view.add_share(entry.node_id, entry.value)

    # Act
    found = exposures(view)

    # Assert: one group, the five, proven by its count coordinate.
    assert [sorted(group.nodes) for group in found] == [NODES]
    assert found[0].total[-1] == pytest.approx(sum(COUNTS.values()), abs=1e-3)
    assert violations(view) == []


def test_with_two_members_colluding_the_honest_three_are_one_group() -> None:
    # Arrange: sites 4 and 5 collude: their own inputs and pair seeds are known.
    sessions, masked, replies = run_sum()
    view = view_of(sessions, masked, [1, 2, 3], minimum=3)
    for node in (1, 2, 3):
        for entry in replies[node].seed_shares:
            view.add_share(entry.node_id, entry.value)
    colluders_know(view, sessions)

    # Act
    found = exposures(view)

    # Assert: the three honest inputs, and their minimum of 4 would be broken.
    assert [sorted(group.nodes) for group in found] == [[1, 2, 3]]
    assert found[0].total[-1] == pytest.approx(COUNTS[1] + COUNTS[2] + COUNTS[3], abs=1e-3)
    assert violations(view) == []
    strict = view_of(sessions, masked, [1, 2, 3], minimum=4)
    strict.shares, strict.pair_seeds = view.shares, view.pair_seeds
    assert [sorted(group.nodes) for group in violations(strict)] == [[1, 2, 3]]


def test_a_victim_whose_pair_seeds_with_honest_sites_are_out_stands_alone() -> None:
    # Arrange: as if sites 2 and 3 had been told site 1 dropped: they reveal their pair seeds
    # with it, while its own self-mask seed is rebuilt from the shares.
    sessions, masked, replies = run_sum()
    view = view_of(sessions, masked, [1, 2, 3], minimum=3)
    for node in (1, 2, 3):
        for entry in replies[node].seed_shares:
            view.add_share(entry.node_id, entry.value)
    colluders_know(view, sessions)
    for node in (2, 3):
        drawn = sessions[node].drawn
        assert drawn is not None
        seed = ka.pair_mask_seed(
            drawn.pair_secrets[1], release_id="r", sum_index=0, nodes=(1, node)
        )
        view.pair_seeds[(node, 1)] = seed

    # Act
    found = {frozenset(group.nodes): group for group in violations(view)}

    # Assert: the victim's input alone is rebuilt, exactly: its node id and its count.
    assert frozenset({1}) in found
    np.testing.assert_allclose(found[frozenset({1})].total, [1.0, COUNTS[1]], atol=1e-3)


def test_without_t_shares_no_seed_and_no_group() -> None:
    # Arrange: the coordinator holds the inputs but no share at all.
    sessions, masked, _ = run_sum()
    view = view_of(sessions, masked, NODES, minimum=3)

    # Act / Assert
    assert exposures(view) == []
