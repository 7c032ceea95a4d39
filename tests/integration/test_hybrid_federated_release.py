"""A federated release on a hybrid model: every party uses the heads the model carries.

Three real site services (``client.service.inprocess``) behind their relays and the real
coordinator over ``server.simulation.InProcessGrid``, on the tiny Qwen3.5: 2 decoder layers of
4 heads, layer 0 Gated DeltaNet (linear attention, no heads), layer 1 softmax attention. The
sites announce ``head_layers = (1,)`` in their PlanAccept; the coordinator's "all heads", its
Gaussian's L_scope and its selection follow it, and each site checks the artifact against the
heads it carries before storing it.
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is first imported

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from client.data.synthetic import write_task_datasets
from client.models import save_tiny_model
from client.release.record import ReleaseRecordStore
from client.service.inprocess import open_in_process_sites, site_settings_for_partition
from dpmtv_common.artifact import load_artifact
from dpmtv_common.crypto import SigningKey, TrustedKeys
from dpmtv_common.errors import InsufficientSharesError
from dpmtv_common.fingerprint import fingerprint_model_dir
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.budget import PrivacyBudget
from dpmtv_common.privacy.ledger import PrivacyLedger, ReleaseState
from dpmtv_common.privacy.testing import SeededNoise
from protocol import plan_calibration
from server.coordinator import ReleaseReport, run_coordinated_release
from server.settings import CoordinatorSettings, RunConfig
from server.simulation import InProcessGrid, make_server_context
from tests.flower_harness import flower_process_state

pytestmark = pytest.mark.integration

SITES, RECORDS, SHOTS = 3, 9, 2  # 3 chunks a site
CARRIED = HeadSet.of((1, head) for head in range(4))
BUDGET = PrivacyBudget(epsilon=10.0, delta=1e-5)


@dataclass(frozen=True)
class World:
    root: Path
    model: Path
    fingerprint: str
    signing_key: Path
    verify_key: Path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    root = tmp_path_factory.mktemp("hybrid-consortium")
    write_task_datasets(
        root / "data", task="colour", sites=SITES, per_site=RECORDS, public=0, test=0, seed=0
    )
    save_tiny_model("qwen3_5", root / "model", seed=0)
    key = SigningKey.generate()
    key.save(root / "coordinator.key")
    key.verify_key.save(root / "coordinator.pub")
    return World(
        root,
        root / "model",
        fingerprint_model_dir(root / "model"),
        root / "coordinator.key",
        root / "coordinator.pub",
    )


@pytest.fixture
def tmp(world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    site = "site-{partition-id}"
    env = {
        "DPMTV_CLIENT_NAME": site,
        "DPMTV_CLIENT_MODEL_PATH": str(world.model),
        "DPMTV_CLIENT_DATA_PATH": str(world.root / "data" / site),
        "DPMTV_CLIENT_LEDGER_PATH": str(tmp_path / f"{site}-ledger.sqlite"),
        "DPMTV_CLIENT_ARTIFACTS_DIR": str(tmp_path / f"{site}-artifacts"),
        "DPMTV_CLIENT_TRUSTED_KEYS": str(world.verify_key),
        "DPMTV_CLIENT_BUDGET_EPSILON": str(BUDGET.epsilon),
        "DPMTV_CLIENT_BUDGET_DELTA": str(BUDGET.delta),
        "DPMTV_CLIENT_DEVICE": "cpu",
        "DPMTV_CLIENT_BATCH_SIZE": "4",
        "DPMTV_CLIENT_MIN_SITES": "2",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with flower_process_state():
        yield tmp_path


def release(
    world: World, tmp: Path, release_id: str, site: dict[str, Any] | None = None, **overrides: Any
) -> ReleaseReport:
    config = {
        "model-fingerprint": world.fingerprint,
        "release-id": release_id,
        "epsilon": 1.0,
        "shots": SHOTS,
        "clip-norm": 1.0,
        "num-selected-heads": 2,
        "expected-sites": SITES,
        "min-sites": 2,
        "node-wait-timeout": 5.0,
        "stage-timeout": 60.0,
        **{name.replace("_", "-"): value for name, value in overrides.items()},
    }
    settings = [site_settings_for_partition(i, site or {}) for i in range(SITES)]
    relays = list(open_in_process_sites(settings).relays)
    grid = InProcessGrid(relays, num_nodes=SITES, run_config=config)
    coordinator = CoordinatorSettings(
        signing_key=world.signing_key,
        ledger_path=tmp / "consortium-ledger.sqlite",
        budget_epsilon=BUDGET.epsilon,
        budget_delta=BUDGET.delta,
        artifacts_dir=tmp / "coordinator-artifacts",
    )
    return run_coordinated_release(
        grid,
        make_server_context(config),
        RunConfig.from_context(dict(config)),
        coordinator,
        SeededNoise(0),
    )


def site_entries(tmp: Path, partition: int) -> list[tuple[str, ReleaseState]]:
    path = tmp / f"site-{partition}-ledger.sqlite"
    if not path.exists():
        return []
    with PrivacyLedger.open(path, BUDGET) as ledger:
        return [(entry.release_id, entry.state) for entry in ledger.releases()]


DISTRIBUTED = {"noise_mode": "distributed", "max_chunks_per_site": RECORDS // (SHOTS + 1)}


@pytest.mark.parametrize(
    ("selection", "order"),
    [("private", "release-first"), ("private", "select-first"), ("all", "release-first")],
)
def test_a_hybrid_consortium_releases_only_carried_heads(world, tmp, selection, order):
    # Act
    release_id = f"hybrid-{selection}-{order}"
    report = release(world, tmp, release_id, selection=selection, order=order)

    # Assert: nothing of layer 0 released or noised; sigma sized for the one carried layer
    outcome = report.outcome
    assert set(outcome.heads.heads) <= set(CARRIED.heads)
    assert set(outcome.gaussian_heads.heads) <= set(CARRIED.heads)
    if selection == "all":
        assert outcome.heads == CARRIED
    one_layer = plan_calibration(report.plan).gaussian(clip_norm=1.0, heads=CARRIED)
    assert outcome.noise_std == pytest.approx(one_layer.noise_std)
    signed = load_artifact(
        report.artifact,
        trusted_keys=TrustedKeys.from_files([world.verify_key]),
        expected_model_fingerprint=world.fingerprint,
    )
    assert signed.manifest.accountant_parameters["num_layers_in_scope"] == 1
    # Every site checked the artifact against its carried heads, stored it and committed.
    assert report.acknowledged == ("site-0", "site-1", "site-2")
    for partition in range(SITES):
        assert site_entries(tmp, partition) == [(release_id, ReleaseState.COMMITTED)]
        settings = site_settings_for_partition(partition, {})
        record = ReleaseRecordStore(settings.releases_folder).require(release_id)
        assert (record.head_layers, record.layout.all_heads()) == ((1,), CARRIED)


@pytest.mark.parametrize("order", ["release-first", "select-first"])
def test_a_distributed_hybrid_release_agrees_on_every_grid(world, tmp, order):
    # Sites recompute the SecAgg+ ranges from the plan and their layout (votes: dense L * H;
    # activations: the carried heads) and refuse any other, so a disagreement would abort.
    release_id = f"hybrid-distributed-{order}"
    report = release(
        world, tmp, release_id, {"noise_mode": "distributed"}, order=order, **DISTRIBUTED
    )

    assert set(report.outcome.heads.heads) <= set(CARRIED.heads)
    assert report.outcome.gaussian_heads.num_layers_in_scope == 1
    assert report.acknowledged == ("site-0", "site-1", "site-2")
    for partition in range(SITES):
        assert site_entries(tmp, partition) == [(release_id, ReleaseState.COMMITTED)]


def test_public_heads_in_a_headless_layer_are_refused_by_every_site_at_no_cost(world, tmp):
    with pytest.raises(InsufficientSharesError, match="accepting sites must number at least"):
        release(world, tmp, "hybrid-public", selection="public", public_heads="0:1,1:2")

    for partition in range(SITES):
        assert site_entries(tmp, partition) == []
