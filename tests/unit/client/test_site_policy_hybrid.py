"""A site on a hybrid model serves only the heads it carries, whatever the coordinator asks.

The record's model has 3 decoder layers of 4 heads; layer 0 carries none (linear attention).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from client.release.policy import (
    ModelShape,
    check_reference,
    check_secure_sum,
    distributed_release,
    gaussian_scope,
)
from client.release.record import ReleaseRecord
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadLayout, HeadSet
from protocol import (
    PROTOCOL_VERSION,
    PlanMismatchError,
    ReleaseOrder,
    ReleasePlan,
    SecureSumRequest,
    SelectionMode,
)

LAYOUT = HeadLayout(3, 4, (1, 2))
DIM = 8
DENSE_ALL = HeadSet.all_heads(num_layers=3, num_heads=4)


def make_record(selection: SelectionMode, order: ReleaseOrder, sent: tuple[str, ...] = ()):
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
        "public_heads": None,
        "selection_share": 0.4,
        "score_top_r": 2,
        "min_sites": 2,
        "max_chunks_per_site": None,
        "created": "2026-11-29T00:00:00+00:00",
    }
    plan = ReleasePlan(**fields)
    record = ReleaseRecord.planned(plan, run_id=1, num_chunks=3, layout=LAYOUT, head_dim=DIM)
    return record.changed(sent=sent)


def extract(heads: tuple[tuple[int, int], ...] | None) -> SecureSumRequest:
    return SecureSumRequest(
        release_id="r1", stage="extract", heads=heads, clip_norm=1.0, score_top_r=None
    )


def test_the_record_keeps_the_layers_that_carry_heads():
    record = make_record(SelectionMode.ALL, ReleaseOrder.RELEASE_FIRST)

    restored = ReleaseRecord.model_validate_json(record.model_dump_json())

    assert restored.head_layers == (1, 2)
    assert restored.layout == LAYOUT


def test_an_all_heads_sum_is_the_carried_heads_not_every_slot():
    record = make_record(SelectionMode.ALL, ReleaseOrder.RELEASE_FIRST)

    check_secure_sum(record, extract(None))
    check_secure_sum(record, extract(LAYOUT.all_heads().heads))
    with pytest.raises(PlanMismatchError, match=r"must cover its 8 carried heads \(every head\)"):
        check_secure_sum(record, extract(DENSE_ALL.heads))
    assert gaussian_scope(record, LAYOUT.all_heads()) == LAYOUT.all_heads()


@pytest.mark.parametrize("heads", [((0, 1), (1, 2)), ((0, 0), (0, 3))])
def test_a_coordinator_asking_for_headless_heads_gets_nothing(heads):
    record = make_record(SelectionMode.PRIVATE, ReleaseOrder.SELECT_FIRST, sent=("select",))

    with pytest.raises(ConfigError, match=r"extract heads must lie in the layers that carry"):
        check_secure_sum(record, extract(heads))
    check_secure_sum(record, extract(((1, 2), (2, 3))))


def test_the_noisy_vector_covers_the_carried_heads_in_the_dense_layout():
    record = make_record(SelectionMode.PRIVATE, ReleaseOrder.RELEASE_FIRST, sent=("extract",))
    values = np.zeros((3, 4, DIM))

    check_reference(record, LAYOUT.all_heads().heads, values)
    with pytest.raises(PlanMismatchError, match="noisy vector must cover the plan's 8 carried"):
        check_reference(record, DENSE_ALL.heads, values)
    with pytest.raises(PlanMismatchError, match=r"noisy vector must have shape \(L, H, D\)"):
        check_reference(record, LAYOUT.all_heads().heads, np.zeros((2, 4, DIM)))


def test_distributed_vote_grids_keep_the_dense_histogram_length():
    # The vote histogram stays L * H long (headless slots hold no votes), on both sides.
    record = make_record(SelectionMode.PRIVATE, ReleaseOrder.RELEASE_FIRST)

    release = distributed_release(record.plan, ModelShape.of_record(record))

    assert release.num_heads_total == 12
