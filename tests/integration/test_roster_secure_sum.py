"""A hostile coordinator inside the secure sum: made-up sites, shifting survivors, forged boxes.

Each test plays the coordinator message by message (``query.sum_shares``,
``query.sum_survivors``, ``query.sum_unmask``) against real site services behind real relays
(``test_hostile_coordinator``'s world: three sites of 15 records, tiny random LLaVA; the
in-process sites share one generated roster). The test holds every member's identity key,
so it can also sign as a member where a case needs a signature no honest site would give (a
stolen key, a colluding member). A refusing site answers an ``ErrorReply`` with its code and
reveals nothing: no masked input when the advertisements are refused, no signature when the
survivors or boxes are, no share or pair seed when the unmask is.
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is first imported

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from client.secure_sum import SiteSumSession
from dpmtv_common.crypto import SigningKey
from dpmtv_common.errors import PolicyError
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.ledger import ReleaseState
from dpmtv_common.roster import Roster
from protocol import (
    DistributedRelease,
    ErrorCode,
    ErrorReply,
    NoiseMode,
    ReleasePlan,
    SelectionMode,
    message_from_record,
)
from protocol.secure_sum import (
    AddressedBox,
    MaskedInput,
    NodeBytes,
    SumInstructions,
    SumRanges,
    SumSharesRequest,
    SurvivorsRequest,
    SurvivorsSigned,
    UnmaskReply,
    UnmaskRequest,
    key_transcript,
    ranges_for,
    survivors_signed_bytes,
)
from protocol.sum_keys import KeyAdvert
from tests.integration import test_hostile_coordinator as hostile
from tests.integration.test_hostile_coordinator import (
    HEAD_DIM,
    NUM_HEADS,
    NUM_LAYERS,
    SITES,
    Consortium,
    World,
    error_code,
    extract_request,
    made_up_advert,
    make_plan,
    open_consortium,
    planned,
    select_request,
)

pytestmark = pytest.mark.integration

world = hostile.world  # the hostile-coordinator tests' world (tiny model, three sites' data)
consortium = hostile.consortium  # three sites, each with a minimum of three

OUTSIDER = 1_000_000  # a node id no site of the run has


@pytest.fixture
def lenient(world: World, tmp_path: Path) -> Iterator[Consortium]:
    """Three sites whose minimum is two: a survivor set of two is acceptable to each."""
    with open_consortium(world, tmp_path, min_sites=2) as opened:
        yield opened


# ---------------------------------------------------------------- driving a sum by hand


@dataclass
class HandSum:
    """A first secure sum the test drives: the advertisements sent, the boxes that came back."""

    consortium: Consortium
    adverts: list[KeyAdvert]
    inbox: dict[int, list[AddressedBox]] = field(default_factory=dict)  # receiver: senders'
    outbox: dict[int, list[AddressedBox]] = field(default_factory=dict)  # sender: receivers'

    @property
    def transcript(self) -> bytes:
        return key_transcript(self.adverts)

    def boxes_for(self, index: int, survivors: Sequence[int]) -> list[AddressedBox]:
        """What an honest coordinator forwards to site ``index``: its survivors' boxes."""
        received = self.inbox.get(self.consortium.node(index), [])
        return [box for box in received if box.node_id in survivors]

    def box_from(self, sender: int, receiver: int) -> bytes:
        """The sealed box site ``sender`` addressed to site ``receiver``."""
        node = self.consortium.node(receiver)
        (box,) = [b.box for b in self.outbox[self.consortium.node(sender)] if b.node_id == node]
        return box

    def survivors(
        self,
        index: int,
        survivors: Sequence[int],
        boxes: list[AddressedBox] | None = None,
        *,
        sum_index: int = 0,
    ) -> Any:
        """Ask site ``index`` to sign ``survivors`` (the honest boxes unless ``boxes``)."""
        request = SurvivorsRequest(
            release_id="r1",
            sum_index=sum_index,
            survivors=list(survivors),
            boxes=self.boxes_for(index, survivors) if boxes is None else boxes,
        )
        return self.consortium.ask(index, "query.sum_survivors", request)

    def unmask(
        self,
        index: int,
        survivors: Sequence[int],
        signatures: Sequence[tuple[int, bytes]],
        *,
        sum_index: int = 0,
    ) -> Any:
        """Ask site ``index`` to reveal for ``survivors``, showing ``signatures``."""
        request = UnmaskRequest(
            release_id="r1",
            sum_index=sum_index,
            survivors=list(survivors),
            signatures=[NodeBytes(node_id=node, value=value) for node, value in signatures],
        )
        return self.consortium.ask(index, "query.sum_unmask", request)

    def stolen_signature(self, index: int, survivors: Sequence[int], sum_index: int = 0) -> bytes:
        """Member ``index``'s signature over ``survivors``, made with its own identity key."""
        statement = survivors_signed_bytes(
            release_id="r1",
            sum_index=sum_index,
            transcript=self.transcript,
            survivors=survivors,
        )
        key = self.consortium.settings(index).identity_key
        assert key is not None
        return SigningKey.load(key).sign(statement)


