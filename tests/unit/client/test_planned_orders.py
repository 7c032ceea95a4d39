"""Which release order each public choice is made for, and when a heads file's order binds."""

from __future__ import annotations

import argparse

import pytest

from client.cli.release_command import _check_heads_file_order, _order_of
from client.cli.select_agnostic import _planned
from client.public.scope import HeadsMode
from dpmtv_common.errors import ConfigError


def _args(
    for_order: str | None, draws: int | None = None, picks_among: str | None = None,
    heads_mode: str | None = None,
) -> argparse.Namespace:  # fmt: skip
    return argparse.Namespace(for_order=for_order, for_epsilon=1.0, for_delta=1e-5, k=4,
                              for_chunks=200, simulated_draws=draws, picks_among=picks_among,
                              heads_mode=heads_mode)  # fmt: skip


PUBLIC, PRIVATE = HeadsMode.PUBLIC, HeadsMode.PRIVATE


@pytest.mark.parametrize(
    ("for_order", "options"),
    [
        # public heads select-first (release-first only noises more), private in both orders,
        # released first among the candidates or every carried head
        (None, [(PUBLIC, False, False), (PRIVATE, False, False), (PRIVATE, True, False),
                (PRIVATE, True, True)]),
        ("select-first", [(PUBLIC, False, False), (PRIVATE, False, False)]),
        ("release-first", [(PUBLIC, True, False), (PRIVATE, True, False), (PRIVATE, True, True)]),
    ],
)  # fmt: skip
def test_the_options_compared_are_planned_in_their_release_orders(for_order, options):
    planned = _planned(_args(for_order))
    assert [(mode, p.every_head, p.among_every_head) for mode, p in planned] == options
    public = next(p for mode, p in planned if mode is PUBLIC)
    for mode, p in planned:
        assert (p.gumbel_scale is not None) is (mode is PRIVATE)  # only private picks
        assert p.num_chunks == 200
        assert p.draws == 8  # the default simulated draws
        if mode is PRIVATE:
            assert p.noise_multiplier > public.noise_multiplier  # picks spend part of epsilon


def test_a_heads_files_order_binds_only_the_clip_norm_it_suggests():
    extras = {"release_order": "select-first", "clip_norm_suggestion": 3.0}
    with pytest.raises(ConfigError, match="--order must be 'select-first'"):
        _check_heads_file_order(extras, "release-first", clip_given=False)
    _check_heads_file_order(extras, "release-first", clip_given=True)  # heads only: either order
    _check_heads_file_order(extras, "select-first", clip_given=False)
    _check_heads_file_order({}, "release-first", clip_given=False)  # an older file: no record


@pytest.mark.parametrize(
    ("named", "recorded", "selection", "expected"),
    [
        (None, "select-first", "private", "select-first"),  # the file's choice
        (None, "release-first", "public", "release-first"),
        ("release-first", "select-first", "private", "release-first"),  # named wins (then checked)
        (None, None, "private", "release-first"),  # no record: the selection's default
        (None, None, "public", "select-first"),
    ],
)
def test_a_release_runs_in_the_order_its_heads_file_was_chosen_for_unless_named(
    named, recorded, selection, expected
):
    args = argparse.Namespace(order=named, selection=selection)
    extras = {} if recorded is None else {"release_order": recorded}
    assert _order_of(args, extras).value == expected


@pytest.mark.parametrize(
    ("picks_among", "options"),
    [
        ("candidates", ["public heads, select-first", "private heads, select-first",
                        "private heads, release-first"]),
        ("every-head", ["public heads, select-first",
                        "private heads, release-first among every head"]),
    ],
)  # fmt: skip
def test_picks_among_keeps_the_private_options_of_that_domain(picks_among, options):
    planned = _planned(_args(None, picks_among=picks_among))
    assert [p.option(mode) for mode, p in planned] == options


def test_a_heads_mode_keeps_its_own_options():
    planned = _planned(_args(None, heads_mode="public"))
    assert [p.option(mode) for mode, p in planned] == ["public heads, select-first"]


def test_private_picks_among_every_head_select_first_leave_nothing_and_say_so():
    with pytest.raises(ConfigError, match="leave no option to compare: private picks among"):
        _planned(_args("select-first", picks_among="every-head", heads_mode="private"))


def test_simulated_draws_are_the_given_number():
    assert {p.draws for _, p in _planned(_args(None, draws=3))} == {3}
