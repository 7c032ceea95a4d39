"""A site's secure-sum session: it masks so that masks cancel, and refuses what it cannot check.

Several ``SiteSumSession`` objects play a small consortium in memory; the test plays the
coordinator (routes the sealed boxes, names the survivors, gathers signatures), honestly
unless a test says otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from client.secure_sum import SiteSumSession
from dpmtv_common.crypto import SigningKey, mask_prg
from dpmtv_common.crypto import key_agreement as ka
from dpmtv_common.errors import ConfigError, PolicyError
from dpmtv_common.roster import Roster
from protocol import (
    AddressedBox,
    KeyAdvert,
    NodeBytes,
    StageOrderError,
    SumRanges,
    SurvivorsRequest,
    UnmaskRequest,
    advert_signed_bytes,
    graph_shape,
    key_transcript,
    nonce_commitment,
    quantise,
    survivors_signed_bytes,
)

RELEASE = "r1"
FIRST_NODE = 1000
RANGES = SumRanges(clipping_range=1.0, quantization_range=2**20, modulus_range=2**40)
SIZE = 20


@dataclass
class Consortium:
    """Roster members and their sessions for one release (site i is node 1000 + i)."""

    roster: Roster
    keys: dict[str, SigningKey]
    sessions: list[SiteSumSession]

    def node(self, index: int) -> int:
        return FIRST_NODE + index

    @property
    def adverts(self) -> list[KeyAdvert]:
        return [session.advertise() for session in self.sessions]

    def join_all(self, adverts: list[KeyAdvert] | None = None) -> None:
        """Check the adverts, reveal every nonce (a sparse graph) and draw the graph."""
        adverts = adverts if adverts is not None else self.adverts
        for session in self.sessions:
            session.join(adverts)
        agreement = self.sessions[0].agreement
        assert agreement is not None
        nonces = [] if agreement.shape.complete else self.nonces()
        for session in self.sessions:
            session.draw_graph(adverts, nonces)

    def nonces(self) -> list[NodeBytes]:
        """Every joined session's revealed nonce."""
        return [NodeBytes(node_id=s.node_id, value=s.reveal_nonce().nonce) for s in self.sessions]

    def share_all(self) -> dict[int, list[AddressedBox]]:
        """Seal every site's shares; the boxes each receiver gets, named by their sender."""
        inbound: dict[int, list[AddressedBox]] = {s.node_id: [] for s in self.sessions}
        for sender in self.sessions:
            for box in sender.seal_shares():
                inbound[box.node_id].append(AddressedBox(node_id=sender.node_id, box=box.box))
        return inbound

    def mask_all(self, sum_index: int, nodes: Sequence[int] | None = None) -> dict[int, Any]:
        masked = {}
        for session in self.sessions:
            if nodes is not None and session.node_id not in nodes:
                continue
            session.begin_sum(sum_index)
            masked[session.node_id] = session.mask(site_input(session.node_id), RANGES)
        return masked

    def survivors_request(
        self,
        receiver: int,
        survivors: Sequence[int],
        inbound: dict[int, list[AddressedBox]],
        sum_index: int = 0,
    ) -> SurvivorsRequest:
        boxes = [box for box in inbound.get(receiver, []) if box.node_id in survivors]
        return SurvivorsRequest(
            release_id=RELEASE,
            sum_index=sum_index,
            survivors=list(survivors),
            boxes=boxes if sum_index == 0 else [],
        )

    def sign_all(
        self,
        survivors: Sequence[int],
        inbound: dict[int, list[AddressedBox]],
        sum_index: int = 0,
    ) -> list[NodeBytes]:
        signatures = []
        for node in survivors:
            request = self.survivors_request(node, survivors, inbound, sum_index)
            signed = self.session(node).sign_survivors(request)
            signatures.append(NodeBytes(node_id=node, value=signed.signature))
        return signatures

    def session(self, node: int) -> SiteSumSession:
        (found,) = [s for s in self.sessions if s.node_id == node]
        return found

    def unmask_request(
        self, survivors: Sequence[int], signatures: list[NodeBytes], sum_index: int = 0
    ) -> UnmaskRequest:
        return UnmaskRequest(
            release_id=RELEASE,
            sum_index=sum_index,
            survivors=list(survivors),
            signatures=signatures,
        )


