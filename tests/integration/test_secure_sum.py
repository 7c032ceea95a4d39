"""Secure sums end to end: the coordinator's session against the sites' real handlers.

``server.secure_sum.SecureSumSession`` runs over ``server.simulation.InProcessGrid``; every
node is the site service's real ClientApp (``client.service.handlers.build_site_app``, its
``SiteSums`` and ``SiteSumSession``) on a stand-in site that sends a vector the test chooses
(``tests.flower_harness.StandInSite``), so each total can be compared with the plain float64
sum. The plan has private selection, so a release runs two sums: ``query.sum_shares``
(sum 0, with the sealed seed shares) and ``query.sum_collect`` (sum 1).

Exactness: a site's rounding to the grid moves a coordinate by at most c / Q, so the total
of n sites lies within n * c / Q of the plain sum (plus float64 rounding of the plain sum).
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is first imported

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from dpmtv_common.crypto import mask_prg
from dpmtv_common.errors import InsufficientSharesError
from dpmtv_common.heads import HeadSet
from protocol import (
    MASKED_ARRAY_KEY,
    ErrorReply,
    MaskedInput,
    ReleasePlan,
    SecureSumRequest,
    SumInstructions,
    SumRanges,
    array_from_record,
    message_from_record,
    quantise,
    ranges_for,
)
from server.coordinator import build_plan
from server.messaging import Exchange
from server.secure_sum import SecureSumSession, SumResult
from server.settings import RunConfig
from server.simulation import FIRST_NODE_ID, InProcessGrid
from tests.flower_harness import (
    Contribute,
    StandInSite,
    advertised_keys,
    flower_process_state,
    stand_in_apps,
    stand_in_sites,
)

pytestmark = pytest.mark.integration

RELEASE = "sums"
DIM = 1000
MATRIX_SHAPE = (3, 4)
BOUND = 1.0  # every coordinate in [-1, 1]: ranges_for gives c = 1
SITE_COUNTS = [3, 5, 12]  # 12: a sparse neighbourhood (k = 5, t = 3)
EXTRACT = SecureSumRequest(
    release_id=RELEASE, stage="extract", heads=None, clip_norm=1.0, score_top_r=None
)
SELECT = SecureSumRequest(
    release_id=RELEASE, stage="select", heads=None, clip_norm=1.0, score_top_r=8
)


def plan() -> ReleasePlan:
    """Private selection, release first: two secure sums."""
    return build_plan(
        RunConfig(
            model_fingerprint="sha256:stand-in",
            release_id=RELEASE,
            clip_norm=1.0,
            selection="private",
            order="release-first",
            min_sites=2,  # the sums here go on with two survivors
        )
    )


def site_input(index: int, request: SecureSumRequest) -> list[np.ndarray]:
    """Site ``index``'s arrays for a sum: within ±BOUND, both extremes included."""
    rng = np.random.default_rng([index, 0 if request.stage == "extract" else 1])
    flat = rng.uniform(-BOUND, BOUND, size=DIM)
    flat[:2] = [BOUND, -BOUND]
    return [flat, rng.uniform(-BOUND, BOUND, size=MATRIX_SHAPE)]


def flat_input(index: int, request: SecureSumRequest) -> np.ndarray:
    return np.concatenate([array.ravel() for array in site_input(index, request)])


@dataclass
class Federation:
    """Stand-in sites behind their real handlers, and the coordinator's session."""

    grid: InProcessGrid
    sites: list[StandInSite]
    session: SecureSumSession

    @property
    def ranges(self) -> SumRanges:
        return ranges_for(BOUND, len(self.grid.node_ids))

    def run(self, sum_index: int, request: SecureSumRequest) -> SumResult:
        instructions = SumInstructions(sum_index=sum_index, request=request, ranges=self.ranges)
        return self.session.run_sum(instructions)

    def replies(self, message_type: str) -> list[object]:
        return [
            message_from_record(reply.content)
            for _, stage, reply in self.grid.replies
            if stage == message_type
        ]


