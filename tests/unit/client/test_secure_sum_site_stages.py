"""The site's secure-sum stages: membership before any reservation, public checks before data.

``SiteSums`` runs on stand-in sites (``tests.flower_harness.StandInSite``): they accept any
plan and record every contribution asked of them, so a test sees whether the site reserved
or computed anything before it refused.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from client.release.site import Site
from client.service.sum_stages import SiteSums
from dpmtv_common.crypto import SigningKey
from dpmtv_common.errors import ConfigError, DpmtvError, PolicyError
from protocol import (
    AddressedBox,
    NodeBytes,
    NoiseMode,
    PlanMismatchError,
    ReleaseOrder,
    ReleasePlan,
    SecureSumRequest,
    SelectionMode,
    StageOrderError,
    SumCollectRequest,
    SumInstructions,
    SumKeysRequest,
    SumRanges,
    SumSharesRequest,
    SurvivorsRequest,
    UnmaskRequest,
)
from tests.flower_harness import StandInSite, stand_in_sites
from tests.plans import make_plan

RANGES = SumRanges(clipping_range=1.0, quantization_range=2**20, modulus_range=2**40)
EXTRACT = SecureSumRequest(
    release_id="r1", stage="extract", heads=None, clip_norm=1.0, score_top_r=None
)


def zeros(index: int, request: SecureSumRequest) -> list[np.ndarray]:
    return [np.zeros(4)]


def sums_of(site: StandInSite) -> SiteSums:
    return SiteSums(cast(Site, site))


def accepted(tmp_path: Path, count: int = 3, plan: ReleasePlan | None = None) -> list[SiteSums]:
    """Stand-in sites that accepted ``plan`` as nodes 1, 2, ..."""
    plan = plan or make_plan()
    everyone = [sums_of(site) for site in stand_in_sites(tmp_path, count, zeros)]
    for node, sums in enumerate(everyone, start=1):
        sums.accept(plan, node_id=node, run_id=7)
    return everyone


def shares_request(everyone: list[SiteSums], ranges: SumRanges = RANGES) -> SumSharesRequest:
    adverts = [sums.sessions["r1"].advertise() for sums in everyone]
    return SumSharesRequest(
        release_id="r1",
        adverts=adverts,
        nonces=[],  # a complete graph: nothing to draw
        instructions=SumInstructions(sum_index=0, request=EXTRACT, ranges=ranges),
    )


def finish_first_sum(everyone: list[SiteSums]) -> None:
    """Run sum 0 through every site's stages, as an honest coordinator with no dropouts."""
    request = shares_request(everyone)
    nodes = list(range(1, len(everyone) + 1))
    inbound: dict[int, list[AddressedBox]] = {node: [] for node in nodes}
    for sender, sums in zip(nodes, everyone, strict=True):
        answer, _ = sums.shares(request, run_id=7)
        for box in answer.boxes:
            inbound[box.node_id].append(AddressedBox(node_id=sender, box=box.box))
    signatures = []
    for node, sums in zip(nodes, everyone, strict=True):
        told = SurvivorsRequest(release_id="r1", sum_index=0, survivors=nodes, boxes=inbound[node])
        signed = sums.survivors(told, run_id=7)
        signatures.append(NodeBytes(node_id=node, value=signed.signature))
    unmask = UnmaskRequest(release_id="r1", sum_index=0, survivors=nodes, signatures=signatures)
    for sums in everyone:
        sums.unmask(unmask, run_id=7)


def stand_in(sums: SiteSums) -> StandInSite:
    return cast(StandInSite, sums.site)


# ----------------------------------------------------------------- membership


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"roster": None, "identity_key": None}, PolicyError, "only with a consortium roster"),
        ({"identity_key": None}, ConfigError, "go together"),
        ({"roster": None}, ConfigError, "go together"),
        ({"name": "site-9"}, ConfigError, "--name must be a member of the roster"),
    ],
)
def test_a_site_that_cannot_take_part_refuses_the_plan_before_reserving(
    tmp_path: Path, change: dict[str, Any], error: type[Exception], match: str
) -> None:
    # Arrange
    (site, _) = stand_in_sites(tmp_path, 2, zeros)
    site.settings = dataclasses.replace(site.settings, **change)

    # Act
    with pytest.raises(error, match=match):
        sums_of(site).accept(make_plan(), node_id=1, run_id=7)

    # Assert: Site.accept_plan (which reserves the budget) never ran
    assert site.records.by_release == {}


def test_an_identity_key_that_is_not_the_roster_s_is_refused_before_reserving(
    tmp_path: Path,
) -> None:
    # Arrange
    (site, _) = stand_in_sites(tmp_path, 2, zeros)
    other = SigningKey.generate().save(tmp_path / "other.key")
    site.settings = dataclasses.replace(site.settings, identity_key=other)

    # Act
    with pytest.raises(ConfigError, match="must be the roster's key for 'site-0'"):
        sums_of(site).accept(make_plan(), node_id=1, run_id=7)

    # Assert
    assert site.records.by_release == {}