def first_sum(
    consortium: Consortium,
    sites: Sequence[int] = range(SITES),
    *,
    adverts: list[KeyAdvert] | None = None,
    ranges: SumRanges | None = None,
) -> HandSum:
    """Send the first sum's advertisements (the sites' own unless given) to ``sites``."""
    adverts = adverts or [consortium.adverts[consortium.node(i)] for i in range(SITES)]
    hand = HandSum(consortium, adverts)
    request = shares_request(adverts, ranges or ranges_for(64.0, SITES))
    for index in sites:
        reply = consortium.ask(index, "query.sum_shares", request)
        assert isinstance(reply, MaskedInput), reply
        sender = consortium.node(index)
        hand.outbox[sender] = list(reply.boxes)
        for box in reply.boxes:
            hand.inbox.setdefault(box.node_id, []).append(AddressedBox(node_id=sender, box=box.box))
    return hand


def shares_request(
    adverts: list[KeyAdvert], ranges: SumRanges, request: Any = None
) -> SumSharesRequest:
    return SumSharesRequest(
        release_id="r1",
        adverts=adverts,
        nonces=[],  # three sites: a complete graph, nothing to draw
        instructions=SumInstructions(
            sum_index=0, request=request or extract_request(), ranges=ranges
        ),
    )


def disclosed(consortium: Consortium, index: int, since: int = 0) -> list[str]:
    """What site ``index`` let out, in order: masked inputs, signatures, unmask replies."""
    node = consortium.node(index)
    kinds: list[str] = []
    for sent_to, _, reply in consortium.grid.replies[since:]:
        answer = message_from_record(reply.content) if sent_to == node else None
        if isinstance(answer, MaskedInput | SurvivorsSigned | UnmaskReply):
            kinds.append(answer.kind)
    return kinds


def nodes(consortium: Consortium, *indices: int) -> list[int]:
    return [consortium.node(i) for i in indices]


# ---------------------------------------------------------------- made-up participants


@dataclass(frozen=True)
class Mode:
    """A noise mode: the sites' settings, the plan's fields, the first sum's grid."""

    settings: dict[str, Any]
    plan: dict[str, Any]

    def ranges(self, plan: ReleasePlan) -> SumRanges:
        if plan.noise_mode is not NoiseMode.DISTRIBUTED:
            return ranges_for(64.0, SITES)
        all_heads = HeadSet.all_heads(num_layers=NUM_LAYERS, num_heads=NUM_HEADS)
        grid = DistributedRelease(plan, NUM_LAYERS * NUM_HEADS, HEAD_DIM).activations(all_heads)
        return SumRanges(
            clipping_range=float(grid.clipping_range),
            quantization_range=grid.quantization_range,
            modulus_range=grid.modulus_range,
        )


MODES = {
    "central": Mode({}, {}),
    "distributed": Mode(
        {"noise_mode": "distributed"},
        {"noise_mode": NoiseMode.DISTRIBUTED, "max_sites": SITES, "max_chunks_per_site": 5},
    ),
}


def forged_adverts(consortium: Consortium, forgery: str, mode: Mode) -> list[KeyAdvert]:
    """Site 0's own advertisement beside two others the coordinator forged or replayed."""
    real = [consortium.adverts[consortium.node(i)] for i in range(SITES)]
    roster = Roster.load(consortium.settings(0).roster)  # type: ignore[arg-type]

    def as_member(index: int, **fields: Any) -> KeyAdvert:
        key = consortium.settings(index).identity_key
        assert key is not None
        return made_up_advert(f"site-{index}", identity=SigningKey.load(key), **fields)

    if forgery == "none":
        return real
    if forgery == "outsiders":  # two names the roster does not hold, with their own keys
        made_up = [("site-8", 1), ("site-9", 2)]
        return [real[0]] + [
            made_up_advert(name, consortium.node(i), roster_sha256=roster.fingerprint)
            for name, i in made_up
        ]
    if forgery == "impostors":  # the roster's names, other keys
        return [real[0]] + [
            made_up_advert(f"site-{i}", consortium.node(i), roster_sha256=roster.fingerprint)
            for i in (1, 2)
        ]
    if forgery == "one-member-twice":  # site 1 on its own node and on another
        twin = as_member(1, node_id=OUTSIDER, roster_sha256=roster.fingerprint)
        return [real[0], real[1], twin]
    if forgery == "another-release":  # site 1's real advertisement of release r2, replayed
        (accept,) = consortium.plan(make_plan(consortium.world, "r2", **mode.plan), range(1, 2))
        assert accept.keys is not None
        return [real[0], accept.keys, real[2]]
    if forgery == "another-roster":  # site 1 signs as a member of some other roster
        return [real[0], as_member(1, node_id=consortium.node(1)), real[2]]
    raise AssertionError(forgery)


