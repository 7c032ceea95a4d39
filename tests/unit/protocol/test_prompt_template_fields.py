"""Sites report their prompt template and instruction digests and dpmtv version; the manifest
fields record them."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from protocol import (
    DPMTV_VERSION,
    PlanAccept,
    ReleaseOrder,
    SelectionMode,
    expect,
    message_to_record,
    release_description,
)
from tests.unit.protocol.test_release import make_plan, seeded_release

DIGEST = "0123456789abcdef" * 4
INSTRUCTION = "fedcba9876543210" * 4


def accept(**overrides: Any) -> PlanAccept:
    fields: dict[str, Any] = {
        "release_id": "r1",
        "site_name": "site-a",
        "num_chunks": 3,
        "num_layers": 2,
        "num_heads": 4,
        "head_dim": 8,
        "prompt_template_sha256": DIGEST,
        "instruction_sha256": INSTRUCTION,
        "dpmtv_version": "0.1.0",
    }
    return PlanAccept(**(fields | overrides))


def test_the_digests_and_version_cross_the_wire():
    sent = accept(dpmtv_version="1.2.3rc1+local.7")

    received = expect(message_to_record(sent), PlanAccept)

    assert (
        received.prompt_template_sha256,
        received.instruction_sha256,
        received.dpmtv_version,
    ) == (DIGEST, INSTRUCTION, "1.2.3rc1+local.7")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"prompt_template_sha256": DIGEST.upper()}, "prompt_template_sha256 must be 64 lowercase"),
        ({"prompt_template_sha256": DIGEST[:-1]}, "prompt_template_sha256 must be 64 lowercase"),
        ({"instruction_sha256": INSTRUCTION.upper()}, "instruction_sha256 must be 64 lowercase"),
        ({"instruction_sha256": ""}, "instruction_sha256 must be 64 lowercase"),
        ({"dpmtv_version": ""}, "dpmtv_version must be a package version"),
        ({"dpmtv_version": "1.0 beta"}, "dpmtv_version must be a package version"),
        ({"dpmtv_version": "1" * 65}, "dpmtv_version must be a package version"),
    ],
)
def test_a_malformed_digest_or_version_is_refused(overrides, message):
    with pytest.raises(ValidationError, match=message):
        accept(**overrides)


@pytest.mark.parametrize(
    "missing", ["prompt_template_sha256", "instruction_sha256", "dpmtv_version"]
)
def test_an_accept_without_a_digest_or_the_version_is_refused(missing):
    fields = accept().model_dump()
    del fields[missing]

    with pytest.raises(ValidationError, match=missing):
        PlanAccept(**fields)


def test_the_running_version_is_a_valid_one():
    assert accept(dpmtv_version=DPMTV_VERSION).dpmtv_version == DPMTV_VERSION


def test_release_description_records_the_digests_and_the_distinct_versions_sorted():
    # Arrange
    plan = make_plan(SelectionMode.ALL, ReleaseOrder.SELECT_FIRST)
    outcome = seeded_release(plan)

    # Act
    description = release_description(
        plan,
        outcome,
        prompt_template_sha256=DIGEST,
        instruction_sha256=INSTRUCTION,
        dpmtv_versions=["0.2.0", "0.1.0", "0.2.0"],
    )

    # Assert
    assert description.prompt_template_sha256 == DIGEST
    assert description.instruction_sha256 == INSTRUCTION
    assert description.dpmtv_versions == ["0.1.0", "0.2.0"]