def drawn(session: SiteSumSession) -> Any:
    """The session's drawn graph and keys (the graph must have been drawn)."""
    assert session.drawn is not None
    return session.drawn


def site_input(node: int) -> np.ndarray:
    return np.random.default_rng(node).uniform(-1.0, 1.0, size=SIZE)


def make_session(
    roster: Roster,
    keys: dict[str, SigningKey],
    index: int,
    *,
    release_id: str = RELEASE,
    identity: SigningKey | None = None,
    **options: Any,
) -> SiteSumSession:
    name = f"site-{index}"
    settings: dict[str, Any] = {
        "num_sums": 2,
        "required_sites": 2,
        "min_threshold_fraction": 0.5,
        **options,
    }
    return SiteSumSession(
        release_id=release_id,
        node_id=FIRST_NODE + index,
        member=name,
        roster=roster,
        identity=identity or keys[name],
        **settings,
    )


def consortium(count: int, **options: Any) -> Consortium:
    keys = {f"site-{i}": SigningKey.generate() for i in range(count)}
    roster = Roster("test", {name: key.verify_key for name, key in keys.items()})
    sessions = [make_session(roster, keys, i, **options) for i in range(count)]
    return Consortium(roster, keys, sessions)


def signed_advert(key: SigningKey, **fields: Any) -> KeyAdvert:
    """An advertisement with chosen fields, signed by ``key`` (a fixed commitment if none)."""
    fields.setdefault("nonce_commitment", bytes(32))
    signature = key.sign(advert_signed_bytes(**fields))
    return KeyAdvert(**fields, signature=signature)


def after_first_sum(count: int, **options: Any) -> tuple[Consortium, dict[int, Any]]:
    """Joined, shared and masked for sum 0; the boxes each site will be sent."""
    group = consortium(count, **options)
    group.join_all()
    inbound = group.share_all()
    group.mask_all(0)
    return group, inbound


# ----------------------------------------------------------------- advertise


def test_the_advert_is_this_member_s_fresh_key_signed_for_this_release_and_roster() -> None:
    # Arrange
    group = consortium(3)
    session = group.sessions[1]

    # Act
    advert = session.advertise()

    # Assert
    assert (advert.member, advert.node_id, advert.release_id) == ("site-1", 1001, RELEASE)
    assert advert.roster_sha256 == group.roster.fingerprint
    assert advert.public_key == session.key.public_bytes
    group.roster.verify("site-1", advert.signed_bytes(), advert.signature)
    assert make_session(group.roster, group.keys, 1).advertise().public_key != advert.public_key


def test_a_site_whose_identity_key_is_not_the_roster_s_refuses_to_advertise() -> None:
    # Arrange
    group = consortium(2)
    session = make_session(group.roster, group.keys, 0, identity=SigningKey.generate())

    # Act / Assert
    with pytest.raises(PolicyError, match="identity key must be the roster's key for 'site-0'"):
        session.advertise()


# ----------------------------------------------------------------- join


@pytest.mark.parametrize("count", [3, 5, 12])
def test_every_site_derives_the_same_symmetric_graph_from_the_adverts(count: int) -> None:
    # Arrange
    group = consortium(count)
    adverts = group.adverts

    # Act
    group.join_all(adverts)

    # Assert
    shape = graph_shape(count, minimum=2)
    graph = {}
    for session in group.sessions:
        assert session.agreement is not None
        assert session.drawn is not None
        assert session.agreement.transcript == key_transcript(adverts)
        assert session.drawn.threshold == shape.threshold
        assert len(drawn(session).neighbours) == shape.degree
        graph[session.node_id] = drawn(session).neighbours
    assert all(node in graph[other] for node, near in graph.items() for other in near)
    assert {
        drawn(s).graph.neighbours == drawn(group.sessions[0]).graph.neighbours
        for s in group.sessions
    } == {True}


def test_an_advert_for_another_release_is_refused() -> None:
    # Arrange
    group = consortium(3)
    other = make_session(group.roster, group.keys, 2, release_id="r2").advertise()
    adverts = [*group.adverts[:2], other]

    # Act / Assert
    with pytest.raises(PolicyError, match="must be for this release"):
        group.sessions[0].join(adverts)