@pytest.mark.parametrize("mode", ["central", "distributed"])
@pytest.mark.parametrize(
    ("forgery", "refused"),
    [
        ("none", False),  # the control: the sites' own advertisements are taken
        ("outsiders", True),
        ("impostors", True),
        ("one-member-twice", True),
        ("another-release", True),
        ("another-roster", True),
    ],
)
def test_made_up_participants_are_refused_before_the_site_sends_anything(
    world: World, tmp_path: Path, mode: str, forgery: str, refused: bool
) -> None:
    # Arrange: the three sites accepted; the coordinator fills site 0's sum with two
    # participants of its own making (a sum of one real site would expose it).
    with open_consortium(world, tmp_path, **MODES[mode].settings) as sites:
        plan = planned(sites, **MODES[mode].plan)
        adverts = forged_adverts(sites, forgery, MODES[mode])
        request = shares_request(adverts, MODES[mode].ranges(plan))
        mark = len(sites.grid.replies)
        # Act
        reply = sites.ask(0, "query.sum_shares", request)
        follow_up = HandSum(sites, adverts).survivors(0, [a.node_id for a in adverts], [])
        # Assert: refused at the advertisements: no masked input, no key agreement to go on.
        if not refused:
            assert isinstance(reply, MaskedInput)
            return
        assert error_code(reply) is ErrorCode.POLICY
        assert reply.error_type == "PolicyError"
        assert error_code(follow_up) is ErrorCode.STAGE_ORDER
        assert disclosed(sites, 0, mark) == []
        assert sites.ledger_state(0, "r1") is ReleaseState.RESERVED
        assert sites.services[0].site.records.require("r1").sent == ()


@pytest.mark.parametrize(
    ("members", "fraction", "allowed"),
    [
        (3, 0.5, True),  # t = 2 of 3 rebuild a seed
        (3, 0.7, False),  # 2 of 3 is not above 0.7 of them
        (5, 0.5, True),  # t = 3 of 5
        (5, 0.6, False),  # 3 of 5 is not above 0.6 of them
        (10, 0.5, True),  # t = 6 of 10
        (10, 0.6, False),
        (2, 0.5, False),  # fewer participants than the site's minimum of 3
    ],
)
def test_a_neighbourhood_weaker_than_the_site_policy_is_refused(
    members: int, fraction: float, allowed: bool
) -> None:
    # Arrange: a roster of ``members`` and each member's session; the sites derive k and t
    # from the advertisements alone (the coordinator names neither).
    keys = {f"m-{i}": SigningKey.generate() for i in range(max(members, 2))}
    roster = Roster("c", {name: key.verify_key for name, key in keys.items()})
    sessions = [
        SiteSumSession(
            release_id="r1",
            node_id=node,
            member=name,
            roster=roster,
            identity=keys[name],
            num_sums=1,
            required_sites=3,
            min_threshold_fraction=fraction,
        )
        for node, name in enumerate(sorted(keys)[:members], start=1)
    ]
    adverts = [session.advertise() for session in sessions]
    # Act / Assert
    if allowed:
        sessions[0].join(adverts)
        assert sessions[0].agreement is not None
    else:
        with pytest.raises(PolicyError):
            sessions[0].join(adverts)
        assert sessions[0].agreement is None


# ---------------------------------------------------------------- dropouts below the minimum


def test_survivors_below_the_site_minimum_are_never_signed_or_unmasked(
    consortium: Consortium,
) -> None:
    # Arrange: every site accepted (minimum 3); site 2 drops before its masked input.
    planned(consortium)
    hand = first_sum(consortium, sites=[0, 1])
    survivors = nodes(consortium, 0, 1)
    # Act: sign the two survivors; then unmask them, with both members' signatures (made
    # with their own keys, which the coordinator could not get from the sites).
    signed = [hand.survivors(i, survivors) for i in (0, 1)]
    signatures = [(node, hand.stolen_signature(i, survivors)) for i, node in enumerate(survivors)]
    unmasked = [hand.unmask(i, survivors, signatures) for i in (0, 1)]
    # Assert: no site signed a set below its minimum, and none unmasks a set it never signed.
    assert [error_code(reply) for reply in signed] == [ErrorCode.POLICY] * 2
    assert [error_code(reply) for reply in unmasked] == [ErrorCode.STAGE_ORDER] * 2
    for index in (0, 1):
        assert disclosed(consortium, index) == ["masked-input"]


