"""The Gumbel scale a public simulation of a plan's picks uses is the plan's own: β = 2·Δ∞/ε₀."""

from __future__ import annotations

import pytest

from dpmtv_common.heads import HeadSet
from protocol import SelectionMode, plan_calibration, plan_gumbel_scale
from tests.plans import make_plan


@pytest.mark.parametrize(("epsilon", "picks"), [(1.0, 2), (1.0, 16), (4.0, 8)])
def test_a_private_plan_s_scale_is_two_over_its_epsilon_per_pick(epsilon, picks):
    plan = make_plan(selection=SelectionMode.PRIVATE, epsilon=epsilon, num_selected_heads=picks,
                     score_top_r=picks)  # fmt: skip
    per_pick = plan_calibration(plan).epsilon_per_pick
    assert per_pick > 0
    assert plan_gumbel_scale(plan) == pytest.approx(2.0 / per_pick)


def test_more_picks_of_one_budget_make_each_pick_noisier():
    few, many = (
        plan_gumbel_scale(
            make_plan(selection=SelectionMode.PRIVATE, num_selected_heads=k, score_top_r=k)
        )
        for k in (2, 16)
    )
    assert few is not None
    assert many is not None
    assert many > few


@pytest.mark.parametrize("selection", [SelectionMode.PUBLIC, SelectionMode.ALL])
def test_a_plan_that_picks_nothing_privately_has_no_scale(selection):
    heads = (
        {"public_heads": HeadSet.of([(0, 0), (0, 1)]).heads}
        if selection is SelectionMode.PUBLIC
        else {}
    )
    assert plan_gumbel_scale(make_plan(selection=selection, **heads)) is None
