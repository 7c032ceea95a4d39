"""Three attacks on the sparse secure sum, at 11, 30 and 100 sites, in both noise modes.

Each test plays a hostile coordinator (``tests.hostile_world``) against real site services
behind real relays, with the colluding roster members it controls, and checks that the
attack is refused *before* anything lets it unmask a victim's input or a sum of fewer honest
sites than the minimum: the targeted sites refuse to sign (a typed policy error, nothing
revealed), and the unmask oracle (``tests.unmask_oracle``), run over everything the
coordinator and its colluders hold, finds no such group.

1. **A survivor set cut around the victim, no colluder needed**: the coordinator names as
   dropped every neighbour of a small group holding the victim (fewer sites than the
   minimum) and keeps everyone else.
2. **Colluders re-draw their keys to sit next to the victim**: before the graph nonces are
   revealed they cannot know the graph (it depends on every honest nonce), and after, a
   re-keyed advert is refused; the coordinator then drops every honest neighbour of the
   victim, so only colluders survive beside it.
3. **Two disjoint survivor sets in one sum**, each told to its own members and signed by
   them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client.release.graph_draws import GraphDrawLog
from dpmtv_common.privacy.ledger import PrivacyLedger, ReleaseState
from protocol import ErrorCode, ErrorReply, key_transcript, message_from_record
from protocol.secure_sum import SumSharesRequest, SurvivorsSigned, UnmaskReply
from protocol.sum_graph import build_graph, graph_seed, graph_shape
from tests.hostile_world import HostileWorld, Release, Scenario, scratch_folder
from tests.integration.test_hostile_coordinator import World, make_world

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SIZES = {11: 4, 30: 12, 100: 12}  # sites: the plan's minimum (the issue's own cases)
MODES = ["central", "distributed"]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return make_world(tmp_path_factory.mktemp("attacks"))


@pytest.fixture
def opened(world: World, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A factory of hostile worlds, each closed (and checked once more) at the end."""
    made: list[HostileWorld] = []

    def make(scenario: Scenario, **site_settings: Any) -> HostileWorld:
        hostile = HostileWorld(
            world.model,
            world.root / "data" / "site-0",
            world.verify_key,
            scratch_folder(),
            scenario,
            **site_settings,
        )
        made.append(hostile)
        return hostile

    yield make
    for hostile in made:
        hostile.close()


def first_sum(hostile: HostileWorld, release_id: str = "r1") -> Release:
    """Plan, nonce round and first sum, run honestly: every honest site masked its input."""
    release = hostile.plan(release_id, hostile.honest)
    adverts = hostile.adverts(release)
    hostile.keys(release, hostile.honest, adverts)
    hostile.shares(release, hostile.honest, adverts, hostile.nonces(release, adverts))
    assert release.senders(0) == hostile.honest
    assert release.graph is not None
    assert not release.graph.shape.complete
    return release


def refusal(reply: Any) -> str:
    assert isinstance(reply, ErrorReply), reply
    assert reply.code is ErrorCode.POLICY, reply
    return reply.error_type


# ---------------------------------------------------------------- 1. the cut


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sites", SIZES)
def test_a_survivor_set_cut_around_the_victim_is_refused_before_any_reveal(
    opened: Any, sites: int, mode: str
) -> None:
    # Arrange: no colluder. The victim and its nearest neighbours form a group one short of
    # the minimum; every other neighbour of the group is named as dropped.
    hostile = opened(Scenario(sites, 0, SIZES[sites], mode))
    release = first_sum(hostile)
    graph = release.graph
    assert graph is not None
    victim = hostile.honest[0]
    group = [victim]
    for node in group:
        group += [o for o in graph.of(node) if o not in group][: SIZES[sites] - 1 - len(group)]
    cut = {o for node in group for o in graph.of(node)} - set(group)
    survivors = [node for node in hostile.honest if node not in cut]

    # Act: every survivor is asked to sign, then to unmask with what was signed.
    signed = {node: hostile.survivors(release, node, 0, survivors) for node in survivors}
    shown = hostile.signatures(release, 0, survivors)
    unmasked = {node: hostile.unmask(release, node, 0, survivors, shown) for node in survivors}

    # Assert: the group refused to sign, so nothing of it was revealed; no sum below the
    # minimum can be unmasked from what the coordinator holds.
    assert len(group) == SIZES[sites] - 1
    for node in group:
        refusal(signed[node])
        assert not isinstance(unmasked[node], UnmaskReply)
    hostile.check()


# ---------------------------------------------------------------- 2. grinding colluders