def test_a_dropout_below_the_site_minimum_in_a_later_sum_never_unmasks(
    consortium: Consortium,
) -> None:
    # Arrange: a private plan: the vote sum over all three, then site 2 drops out of the
    # activation sum before its masked input.
    plan = planned(consortium, selection=SelectionMode.PRIVATE)
    assert consortium.secure_sum(select_request(plan)) is not None
    consortium.grid.drops[consortium.node(2)] = {"query.sum_collect"}
    mark = len(consortium.grid.replies)
    # Act: the coordinator's own session goes on with two survivors (its two picked heads).
    result = consortium.secure_sum(extract_request(heads=((0, 1), (1, 2))))
    # Assert: both survivors refused to sign, so no unmask was ever sent, nothing revealed.
    assert result is None
    later = consortium.grid.replies[mark:]
    survivors = [
        message_from_record(reply.content)
        for _, stage, reply in later
        if stage == "query.sum_survivors"
    ]
    assert [error_code(reply) for reply in survivors] == [ErrorCode.POLICY] * 2
    assert not [stage for _, stage, _ in later if stage == "query.sum_unmask"]
    for index in (0, 1):
        assert disclosed(consortium, index, mark) == ["masked-input"]


# ---------------------------------------------------------------- one survivor set a sum


def test_a_site_signs_one_survivor_set_a_sum(lenient: Consortium) -> None:
    # Arrange: sites of minimum 2; all three masked; site 0 signed U1 = all three.
    planned(lenient, min_sites=2)
    hand = first_sum(lenient)
    everyone, fewer = nodes(lenient, 0, 1, 2), nodes(lenient, 0, 1)
    assert isinstance(hand.survivors(0, everyone), SurvivorsSigned)
    # Act: the coordinator asks it to sign U2 = {0, 1} as well (to drop site 2 for others).
    again = hand.survivors(0, fewer)
    # Assert
    assert error_code(again) is ErrorCode.POLICY
    assert disclosed(lenient, 0) == ["masked-input", "survivors-signed"]


@pytest.mark.parametrize("own", ["stolen-key-over-U2", "its-own-over-U1"])
def test_a_site_reveals_only_for_the_survivor_set_it_signed(lenient: Consortium, own: str) -> None:
    # Arrange: site 0 signed U1 = all three; site 1 was told U2 = {0, 1} and signed that.
    # Revealing for U2 would give site 2's pair seed while site 0's U1 says 2 survived
    # (its self-mask shares go out too): no node may be both survivor and dropped.
    planned(lenient, min_sites=2)
    hand = first_sum(lenient)
    everyone, fewer = nodes(lenient, 0, 1, 2), nodes(lenient, 0, 1)
    assert isinstance(hand.survivors(0, everyone), SurvivorsSigned)
    of_site_1 = hand.survivors(1, fewer)
    assert isinstance(of_site_1, SurvivorsSigned)
    of_site_0 = {
        "stolen-key-over-U2": hand.stolen_signature(0, fewer),  # every signature verifies
        "its-own-over-U1": hand.stolen_signature(0, everyone),
    }[own]
    # Act
    reply = hand.unmask(0, fewer, [(fewer[0], of_site_0), (fewer[1], of_site_1.signature)])
    # Assert
    assert error_code(reply) is ErrorCode.POLICY
    assert disclosed(lenient, 0) == ["masked-input", "survivors-signed"]


