"""The coordinator refuses sites whose prompt templates differ; the manifest records the digest."""

from __future__ import annotations

import pytest

from dpmtv_common.errors import ConfigError
from protocol import PlanAccept, ReleasePlan
from server.coordinator import Coordinator
from server.settings import RunConfig
from tests.unit.protocol.test_release import DIM, HEADS, LAYERS
from tests.unit.server import coordinator_world
from tests.unit.server.coordinator_world import broadcast_manifest

RUN = RunConfig.from_context(
    {
        "model-fingerprint": "sha256:abc",
        "release-id": "r1",
        "clip-norm": 1.0,
        "selection": "all",
        "min-sites": 2,
        "expected-sites": 3,
        "max-chunks-per-site": 0,  # the plan's own round trip (FixedExchange answers it)
    }
)
ONE, OTHER = "1" * 64, "2" * 64


def accept(site: int, template: str, version: str = "0.1.0", instruction: str = ONE) -> PlanAccept:
    return PlanAccept(
        release_id="r1",
        site_name=f"site-{site}",
        num_chunks=5,
        num_layers=LAYERS,
        num_heads=HEADS,
        head_dim=DIM,
        prompt_template_sha256=template,
        instruction_sha256=instruction,
        dpmtv_version=version,
    )


def planned(
    monkeypatch: pytest.MonkeyPatch, accepts: list[PlanAccept]
) -> tuple[Coordinator, ReleasePlan]:
    return coordinator_world.planned(monkeypatch, RUN, accepts)


def test_sites_with_different_prompt_templates_are_refused_naming_the_digests(monkeypatch):
    # Arrange
    accepts = [accept(0, ONE), accept(1, OTHER), accept(2, ONE)]

    # Act
    with pytest.raises(ConfigError, match="must render prompts with one chat template") as info:
        planned(monkeypatch, accepts)

    # Assert
    message = str(info.value)
    assert f"'{ONE}': ['site-0', 'site-2']" in message
    assert f"'{OTHER}': ['site-1']" in message


def test_sites_on_different_dpmtv_versions_with_one_template_are_accepted(monkeypatch):
    accepts = [accept(0, ONE, "0.1.0"), accept(1, ONE, "0.2.0"), accept(2, ONE, "0.1.0")]

    coordinator, _ = planned(monkeypatch, accepts)

    assert len(coordinator.accepted) == 3


def test_the_manifest_records_the_sites_template_digest_and_their_versions(monkeypatch, tmp_path):
    # Arrange: three sites, one template, two dpmtv versions
    accepts = [accept(0, ONE, "0.2.0"), accept(1, ONE, "0.1.0"), accept(2, ONE, "0.2.0")]

    # Act
    manifest = broadcast_manifest(monkeypatch, tmp_path, RUN, accepts)

    # Assert
    assert manifest.prompt_template_sha256 == ONE
    assert manifest.dpmtv_versions == ["0.1.0", "0.2.0"]