# ----------------------------------------------------------------- accept


def test_the_acceptance_carries_the_site_s_signed_key_for_its_node(tmp_path: Path) -> None:
    # Arrange
    (site, _) = stand_in_sites(tmp_path, 2, zeros)
    sums = sums_of(site)

    # Act
    accept = sums.accept(make_plan(), node_id=1001, run_id=7)

    # Assert
    assert accept.keys is not None
    assert (accept.keys.member, accept.keys.node_id, accept.keys.release_id) == (
        "site-0",
        1001,
        "r1",
    )
    session = sums.sessions["r1"]
    session.roster.verify("site-0", accept.keys.signed_bytes(), accept.keys.signature)


@pytest.mark.parametrize(
    ("plan", "site_min", "required", "num_sums"),
    [
        (make_plan(min_sites=2), 3, 3, 1),
        (make_plan(min_sites=4), 3, 4, 1),
        (make_plan(selection=SelectionMode.PRIVATE), 2, 2, 2),
        (
            make_plan(noise_mode=NoiseMode.DISTRIBUTED, min_honest=5, max_sites=8, min_sites=5),
            2,
            5,
            1,
        ),
    ],
)
def test_the_session_requires_the_larger_minimum_and_runs_the_plan_s_sums(
    tmp_path: Path, plan: ReleasePlan, site_min: int, required: int, num_sums: int
) -> None:
    # Arrange
    (site, _) = stand_in_sites(tmp_path, 2, zeros, min_sites=site_min)
    sums = sums_of(site)

    # Act
    sums.accept(plan, node_id=1, run_id=7)

    # Assert
    session = sums.sessions[plan.release_id]
    assert session.required_sites == required
    assert session.num_sums == num_sums


# ----------------------------------------------------------------- the graph draw


def keys_request(everyone: list[SiteSums]) -> SumKeysRequest:
    adverts = [sums.sessions["r1"].advertise() for sums in everyone]
    return SumKeysRequest(release_id="r1", adverts=adverts)


def test_a_sparse_graph_s_nonce_is_revealed_once_the_draw_is_counted(tmp_path: Path) -> None:
    # Arrange: twelve sites: a sparse graph, drawn from every site's nonce.
    everyone = accepted(tmp_path, count=12)
    request = keys_request(everyone)

    # Act
    reveal = everyone[0].keys(request, run_id=7)

    # Assert
    assert reveal.nonce == everyone[0].sessions["r1"].nonce
    assert stand_in(everyone[0]).graph_draws == ["r1"]


def test_a_second_reveal_is_refused_and_not_counted_again(tmp_path: Path) -> None:
    # Arrange
    everyone = accepted(tmp_path, count=12)
    request = keys_request(everyone)
    everyone[0].keys(request, run_id=7)

    # Act / Assert
    with pytest.raises(StageOrderError, match="once a release"):
        everyone[0].keys(request, run_id=7)
    assert stand_in(everyone[0]).graph_draws == ["r1"]


def test_a_complete_graph_reveals_no_nonce_and_counts_no_draw(tmp_path: Path) -> None:
    # Arrange: three sites: every site is every site's neighbour, nothing to draw.
    everyone = accepted(tmp_path)

    # Act / Assert
    with pytest.raises(StageOrderError, match="complete graph of 3 needs no nonce"):
        everyone[0].keys(keys_request(everyone), run_id=7)
    assert stand_in(everyone[0]).graph_draws == []


def test_forged_adverts_are_refused_before_the_draw_is_counted(tmp_path: Path) -> None:
    # Arrange
    everyone = accepted(tmp_path, count=12)
    request = keys_request(everyone)
    adverts = list(request.adverts)
    adverts[3] = adverts[3].model_copy(update={"public_key": bytes(32)})

    # Act / Assert
    with pytest.raises(PolicyError, match="must sign with its roster identity key"):
        everyone[0].keys(request.model_copy(update={"adverts": adverts}), run_id=7)
    assert stand_in(everyone[0]).graph_draws == []


# ----------------------------------------------------------------- public checks first


def test_a_range_too_small_for_the_site_s_chunks_is_refused_before_computing(
    tmp_path: Path,
) -> None:
    # Arrange: m_i = 1 chunk at C = 1 needs c >= 1.
    everyone = accepted(tmp_path)
    narrow = RANGES.model_copy(update={"clipping_range": 0.5})

    # Act
    with pytest.raises(PlanMismatchError, match=r"at least m_i \* max\(C, 1\) = 1"):
        everyone[0].shares(shares_request(everyone, narrow), run_id=7)

    # Assert
    assert stand_in(everyone[0]).requests == []


