"""A site checks the plan's crop cap against its processor before it reserves anything."""

from __future__ import annotations

import dataclasses

import pytest

import client.release.site
from protocol import ErrorCode, PlanAccept
from tests.integration import test_hostile_coordinator as hostile
from tests.integration.test_hostile_coordinator import Consortium, error_code, make_plan

world = hostile.world  # the hostile-coordinator tests' fixtures: three sites, tiny LLaVA
consortium = hostile.consortium

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_a_cap_the_processor_meets_is_accepted_and_recorded(consortium: Consortium) -> None:
    # Act: tiny LLaVA 1.5 never splits, so every cap holds
    (reply,) = consortium.plan(make_plan(consortium.world, max_image_crops=1), range(1))

    # Assert
    assert isinstance(reply, PlanAccept)
    record = consortium.services[0].site.records.get("r1")
    assert record is not None
    assert record.plan.max_image_crops == 1


def test_a_cap_on_a_processor_without_a_knob_is_refused_before_any_reservation(
    consortium: Consortium, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Arrange: the same model behind an adapter that declares no way to cap crops
    site = consortium.services[0].site
    loaded = site.model()
    undeclared = dataclasses.replace(
        loaded, adapter=dataclasses.replace(loaded.adapter, image_crops=None)
    )
    monkeypatch.setattr(client.release.site, "cached_model", lambda settings: undeclared)

    # Act
    (refused,) = consortium.plan(make_plan(consortium.world, max_image_crops=2), range(1))
    (accepted,) = consortium.plan(make_plan(consortium.world, "r2"), range(1))

    # Assert: refused with the reason, nothing reserved; without a cap the plan is fine
    assert error_code(refused) is ErrorCode.BAD_REQUEST
    assert consortium.ledger_state(0, "r1") is None
    assert site.records.get("r1") is None
    assert isinstance(accepted, PlanAccept)
