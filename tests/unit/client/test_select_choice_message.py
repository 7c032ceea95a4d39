"""What ``select-heads --public-task`` says of its choice, beside each option's held-out score."""

from __future__ import annotations

import numpy as np
import pytest

from client.cli.select_agnostic import _say_choice
from client.public.scope import HeadsMode, ScopeChoice, option_name
from dpmtv_common.centre import ActivationCentre
from dpmtv_common.heads import HeadSet

PUBLIC_NAME = option_name(HeadsMode.PUBLIC, release_first=False)
PRIVATE_NAME = option_name(HeadsMode.PRIVATE, release_first=False)


def _choice(mode: HeadsMode, held_out: float, tried: dict[str, float]) -> ScopeChoice:
    heads = HeadSet.of([(0, 0), (1, 1)])
    private = mode is HeadsMode.PRIVATE
    return ScopeChoice(
        mode=mode, heads=heads, candidates=HeadSet.of([(0, 0), (0, 1), (1, 0), (1, 1)]) if private
        else None, clip_norm=2.0, factor=2.0, scale=1.0,
        centre=ActivationCentre.from_array(np.zeros((2, 2, 4))), transfer=0.8, public_only=0.3,
        candidates_tried=(), held_out=held_out, options_tried=tuple(tried.items()),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("mode", "tried", "explained"),
    [
        # the private option keeps most of the better public option's gain: said why
        (HeadsMode.PRIVATE, {PUBLIC_NAME: 0.60, PRIVATE_NAME: 0.58}, True),
        # the chosen option is the best one measured: nothing to explain
        (HeadsMode.PRIVATE, {PUBLIC_NAME: 0.50, PRIVATE_NAME: 0.58}, False),
        (HeadsMode.PUBLIC, {PUBLIC_NAME: 0.60, PRIVATE_NAME: 0.58}, False),
    ],
)
def test_a_pick_below_the_best_held_out_score_says_why(mode, tried, explained, capsys):
    # Arrange
    chosen = PRIVATE_NAME if mode is HeadsMode.PRIVATE else PUBLIC_NAME

    # Act
    _say_choice(_choice(mode, tried[chosen], tried), {200: 0.55})

    # Assert: every option's score is shown; the reason only where a better score lost
    out = capsys.readouterr().out
    assert f"{PUBLIC_NAME} {tried[PUBLIC_NAME]:.2f}" in out
    assert f"{PRIVATE_NAME} {tried[PRIVATE_NAME]:.2f}" in out
    assert f"chosen: {chosen}" in out
    reason = f"({PRIVATE_NAME} keeps --clip-keep of {PUBLIC_NAME}'s gain over the centre alone"
    assert (reason in out) is explained
    assert ("keeps --clip-keep of" in out) is explained
    assert "m = 200: 0.55" in out