def test_the_first_sum_checks_the_adverts_before_computing(tmp_path: Path) -> None:
    # Arrange: site 1 of 3 accepted another plan's release id: its advert is not for r1.
    everyone = accepted(tmp_path)
    request = shares_request(everyone)
    adverts = list(request.adverts)
    adverts[1] = adverts[1].model_copy(update={"release_id": "r2"})

    # Act
    with pytest.raises(PolicyError, match="must be for this release"):
        everyone[0].shares(request.model_copy(update={"adverts": adverts}), run_id=7)

    # Assert
    assert stand_in(everyone[0]).requests == []


def test_the_first_sum_returns_boxes_for_the_neighbours_and_a_masked_vector(
    tmp_path: Path,
) -> None:
    # Arrange
    everyone = accepted(tmp_path)

    # Act
    answer, masked = everyone[0].shares(shares_request(everyone), run_id=7)

    # Assert
    assert answer.sum_index == 0
    assert sorted(box.node_id for box in answer.boxes) == [2, 3]
    assert masked.dtype == np.int64
    assert masked.shape == (4,)
    assert stand_in(everyone[0]).requests == [EXTRACT]


def test_a_vector_the_request_does_not_name_is_refused(tmp_path: Path) -> None:
    # Arrange
    plan = make_plan(selection=SelectionMode.PRIVATE, order=ReleaseOrder.RELEASE_FIRST)
    everyone = accepted(tmp_path, plan=plan)
    finish_first_sum(everyone)
    collect = SumCollectRequest(
        release_id="r1",
        instructions=SumInstructions(sum_index=1, request=EXTRACT, ranges=RANGES),
    )

    # Act
    with pytest.raises(PlanMismatchError, match="must not carry arrays it does not name"):
        everyone[0].collect(collect, np.zeros(128), run_id=7)

    # Assert: only sum 0 was computed
    assert stand_in(everyone[0]).requests == [EXTRACT]


def test_a_select_sum_naming_a_vector_must_carry_it(tmp_path: Path) -> None:
    # Arrange
    plan = make_plan(selection=SelectionMode.PRIVATE, order=ReleaseOrder.RELEASE_FIRST)
    everyone = accepted(tmp_path, plan=plan)
    finish_first_sum(everyone)
    select = SecureSumRequest(
        release_id="r1",
        stage="select",
        heads=None,
        clip_norm=1.0,
        score_top_r=2,
        reference_heads=((0, 0), (0, 1)),
    )
    collect = SumCollectRequest(
        release_id="r1",
        instructions=SumInstructions(sum_index=1, request=select, ranges=RANGES),
    )

    # Act
    with pytest.raises(PlanMismatchError, match="must carry the vector"):
        everyone[0].collect(collect, None, run_id=7)

    # Assert
    assert stand_in(everyone[0]).requests == [EXTRACT]


def test_a_sum_whose_instructions_name_another_release_is_refused_before_computing(
    tmp_path: Path,
) -> None:
    # Arrange: both sites accepted r1 (2 sites suffice); site 0 also r2, which needs 3.
    everyone = accepted(tmp_path, count=2)
    everyone[0].accept(make_plan(release_id="r2", min_sites=3), node_id=1, run_id=7)
    r2_request = EXTRACT.model_copy(update={"release_id": "r2"})
    request = shares_request(everyone)
    mixed = request.model_copy(
        update={"instructions": request.instructions.model_copy(update={"request": r2_request})}
    )

    # Act
    with pytest.raises(DpmtvError):
        everyone[0].shares(mixed, run_id=7)

    # Assert: r2's data was not computed for a sum of two
    assert stand_in(everyone[0]).requests == []


# ----------------------------------------------------------------- sessions


def test_a_release_without_keys_here_is_refused(tmp_path: Path) -> None:
    # Arrange
    everyone = accepted(tmp_path)
    request = SurvivorsRequest(release_id="r9", sum_index=0, survivors=[1, 2], boxes=[])

    # Act / Assert
    with pytest.raises(StageOrderError, match="release 'r9' has no secure-sum keys"):
        everyone[0].survivors(request, run_id=7)


def test_a_forgotten_release_keeps_no_keys(tmp_path: Path) -> None:
    # Arrange
    everyone = accepted(tmp_path)

    # Act
    everyone[0].forget("r1")

    # Assert
    assert everyone[0].sessions == {}
    with pytest.raises(StageOrderError, match="has no secure-sum keys"):
        everyone[0].shares(shares_request(everyone[1:]), run_id=7)


def test_the_sessions_of_releases_the_site_resolved_itself_are_dropped(tmp_path: Path) -> None:
    # Arrange: two accepted releases; the site's own sweep resolves r1 (no message comes)
    everyone = accepted(tmp_path)
    everyone[0].accept(make_plan(release_id="r2"), node_id=1, run_id=7)
    del stand_in(everyone[0]).records.by_release["r1"]

    # Act
    dropped = everyone[0].forget_resolved()

    # Assert: r1's keys are gone, r2's stay
    assert dropped == ["r1"]
    assert list(everyone[0].sessions) == ["r2"]