@pytest.fixture(autouse=True)
def _process_state() -> Iterator[None]:
    with flower_process_state():
        yield


def federation(
    tmp_path: Path,
    num_sites: int,
    *,
    drops: Mapping[int, set[str]] | None = None,
    min_sites: int = 2,
    site_min_sites: int = 2,
    contribute: Contribute = site_input,
) -> Federation:
    sites = stand_in_sites(tmp_path, num_sites, contribute, min_sites=site_min_sites)
    grid = InProcessGrid(stand_in_apps(sites), num_nodes=num_sites, drops=drops)
    adverts = advertised_keys(grid, plan())
    session = SecureSumSession(Exchange(grid, timeout=60.0), RELEASE, adverts, min_sites)
    return Federation(grid, sites, session)


def node(index: int) -> int:
    return FIRST_NODE_ID + index


def assert_exact(
    result: SumResult, request: SecureSumRequest, ranges: SumRanges, sites: Iterable[int]
) -> None:
    indices = sorted(sites)
    assert result.survivors == tuple(node(i) for i in indices)
    want = np.sum([flat_input(i, request) for i in indices], axis=0)
    # c / Q per site and coordinate from the rounding, 1e-12 for float64's plain sum.
    tolerance = len(indices) * ranges.clipping_range / ranges.quantization_range + 1e-12
    assert result.total.dtype == np.float64
    assert result.total.shape == want.shape
    assert np.max(np.abs(result.total - want)) <= tolerance


@pytest.mark.parametrize("num_sites", SITE_COUNTS)
def test_both_sums_of_a_release_equal_the_plain_sums_within_the_quantisation_bound(
    tmp_path: Path, num_sites: int
) -> None:
    # Arrange
    fed = federation(tmp_path, num_sites)
    # Act
    first = fed.run(0, EXTRACT)
    second = fed.run(1, SELECT)
    # Assert
    everyone = range(num_sites)
    assert first.failures == {}
    assert second.failures == {}
    assert_exact(first, EXTRACT, fed.ranges, everyone)
    assert_exact(second, SELECT, fed.ranges, everyone)
    assert not np.allclose(first.total, second.total)


@pytest.mark.parametrize("num_sites", SITE_COUNTS)
def test_a_site_lost_at_the_first_sum_leaves_the_exact_sum_of_the_others(
    tmp_path: Path, num_sites: int
) -> None:
    # Arrange: its neighbours masked with it; they reveal those pair seeds at unmask.
    fed = federation(tmp_path, num_sites, drops={node(1): {"query.sum_shares"}})
    # Act
    first = fed.run(0, EXTRACT)
    second = fed.run(1, SELECT)
    # Assert
    others = [i for i in range(num_sites) if i != 1]
    assert set(first.failures) == {node(1)}
    assert_exact(first, EXTRACT, fed.ranges, others)
    assert_exact(second, SELECT, fed.ranges, others)  # not asked again
    assert second.failures == {}


@pytest.mark.parametrize("num_sites", SITE_COUNTS)
def test_a_site_lost_at_the_second_sum_is_in_the_first_only(tmp_path: Path, num_sites: int) -> None:
    # Arrange
    lost = num_sites - 1
    fed = federation(tmp_path, num_sites, drops={node(lost): {"query.sum_collect"}})
    # Act
    first = fed.run(0, EXTRACT)
    second = fed.run(1, SELECT)
    # Assert
    assert_exact(first, EXTRACT, fed.ranges, range(num_sites))
    assert_exact(second, SELECT, fed.ranges, range(lost))
    assert set(second.failures) == {node(lost)}


@pytest.mark.parametrize("num_sites", SITE_COUNTS)
def test_a_site_lost_at_unmask_is_in_the_sum_its_input_reached(
    tmp_path: Path, num_sites: int
) -> None:
    # Arrange: its masked input arrived; t of its neighbours' shares rebuild its self mask.
    fed = federation(tmp_path, num_sites, drops={node(0): {"query.sum_unmask"}})
    # Act
    first = fed.run(0, EXTRACT)
    second = fed.run(1, SELECT)
    # Assert: it never saw the unmask, so it refuses the next sum (its own state machine).
    assert_exact(first, EXTRACT, fed.ranges, range(num_sites))
    assert_exact(second, SELECT, fed.ranges, range(1, num_sites))
    assert set(second.failures) == {node(0)}


