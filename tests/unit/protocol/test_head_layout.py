"""HeadLayout (which decoder layers carry heads) and PlanAccept's head_layers on the wire."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadLayout, HeadSet
from protocol import MAX_HEADS, PlanAccept, expect, message_to_record


def accept(**overrides: object) -> PlanAccept:
    fields: dict[str, object] = {
        "release_id": "r1",
        "site_name": "site-a",
        "num_chunks": 3,
        "num_layers": 4,
        "num_heads": 2,
        "head_dim": 8,
        "prompt_template_sha256": "a" * 64,
        "instruction_sha256": "b" * 64,
        "dpmtv_version": "0.1.0",
    }
    return PlanAccept(**(fields | overrides))  # type: ignore[arg-type]


def test_a_layout_carries_the_heads_of_its_layers_only():
    layout = HeadLayout(4, 2, (1, 3))

    assert layout.all_heads() == HeadSet.of([(1, 0), (1, 1), (3, 0), (3, 1)])
    assert layout.all_heads() == HeadSet.of_layers((3, 1), num_heads=2)
    assert layout.candidates() == [2, 3, 6, 7]
    assert layout.heads_at([7, 2]) == HeadSet.of([(1, 0), (3, 1)])
    assert layout.dense_size == 8


def test_no_layer_list_means_every_layer():
    layout = HeadLayout(3, 2)

    assert layout.head_layers == (0, 1, 2)
    assert layout.all_heads() == HeadSet.all_heads(num_layers=3, num_heads=2)
    assert layout == HeadLayout(3, 2, (0, 1, 2))


def test_dense_rows_put_carried_rows_in_place_and_zeros_elsewhere():
    layout = HeadLayout(3, 2, (1,))
    rows = np.array([[1.0, 2.0], [3.0, 4.0]])

    dense = layout.dense_rows(rows)

    assert dense.shape == (3, 2, 2)
    np.testing.assert_array_equal(dense[1], rows)
    assert not dense[[0, 2]].any()
    with pytest.raises(ConfigError, match=r"one row per head"):
        layout.dense_rows(np.zeros((6, 2)))


@pytest.mark.parametrize("head", [(0, 0), (2, 1), (1, 2), (3, 0)])
def test_heads_outside_the_carried_layers_are_refused(head):
    layout = HeadLayout(3, 2, (1,))

    with pytest.raises(ConfigError, match=r"must lie in the layers that carry heads \[1\]"):
        layout.check_carried([head], "heads")
    with pytest.raises(ConfigError):
        layout.dense_indices(HeadSet.of([head]))


@pytest.mark.parametrize("layers", [(), (1, 1), (2, 1), (-1, 2), (0, 4), (4,)])
def test_a_head_layer_list_must_be_strictly_ascending_within_the_model(layers):
    with pytest.raises(ConfigError, match="head_layers must"):
        HeadLayout(4, 2, layers)
    with pytest.raises(ValidationError, match="head_layers must"):
        accept(head_layers=layers)


def test_plan_accept_head_layers_are_bounded():
    with pytest.raises(ValidationError, match="at most 65536"):
        accept(num_layers=MAX_HEADS + 2, head_layers=tuple(range(MAX_HEADS + 1)))


@pytest.mark.parametrize("layers", [None, (1, 3), (0, 1, 2, 3)])
def test_plan_accept_head_layers_survive_the_wire(layers):
    message = accept(head_layers=layers)

    decoded = expect(message_to_record(message), PlanAccept)

    assert decoded == message
    expected = HeadLayout(4, 2, layers)
    assert decoded.layout() == expected


def test_a_plan_accept_without_head_layers_decodes_as_every_layer():
    # A site of an earlier version sends no head_layers: wire compatible, all layers carry heads.
    body = accept().model_dump(mode="json")
    body.pop("head_layers")

    decoded = PlanAccept.model_validate_json(json.dumps(body))

    assert decoded.head_layers is None
    assert decoded.layout().head_layers == (0, 1, 2, 3)
