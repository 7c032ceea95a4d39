"""Which release order each public choice is made for, and when a heads file's order binds."""

from __future__ import annotations

import argparse

import pytest

from client.cli.release_command import _check_heads_file_order
from client.cli.select_agnostic import _planned
from client.public.scope import HeadsMode
from dpmtv_common.errors import ConfigError


def _args(for_order: str | None) -> argparse.Namespace:
    return argparse.Namespace(for_order=for_order, for_epsilon=1.0, for_delta=1e-5, k=4,
                              for_chunks=200)  # fmt: skip


@pytest.mark.parametrize(
    ("for_order", "public_every_head", "private_every_head"),
    [
        (None, False, True),  # each mode in the order release runs it by default
        ("select-first", False, False),
        ("release-first", True, True),
    ],
)
def test_each_heads_mode_is_planned_in_its_release_order(
    for_order, public_every_head, private_every_head
):
    planned = _planned(_args(for_order))
    assert planned[HeadsMode.PUBLIC].every_head is public_every_head
    assert planned[HeadsMode.PRIVATE].every_head is private_every_head
    assert planned[HeadsMode.PRIVATE].noise_multiplier > planned[HeadsMode.PUBLIC].noise_multiplier


def test_a_heads_files_order_binds_only_the_clip_norm_it_suggests():
    extras = {"release_order": "select-first", "clip_norm_suggestion": 3.0}
    with pytest.raises(ConfigError, match="--order must be 'select-first'"):
        _check_heads_file_order(extras, "release-first", clip_given=False)
    _check_heads_file_order(extras, "release-first", clip_given=True)  # heads only: either order
    _check_heads_file_order(extras, "select-first", clip_given=False)
    _check_heads_file_order({}, "release-first", clip_given=False)  # an older file: no record
