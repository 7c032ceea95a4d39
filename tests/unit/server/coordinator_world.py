"""A coordinator with no grid and no sites: its exchange answers with given PlanAccepts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dpmtv_common.artifact import ArtifactManifest, load_artifact
from dpmtv_common.crypto import SigningKey, TrustedKeys
from dpmtv_common.privacy.testing import SeededNoise
from protocol import PlanAccept, ReleasePlan
from protocol.sum_keys import KeyAdvert
from server.coordinator import Coordinator, build_plan
from server.messaging import Replies
from server.settings import CoordinatorSettings, RunConfig
from tests.unit.protocol.test_release import seeded_release


class FixedExchange:
    """Answers every broadcast with the given PlanAccepts (no grid, no sites)."""

    def __init__(self, accepts: list[PlanAccept]) -> None:
        self.accepts = accepts

    def broadcast(self, *args: Any, **kwargs: Any) -> Replies:
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
        nonce_commitment=bytes(32),
        signature=bytes(64),
    )


def planned(
    monkeypatch: pytest.MonkeyPatch, run: RunConfig, accepts: list[PlanAccept], **settings: Any
) -> tuple[Coordinator, ReleasePlan]:
    """A coordinator for ``run`` after its plan stage, every site answering from ``accepts``."""
    coordinator = Coordinator(
        grid=None,  # type: ignore[arg-type]
        context=None,  # type: ignore[arg-type]
        run=run,
        settings=CoordinatorSettings(**settings),
        noise=SeededNoise(0),
    )
    exchange = FixedExchange(accepts)
    monkeypatch.setattr(coordinator, "_exchange", lambda: exchange)
    plan = build_plan(run)
    coordinator.plan_stage(plan, [1, 2, 3])
    return coordinator, plan


def broadcast_manifest(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, run: RunConfig, accepts: list[PlanAccept]
) -> ArtifactManifest:
    """The signed manifest the coordinator broadcasts after a release on ``FakeSums``."""
    key = SigningKey.generate()
    key_path = key.save(tmp_path / "coordinator.pem")
    coordinator, plan = planned(
        monkeypatch, run, accepts, signing_key=key_path, artifacts_dir=tmp_path / "artifacts"
    )
    outcome = seeded_release(plan)
    path, _ = coordinator.broadcast_stage(plan, outcome)
    return load_artifact(
        path,
        trusted_keys=TrustedKeys([key.verify_key]),
        expected_model_fingerprint=run.model_fingerprint,
    ).manifest
