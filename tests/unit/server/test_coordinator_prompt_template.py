"""The coordinator refuses sites whose prompt templates differ; the manifest records the digest."""

from __future__ import annotations

from typing import Any

import pytest

from dpmtv_common.artifact import load_artifact
from dpmtv_common.crypto import SigningKey, TrustedKeys
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadLayout
from dpmtv_common.privacy.testing import SeededNoise
from protocol import PlanAccept, ReleasePlan, run_release
from protocol.sum_keys import KeyAdvert
from server.coordinator import Coordinator, build_plan
from server.messaging import Replies
from server.settings import CoordinatorSettings, RunConfig
from tests.unit.protocol.test_release import DIM, HEADS, LAYERS, FakeSums

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


class FixedExchange:
    """Answers every broadcast with the given PlanAccepts (no grid, no sites)."""

    def __init__(self, accepts: list[PlanAccept]) -> None:
        self.accepts = accepts

    def broadcast(self, *args: Any) -> Replies:
        message = args[1]  # ("plan", PlanRequest, nodes, ...) or ("release", ReleaseRequest, ...)
        release_id = message.plan.release_id if hasattr(message, "plan") else message.release_id
        answers = {
            node: accept.model_copy(update={"keys": unsigned_keys(node, release_id)})
            for node, accept in enumerate(self.accepts, start=1)
        }
        return Replies(answers=dict(answers), failures={})


def unsigned_keys(node: int, release_id: str) -> KeyAdvert:
    """A key advertisement of the right shape (the coordinator does not verify it)."""
    return KeyAdvert(
        member=f"site-{node}",
        node_id=node,
        release_id=release_id,
        roster_sha256="0" * 64,
        public_key=bytes(32),
        signature=bytes(64),
    )


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
    monkeypatch: pytest.MonkeyPatch, accepts: list[PlanAccept], **settings: Any
) -> tuple[Coordinator, ReleasePlan]:
    coordinator = Coordinator(
        grid=None,  # type: ignore[arg-type]
        context=None,  # type: ignore[arg-type]
        run=RUN,
        settings=CoordinatorSettings(**settings),
        noise=SeededNoise(0),
    )
    monkeypatch.setattr(coordinator, "_exchange", lambda: FixedExchange(accepts))
    plan = build_plan(RUN)
    coordinator.plan_stage(plan, [1, 2, 3])
    return coordinator, plan


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
    key = SigningKey.generate()
    key_path = key.save(tmp_path / "coordinator.pem")
    accepts = [accept(0, ONE, "0.2.0"), accept(1, ONE, "0.1.0"), accept(2, ONE, "0.2.0")]
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
    assert manifest.prompt_template_sha256 == ONE
    assert manifest.dpmtv_versions == ["0.1.0", "0.2.0"]