def test_an_advert_under_another_roster_is_refused_with_both_fingerprints() -> None:
    # Arrange: site-2 holds a roster with one more member.
    group = consortium(3)
    bigger = Roster("test", {**group.roster.members, "x": SigningKey.generate().verify_key})
    other = make_session(bigger, group.keys, 2).advertise()
    adverts = [*group.adverts[:2], other]

    # Act
    with pytest.raises(PolicyError, match="install one roster") as info:
        group.sessions[0].join(adverts)

    # Assert
    assert group.roster.fingerprint in str(info.value)
    assert bigger.fingerprint in str(info.value)


def test_an_advert_whose_key_was_swapped_is_refused() -> None:
    # Arrange: a coordinator in the middle replaces site-2's public key with its own.
    group = consortium(3)
    adverts = group.adverts
    adverts[2] = adverts[2].model_copy(
        update={"public_key": ka.AgreementKey.generate().public_bytes}
    )

    # Act / Assert
    with pytest.raises(PolicyError, match="'site-2' must sign with its roster identity key"):
        group.sessions[0].join(adverts)


def test_an_advert_from_a_non_member_is_refused() -> None:
    # Arrange: a site the coordinator made up, claiming this roster.
    group = consortium(3)
    fake = signed_advert(
        SigningKey.generate(),
        member="mallory",
        node_id=1003,
        release_id=RELEASE,
        roster_sha256=group.roster.fingerprint,
        public_key=ka.AgreementKey.generate().public_bytes,
    )

    # Act / Assert
    with pytest.raises(PolicyError, match="must be a member of roster"):
        group.sessions[0].join([*group.adverts, fake])


@pytest.mark.parametrize(("member", "node_id"), [("site-1", 1005), ("site-2", 1001)])
def test_one_member_on_two_nodes_or_two_members_on_one_node_is_refused(
    member: str, node_id: int
) -> None:
    # Arrange: a member signs a second advert (it would count twice in the sum).
    group = consortium(3)
    second = signed_advert(
        group.keys[member],
        member=member,
        node_id=node_id,
        release_id=RELEASE,
        roster_sha256=group.roster.fingerprint,
        public_key=ka.AgreementKey.generate().public_bytes,
    )

    # Act / Assert
    with pytest.raises(PolicyError, match="distinct roster members on distinct nodes"):
        group.sessions[0].join([*group.adverts, second])


def test_adverts_without_this_site_s_own_are_refused() -> None:
    # Arrange
    group = consortium(4)

    # Act / Assert
    with pytest.raises(PolicyError, match="this site's own, unchanged"):
        group.sessions[0].join(group.adverts[1:])


def test_an_old_advert_of_this_site_replayed_in_place_of_its_own_is_refused() -> None:
    # Arrange: a genuine advert of site-0 for this release and node, with an earlier key.
    group = consortium(3)
    replayed = make_session(group.roster, group.keys, 0).advertise()
    adverts = [replayed, *group.adverts[1:]]

    # Act / Assert
    with pytest.raises(PolicyError, match="this site's own, unchanged"):
        group.sessions[0].join(adverts)


def test_fewer_participants_than_the_site_s_minimum_are_refused() -> None:
    # Arrange
    group = consortium(3, required_sites=4)

    # Act / Assert
    with pytest.raises(PolicyError, match="at least this site's minimum of 4 roster members"):
        group.sessions[0].join(group.adverts)


def test_a_threshold_below_the_site_s_policy_is_refused() -> None:
    # Arrange: 5 sites give t = 3 of k = 5; this site wants t > 0.9 k.
    group = consortium(5, min_threshold_fraction=0.9)

    # Act / Assert
    with pytest.raises(PolicyError, match=r"must exceed 0\.9 of the neighbourhood of 5, got 3"):
        group.sessions[0].join(group.adverts)


def test_the_adverts_arrive_once() -> None:
    # Arrange
    group = consortium(3)
    adverts = group.adverts
    group.sessions[0].join(adverts)

    # Act / Assert
    with pytest.raises(StageOrderError, match="once a release"):
        group.sessions[0].join(adverts)


