"""A site accepts private picks only from the plan's public candidate set.

In release-first order the plan's Gaussian covers its candidates: the site sums exactly them,
takes a noisy vector of exactly them, and checks σ against their layers.
"""

from __future__ import annotations

import numpy as np
import pytest

from client.release.policy import (  # _check_released_heads: the head rule of check_artifact
    _check_released_heads,
    check_reference,
    check_secure_sum,
    gaussian_scope,
)
from client.release.record import ReleaseRecord
from dpmtv_common.heads import HeadLayout, HeadSet
from protocol import (
    PROTOCOL_VERSION,
    PlanMismatchError,
    ReleaseOrder,
    ReleasePlan,
    SecureSumRequest,
    SelectionMode,
)


def _record(
    candidates: tuple[tuple[int, int], ...] | None,
    order: ReleaseOrder = ReleaseOrder.RELEASE_FIRST,
) -> ReleaseRecord:
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
        order=order,
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


CANDIDATES = ((0, 0), (1, 1), (2, 2))


def _extract(heads: tuple[tuple[int, int], ...] | None) -> SecureSumRequest:
    return SecureSumRequest(
        release_id="r1", stage="extract", heads=heads, clip_norm=1.0, score_top_r=None
    )


def test_a_release_first_plan_with_candidates_sums_and_noises_exactly_the_candidates():
    record = _record(CANDIDATES)

    check_secure_sum(record, _extract(CANDIDATES))  # the Gaussian's heads: accepted
    for other in (None, CANDIDATES[:2], ((0, 0), (1, 1), (2, 3))):  # every head, fewer, others
        with pytest.raises(PlanMismatchError, match="must cover its 3 candidate heads"):
            check_secure_sum(record, _extract(other))
    # σ is checked against the candidates' layers, whatever two heads were released
    assert gaussian_scope(record, HeadSet.of([(0, 0), (2, 2)])) == HeadSet(CANDIDATES)
    assert (
        gaussian_scope(_record(None), HeadSet.of([(0, 0), (2, 2)])) == HeadLayout(3, 4).all_heads()
    )


def test_a_noisy_vector_must_cover_the_plan_s_candidates():
    record = _record(CANDIDATES).changed(sent=("extract",))
    values = np.zeros((3, 4, 8))

    check_reference(record, CANDIDATES, values)
    with pytest.raises(PlanMismatchError, match="must cover the plan's 3 candidate heads, got 12"):
        check_reference(record, HeadLayout(3, 4).all_heads().heads, values)


def test_released_picks_need_not_be_the_summed_candidates():
    # Release-first sums the candidates, then releases k of them: the picks are checked
    # against the candidates, not against the extract sum's heads.
    record = _record(CANDIDATES).changed(extract_heads=CANDIDATES)
    _check_released_heads(record, HeadSet.of([(0, 0), (2, 2)]))


def test_select_first_picks_must_be_the_heads_the_site_summed():
    # Select-first sums the picks themselves: an artifact naming other candidates is refused.
    record = _record(CANDIDATES, ReleaseOrder.SELECT_FIRST).changed(extract_heads=((0, 0), (2, 2)))
    _check_released_heads(record, HeadSet.of([(0, 0), (2, 2)]))
    with pytest.raises(PlanMismatchError, match="artifact heads must be"):
        _check_released_heads(record, HeadSet.of([(0, 0), (1, 1)]))
