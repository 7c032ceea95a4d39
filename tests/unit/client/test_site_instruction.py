"""A site reports the digest of its data's instruction, contributes only under it, and stores
only an artifact whose manifest records it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import cast

import numpy as np
import pytest

import client.release.site
from client.data.records import SiteDataset
from client.models import instruction_digest
from client.release.policy import check_artifact
from client.release.record import ReleaseRecord, SiteReleaseState
from client.release.site import Site
from client.settings import SiteSettings
from dpmtv_common.artifact import ReleaseDescription, TaskVectorArtifact, load_artifact
from dpmtv_common.artifact import write_artifact as write
from dpmtv_common.crypto import SigningKey, TrustedKeys
from dpmtv_common.errors import DataError
from dpmtv_common.privacy.ledger import ReleaseState
from protocol import PlanMismatchError, ReleasePlan, plan_calibration
from tests.plans import make_plan
from tests.unit.client.test_release_states import (
    EXTRACT,
    M_I,
    RUN,
    SHAPE,
    ModelFreeSite,
)

INSTRUCTION = "Answer with one word."
TEMPLATE = "0" * 64
KEY = SigningKey.generate()


class InstructedSite(ModelFreeSite):
    """The model-free site, its data carrying ``instruction`` (which a test may edit)."""

    instruction: str | None = INSTRUCTION

    def _listed_dataset(self) -> SiteDataset:
        data = SimpleNamespace(privacy_unit="example", instruction=self.instruction)
        return cast(SiteDataset, data)


class ChunkingSite(InstructedSite):
    """The real secure-sum computation (it stops at chunking, which needs real data)."""

    _compute = Site._compute


class ChunkingReached(Exception):
    """Raised where the computation would chunk the data: every earlier check passed."""


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    # Checks that need a model or data; each is tested on its own elsewhere.
    monkeypatch.setattr(client.release.site, "check_plan", lambda plan, **_: None)
    monkeypatch.setattr(client.release.site, "planned_num_chunks", lambda *_: M_I)
    monkeypatch.setattr(client.release.site, "prompt_template_digest", lambda _: TEMPLATE)

    def reached(*_: object, **__: object) -> None:
        raise ChunkingReached

    monkeypatch.setattr(client.release.site, "make_chunks", reached)


def open_site(kind: type[InstructedSite], tmp_path: Path) -> InstructedSite:
    return kind(SiteSettings(name="site-1", state_dir=tmp_path / "state"))


def ledger_state(site: Site) -> ReleaseState | None:
    with site.ledger() as ledger:
        return {e.release_id: e.state for e in ledger.releases()}.get("r1")


# ---------------------------------------------------------------- plan and secure sums


@pytest.mark.usefixtures("stand_ins")
@pytest.mark.parametrize("instruction", [INSTRUCTION, None, ""])
def test_the_site_reports_and_records_the_digest_of_its_data_s_instruction(tmp_path, instruction):
    site = open_site(InstructedSite, tmp_path)
    site.instruction = instruction

    accept = site.accept_plan(make_plan(), run_id=RUN)

    assert accept.instruction_sha256 == instruction_digest(instruction)
    assert site.records.require("r1").instruction_sha256 == instruction_digest(instruction)


@pytest.mark.usefixtures("stand_ins")
def test_a_sum_after_the_instruction_changed_is_refused_before_anything_is_sent(tmp_path):
    # Arrange: the plan accepted under one instruction, then dataset.json edited
    site = open_site(ChunkingSite, tmp_path)
    site.accept_plan(make_plan(), run_id=RUN)
    site.instruction = "Answer in a sentence."

    # Act
    with pytest.raises(DataError, match="instruction must be the one reported") as info:
        site.contribution(EXTRACT, run_id=RUN)

    # Assert: both digests named; nothing left, so nothing is counted
    assert f"sha256 {instruction_digest(INSTRUCTION)}" in str(info.value)
    assert f"sha256 {instruction_digest('Answer in a sentence.')}" in str(info.value)
    assert site.records.require("r1").state is SiteReleaseState.PLANNED
    assert ledger_state(site) is ReleaseState.RESERVED


@pytest.mark.usefixtures("stand_ins")
def test_a_sum_under_the_reported_instruction_goes_on_to_chunk_the_data(tmp_path):
    site = open_site(ChunkingSite, tmp_path)
    site.accept_plan(make_plan(), run_id=RUN)

    with pytest.raises(ChunkingReached):
        site.contribution(EXTRACT, run_id=RUN)


# ---------------------------------------------------------------- the artifact


def record(plan: ReleasePlan, instruction_sha256: str | None) -> ReleaseRecord:
    return ReleaseRecord.planned(
        plan,
        run_id=RUN,
        num_chunks=M_I,
        layout=SHAPE.layout,
        head_dim=SHAPE.head_dim,
        model_dtype="float32",
        prompt_template_sha256=TEMPLATE,
        instruction_sha256=instruction_sha256,
    )


def artifact(
    tmp_path: Path, plan: ReleasePlan, instruction_sha256: str | None
) -> TaskVectorArtifact:
    """The artifact the plan produces, as a coordinator signs it, but for the instruction."""
    calibration = plan_calibration(plan)
    heads = SHAPE.layout.all_heads()
    description = ReleaseDescription(
        protocol_version=plan.protocol_version,
        release_id=plan.release_id,
        model_fingerprint=plan.model_fingerprint,
        task=plan.task,
        plan=plan.model_dump(mode="json"),
        epsilon=calibration.bound.epsilon,
        delta=plan.delta,
        accountant=calibration.bound.accountant,
        accountant_parameters={
            "neighbouring": plan.neighbouring.value,
            "privacy_unit": plan.privacy_unit.value,
        },
        num_chunks=3 * M_I,
        shots=plan.shots,
        clip_norm=plan.clip_norm,
        noise_std=calibration.gaussian(clip_norm=plan.clip_norm, heads=heads).noise_std,
        model_dtype="float32",
        prompt_template_sha256=TEMPLATE,
        instruction_sha256=instruction_sha256,
    )
    path = write(
        tmp_path / f"artifact-{instruction_sha256}",
        heads=heads,
        values=np.zeros((len(heads), SHAPE.head_dim)),
        release=description,
        signing_key=KEY,
    )
    trusted = TrustedKeys([KEY.verify_key])
    return load_artifact(
        path, trusted_keys=trusted, expected_model_fingerprint=plan.model_fingerprint
    )


def test_the_plan_s_own_artifact_under_the_reported_instruction_passes(tmp_path):
    plan, digest = make_plan(), instruction_digest(INSTRUCTION)

    check_artifact(record(plan, digest), artifact(tmp_path, plan, digest), None)


@pytest.mark.parametrize("recorded", [instruction_digest(None), None], ids=["other", "none"])
def test_an_artifact_of_another_instruction_or_of_none_is_refused_naming_both(tmp_path, recorded):
    plan, reported = make_plan(), instruction_digest(INSTRUCTION)

    with pytest.raises(PlanMismatchError, match="artifact instruction_sha256 must be") as info:
        check_artifact(record(plan, reported), artifact(tmp_path, plan, recorded), None)

    assert f"'{reported}', got {recorded!r}" in str(info.value)


def test_a_record_written_before_the_field_takes_an_artifact_of_any_instruction(tmp_path):
    plan = make_plan()

    check_artifact(record(plan, None), artifact(tmp_path, plan, "1" * 64), None)