# ----------------------------------------------------------------- nonce and graph


def test_the_advert_commits_to_a_fresh_nonce_bound_to_this_release_member_and_node() -> None:
    # Arrange
    group = consortium(12)
    session = group.sessions[3]

    # Act
    advert = session.advertise()

    # Assert
    expected = nonce_commitment(
        release_id=RELEASE, member="site-3", node_id=1003, nonce=session.nonce
    )
    assert advert.nonce_commitment == expected
    assert make_session(group.roster, group.keys, 3).nonce != session.nonce


def test_a_complete_graph_reveals_no_nonce_and_draws_without_one() -> None:
    # Arrange: up to ten sites everyone is everyone's neighbour: nothing to draw.
    group = consortium(5)
    adverts = group.adverts
    session = group.sessions[0]
    session.join(adverts)

    # Act / Assert
    with pytest.raises(StageOrderError, match="complete graph of 5 needs no nonce"):
        session.reveal_nonce()
    with pytest.raises(PolicyError, match="a complete graph takes no nonces"):
        session.draw_graph(adverts, [NodeBytes(node_id=1000, value=session.nonce)])
    session.draw_graph(adverts, [])
    assert session.drawn is not None
    assert len(drawn(session).neighbours) == 4


def test_a_site_reveals_its_nonce_once_and_only_after_the_adverts() -> None:
    # Arrange
    group = consortium(12)
    session = group.sessions[0]

    # Act / Assert
    with pytest.raises(StageOrderError, match="advertisements must arrive before"):
        session.reveal_nonce()
    session.join(group.adverts)
    assert session.reveal_nonce().nonce == session.nonce
    with pytest.raises(StageOrderError, match="reveals its graph nonce once a release"):
        session.reveal_nonce()


def test_a_sparse_graph_is_not_drawn_before_this_site_revealed() -> None:
    # Arrange: the coordinator skips the nonce round for this site (it holds the others').
    group = consortium(12)
    adverts = group.adverts
    for other in group.sessions[1:]:
        other.join(adverts)
    nonces = [
        NodeBytes(node_id=s.node_id, value=s.reveal_nonce().nonce) for s in group.sessions[1:]
    ]

    # Act / Assert
    with pytest.raises(StageOrderError, match="nonce revealed first"):
        group.sessions[0].draw_graph(adverts, nonces)


def test_the_graph_is_drawn_only_for_the_adverts_this_site_revealed_for() -> None:
    # Arrange: after site 0 revealed, the coordinator swaps in a re-keyed site 5 (a colluder
    # grinding keys after seeing the nonces).
    group = consortium(12)
    adverts = group.adverts
    group.sessions[0].join(adverts)
    group.sessions[0].reveal_nonce()
    regrind = make_session(group.roster, group.keys, 5)
    other = [regrind.advertise() if a.node_id == 1005 else a for a in adverts]

    # Act / Assert
    with pytest.raises(PolicyError, match="advertisements must be those this site checked"):
        group.sessions[0].draw_graph(other, [])


@pytest.mark.parametrize("change", ["missing", "extra", "twice", "wrong", "own replaced"])
def test_nonces_must_be_one_per_participant_each_matching_its_commitment(change: str) -> None:
    # Arrange
    group = consortium(12)
    adverts = group.adverts
    for session in group.sessions:
        session.join(adverts)
    nonces = group.nonces()
    if change == "missing":
        nonces = nonces[1:]
    elif change == "extra":
        nonces.append(NodeBytes(node_id=1099, value=bytes(32)))
    elif change == "twice":
        nonces.append(nonces[1])
    elif change == "wrong":
        nonces[4] = NodeBytes(node_id=1004, value=bytes(32))
    else:
        nonces[0] = NodeBytes(node_id=1000, value=bytes(32))
    session = group.sessions[0] if change != "own replaced" else group.sessions[1]

    # Act / Assert
    with pytest.raises(PolicyError, match=r"one nonce from every participant|must match its"):
        session.draw_graph(adverts, nonces)


