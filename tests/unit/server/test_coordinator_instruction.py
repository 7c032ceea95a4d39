"""The coordinator refuses sites whose instructions differ; the manifest records the digest."""

from __future__ import annotations

import pytest

from dpmtv_common.artifact import load_artifact
from dpmtv_common.crypto import SigningKey, TrustedKeys
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadLayout
from dpmtv_common.privacy.testing import SeededNoise
from protocol import run_release
from tests.unit.protocol.test_release import HEADS, LAYERS, FakeSums
from tests.unit.server.test_coordinator_prompt_template import ONE, OTHER, accept, planned

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
    key = SigningKey.generate()
    key_path = key.save(tmp_path / "coordinator.pem")
    accepts = [accept(site, TEMPLATE, instruction=OTHER) for site in range(3)]
    coordinator, plan = planned(
        monkeypatch, accepts, signing_key=key_path, artifacts_dir=tmp_path / "artifacts"
    )
    outcome = run_release(
        plan,
        sums=FakeSums(),
        layout=HeadLayout(LAYERS, HEADS),
        noise=SeededNoise(0),
        on_first_noise=lambda: None,
    )

    # Act
    path, _ = coordinator.broadcast_stage(plan, outcome)

    # Assert
    manifest = load_artifact(
        path, trusted_keys=TrustedKeys([key.verify_key]), expected_model_fingerprint="sha256:abc"
    ).manifest
    assert manifest.instruction_sha256 == OTHER
    assert manifest.prompt_template_sha256 == TEMPLATE
