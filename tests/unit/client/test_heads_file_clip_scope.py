"""Which layers a heads file's C' was chosen for: recorded, or read from an older file."""

from __future__ import annotations

import pytest

from client.cli._common import CLIP_SCOPE_EVERY_HEAD, CLIP_SCOPE_LISTED, heads_file_clip_scope
from client.cli.release_command import _check_candidates_clip_scope
from dpmtv_common.errors import ConfigError


@pytest.mark.parametrize(
    ("extras", "scope"),
    [
        ({"clip_scope": CLIP_SCOPE_EVERY_HEAD, "heads_mode": "private"}, CLIP_SCOPE_EVERY_HEAD),
        ({"clip_scope": CLIP_SCOPE_LISTED, "release_order": "release-first"}, CLIP_SCOPE_LISTED),
        # older files: a public list for a release-first plan bounds every head's layers
        ({"release_order": "release-first"}, CLIP_SCOPE_EVERY_HEAD),
        ({"release_order": "release-first", "heads_mode": "public"}, CLIP_SCOPE_EVERY_HEAD),
        ({"release_order": "release-first", "heads_mode": "private"}, CLIP_SCOPE_LISTED),
        ({"release_order": "select-first"}, CLIP_SCOPE_LISTED),
        ({}, CLIP_SCOPE_LISTED),
        ({"clip_scope": "something else", "release_order": "release-first"},
         CLIP_SCOPE_EVERY_HEAD),
    ],
)  # fmt: skip
def test_a_heads_file_s_clip_scope(extras, scope):
    assert heads_file_clip_scope(extras) == scope


def test_candidates_take_only_a_c_chosen_for_their_own_layers():
    every = {"clip_scope": CLIP_SCOPE_EVERY_HEAD}
    with pytest.raises(ConfigError, match="--clip-norm must be given"):
        _check_candidates_clip_scope(every, clip_given=False)
    _check_candidates_clip_scope(every, clip_given=True)  # the file lends its heads only
    _check_candidates_clip_scope({"clip_scope": CLIP_SCOPE_LISTED}, clip_given=False)