def test_a_survivor_that_does_not_sign_stops_the_sum_before_anything_is_revealed(
    tmp_path: Path,
) -> None:
    # Arrange
    fed = federation(tmp_path, 5, drops={node(3): {"query.sum_survivors"}})
    # Act
    with pytest.raises(InsufficientSharesError, match="every survivor must sign"):
        fed.run(0, EXTRACT)
    # Assert
    assert fed.replies("query.sum_unmask") == []


def test_fewer_survivors_than_min_sites_asks_no_site_to_sign_or_reveal(tmp_path: Path) -> None:
    # Arrange
    drops = {node(0): {"query.sum_shares"}, node(1): {"query.sum_shares"}}
    fed = federation(tmp_path, 5, drops=drops, min_sites=4)
    # Act
    with pytest.raises(InsufficientSharesError, match="min-sites=4, got 3"):
        fed.run(0, EXTRACT)
    # Assert
    assert fed.replies("query.sum_survivors") == []
    assert fed.replies("query.sum_unmask") == []


def test_sites_refuse_to_sign_survivors_below_their_own_minimum(tmp_path: Path) -> None:
    # Arrange: the coordinator would go on with 3 of 5; each site requires 4.
    drops = {node(0): {"query.sum_shares"}, node(1): {"query.sum_shares"}}
    fed = federation(tmp_path, 5, drops=drops, min_sites=2, site_min_sites=4)
    # Act
    with pytest.raises(InsufficientSharesError, match="every survivor must sign"):
        fed.run(0, EXTRACT)
    # Assert
    signed = fed.replies("query.sum_survivors")
    assert len(signed) == 3
    assert all(isinstance(answer, ErrorReply) for answer in signed)
    assert fed.replies("query.sum_unmask") == []


def test_fewer_sites_with_keys_than_min_sites_is_refused_before_any_sum_message(
    tmp_path: Path,
) -> None:
    # Arrange
    sites = stand_in_sites(tmp_path, 3, site_input)
    grid = InProcessGrid(stand_in_apps(sites), num_nodes=3)
    adverts = advertised_keys(grid, plan())
    # Act
    with pytest.raises(InsufficientSharesError, match="min-sites=4, got 3"):
        SecureSumSession(Exchange(grid, timeout=60.0), RELEASE, adverts, 4)
    # Assert
    assert {stage for _, stage, _ in grid.replies} == {"query.plan"}


def test_a_coordinate_beyond_the_clipping_range_is_refused_not_clipped(tmp_path: Path) -> None:
    # Arrange: site 1 sends 1.5 c in one coordinate (a silent clip would bias the sum).
    def overshooting(index: int, request: SecureSumRequest) -> list[np.ndarray]:
        arrays = site_input(index, request)
        if index == 1:
            arrays[0][5] = 1.5 * BOUND
        return arrays

    fed = federation(tmp_path, 4, contribute=overshooting)
    # Act
    result = fed.run(0, EXTRACT)
    # Assert: it refused with a fixed reason, and the others' sum is exact.
    assert set(result.failures) == {node(1)}
    (refusal,) = [a for a in fed.replies("query.sum_shares") if isinstance(a, ErrorReply)]
    assert "1.5" not in refusal.reason
    assert_exact(result, EXTRACT, fed.ranges, [0, 2, 3])


