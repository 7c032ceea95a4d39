"""The coordinator refuses sites whose instructions differ; the manifest records the digest."""

from __future__ import annotations

import pytest

from dpmtv_common.errors import ConfigError
from tests.unit.server.coordinator_world import broadcast_manifest
from tests.unit.server.test_coordinator_prompt_template import (
    ONE,
    OTHER,
    RUN,
    accept,
    planned,
)

TEMPLATE = "3" * 64


def test_sites_with_different_instructions_are_refused_naming_the_sites_and_digests(
    monkeypatch,
):
    # Arrange: one chat template, two instructions
    accepts = [
        accept(0, TEMPLATE, instruction=OTHER),
        accept(1, TEMPLATE, instruction=ONE),
        accept(2, TEMPLATE, instruction=OTHER),
    ]

    # Act
    with pytest.raises(ConfigError, match="must prompt with one task instruction") as info:
        planned(monkeypatch, accepts)

    # Assert
    message = str(info.value)
    assert "instruction_sha256" in message
    assert f"'{ONE}': ['site-1']" in message
    assert f"'{OTHER}': ['site-0', 'site-2']" in message


def test_sites_with_one_instruction_are_accepted(monkeypatch):
    accepts = [accept(site, TEMPLATE, instruction=OTHER) for site in range(3)]

    coordinator, _ = planned(monkeypatch, accepts)

    assert len(coordinator.accepted) == 3


def test_the_manifest_records_the_sites_instruction_digest(monkeypatch, tmp_path):
    # Arrange
    accepts = [accept(site, TEMPLATE, instruction=OTHER) for site in range(3)]

    # Act
    manifest = broadcast_manifest(monkeypatch, tmp_path, RUN, accepts)

    # Assert
    assert manifest.instruction_sha256 == OTHER
    assert manifest.prompt_template_sha256 == TEMPLATE
