"""A centred release: the centre the plan pins, added back after the noise, nothing else changed."""

from __future__ import annotations

import numpy as np
import pytest

from dpmtv_common.centre import ActivationCentre
from dpmtv_common.heads import HeadLayout
from dpmtv_common.privacy.testing import SeededNoise
from protocol import (
    NoiseMode,
    PlanMismatchError,
    ReleaseOrder,
    ReleasePlan,
    SelectionMode,
    plan_calibration,
    plan_hash,
    plan_release_event,
    run_release,
)
from tests.unit.protocol.test_release import DIM, HEADS, LAYERS, FakeSums, make_plan

CENTRE = ActivationCentre.from_array(
    np.random.default_rng(3).normal(size=(LAYERS, HEADS, DIM)) * 5.0
)
CASES = [
    (SelectionMode.ALL, ReleaseOrder.SELECT_FIRST),
    (SelectionMode.PUBLIC, ReleaseOrder.SELECT_FIRST),
    (SelectionMode.PRIVATE, ReleaseOrder.SELECT_FIRST),
    (SelectionMode.PRIVATE, ReleaseOrder.RELEASE_FIRST),
]


def _centred(plan: ReleasePlan, centre: ActivationCentre = CENTRE) -> ReleasePlan:
    return plan.model_copy(update={"centre_sha256": centre.digest()})


def _release(plan: ReleasePlan, centre: ActivationCentre | None, sums: FakeSums | None = None):
    return run_release(
        plan,
        sums=sums or FakeSums(),
        layout=HeadLayout(LAYERS, HEADS),
        noise=SeededNoise(0),
        on_first_noise=lambda: None,
        centre=centre,
    )


@pytest.mark.parametrize(("selection", "order"), CASES)
def test_the_centre_is_added_back_to_the_same_noisy_mean(selection, order):
    # Arrange: the same sums and the same seeded noise, plain and centred
    plain_plan = make_plan(selection, order)
    plain = _release(plain_plan, None)

    # Act
    centred = _release(_centred(plain_plan), CENTRE)

    # Assert: the same heads and sigma; the values moved by exactly the centre's rows
    assert centred.heads == plain.heads
    assert centred.noise_std == plain.noise_std
    np.testing.assert_allclose(centred.values - plain.values, CENTRE.rows(plain.heads), atol=1e-9)
    assert centred.signal_to_noise == pytest.approx(plain.signal_to_noise)


def test_release_first_votes_are_scored_against_the_recentred_vector():
    # Arrange
    plan = make_plan(SelectionMode.PRIVATE, ReleaseOrder.RELEASE_FIRST)
    plain_sums, centred_sums = FakeSums(), FakeSums()
    _release(plan, None, plain_sums)

    # Act
    _release(_centred(plan), CENTRE, centred_sums)

    # Assert: the sites score against the vector they will patch in (centre included)
    (plain_reference,) = plain_sums.references
    (centred_reference,) = centred_sums.references
    assert plain_reference is not None
    assert centred_reference is not None
    np.testing.assert_allclose(centred_reference - plain_reference, CENTRE.values, atol=1e-9)


@pytest.mark.parametrize(
    ("pinned", "given", "match"),
    [
        (True, None, "no centre"),
        (False, CENTRE, "without centre_sha256"),
        (True, ActivationCentre.from_array(CENTRE.values + 1e-9), "the plan's digest"),
    ],
    ids=["missing", "unpinned", "other-digest"],
)
def test_a_centre_that_is_not_the_pinned_one_is_refused_before_any_sum(pinned, given, match):
    # Arrange
    plan = make_plan(SelectionMode.ALL, ReleaseOrder.SELECT_FIRST)
    plan = _centred(plan) if pinned else plan
    sums = FakeSums()

    # Act / Assert
    with pytest.raises(PlanMismatchError, match=match):
        _release(plan, given, sums)
    assert sums.log == []


@pytest.mark.parametrize("mode", [NoiseMode.CENTRAL, NoiseMode.DISTRIBUTED])
def test_accounting_is_identical_with_and_without_a_centre(mode):
    # Arrange
    extra = {"noise_mode": mode, "max_sites": 4, "max_chunks_per_site": 100, "min_sites": 2}
    plain = make_plan(SelectionMode.PRIVATE, ReleaseOrder.SELECT_FIRST, **extra)
    centred = _centred(plain)

    # Act / Assert: the reserved event, the calibration and the stated bound are the same
    assert plan_release_event(centred).to_dict() == plan_release_event(plain).to_dict()
    if mode is NoiseMode.CENTRAL:
        assert plan_calibration(centred) == plan_calibration(plain)
    assert _release(centred, CENTRE).bound == _release(plain, None).bound


def test_the_centre_digest_is_in_the_plan_hash_and_a_plain_plan_hashes_as_before():
    # Arrange
    plain = make_plan(SelectionMode.ALL, ReleaseOrder.SELECT_FIRST)
    other = ActivationCentre.from_array(CENTRE.values * 2)

    # Act / Assert
    assert "centre_sha256" not in plain.model_dump(mode="json")
    assert plan_hash(_centred(plain)) != plan_hash(plain)
    assert plan_hash(_centred(plain)) != plan_hash(_centred(plain, other))


def test_a_plan_refuses_a_centre_digest_that_is_not_sha256_hex():
    with pytest.raises(ValueError, match="64 lowercase hex"):
        make_plan(SelectionMode.ALL, ReleaseOrder.SELECT_FIRST, centre_sha256="ABC")
