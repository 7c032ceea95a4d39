from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from dpmtv_common.errors import ConfigError, InsufficientSharesError
from dpmtv_common.heads import HeadLayout, HeadSet
from dpmtv_common.privacy.testing import SeededNoise
from protocol import (
    PROTOCOL_VERSION,
    ActivationSum,
    NoiseMode,
    ReleaseOrder,
    ReleaseOutcome,
    ReleasePlan,
    SelectionMode,
    VoteSum,
    run_release,
)

LAYERS, HEADS, DIM = 3, 4, 2


def make_plan(selection: SelectionMode, order: ReleaseOrder, **overrides) -> ReleasePlan:
    fields: dict[str, Any] = {
        "protocol_version": PROTOCOL_VERSION,
        "release_id": "r1",
        "task": "shapes",
        "model_fingerprint": "sha256:abc",
        "epsilon": 1.0,
        "delta": 1e-5,
        "shots": 2,
        "clip_norm": 1.0,
        "selection": selection,
        "order": order,
        "num_selected_heads": 2,
        "public_heads": ((0, 1), (2, 3)) if selection is SelectionMode.PUBLIC else None,
        "selection_share": 0.4,
        "score_top_r": 2,
        "min_sites": 1,
        "max_chunks_per_site": None,
        "created": "2026-11-29T00:00:00+00:00",
    }
    fields.update(overrides)
    return ReleasePlan(**fields)


@dataclass
class FakeSums:
    """In-memory sums: every head's sum is its (layer, head) index; votes favour heads 5, 9."""

    num_chunks: int = 1000
    log: list[str] = field(default_factory=list)
    references: list[np.ndarray | None] = field(default_factory=list)

    def activation_sum(self, heads: HeadSet) -> ActivationSum:
        self.log.append(f"activations:{len(heads)}")
        rows = np.array([[10.0 * layer + head] * DIM for layer, head in heads.heads])
        return ActivationSum(heads, rows * self.num_chunks, self.num_chunks)

    def vote_sum(self, reference):
        self.log.append("votes")
        self.references.append(reference)
        total = np.zeros(LAYERS * HEADS)
        total[[5, 9]] = 1e6  # (1, 1) and (2, 1) win whatever the Gumbel noise
        return VoteSum(total, self.num_chunks)


def seeded_release(plan: ReleasePlan) -> ReleaseOutcome:
    """``plan`` released on ``FakeSums`` with seeded noise."""
    return run_release(
        plan,
        sums=FakeSums(),
        layout=HeadLayout(LAYERS, HEADS),
        noise=SeededNoise(0),
        on_first_noise=lambda: None,
    )


class CountingNoise(SeededNoise):
    def __init__(self, log: list[str]):
        super().__init__(0)
        self.log = log

    def add_gaussian(self, values, *, noise_std):
        self.log.append("gaussian")
        return super().add_gaussian(values, noise_std=noise_std)

    def gumbel_top_k(self, scores, *, k, scale):
        self.log.append("gumbel")
        return super().gumbel_top_k(scores, k=k, scale=scale)


def release(plan: ReleasePlan, sums: FakeSums):
    noise = CountingNoise(sums.log)
    outcome = run_release(
        plan,
        sums=sums,
        layout=HeadLayout(LAYERS, HEADS),
        noise=noise,
        on_first_noise=lambda: sums.log.append("exposed"),
    )
    return outcome


def test_private_select_first_selects_then_noises_only_the_selected_heads():
    sums = FakeSums()
    outcome = release(make_plan(SelectionMode.PRIVATE, ReleaseOrder.SELECT_FIRST), sums)
    assert sums.log == ["votes", "exposed", "gumbel", "activations:2", "gaussian"]
    assert outcome.heads == HeadSet.of([(1, 1), (2, 1)])
    assert outcome.gaussian_heads == outcome.heads
    assert outcome.values.shape == (2, DIM)
    # Sensitivity covers the 2 layers in scope only.
    expected_std = outcome.calibration.noise_multiplier * 2 * 1.0 * np.sqrt(2)
    assert outcome.noise_std == pytest.approx(expected_std)


def test_private_release_first_noises_all_heads_once_then_selects_against_the_noisy_vector():
    sums = FakeSums()
    outcome = release(make_plan(SelectionMode.PRIVATE, ReleaseOrder.RELEASE_FIRST), sums)
    assert sums.log == ["activations:12", "exposed", "gaussian", "votes", "gumbel"]
    assert sums.references[0] is not None
    assert sums.references[0].shape == (LAYERS, HEADS, DIM)
    assert outcome.heads == HeadSet.of([(1, 1), (2, 1)])
    assert outcome.gaussian_heads == HeadSet.all_heads(num_layers=LAYERS, num_heads=HEADS)
    # The released rows are the noisy rows of the selected heads (no second draw).
    np.testing.assert_allclose(outcome.values[:, 0], [11.0, 21.0], atol=1.0)