def test_the_graph_follows_every_nonce_so_no_member_chooses_it() -> None:
    # Arrange: a graph of 30; then the same sites again, site 0 alone with a fresh nonce.
    group = consortium(30)
    group.join_all()
    first = drawn(group.sessions[1]).graph.neighbours
    group.sessions[0] = make_session(group.roster, group.keys, 0)
    for session in group.sessions[1:]:
        session.agreement, session.drawn, session.revealed = None, None, False

    # Act
    group.join_all()

    # Assert: every site drew the same graph, and one other nonce gave another graph.
    second = drawn(group.sessions[1]).graph.neighbours
    assert all(drawn(session).graph.neighbours == second for session in group.sessions)
    assert second != first


# ----------------------------------------------------------------- seal and mask


def test_each_neighbour_gets_one_box_and_the_site_keeps_its_own_share() -> None:
    # Arrange
    group = consortium(12)
    group.join_all()
    session = group.sessions[4]

    # Act
    boxes = session.seal_shares()

    # Assert
    assert session.drawn is not None
    assert sorted(box.node_id for box in boxes) == list(drawn(session).neighbours)
    assert len(session.own_shares) == 2  # one share per planned sum
    assert len(session.seeds) == 2
    assert session.seeds[0] != session.seeds[1]


def test_shares_are_sealed_once_and_only_after_the_adverts() -> None:
    # Arrange
    group = consortium(3)
    session = group.sessions[0]

    # Act / Assert
    with pytest.raises(StageOrderError, match="drawn before any sum"):
        session.seal_shares()
    group.join_all()
    session.seal_shares()
    with pytest.raises(StageOrderError, match="once a release"):
        session.seal_shares()


@pytest.mark.parametrize("count", [3, 12])
def test_pair_masks_cancel_leaving_inputs_and_self_masks(count: int) -> None:
    # Arrange
    group = consortium(count)
    group.join_all()
    group.share_all()

    # Act
    masked = group.mask_all(0)

    # Assert
    modulus = RANGES.modulus_range
    total = np.sum(list(masked.values()), axis=0) % modulus
    for session in group.sessions:
        self_mask = mask_prg.expand_mask(session.seeds[0], modulus, [(SIZE,)])[0]
        total = (total - self_mask) % modulus
    plain = np.sum([quantise(site_input(node), RANGES) for node in masked], axis=0)
    np.testing.assert_array_equal(total, plain % modulus)


def test_a_masked_input_hides_the_quantised_input() -> None:
    # Arrange
    group = consortium(3)
    group.join_all()
    group.share_all()

    # Act
    masked = group.mask_all(0)

    # Assert
    for node, vector in masked.items():
        assert np.count_nonzero(vector == quantise(site_input(node), RANGES)) <= 1


def test_a_coordinate_beyond_c_is_refused_not_clipped() -> None:
    # Arrange
    group = consortium(3)
    group.join_all()
    group.share_all()
    session = group.sessions[0]
    session.begin_sum(0)

    # Act / Assert
    with pytest.raises(ConfigError, match=r"within ±c = 1\.0"):
        session.mask(np.array([0.5, 1.5]), RANGES)


def test_a_grid_that_could_wrap_for_the_participants_is_refused() -> None:
    # Arrange: M = 4 Q, and 5 participants.
    group = consortium(5)
    group.join_all()
    group.share_all()
    session = group.sessions[0]
    session.begin_sum(0)
    narrow = SumRanges(clipping_range=1.0, quantization_range=2**20, modulus_range=2**22)

    # Act / Assert
    with pytest.raises(PolicyError, match="must fit the modulus"):
        session.mask(np.zeros(3), narrow)


def test_a_sum_is_masked_once() -> None:
    # Arrange
    group = consortium(3)
    group.join_all()
    group.share_all()
    group.mask_all(0)

    # Act / Assert
    with pytest.raises(StageOrderError, match="masked once"):
        group.sessions[0].mask(np.zeros(SIZE), RANGES)


def test_sums_run_in_order_and_no_more_than_planned() -> None:
    # Arrange
    group = consortium(3, num_sums=1)
    group.join_all()
    inbound = group.share_all()
    session = group.sessions[0]

    # Act / Assert: sum 1 before sum 0
    with pytest.raises(StageOrderError, match="secure sum 1 must come next"):
        session.begin_sum(1)
    group.mask_all(0)
    # before sum 0 is unmasked
    with pytest.raises(StageOrderError, match="previous one unmasked: False"):
        session.begin_sum(1)
    nodes = [s.node_id for s in group.sessions]
    request = group.unmask_request(nodes, group.sign_all(nodes, inbound))
    for other in group.sessions:
        other.reveal(request)
    # beyond the plan's one sum
    with pytest.raises(StageOrderError, match="of 1"):
        session.begin_sum(1)