def test_only_masked_integers_leave_a_site(tmp_path: Path) -> None:
    # Arrange
    fed = federation(tmp_path, 3)
    # Act
    fed.run(0, EXTRACT)
    # Assert: one int64 array in [0, M), far from the quantised input, beside the message.
    modulus = fed.ranges.modulus_range
    collected = [(n, reply) for n, stage, reply in fed.grid.replies if stage == "query.sum_shares"]
    assert len(collected) == 3
    for node_id, reply in collected:
        content = reply.content
        assert list(content.array_records) == [MASKED_ARRAY_KEY]
        assert len(content.config_records) == 1  # the message envelope, nothing else
        assert isinstance(message_from_record(content), MaskedInput)
        masked = array_from_record(content, MASKED_ARRAY_KEY, dtype="int64")
        assert masked.min() >= 0
        assert masked.max() < modulus
        plain = quantise(flat_input(node_id - FIRST_NODE_ID, EXTRACT), fed.ranges)
        assert np.count_nonzero(masked == plain) <= 1


def test_every_mask_is_expanded_by_the_chacha20_prg(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Arrange
    seeds: list[bytes] = []
    real_expand = mask_prg.expand_mask

    def spy(seed: bytes, num_range: int, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
        seeds.append(seed)
        return real_expand(seed, num_range, shapes)

    monkeypatch.setattr(mask_prg, "expand_mask", spy)
    fed = federation(tmp_path, 3)
    # Act
    result = fed.run(0, EXTRACT)
    # Assert: sites 3 x (1 self mask + 2 pair masks); the coordinator removes 3 self masks.
    assert len(seeds) == 3 * 3 + 3
    assert len(set(seeds)) == 3 + 3  # each pair seed is expanded by both of its sites
    assert_exact(result, EXTRACT, fed.ranges, range(3))


def test_the_noisy_vector_rides_beside_a_select_sum_to_every_site(tmp_path: Path) -> None:
    # Arrange: release-first order scores votes against the released all-head vector.
    fed = federation(tmp_path, 3)
    all_heads = HeadSet.all_heads(num_layers=2, num_heads=4)
    select = SELECT.model_copy(update={"reference_heads": all_heads.heads})
    reference = np.random.default_rng(7).normal(size=2 * 4 * 16)
    fed.run(0, EXTRACT)
    # Act
    result = fed.session.run_sum(
        SumInstructions(sum_index=1, request=select, ranges=fed.ranges), reference
    )
    # Assert
    assert result.failures == {}
    for site in fed.sites:
        np.testing.assert_array_equal(site.references[RELEASE].ravel(), reference)


def test_a_masked_input_of_another_length_drops_its_site(tmp_path: Path) -> None:
    # Arrange: site 1 sends one coordinate fewer.
    def short(index: int, request: SecureSumRequest) -> list[np.ndarray]:
        arrays = site_input(index, request)
        if index == 1:
            arrays[0] = arrays[0][:-1]
        return arrays

    fed = federation(tmp_path, 4, contribute=short)
    # Act
    result = fed.run(0, EXTRACT)
    # Assert
    assert set(result.failures) == {node(1)}
    assert_exact(result, EXTRACT, fed.ranges, [0, 2, 3])


def test_a_site_that_withholds_its_graph_nonce_stops_the_release_before_any_input(
    tmp_path: Path,
) -> None:
    # Arrange: twelve sites (a sparse graph); one never answers the nonce round. Drawing
    # without its nonce would let a colluder choose between graphs by withholding its own.
    fed = federation(tmp_path, 12, drops={node(5): {"query.sum_keys"}})
    # Act
    with pytest.raises(InsufficientSharesError, match="must reveal its graph nonce"):
        fed.run(0, EXTRACT)
    # Assert: no site was asked for its input; each counted the one draw it took part in.
    assert fed.replies("query.sum_shares") == []
    assert [site.graph_draws for site in fed.sites if site.index != 5] == [[RELEASE]] * 11


def test_up_to_ten_sites_there_is_no_nonce_round(tmp_path: Path) -> None:
    # Arrange: a complete graph needs no randomness.
    fed = federation(tmp_path, 10)
    # Act
    result = fed.run(0, EXTRACT)
    # Assert
    assert fed.replies("query.sum_keys") == []
    assert_exact(result, EXTRACT, fed.ranges, range(10))
    assert all(site.graph_draws == [] for site in fed.sites)