def test_private_release_first_among_candidates_noises_only_the_candidates():
    # Arrange: four candidates in two layers, the votes' favourites (1, 1) and (2, 1) among them
    candidates = ((1, 1), (1, 2), (2, 1), (2, 3))
    plan = make_plan(SelectionMode.PRIVATE, ReleaseOrder.RELEASE_FIRST, candidate_heads=candidates)
    sums = FakeSums()

    # Act
    outcome = release(plan, sums)

    # Assert: one draw over the candidates only, σ for their 2 layers (not the model's 3)
    assert sums.log == ["activations:4", "exposed", "gaussian", "votes", "gumbel"]
    assert outcome.gaussian_heads == HeadSet(candidates)
    expected_std = outcome.calibration.noise_multiplier * 2 * 1.0 * np.sqrt(2)
    assert outcome.noise_std == pytest.approx(expected_std)
    # The reference holds the candidates' noisy rows placed dense, zeros elsewhere
    reference = sums.references[0]
    assert reference is not None
    assert reference.shape == (LAYERS, HEADS, DIM)
    inside = np.zeros((LAYERS, HEADS), dtype=bool)
    inside[tuple(np.array(candidates).T)] = True
    assert not reference[~inside].any()
    np.testing.assert_allclose(reference[1, 2], np.full(DIM, 12.0), atol=1.0)
    # The picks are among the candidates, their released rows those of the one draw
    assert outcome.heads == HeadSet.of([(1, 1), (2, 1)])
    np.testing.assert_allclose(outcome.values, reference[[1, 2], [1, 1]])


def test_a_plan_whose_candidates_are_fewer_than_its_top_r_is_refused():
    with pytest.raises(ValueError, match="candidate_heads must hold at least score_top_r = 3"):
        make_plan(
            SelectionMode.PRIVATE, ReleaseOrder.RELEASE_FIRST, score_top_r=3,
            candidate_heads=((1, 1), (1, 2)),
        )  # fmt: skip


@pytest.mark.parametrize("order", list(ReleaseOrder))
def test_public_heads_are_released_with_one_draw(order):
    sums = FakeSums()
    outcome = release(make_plan(SelectionMode.PUBLIC, order), sums)
    assert outcome.heads == HeadSet.of([(0, 1), (2, 3)])
    assert sums.log.count("gaussian") == 1
    assert "gumbel" not in sums.log
    assert outcome.calibration.picks == 0


def test_all_heads_mode_releases_every_head():
    sums = FakeSums()
    outcome = release(make_plan(SelectionMode.ALL, ReleaseOrder.RELEASE_FIRST), sums)
    assert len(outcome.heads) == LAYERS * HEADS
    assert sums.log == ["activations:12", "exposed", "gaussian"]


def test_values_are_the_mean_over_chunks():
    sums = FakeSums(num_chunks=10**6)
    outcome = release(make_plan(SelectionMode.PUBLIC, ReleaseOrder.SELECT_FIRST), sums)
    np.testing.assert_allclose(outcome.values[:, 0], [1.0, 23.0], atol=1e-3)
    assert outcome.signal_to_noise > 100


def test_public_heads_outside_the_model_are_refused_before_any_work():
    sums = FakeSums()
    plan = make_plan(SelectionMode.PUBLIC, ReleaseOrder.SELECT_FIRST, public_heads=((0, 1), (7, 0)))
    with pytest.raises(ConfigError, match="public heads"):
        release(plan, sums)
    assert sums.log == []


def test_zero_chunks_abort_before_noise():
    sums = FakeSums(num_chunks=0)
    with pytest.raises(InsufficientSharesError):
        release(make_plan(SelectionMode.ALL, ReleaseOrder.SELECT_FIRST), sums)
    assert "gaussian" not in sums.log
    assert "exposed" not in sums.log


# ---- a public candidate set for private selection


def test_private_selection_picks_only_among_the_plan_s_candidate_heads():
    # Arrange: votes favour (1, 1) and (2, 1) overwhelmingly, but neither is a candidate
    candidates = ((0, 0), (0, 2), (1, 3), (2, 0))
    for order in ReleaseOrder:
        plan = make_plan(SelectionMode.PRIVATE, order, candidate_heads=candidates)
        # Act
        outcome = release(plan, FakeSums())
        # Assert
        assert set(outcome.heads.heads) <= set(candidates), order
        assert len(outcome.heads) == 2


