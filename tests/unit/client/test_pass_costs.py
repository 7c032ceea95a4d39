"""Tests of ``client.service.pass_costs``: measured pass costs and the join horizon they give."""

from __future__ import annotations

import pytest

from client.service.pass_costs import PassCosts, join_horizon


def test_the_averages_start_at_the_first_pass_and_move_a_fifth_of_the_way_to_each_next():
    costs = PassCosts()
    costs.record(8, 1.0, prefill=False)
    costs.record(8, 2.0, prefill=False)
    costs.record(3, 4.0, prefill=True)
    assert costs.step == pytest.approx(1.2)
    assert costs.prefills == {3: 4.0}


def test_a_prefill_of_an_unmeasured_size_is_estimated_from_the_nearest_size_measured():
    costs = PassCosts(step=1.0, prefills={2: 2.0, 8: 5.0})
    assert costs.prefill(2) == 2.0
    assert costs.prefill(3) == 2.0
    assert costs.prefill(6) == 5.0
    assert costs.prefill(5) == 2.0  # as near to 2 as to 8: the smaller, the cheaper guess
    assert PassCosts().prefill(4) is None


@pytest.mark.parametrize(
    ("step", "prefill", "joining", "running", "expected"),
    [
        (1.0, 3.0, 5, 3, 4),  # 3 x 8 / (5 x 1) = 4.8
        (1.0, 3.0, 3, 5, 8),  # 3 x 8 / (3 x 1) = 8
        (0.132, 0.305, 8, 1, 2),  # the pretrained decoder's step and prefill of 8: 2.6
        (1.0, 0.5, 1, 1, 2),  # cheap prefills: never below the floor
    ],
)
def test_rows_wait_for_as_many_steps_as_their_prefill_costs_every_row_in_waiting(
    step, prefill, joining, running, expected
):
    costs = PassCosts(step=step, prefills={joining: prefill})
    assert join_horizon(costs, joining=joining, running=running, floor=2) == expected


@pytest.mark.parametrize(
    "costs",
    [
        PassCosts(),
        PassCosts(step=1.0),
        PassCosts(prefills={4: 1.0}),
        PassCosts(step=0.0, prefills={4: 1.0}),
    ],
)
def test_without_both_measurements_the_horizon_is_the_floor(costs):
    assert join_horizon(costs, joining=4, running=4, floor=3) == 3
