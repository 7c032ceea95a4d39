"""The plan's ``max_image_crops``: bounded, hashed, sent, recorded; unset hashes as before."""

import json
from typing import Any

import pytest
from pydantic import ValidationError

from dpmtv_common.artifact import ReleaseDescription
from protocol import (
    MAX_IMAGE_CROPS,
    PlanRequest,
    ReleasePlan,
    expect,
    message_to_record,
    plan_hash,
)
from tests.unit.protocol.test_plan import PINNED_HASH, VALID


def make_plan(**overrides: Any) -> ReleasePlan:
    return ReleasePlan.model_validate({**VALID, **overrides})


def test_an_unset_cap_hashes_as_plans_did_before_the_field():
    plan = make_plan()

    assert plan.max_image_crops is None
    assert "max_image_crops" not in plan.model_dump(mode="json")
    assert plan_hash(plan) == PINNED_HASH


def test_every_cap_gives_its_own_plan_hash():
    hashes = {plan_hash(make_plan(max_image_crops=cap)) for cap in (1, 2, 17, MAX_IMAGE_CROPS)}

    assert len(hashes) == 4
    assert PINNED_HASH not in hashes


@pytest.mark.parametrize("bad", [0, -3, MAX_IMAGE_CROPS + 1, 2.0, "4", True])
def test_a_cap_outside_the_bounds_or_not_an_int_is_refused(bad):
    with pytest.raises(ValidationError, match="max_image_crops"):
        make_plan(max_image_crops=bad)


@pytest.mark.parametrize("cap", [None, 1, 9])
def test_the_cap_crosses_the_wire_and_keeps_the_hash(cap):
    plan = make_plan(max_image_crops=cap)

    decoded = expect(message_to_record(PlanRequest(plan=plan)), PlanRequest).plan

    assert decoded.max_image_crops == cap
    assert plan_hash(decoded) == plan_hash(plan)


def test_an_old_plan_document_without_the_key_reads_as_no_cap():
    document = make_plan().model_dump(mode="json")

    assert ReleasePlan.model_validate_json(json.dumps(document)).max_image_crops is None


@pytest.mark.parametrize("cap", [None, 1, 4])
def test_a_release_description_of_the_plan_records_its_cap(cap):
    plan = make_plan(max_image_crops=cap)

    description = ReleaseDescription(
        protocol_version=plan.protocol_version,
        release_id=plan.release_id,
        model_fingerprint=plan.model_fingerprint,
        task=plan.task,
        plan=plan.model_dump(mode="json"),
        epsilon=1.0,
        delta=plan.delta,
        accountant="rdp",
        accountant_parameters={},
        num_chunks=3,
        shots=plan.shots,
        clip_norm=plan.clip_norm,
        noise_std=1.0,
    )

    assert description.max_image_crops == cap