def grind(hostile: HostileWorld, release: Release, victim: int, attempts: int) -> Any:
    """Colluder adverts under which they would be ``victim``'s neighbours *if* the honest
    nonces were the ones they guess: (neighbours won, adverts, sessions, guessed graph)."""
    guessed = {node: bytes(32) for node in release.accepted}
    best: Any = None
    for _ in range(attempts):
        colluding = [hostile.regrind(release, node) for node in hostile.colluders]
        adverts = [*release.accepted.values(), *colluding]
        nonces = {**guessed, **{n: s.nonce for n, s in release.colluding.items()}}
        shape = graph_shape(len(adverts), minimum=release.plan.min_sites)
        seed = graph_seed(key_transcript(adverts), nonces)
        guess = build_graph([advert.node_id for advert in adverts], shape, seed)
        near = len(set(guess.of(victim)) & set(hostile.colluders))
        if best is None or near > best[0]:
            best = (near, adverts, dict(release.colluding), guess)
    return best


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sites", SIZES)
def test_colluders_grinding_keys_to_sit_next_to_the_victim_are_refused(
    opened: Any, sites: int, mode: str
) -> None:
    # Arrange: a tenth of the roster colludes. Before any nonce is revealed they re-draw
    # their keys 50 times and keep the adverts under which the guessed graph puts them
    # next to the victim. Every honest site but one (the late one) reveals and masks.
    hostile = opened(Scenario(sites, sites // 10, SIZES[sites], mode))
    release = hostile.plan("r1", hostile.honest)
    victim, late = hostile.honest[0], hostile.honest[1]
    _, adverts, sessions, guess = grind(hostile, release, victim, attempts=50)
    release.colluding = sessions
    hostile.keys(release, hostile.honest, adverts)
    nonces = hostile.nonces(release, adverts)
    hostile.shares(release, [n for n in hostile.honest if n != late], adverts, nonces)
    graph = release.graph
    assert graph is not None

    # Act 1: knowing the nonces now, the colluders re-key for a graph of their choice.
    regrown = [
        *release.accepted.values(),
        *(hostile.regrind(release, n) for n in hostile.colluders),
    ]
    release.colluding = sessions
    request = SumSharesRequest(
        release_id="r1",
        adverts=regrown,
        nonces=hostile.nonces(release, adverts),
        instructions=hostile.instructions(release, 0),
    )
    rekeyed = hostile.ask(late, "query.sum_shares", request)

    # Act 2: every honest neighbour of the victim is named as dropped; only the colluders
    # survive beside it. The victim is asked to sign, then to unmask.
    honest_near = set(graph.of(victim)) - set(hostile.colluders)
    survivors = sorted((set(release.senders(0)) - honest_near) | set(hostile.colluders))
    signed = hostile.survivors(release, victim, 0, survivors)
    shown = hostile.signatures(release, 0, survivors)
    unmasked = hostile.unmask(release, victim, 0, survivors, shown)

    # Assert: the graph is not the one guessed; the re-keyed adverts get nothing; the
    # victim's colluding neighbours are within the bound, below r, so it refuses to sign
    # and never reveals; no sum below the minimum can be unmasked.
    assert graph.neighbours != guess.neighbours
    assert refusal(rekeyed) == "PolicyError"
    assert len(set(graph.of(victim)) & set(hostile.colluders)) <= graph.shape.colluding_neighbours
    refusal(signed)
    assert not isinstance(unmasked, UnmaskReply)
    hostile.check()


# ---------------------------------------------------------------- 3. two survivor sets


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sites", SIZES)
def test_two_disjoint_survivor_sets_in_one_sum_cannot_both_be_signed(
    opened: Any, sites: int, mode: str
) -> None:
    # Arrange: the honest sites split in two, each half told that it alone survived.
    hostile = opened(Scenario(sites, 0, SIZES[sites], mode))
    release = first_sum(hostile)
    half = len(hostile.honest) * 4 // 11  # 4 + 7 at 11 sites, as in the attack seen
    first, second = hostile.honest[:half], hostile.honest[half:]

    # Act
    signed = {
        node: hostile.survivors(release, node, 0, part) for part in (first, second) for node in part
    }
    for part in (first, second):
        shown = hostile.signatures(release, 0, part)
        for node in part:
            hostile.unmask(release, node, 0, part, shown)

    # Assert: the minority set is refused by every member; at most one set was revealed for.
    for node in first:
        refusal(signed[node])
    revealed = {survivors for survivors, _ in release.revealed.get(0, {}).values()}
    assert revealed <= {tuple(second)}
    assert any(isinstance(signed[node], SurvivorsSigned) for node in second) or not revealed
    hostile.check()


# ---------------------------------------------------------------- bounded re-draws


@pytest.mark.parametrize("mode", MODES)
def test_a_coordinator_that_aborts_to_redraw_the_graph_gets_the_site_s_draws_and_no_more(
    opened: Any, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Arrange: sites that allow two graph draws a day.
    hostile = opened(Scenario(11, 1, 4, mode), secagg_max_graph_draws=2)
    site = hostile.honest[0]
    replies = []

    # Act: three releases in a row, each aborted once the graph is drawn (a re-draw).
    caplog.set_level(logging.WARNING, logger="client.service.handlers")
    for index in range(3):
        release = hostile.plan(f"r{index}", hostile.honest)
        hostile.keys(release, hostile.honest, hostile.adverts(release))
        replies.append(release.reveals.get(site))
        hostile.abort(release, hostile.honest)

    # Assert: two nonces, then a refusal naming the setting; nothing of the data left, so
    # each release is refunded; the log a restarted service reads holds the two draws.
    assert replies[0] is not None
    assert replies[1] is not None
    assert replies[2] is None
    refused = [
        message_from_record(reply.content)
        for node, stage, reply in hostile.grid.replies
        if node == site and stage == "query.sum_keys"
    ][-1]
    assert isinstance(refused, ErrorReply)
    assert refused.code is ErrorCode.POLICY
    settings = hostile.service(site).settings
    assert any("secagg_max_graph_draws=2" in line for line in caplog.messages)
    with PrivacyLedger.open(settings.ledger_file, settings.budget) as ledger:
        states = {entry.release_id: entry.state for entry in ledger.releases()}
    assert set(states.values()) == {ReleaseState.ABORTED}
    assert [r for r, _ in GraphDrawLog(settings.graph_draws_file).draws_since(0)] == ["r0", "r1"]
    hostile.check()