# ----------------------------------------------------------------- sign survivors


def test_every_survivor_signs_the_same_statement_with_its_roster_key() -> None:
    # Arrange
    group, inbound = after_first_sum(4)
    survivors = [1000, 1001, 1003]

    # Act
    signatures = group.sign_all(survivors, inbound)

    # Assert
    agreement = group.sessions[0].agreement
    assert agreement is not None
    statement = survivors_signed_bytes(
        release_id=RELEASE, sum_index=0, transcript=agreement.transcript, survivors=survivors
    )
    for entry in signatures:
        group.roster.verify(f"site-{entry.node_id - FIRST_NODE}", statement, entry.value)


@pytest.mark.parametrize(
    "survivors", [[1001, 1002, 1003], [1000, 1001, 1009], [1000, 1000, 1001, 1002, 1009]]
)
def test_survivors_that_lack_this_site_or_name_a_non_participant_are_refused(
    survivors: list[int],
) -> None:
    # Arrange
    group, inbound = after_first_sum(4)
    request = group.survivors_request(1000, survivors, inbound)

    # Act / Assert
    with pytest.raises(PolicyError, match="survivors must be participants of this sum"):
        group.sessions[0].sign_survivors(request)


def test_survivors_below_the_site_s_minimum_are_refused() -> None:
    # Arrange
    group, inbound = after_first_sum(4, required_sites=4)
    request = group.survivors_request(1000, [1000, 1001, 1002], inbound)

    # Act / Assert
    with pytest.raises(PolicyError, match="survivors must number at least this site's minimum"):
        group.sessions[0].sign_survivors(request)


@pytest.mark.parametrize(("count", "required"), [(12, 2), (30, 12)])
def test_survivors_leaving_fewer_than_r_neighbours_are_refused_even_as_a_majority(
    count: int, required: int
) -> None:
    # Arrange: a sparse graph; U holds a majority of the sites and one neighbour fewer than r
    # of site 0's (at 30 sites with a minimum of 12: r = 14 > t - 1 = 9, so even a set that
    # rebuilds every seed is refused: with its 3 possibly colluding neighbours, fewer than
    # 11 honest sites would be tied to its input).
    group, inbound = after_first_sum(count, required_sites=required)
    session = group.sessions[0]
    shape = drawn(session).graph.shape
    need = shape.required_neighbours(required)
    near = drawn(session).neighbours
    others = [node for node in range(1001, 1000 + count) if node not in near]
    survivors = sorted([1000, *near[: need - 1], *others])
    request = group.survivors_request(1000, survivors, inbound)

    # Act / Assert
    assert 2 * len(survivors) > count
    assert len(survivors) >= required
    with pytest.raises(PolicyError, match=rf"r = {need} surviving neighbours .* got {need - 1}"):
        session.sign_survivors(request)


