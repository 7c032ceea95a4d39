"""Group-level privacy in a federation: the unit travels in the plan and every site checks it.

Three sites whose data are group-level (each patient's records one unit, ``dataset.json``
says ``privacy_unit: group``) complete a federated release when the run config says
``privacy-unit="group"``; the plan, the artifact and every ledger state the unit. A site
refuses a plan of another unit before reserving anything, so a consortium whose run config
left the unit at its default leaves the group-level sites out. Tiny random LLaVA, K = 2.
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is first imported

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from client.data.records import write_jsonl_dataset
from client.data.synthetic import write_task_datasets
from client.models import save_tiny_model
from dpmtv_common.crypto import SigningKey
from dpmtv_common.errors import InsufficientSharesError
from dpmtv_common.fingerprint import fingerprint_model_dir
from dpmtv_common.privacy.budget import PrivacyBudget
from dpmtv_common.privacy.ledger import PrivacyLedger
from tests.flower_harness import flower_process_state
from tests.integration.test_federated_release import (
    BUDGET,
    Paths,
    World,
    release,
    run_config,
)

pytestmark = pytest.mark.integration

SITES, GROUPS, PER_GROUP = 3, 6, 3  # each group one chunk: m_i = 6


def _group_level(site: Path) -> None:
    """Rewrite a synthetic site as group-level: consecutive records share a patient."""
    rows = [json.loads(line) for line in (site / "manifest.jsonl").read_text().splitlines()]
    for index, row in enumerate(rows):
        row["group"] = f"patient-{index // PER_GROUP}"
    write_jsonl_dataset(site, rows, task="colour", privacy_unit="group")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    root = tmp_path_factory.mktemp("groups")
    write_task_datasets(
        root / "data", task="colour", sites=SITES, per_site=GROUPS * PER_GROUP, public=0,
        test=0, seed=0,
    )  # fmt: skip
    for i in range(SITES):
        _group_level(root / "data" / f"site-{i}")
    save_tiny_model("llava", root / "model", seed=0)
    key = SigningKey.generate()
    key.save(root / "coordinator.key")
    key.verify_key.save(root / "coordinator.pub")
    return World(
        root=root,
        model=root / "model",
        other_model=root / "model",
        fingerprint=fingerprint_model_dir(root / "model"),
        signing_key=root / "coordinator.key",
        verify_key=root / "coordinator.pub",
    )


@pytest.fixture
def paths(world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Paths]:
    site = "site-{partition-id}"
    env = {
        "DPMTV_CLIENT_NAME": site,
        "DPMTV_CLIENT_MODEL_PATH": str(world.model),
        "DPMTV_CLIENT_DATA_PATH": str(world.root / "data" / site),
        "DPMTV_CLIENT_STATE_DIR": str(tmp_path / f"{site}-state"),
        "DPMTV_CLIENT_LEDGER_PATH": str(tmp_path / f"{site}-ledger.sqlite"),
        "DPMTV_CLIENT_ARTIFACTS_DIR": str(tmp_path / f"{site}-artifacts"),
        "DPMTV_CLIENT_TRUSTED_KEYS": str(world.verify_key),
        "DPMTV_CLIENT_DEVICE": "cpu",
        "DPMTV_CLIENT_MIN_SITES": "3",  # the site default
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with flower_process_state():
        yield Paths(tmp_path)


def _units(path: Path) -> dict[str, str]:
    with PrivacyLedger.open(path, PrivacyBudget(BUDGET.epsilon, BUDGET.delta)) as ledger:
        return {entry.release_id: entry.privacy_unit for entry in ledger.releases()}


def test_three_group_level_sites_complete_a_group_level_federated_release(
    world: World, paths: Paths
) -> None:
    # Arrange: the run config names the unit, and the sites' default minimum of 3
    config = run_config(
        world, "groups-1", SITES, selection="all", privacy_unit="group", min_sites=3
    )
    # Act
    report = release(world, paths, config, num_sites=SITES)
    # Assert: every site took part; plan, artifact and ledgers say group
    assert report.acknowledged == ("site-0", "site-1", "site-2")
    assert report.plan.privacy_unit.value == "group"
    assert report.outcome.num_chunks == SITES * GROUPS  # one chunk per patient
    for i in range(SITES):
        manifest = json.loads((paths.site_artifacts(i) / "groups-1" / "manifest.json").read_text())
        assert manifest["accountant_parameters"]["privacy_unit"] == "group"
        assert _units(paths.site_ledger(i)) == {"groups-1": "group"}
    assert _units(paths.consortium_ledger) == {"groups-1": "group"}


def test_a_group_level_site_refuses_an_example_level_plan_before_reserving(
    world: World, paths: Paths, caplog: pytest.LogCaptureFixture
) -> None:
    # Arrange: the run config leaves the unit at its default (example)
    config = run_config(world, "examples-1", SITES, selection="all", min_sites=3)
    # Act: every site refuses, so too few accept
    with (
        caplog.at_level(logging.WARNING, logger="client.service.server"),
        pytest.raises(InsufficientSharesError),
    ):
        release(world, paths, config, num_sites=SITES)
    # Assert: for the unit, in each site's own log
    refusal = "plan privacy_unit must be the unit of this site's data 'group', got 'example'"
    assert caplog.text.count(refusal) == SITES
    # Assert: nothing reserved at any site
    for i in range(SITES):
        ledger = paths.site_ledger(i)
        if ledger.exists():
            with PrivacyLedger.open(ledger, BUDGET) as opened:
                assert opened.releases() == []
