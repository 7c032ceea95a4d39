"""A site accepts private picks only from the plan's public candidate set."""

from __future__ import annotations

import pytest

from client.release.policy import _check_released_heads  # the head rule of check_artifact
from client.release.record import ReleaseRecord
from dpmtv_common.heads import HeadLayout, HeadSet
from protocol import PROTOCOL_VERSION, PlanMismatchError, ReleaseOrder, ReleasePlan, SelectionMode


def _record(candidates: tuple[tuple[int, int], ...] | None) -> ReleaseRecord:
    plan = ReleasePlan(
        protocol_version=PROTOCOL_VERSION,
        release_id="r1",
        task="shapes",
        model_fingerprint="sha256:abc",
        epsilon=1.0,
        delta=1e-5,
        shots=2,
        clip_norm=1.0,
        selection=SelectionMode.PRIVATE,
        order=ReleaseOrder.RELEASE_FIRST,
        num_selected_heads=2,
        public_heads=None,
        candidate_heads=candidates,
        selection_share=0.3,
        score_top_r=2,
        min_sites=2,
        max_chunks_per_site=None,
        created="2026-12-01T00:00:00+00:00",
    )
    return ReleaseRecord.planned(plan, run_id=1, num_chunks=3, layout=HeadLayout(3, 4), head_dim=8)


def test_an_artifact_with_picks_outside_the_candidates_is_refused():
    record = _record(((0, 0), (1, 1), (2, 2)))
    _check_released_heads(record, HeadSet.of([(0, 0), (2, 2)]))
    with pytest.raises(PlanMismatchError, match="candidate heads, got 1 outside them"):
        _check_released_heads(record, HeadSet.of([(0, 0), (2, 3)]))


def test_without_candidates_any_carried_picks_pass():
    _check_released_heads(_record(None), HeadSet.of([(0, 3), (2, 3)]))