@pytest.mark.parametrize("count", [4, 12])
def test_a_survivor_set_of_half_the_participants_or_fewer_is_refused(count: int) -> None:
    # Arrange: two disjoint halves could each be fully signed by their own members.
    group, inbound = after_first_sum(count)
    half = [FIRST_NODE + i for i in range(count // 2)]
    request = group.survivors_request(1000, half, inbound)

    # Act / Assert
    with pytest.raises(PolicyError, match="must be a majority of the sum's"):
        group.sessions[0].sign_survivors(request)


def test_a_forged_box_is_refused() -> None:
    # Arrange
    group, inbound = after_first_sum(3)
    request = group.survivors_request(1000, [1000, 1001, 1002], inbound)
    first = request.boxes[0]
    flipped = bytes([first.box[0], *first.box[1:-1], first.box[-1] ^ 1])
    boxes = [first.model_copy(update={"box": flipped}), *request.boxes[1:]]

    # Act / Assert
    with pytest.raises(PolicyError, match=f"share box from node {first.node_id} must open"):
        group.sessions[0].sign_survivors(request.model_copy(update={"boxes": boxes}))


def test_a_box_relabelled_as_another_sender_s_is_refused() -> None:
    # Arrange: the coordinator swaps the senders of site 0's two boxes.
    group, inbound = after_first_sum(3)
    request = group.survivors_request(1000, [1000, 1001, 1002], inbound)
    one, two = request.boxes
    swapped = [one.model_copy(update={"box": two.box}), two.model_copy(update={"box": one.box})]

    # Act / Assert
    with pytest.raises(PolicyError, match="must open"):
        group.sessions[0].sign_survivors(request.model_copy(update={"boxes": swapped}))


@pytest.mark.parametrize("change", ["missing", "twice", "from a dropped site"])
def test_boxes_must_come_once_from_each_surviving_neighbour(change: str) -> None:
    # Arrange
    group, inbound = after_first_sum(4)
    survivors = [1000, 1001, 1002]
    request = group.survivors_request(1000, survivors, inbound)
    boxes = list(request.boxes)
    if change == "missing":
        boxes = boxes[1:]
    elif change == "twice":
        boxes.append(boxes[0])
    else:
        boxes += [box for box in inbound[1000] if box.node_id == 1003]

    # Act / Assert
    with pytest.raises(PolicyError, match="share boxes must come once from each surviving"):
        group.sessions[0].sign_survivors(request.model_copy(update={"boxes": boxes}))


def test_a_site_signs_one_survivor_set_a_sum() -> None:
    # Arrange
    group, inbound = after_first_sum(4)
    session = group.sessions[0]
    first = session.sign_survivors(group.survivors_request(1000, [1000, 1001, 1002], inbound))

    # Act: the same set again is the same signature; another set is refused.
    again = session.sign_survivors(group.survivors_request(1000, [1000, 1001, 1002], inbound))
    other = group.survivors_request(1000, [1000, 1001, 1003], inbound)

    # Assert
    assert again.signature == first.signature
    with pytest.raises(PolicyError, match="one survivor set a sum"):
        session.sign_survivors(other)


def test_survivors_must_follow_this_site_s_input_to_that_sum() -> None:
    # Arrange
    group = consortium(3)
    group.join_all()
    inbound = group.share_all()
    group.sessions[0].begin_sum(0)
    request = group.survivors_request(1000, [1000, 1001, 1002], inbound)

    # Act / Assert: no input masked yet; then a survivors request for another sum.
    with pytest.raises(StageOrderError, match="must follow this site's input to sum 0"):
        group.sessions[0].sign_survivors(request)
    group.sessions[0].mask(site_input(1000), RANGES)
    with pytest.raises(StageOrderError, match="must follow this site's input to sum 0"):
        group.sessions[0].sign_survivors(request.model_copy(update={"sum_index": 1}))


def test_boxes_travel_with_the_first_sum_only() -> None:
    # Arrange: sum 0 done by everyone, sum 1 masked.
    group, inbound = after_first_sum(3)
    nodes = [1000, 1001, 1002]
    request = group.unmask_request(nodes, group.sign_all(nodes, inbound))
    for session in group.sessions:
        session.reveal(request)
    group.mask_all(1)
    later = group.survivors_request(1000, nodes, inbound, sum_index=1)
    with_boxes = later.model_copy(update={"boxes": inbound[1000]})

    # Act / Assert
    with pytest.raises(PolicyError, match="first sum only"):
        group.sessions[0].sign_survivors(with_boxes)


# ----------------------------------------------------------------- reveal


def test_reveal_gives_survivors_seed_shares_and_dropped_neighbours_pair_seeds_only() -> None:
    # Arrange: site 3 of 4 never sent its input.
    group = consortium(4)
    group.join_all()
    inbound = group.share_all()
    survivors = [1000, 1001, 1002]
    group.mask_all(0, survivors)
    request = group.unmask_request(survivors, group.sign_all(survivors, inbound))

    # Act
    reply = group.sessions[0].reveal(request)

    # Assert: never a share of the dropped site's seed, never a survivor's pair seed.
    assert [entry.node_id for entry in reply.seed_shares] == survivors
    assert [entry.node_id for entry in reply.pair_seeds] == [1003]
    dropped = group.session(1003)
    secret = dropped.key.shared_secret(group.sessions[0].key.public_bytes)
    expected = ka.pair_mask_seed(secret, release_id=RELEASE, sum_index=0, nodes=(1003, 1000))
    assert reply.pair_seeds[0].value == expected


def test_the_next_sum_runs_over_the_survivors_only() -> None:
    # Arrange
    group = consortium(4)
    group.join_all()
    inbound = group.share_all()
    survivors = [1000, 1001, 1002]
    group.mask_all(0, survivors)
    request = group.unmask_request(survivors, group.sign_all(survivors, inbound))
    for node in survivors:
        group.session(node).reveal(request)

    # Act
    masked = group.mask_all(1, survivors)
    reply_nodes = group.sign_all(survivors, inbound, sum_index=1)
    second = group.sessions[0].reveal(group.unmask_request(survivors, reply_nodes, 1))

    # Assert: the dropped site is no longer a participant: nothing to cancel for it.
    assert group.sessions[0].participants == tuple(survivors)
    assert second.pair_seeds == []
    assert sorted(masked) == survivors


def test_unmask_for_another_survivor_set_than_the_one_signed_is_refused() -> None:
    # Arrange
    group, inbound = after_first_sum(4)
    survivors = [1000, 1001, 1002, 1003]
    signatures = group.sign_all(survivors, inbound)
    fewer = [1000, 1001, 1002]

    # Act / Assert
    with pytest.raises(PolicyError, match="the survivor set this site signed"):
        group.sessions[0].reveal(group.unmask_request(fewer, signatures[:3]))


def test_unmask_without_every_survivor_s_signature_is_refused() -> None:
    # Arrange
    group, inbound = after_first_sum(4)
    survivors = [1000, 1001, 1002, 1003]
    signatures = group.sign_all(survivors, inbound)

    # Act / Assert
    with pytest.raises(PolicyError, match="one signature from every survivor"):
        group.sessions[0].reveal(group.unmask_request(survivors, signatures[:3]))


def test_a_signature_by_another_member_is_refused() -> None:
    # Arrange: site 1's signature stands in for site 2's.
    group, inbound = after_first_sum(4)
    survivors = [1000, 1001, 1002, 1003]
    signatures = group.sign_all(survivors, inbound)
    signatures[2] = NodeBytes(node_id=1002, value=signatures[1].value)

    # Act / Assert
    with pytest.raises(PolicyError, match="'site-2' must sign with its roster identity key"):
        group.sessions[0].reveal(group.unmask_request(survivors, signatures))


def test_a_coordinator_that_tells_sites_different_survivors_gets_nothing() -> None:
    # Arrange: sites 0-2 are told U (all four); site 3 is told U' (without site 2), which
    # would have site 2's self mask rebuilt while site 3 reveals its pair seed with site 2.
    group, inbound = after_first_sum(4)
    survivors = [1000, 1001, 1002, 1003]
    mixed = []
    for node in (1000, 1001, 1002):
        told = group.survivors_request(node, survivors, inbound)
        signed = group.session(node).sign_survivors(told)
        mixed.append(NodeBytes(node_id=node, value=signed.signature))
    other = group.survivors_request(1003, [1000, 1001, 1003], inbound)
    signed = group.session(1003).sign_survivors(other)
    mixed.append(NodeBytes(node_id=1003, value=signed.signature))

    # Act / Assert
    with pytest.raises(PolicyError, match="'site-3' must sign"):
        group.sessions[0].reveal(group.unmask_request(survivors, mixed))


def test_unmask_comes_once_and_only_after_signing() -> None:
    # Arrange
    group, inbound = after_first_sum(3)
    survivors = [1000, 1001, 1002]
    session = group.sessions[0]
    early = group.unmask_request(survivors, [])

    # Act / Assert
    with pytest.raises(StageOrderError, match="unmask must follow the survivors of sum 0"):
        session.reveal(early)
    request = group.unmask_request(survivors, group.sign_all(survivors, inbound))
    session.reveal(request)
    with pytest.raises(StageOrderError, match="unmask must follow the survivors of sum 0"):
        session.reveal(request)