def test_distributed_top_k_also_keeps_to_the_candidate_heads():
    candidates = ((0, 0), (0, 2), (1, 3))
    plan = make_plan(
        SelectionMode.PRIVATE,
        ReleaseOrder.SELECT_FIRST,
        candidate_heads=candidates,
        noise_mode=NoiseMode.DISTRIBUTED,
        min_sites=2,
        max_sites=3,
        max_chunks_per_site=1000,
    )
    sums = FakeSums()
    outcome = run_release(
        plan, sums=sums, layout=HeadLayout(LAYERS, HEADS), noise=SeededNoise(0),
        on_first_noise=lambda: None,
    )  # fmt: skip
    assert set(outcome.heads.heads) <= set(candidates)


def test_without_candidates_the_favoured_heads_win():
    outcome = release(make_plan(SelectionMode.PRIVATE, ReleaseOrder.SELECT_FIRST), FakeSums())
    assert set(outcome.heads.heads) == {(1, 1), (2, 1)}


def test_candidate_heads_outside_the_carried_heads_are_refused_before_any_sum():
    plan = make_plan(
        SelectionMode.PRIVATE, ReleaseOrder.SELECT_FIRST, candidate_heads=((0, 0), (5, 0))
    )
    sums = FakeSums()
    with pytest.raises(ConfigError, match="plan candidate heads must lie"):
        release(plan, sums)
    assert sums.log == []


@pytest.mark.parametrize(
    ("selection", "candidates", "message"),
    [
        (SelectionMode.PUBLIC, ((0, 0), (0, 2)), "candidate_heads must be None"),
        (SelectionMode.ALL, ((0, 0), (0, 2)), "candidate_heads must be None"),
        (SelectionMode.PRIVATE, ((0, 0),), "at least num_selected_heads = 2"),
    ],
)
def test_a_plan_refuses_candidates_outside_private_selection_or_fewer_than_k(
    selection, candidates, message
):
    with pytest.raises(ValueError, match=message):
        make_plan(selection, ReleaseOrder.SELECT_FIRST, candidate_heads=candidates)


def test_a_plan_without_candidates_hashes_as_before_and_one_with_them_differs():
    from protocol import plan_hash

    plain = make_plan(SelectionMode.PRIVATE, ReleaseOrder.SELECT_FIRST)
    assert "candidate_heads" not in plain.model_dump(mode="json")
    restricted = plain.model_copy(update={"candidate_heads": ((0, 0), (0, 2))})
    assert plan_hash(restricted) != plan_hash(plain)


def test_check_candidate_picks_names_the_picks_outside_the_candidates():
    from protocol import check_candidate_picks
    from protocol.errors import PlanMismatchError

    plan = make_plan(
        SelectionMode.PRIVATE, ReleaseOrder.SELECT_FIRST, candidate_heads=((0, 0), (0, 2))
    )
    check_candidate_picks(plan, ((0, 2), (0, 0)), "heads")
    with pytest.raises(PlanMismatchError, match=r"1 outside them \(\[\[1, 1\]\]\)"):
        check_candidate_picks(plan, ((0, 0), (1, 1)), "heads")
    plain = make_plan(SelectionMode.PRIVATE, ReleaseOrder.SELECT_FIRST)
    check_candidate_picks(plain, ((1, 1), (2, 3)), "heads")  # no candidate set: any head


# ---- one release flow for both noise modes


@dataclass
class RecordingSums(FakeSums):
    """FakeSums that also records each request's exact argument (heads, reference shape)."""

    requests: list[tuple[str, object]] = field(default_factory=list)

    def activation_sum(self, heads: HeadSet) -> ActivationSum:
        self.requests.append(("activations", heads.heads))
        return super().activation_sum(heads)

    def vote_sum(self, reference):
        self.requests.append(("votes", None if reference is None else reference.shape))
        return super().vote_sum(reference)


def _requests_in(noise_mode: NoiseMode, selection: SelectionMode, order: ReleaseOrder):
    plan = make_plan(
        selection, order, noise_mode=noise_mode, min_sites=2, max_sites=3, max_chunks_per_site=1000
    )
    sums = RecordingSums()
    outcome = run_release(
        plan,
        sums=sums,
        layout=HeadLayout(LAYERS, HEADS),
        noise=SeededNoise(0),
        on_first_noise=lambda: sums.requests.append(("exposed", None)),
    )
    return sums.requests, outcome


@pytest.mark.parametrize("order", list(ReleaseOrder))
@pytest.mark.parametrize("selection", list(SelectionMode))
def test_both_noise_modes_ask_for_the_same_sums_in_the_same_order(selection, order):
    central, central_outcome = _requests_in(NoiseMode.CENTRAL, selection, order)
    distributed, distributed_outcome = _requests_in(NoiseMode.DISTRIBUTED, selection, order)
    assert central == distributed
    assert central.count(("exposed", None)) == 1
    assert central_outcome.heads == distributed_outcome.heads
    assert central_outcome.gaussian_heads == distributed_outcome.gaussian_heads
    assert central_outcome.distributed is None
    assert central_outcome.calibration is not None
    assert distributed_outcome.distributed is not None
    assert distributed_outcome.calibration is None
