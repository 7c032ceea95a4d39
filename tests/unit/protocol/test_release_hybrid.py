"""run_release on a hybrid layout: "all heads" are the heads of the layers that carry them.

The fake model has 4 decoder layers of 3 heads; layers 0 and 2 carry no heads (a hybrid's
linear-attention or convolution layers). The fake vote sums put their largest counts on the
headless slots, so a selection that looked at the dense histogram would pick them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadLayout, HeadSet
from dpmtv_common.privacy.testing import SeededNoise
from protocol import (
    PROTOCOL_VERSION,
    ActivationSum,
    NoiseMode,
    ReleaseOrder,
    ReleasePlan,
    SelectionMode,
    VoteSum,
    check_plan_scope,
    run_release,
)

LAYERS, HEADS, DIM = 4, 3, 2
LAYOUT = HeadLayout(LAYERS, HEADS, (1, 3))
CARRIED = HeadSet.of((layer, head) for layer in (1, 3) for head in range(HEADS))
HEADLESS_SLOTS = [layer * HEADS + head for layer in (0, 2) for head in range(HEADS)]


def make_plan(selection: SelectionMode, order: ReleaseOrder, **overrides: Any) -> ReleasePlan:
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
        "public_heads": ((1, 0), (3, 2)) if selection is SelectionMode.PUBLIC else None,
        "selection_share": 0.4,
        "score_top_r": 2,
        "min_sites": 1,
        "max_chunks_per_site": None,
        "created": "2026-11-29T00:00:00+00:00",
    }
    fields.update(overrides)
    return ReleasePlan(**fields)


def distributed(plan: ReleasePlan) -> ReleasePlan:
    return plan.model_copy(
        update={
            "noise_mode": NoiseMode.DISTRIBUTED,
            "min_sites": 2,
            "max_sites": 4,
            "max_chunks_per_site": 500,
        }
    )


@dataclass
class HybridSums:
    """Activation rows are 10·layer + head; votes favour the headless slots, then (3, 1), (1, 2)."""

    num_chunks: int = 1000
    log: list[str] = field(default_factory=list)
    asked: list[HeadSet] = field(default_factory=list)
    references: list[np.ndarray | None] = field(default_factory=list)

    def activation_sum(self, heads: HeadSet) -> ActivationSum:
        self.log.append("activations")
        self.asked.append(heads)
        rows = np.array([[10.0 * layer + head] * DIM for layer, head in heads.heads])
        return ActivationSum(heads, rows * self.num_chunks, self.num_chunks, num_sites=3)

    def vote_sum(self, reference: np.ndarray | None) -> VoteSum:
        self.log.append("votes")
        self.references.append(reference)
        total = np.zeros(LAYERS * HEADS)
        total[HEADLESS_SLOTS] = 1e9  # a dense top-k would take these
        total[[3 * HEADS + 1, 1 * HEADS + 2]] = 1e6
        return VoteSum(total, self.num_chunks)


def release(plan: ReleasePlan, sums: HybridSums, layout: HeadLayout = LAYOUT):
    return run_release(
        plan, sums=sums, layout=layout, noise=SeededNoise(0), on_first_noise=lambda: None
    )


PLANS = [
    pytest.param(make_plan(selection, order), id=f"{selection.value}-{order.value}")
    for selection in SelectionMode
    for order in ReleaseOrder
]


@pytest.mark.parametrize("mode", ["central", "distributed"])
@pytest.mark.parametrize("plan", PLANS)
def test_no_release_touches_a_headless_layer(plan, mode):
    # Arrange
    plan = distributed(plan) if mode == "distributed" else plan
    sums = HybridSums()

    # Act
    outcome = release(plan, sums)

    # Assert: nothing asked for, noised or released lies in layer 0 or 2
    for heads in (*sums.asked, outcome.heads, outcome.gaussian_heads):
        assert set(heads.layers) <= {1, 3}
    assert outcome.gaussian_heads.num_layers_in_scope == len(set(outcome.gaussian_heads.layers))


@pytest.mark.parametrize("mode", ["central", "distributed"])
@pytest.mark.parametrize("order", list(ReleaseOrder))
def test_private_selection_picks_only_carried_heads_however_the_votes_fall(order, mode):
    plan = make_plan(SelectionMode.PRIVATE, order)
    plan = distributed(plan) if mode == "distributed" else plan

    outcome = release(plan, HybridSums())

    assert outcome.heads == HeadSet.of([(1, 2), (3, 1)])


@pytest.mark.parametrize("selection", [SelectionMode.ALL, SelectionMode.PRIVATE])
def test_an_all_heads_gaussian_counts_only_the_layers_that_carry_heads(selection):
    # Arrange: release-first noises every head; L_scope must be 2 (layers 1, 3), not 4
    plan = make_plan(selection, ReleaseOrder.RELEASE_FIRST)

    # Act
    outcome = release(plan, HybridSums())

    # Assert
    assert outcome.gaussian_heads == CARRIED
    assert outcome.gaussian_heads.num_layers_in_scope == 2
    z = outcome.calibration.noise_multiplier
    assert outcome.noise_std == pytest.approx(z * 2 * plan.clip_norm * np.sqrt(2))


def test_the_reference_is_dense_with_zeros_in_headless_layers():
    sums = HybridSums()

    release(make_plan(SelectionMode.PRIVATE, ReleaseOrder.RELEASE_FIRST), sums)

    reference = sums.references[0]
    assert reference is not None
    assert reference.shape == (LAYERS, HEADS, DIM)
    assert not reference[[0, 2]].any()
    np.testing.assert_allclose(reference[3, 1], np.array([31.0, 31.0]), atol=1.0)


@pytest.mark.parametrize("order", list(ReleaseOrder))
@pytest.mark.parametrize("public", [((0, 1),), ((1, 0), (2, 2)), ((3, 3),), ((4, 0),)])
def test_public_heads_the_model_does_not_carry_are_refused_before_any_sum(public, order):
    # Arrange: a headless layer (0, 2), a head index past H (3), a layer past L (4)
    plan = make_plan(
        SelectionMode.PUBLIC, order, public_heads=public, num_selected_heads=len(public)
    )
    sums = HybridSums()

    # Act / Assert
    with pytest.raises(ConfigError, match=r"plan public heads must lie in the layers that carry"):
        release(plan, sums)
    assert sums.log == []


def test_more_picks_or_votes_than_carried_heads_are_refused():
    too_many = make_plan(SelectionMode.PRIVATE, ReleaseOrder.SELECT_FIRST, num_selected_heads=7)
    top_r = make_plan(SelectionMode.PRIVATE, ReleaseOrder.SELECT_FIRST, score_top_r=7)

    with pytest.raises(ConfigError, match=r"num_selected_heads\) must be at most the model's 6"):
        check_plan_scope(too_many, LAYOUT)
    with pytest.raises(ConfigError, match=r"score_top_r\) must be at most the model's 6"):
        check_plan_scope(top_r, LAYOUT)
    check_plan_scope(make_plan(SelectionMode.PRIVATE, ReleaseOrder.SELECT_FIRST), LAYOUT)


def test_a_full_layout_releases_exactly_as_before():
    # Every layer carries heads: the candidates are every slot of the dense histogram.
    layout = HeadLayout(LAYERS, HEADS)
    sums = HybridSums()

    outcome = release(make_plan(SelectionMode.PRIVATE, ReleaseOrder.SELECT_FIRST), sums, layout)

    assert set(outcome.heads.layers) <= {0, 2}  # the 1e9 slots win when they are candidates
    assert layout.all_heads() == HeadSet.all_heads(num_layers=LAYERS, num_heads=HEADS)