@pytest.mark.parametrize(
    "signatures",
    [
        "every-survivor",  # the control: the site reveals
        "one-missing",
        "one-over-another-set",
        "one-by-another-member",
        "one-twice",
    ],
)
def test_an_unmask_needs_every_survivor_s_signature_over_that_very_set(
    lenient: Consortium, signatures: str
) -> None:
    # Arrange: all three masked; sites 0 and 2 signed U = all three; site 1 signed U as
    # well, or only U2 = {0, 1} when the coordinator told it that.
    planned(lenient, min_sites=2)
    hand = first_sum(lenient)
    everyone, fewer = nodes(lenient, 0, 1, 2), nodes(lenient, 0, 1)
    told_site_1 = fewer if signatures == "one-over-another-set" else everyone
    signed = {
        node: hand.survivors(i, told_site_1 if i == 1 else everyone).signature
        for i, node in enumerate(everyone)
    }
    zero, one, two = everyone
    shown = {
        "every-survivor": [(zero, signed[zero]), (one, signed[one]), (two, signed[two])],
        "one-missing": [(zero, signed[zero]), (one, signed[one])],
        "one-over-another-set": [(zero, signed[zero]), (one, signed[one]), (two, signed[two])],
        "one-by-another-member": [(zero, signed[zero]), (one, signed[two]), (two, signed[two])],
        "one-twice": [
            (zero, signed[zero]),
            (one, signed[one]),
            (one, signed[one]),
            (two, signed[two]),
        ],
    }[signatures]
    # Act
    reply = hand.unmask(0, everyone, shown)
    # Assert
    if signatures == "every-survivor":
        assert isinstance(reply, UnmaskReply)
        return
    assert error_code(reply) is ErrorCode.POLICY
    assert disclosed(lenient, 0) == ["masked-input", "survivors-signed"]


# ---------------------------------------------------------------- forged share boxes


def flipped(box: bytes) -> bytes:
    """``box`` with one bit of its ciphertext flipped."""
    return box[:20] + bytes([box[20] ^ 0x01]) + box[21:]


@pytest.mark.parametrize(
    ("forgery", "code"),
    [
        ("none", None),  # the control: the boxes open and the site signs
        ("bit-flipped", ErrorCode.POLICY),
        ("meant-for-another-site", ErrorCode.POLICY),  # 2's box to 1, replayed to 0
        ("reflected", ErrorCode.POLICY),  # 0's own box to 2, sent back as 2's
        ("senders-swapped", ErrorCode.POLICY),
        ("from-a-non-participant", ErrorCode.POLICY),
        ("one-missing", ErrorCode.POLICY),
        ("one-twice", ErrorCode.POLICY),
    ],
)
def test_a_forged_or_replayed_share_box_is_refused_before_the_site_signs(
    consortium: Consortium, forgery: str, code: ErrorCode | None
) -> None:
    # Arrange: all three masked; site 0 is due the boxes of sites 1 and 2.
    planned(consortium)
    hand = first_sum(consortium)
    everyone = nodes(consortium, 0, 1, 2)
    one, two = everyone[1], everyone[2]
    honest = {one: hand.box_from(1, 0), two: hand.box_from(2, 0)}
    boxes = {
        "none": [(one, honest[one]), (two, honest[two])],
        "bit-flipped": [(one, honest[one]), (two, flipped(honest[two]))],
        "meant-for-another-site": [(one, honest[one]), (two, hand.box_from(2, 1))],
        "reflected": [(one, honest[one]), (two, hand.box_from(0, 2))],
        "senders-swapped": [(one, honest[two]), (two, honest[one])],
        "from-a-non-participant": [(one, honest[one]), (OUTSIDER, honest[two])],
        "one-missing": [(one, honest[one])],
        "one-twice": [(one, honest[one]), (one, honest[one]), (two, honest[two])],
    }[forgery]
    sent = [AddressedBox(node_id=node, box=box) for node, box in boxes]
    # Act: the boxes to site 0; then an unmask with every survivor's signature (sites 1 and
    # 2 sign U; site 0's is made with its own key, as only a stolen key could).
    reply = hand.survivors(0, everyone, sent)
    signatures = [(everyone[0], hand.stolen_signature(0, everyone))]
    signatures += [(everyone[i], hand.survivors(i, everyone).signature) for i in (1, 2)]
    unmasked = hand.unmask(0, everyone, signatures)
    # Assert: refused before it signed, so it reveals nothing even with every signature.
    if code is None:
        assert isinstance(reply, SurvivorsSigned)
        assert isinstance(unmasked, UnmaskReply)
        return
    assert error_code(reply) is code
    assert error_code(unmasked) is ErrorCode.STAGE_ORDER
    assert disclosed(consortium, 0) == ["masked-input"]


def test_survivors_before_the_key_agreement_are_refused(consortium: Consortium) -> None:
    # Arrange: sites 1 and 2 masked; site 0 never saw the advertisements.
    planned(consortium)
    hand = first_sum(consortium, sites=[1, 2])
    everyone = nodes(consortium, 0, 1, 2)
    # Act
    reply = hand.survivors(0, everyone, hand.boxes_for(0, everyone))
    # Assert
    assert error_code(reply) is ErrorCode.STAGE_ORDER
    assert isinstance(reply, ErrorReply)
    assert disclosed(consortium, 0) == []
