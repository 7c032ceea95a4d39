"""Federated release end to end: the coordinator's logic against real ClientApp sites.

Every test runs ``server.coordinator.run_coordinated_release`` (or the real ``ServerApp``)
over ``server.simulation.InProcessGrid``: the plan exchange, SecAgg+ secure sums with
ChaCha20 masks, Gumbel picks, the single Gaussian draw, the signed broadcast, abort notices,
and the ledgers on both sides. Every site is a real site service behind a real relay
(``client.service.inprocess``); sites read their settings from ``DPMTV_CLIENT_*`` variables
with ``{partition-id}`` placeholders, and a test overrides one site's settings. The model is
a tiny random LLaVA (L = 2 layers, H = 4 heads, D = 16); the sites hold 24, 21, 18 and 15
records, so with K = 2 shots they cut 8, 7, 6 and 5 chunks, and m tells which sites are in
a sum.
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is first imported

import logging
import shutil
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Message

import server.app
from client.activations.chunking import num_chunks
from client.data.synthetic import write_task_datasets
from client.models import save_tiny_model
from client.service.inprocess import open_in_process_sites, site_settings_for_partition
from dpmtv_common.artifact import TaskVectorArtifact, load_artifact
from dpmtv_common.crypto import SigningKey, TrustedKeys
from dpmtv_common.errors import InsecureRandomnessError, InsufficientSharesError
from dpmtv_common.fingerprint import fingerprint_model_dir
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.budget import PrivacyBudget
from dpmtv_common.privacy.composition import epsilon_bound
from dpmtv_common.privacy.ledger import LedgerEntry, PrivacyLedger, ReleaseState
from dpmtv_common.privacy.noise import NoiseSource, SecureNoise
from dpmtv_common.privacy.testing import SeededNoise
from protocol import (
    AbortNotice,
    ReleasePlan,
    SelectionMode,
    message_from_record,
    plan_calibration,
    plan_hash,
)
from protocol.secure_sum import SumCollectRequest, SumSharesRequest
from server.coordinator import ReleaseReport, build_plan, run_coordinated_release
from server.settings import CoordinatorSettings, RunConfig
from server.simulation import FIRST_NODE_ID, InProcessGrid, make_server_context
from tests.flower_harness import flower_process_state

pytestmark = pytest.mark.integration

SHOTS = 2
SITE_RECORDS = (24, 21, 18, 15)  # m_i = 8, 7, 6, 5 chunks at K = 2
NUM_LAYERS, NUM_HEADS = 2, 4  # the tiny LLaVA's text model
PUBLIC_HEADS = "0:1,1:2"
K_PRIVATE = 2
HEAD_DIM = 16  # the tiny LLaVA's head size
BUDGET = PrivacyBudget(epsilon=10.0, delta=1e-5)
FITINS_CONFIG = "fitins.config"


@dataclass(frozen=True)
class World:
    """What every test shares: one model, another model, site data and the coordinator key."""

    root: Path
    model: Path
    other_model: Path
    fingerprint: str
    signing_key: Path
    verify_key: Path


@dataclass(frozen=True)
class Paths:
    """Where one test's coordinator and sites keep their state."""

    tmp: Path

    @property
    def consortium_ledger(self) -> Path:
        return self.tmp / "consortium-ledger.sqlite"

    @property
    def coordinator_artifacts(self) -> Path:
        return self.tmp / "coordinator-artifacts"

    def site_ledger(self, partition: int) -> Path:
        return self.tmp / f"site-{partition}-ledger.sqlite"

    def site_artifacts(self, partition: int) -> Path:
        return self.tmp / f"site-{partition}-artifacts"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    root = tmp_path_factory.mktemp("consortium")
    data = root / "data"
    # Site 0 with the public and test sets, then each other site with its own size.
    write_task_datasets(
        data, task="colour", sites=1, per_site=SITE_RECORDS[0], public=6, test=4, seed=0
    )
    for partition, records in enumerate(SITE_RECORDS[1:], start=1):
        scratch = root / f"scratch-{partition}"
        write_task_datasets(
            scratch, task="colour", sites=1, per_site=records, public=0, test=0, seed=partition
        )
        shutil.move(scratch / "site-0", data / f"site-{partition}")
    save_tiny_model("llava", root / "model", seed=0)
    save_tiny_model("llava", root / "other-model", seed=1)
    key = SigningKey.generate()
    key.save(root / "coordinator.key")
    key.verify_key.save(root / "coordinator.pub")
    return World(
        root=root,
        model=root / "model",
        other_model=root / "other-model",
        fingerprint=fingerprint_model_dir(root / "model"),
        signing_key=root / "coordinator.key",
        verify_key=root / "coordinator.pub",
    )


@pytest.fixture
def paths(world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Paths]:
    """Fresh ledgers and artifact folders; site settings from env with placeholders."""
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
        "DPMTV_CLIENT_BATCH_SIZE": "8",
        "DPMTV_CLIENT_MIN_SITES": "2",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with flower_process_state():
        yield Paths(tmp_path)


def run_config(world: World, release_id: str, num_sites: int, **overrides: Any) -> dict[str, Any]:
    return {
        "model-fingerprint": world.fingerprint,
        "release-id": release_id,
        "epsilon": 1.0,
        "shots": SHOTS,
        "clip-norm": 1.0,
        "num-selected-heads": K_PRIVATE,
        "expected-sites": num_sites,
        "min-sites": 2,
        "node-wait-timeout": 5.0,
        "stage-timeout": 60.0,
        **{name.replace("_", "-"): value for name, value in overrides.items()},
    }


def coordinator_settings(world: World, paths: Paths) -> CoordinatorSettings:
    return CoordinatorSettings(
        signing_key=world.signing_key,
        ledger_path=paths.consortium_ledger,
        budget_epsilon=BUDGET.epsilon,
        budget_delta=BUDGET.delta,
        artifacts_dir=paths.coordinator_artifacts,
    )


def site_relays(num_sites: int, overrides: list[dict[str, Any]] | None = None) -> list[Any]:
    """One real site service per partition, behind its relay (settings from the env)."""
    extra = overrides or [{}] * num_sites
    settings = [site_settings_for_partition(i, extra[i]) for i in range(num_sites)]
    return list(open_in_process_sites(settings).relays)


def release(
    world: World,
    paths: Paths,
    config: Mapping[str, Any],
    *,
    num_sites: int = 3,
    drops: Mapping[int, set[str]] | None = None,
    node_configs: list[dict[str, Any]] | None = None,
    grid: InProcessGrid | None = None,
) -> ReleaseReport:
    grid = grid or InProcessGrid(
        site_relays(num_sites, node_configs), num_nodes=num_sites, run_config=config, drops=drops
    )
    return run_coordinated_release(
        grid,
        make_server_context(config),
        RunConfig.from_context(dict(config)),
        coordinator_settings(world, paths),
        SeededNoise(0),  # tests inject a seeded source; the ServerApp tests cover production
    )


def node(partition: int) -> int:
    return FIRST_NODE_ID + partition


def chunks(partitions: Iterable[int]) -> int:
    return sum(num_chunks(SITE_RECORDS[p], SHOTS) for p in partitions)


def entries(path: Path, budget: PrivacyBudget = BUDGET) -> list[LedgerEntry]:
    if not path.exists():
        return []
    with PrivacyLedger.open(path, budget) as ledger:
        return ledger.releases()


def states(path: Path) -> dict[str, ReleaseState]:
    return {entry.release_id: entry.state for entry in entries(path)}


def spent_epsilon(path: Path) -> float | None:
    with PrivacyLedger.open(path, BUDGET) as ledger:
        spent = ledger.spent()
    return None if spent is None else spent.epsilon


def site_artifact(
    world: World, paths: Paths, partition: int, release_id: str
) -> TaskVectorArtifact:
    return load_artifact(
        paths.site_artifacts(partition) / release_id,
        trusted_keys=TrustedKeys.from_files([world.verify_key]),
        expected_model_fingerprint=world.fingerprint,
    )


def assert_released_everywhere(
    world: World, paths: Paths, report: ReleaseReport, partitions: Iterable[int]
) -> TaskVectorArtifact:
    """Every listed site stores the coordinator's verified artifact and committed ledgers."""
    release_id = report.plan.release_id
    signed = load_artifact(
        report.artifact,
        trusted_keys=TrustedKeys.from_files([world.verify_key]),
        expected_model_fingerprint=world.fingerprint,
    )
    expected_epsilon = epsilon_bound([plan_calibration(report.plan).event], delta=BUDGET.delta)
    assert expected_epsilon.epsilon <= report.plan.epsilon * (1 + 1e-9)
    assert states(paths.consortium_ledger) == {release_id: ReleaseState.COMMITTED}
    assert spent_epsilon(paths.consortium_ledger) == pytest.approx(expected_epsilon.epsilon)
    for partition in partitions:
        stored = site_artifact(world, paths, partition, release_id)
        assert stored.manifest == signed.manifest
        assert stored.heads == signed.heads
        np.testing.assert_array_equal(stored.values, signed.values)
        (entry,) = entries(paths.site_ledger(partition))
        assert (entry.release_id, entry.state) == (release_id, ReleaseState.COMMITTED)
        assert entry.plan_hash == plan_hash(report.plan)
        assert spent_epsilon(paths.site_ledger(partition)) == pytest.approx(
            expected_epsilon.epsilon
        )
    return signed


def assert_no_artifact(paths: Paths, release_id: str, partitions: Iterable[int]) -> None:
    assert not (paths.coordinator_artifacts / release_id).exists()
    for partition in partitions:
        assert not (paths.site_artifacts(partition) / release_id).exists()


def abort_notices(grid: InProcessGrid) -> dict[int, AbortNotice]:
    """The abort notices sites acknowledged (a site that never reserved answers an error)."""
    answers = {
        node_id: message_from_record(reply.content)
        for node_id, stage, reply in grid.replies
        if stage == "query.abort"
    }
    return {node_id: a for node_id, a in answers.items() if isinstance(a, AbortNotice)}


def planned_epsilon(config: Mapping[str, Any]) -> float:
    """ε of the plan's calibration event composed at the ledgers' δ (what they must hold)."""
    plan = build_plan(RunConfig.from_context(dict(config)))
    return epsilon_bound([plan_calibration(plan).event], delta=BUDGET.delta).epsilon


def expected_heads(plan: ReleasePlan) -> int:
    if plan.public_heads is not None:
        return len(plan.public_heads)
    if plan.selection is SelectionMode.PRIVATE:
        return K_PRIVATE
    return NUM_LAYERS * NUM_HEADS


@pytest.mark.parametrize("order", ["select-first", "release-first"])
@pytest.mark.parametrize(
    ("selection", "public_heads"),
    [("private", ""), ("public", PUBLIC_HEADS), ("all", "")],
)
def test_every_mode_releases_one_verified_artifact_to_every_site(
    world: World, paths: Paths, selection: str, public_heads: str, order: str
) -> None:
    # Arrange
    release_id = f"{selection}-{order}"
    config = run_config(
        world, release_id, 3, selection=selection, order=order, public_heads=public_heads
    )
    # Act
    report = release(world, paths, config)
    # Assert
    signed = assert_released_everywhere(world, paths, report, range(3))
    assert report.acknowledged == ("site-0", "site-1", "site-2")
    assert len(signed.heads) == expected_heads(report.plan)
    if selection == "public":
        assert signed.heads == HeadSet.of([(0, 1), (1, 2)])
    assert signed.manifest.num_chunks == report.outcome.num_chunks == chunks(range(3))


@pytest.mark.parametrize(
    ("stage", "counted"),
    [
        ("query.plan", [0, 1, 2]),
        ("query.sum_shares", [0, 1, 2]),
        # Lost at unmask, its masked vector is already in the sum; neighbours' shares
        # rebuild its self mask, so its chunks count.
        ("query.sum_unmask", [0, 1, 2, 3]),
    ],
)
def test_a_site_lost_in_the_activation_sum_leaves_the_others_to_release(
    world: World, paths: Paths, stage: str, counted: list[int]
) -> None:
    # Arrange: mode "all" runs exactly one secure sum, the activation sum.
    config = run_config(world, f"lost-at-{stage}", 4, selection="all")
    # Act
    report = release(world, paths, config, num_sites=4, drops={node(3): {stage}})
    # Assert: m is what came out of the secure sum, not what the plan announced.
    signed = assert_released_everywhere(world, paths, report, [0, 1, 2])
    assert report.outcome.num_chunks == signed.manifest.num_chunks == chunks(counted)


def test_every_site_lost_at_the_first_sum_aborts_with_too_few_sites(
    world: World, paths: Paths
) -> None:
    # Arrange: the sites reserved at the plan; then no masked input arrives.
    release_id = "all-lost-at-shares"
    config = run_config(world, release_id, 3, selection="all", max_chunks_per_site=0)
    lost = {node(p): {"query.sum_shares"} for p in range(3)}
    # Act
    with pytest.raises(InsufficientSharesError, match="masked input arrived must number"):
        release(world, paths, config, drops=lost)
    # Assert
    assert states(paths.consortium_ledger) == {release_id: ReleaseState.ABORTED}
    for partition in range(3):
        assert states(paths.site_ledger(partition)) == {release_id: ReleaseState.ABORTED}
    assert_no_artifact(paths, release_id, range(3))


def test_a_plan_that_no_site_gets_reserves_nothing(world: World, paths: Paths) -> None:
    # Arrange
    release_id = "plan-lost"
    config = run_config(world, release_id, 3, selection="all")
    lost = {node(p): {"query.plan"} for p in range(3)}
    grid = InProcessGrid(site_relays(3), num_nodes=3, run_config=config, drops=lost)
    # Act
    with pytest.raises(InsufficientSharesError, match="accepting sites must number"):
        release(world, paths, config, grid=grid)
    # Assert: refunded at the coordinator; no site saw the plan, so none reserved; every
    # site it was sent to is told (a lost reply may hide a reservation).
    assert states(paths.consortium_ledger) == {release_id: ReleaseState.ABORTED}
    told = sorted(node_id for node_id, stage, _ in grid.replies if stage == "query.abort")
    assert told == [node(p) for p in range(3)]
    for partition in range(3):
        assert states(paths.site_ledger(partition)) == {}
    assert_no_artifact(paths, release_id, range(3))


def test_too_few_sites_in_the_first_sum_refunds_only_where_nothing_left(
    world: World, paths: Paths
) -> None:
    # Arrange: private select-first; the vote sum (before any noise) loses 2 of 3 sites.
    # Site 0 sent its masked votes before the sum failed: by its own record something left
    # it, so it counts the release whatever the coordinator's notice says (fail closed).
    release_id = "lost-before-noise"
    config = run_config(world, release_id, 3, selection="private", order="select-first")
    lost = {node(1): {"query.sum_shares"}, node(2): {"query.sum_shares"}}
    grid = InProcessGrid(site_relays(3), num_nodes=3, run_config=config, drops=lost)
    # Act
    with pytest.raises(InsufficientSharesError):
        release(world, paths, config, grid=grid)
    # Assert
    assert states(paths.consortium_ledger) == {release_id: ReleaseState.ABORTED}
    assert spent_epsilon(paths.consortium_ledger) is None
    notices = abort_notices(grid)
    assert sorted(notices) == [node(p) for p in range(3)]
    assert not any(notice.noisy_output for notice in notices.values())
    assert states(paths.site_ledger(0)) == {release_id: ReleaseState.COMMITTED}
    for partition in (1, 2):
        assert states(paths.site_ledger(partition)) == {release_id: ReleaseState.ABORTED}
        assert spent_epsilon(paths.site_ledger(partition)) is None
    assert_no_artifact(paths, release_id, range(3))


class ExtractSumLossGrid(InProcessGrid):
    """Silences ``lost`` nodes at the collect stage of the activation (extract) sum only."""

    def __init__(self, *args: Any, lost: set[int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lost = lost

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        kept = [msg for msg in messages if not self._lost_in_extract(msg)]
        return super().send_and_receive(kept, timeout=timeout)

    def _lost_in_extract(self, msg: Message) -> bool:
        if msg.metadata.dst_node_id not in self.lost:
            return False
        if msg.metadata.message_type not in ("query.sum_shares", "query.sum_collect"):
            return False
        request = message_from_record(msg.content)
        assert isinstance(request, SumSharesRequest | SumCollectRequest)
        return request.instructions.request.stage == "extract"


def test_too_few_sites_after_the_gumbel_picks_aborts_but_counts_everywhere(
    world: World, paths: Paths
) -> None:
    # Arrange: the vote sum and the Gumbel picks succeed, then the activation sum loses
    # 2 of 3 sites: noisy output (the picks) exists, so nothing may be refunded.
    release_id = "lost-after-noise"
    config = run_config(world, release_id, 3, selection="private", order="select-first")
    grid = ExtractSumLossGrid(
        site_relays(3), num_nodes=3, run_config=config, lost={node(1), node(2)}
    )
    # Act
    with pytest.raises(InsufficientSharesError):
        release(world, paths, config, grid=grid)
    # Assert
    expected = planned_epsilon(config)
    assert states(paths.consortium_ledger) == {release_id: ReleaseState.COMMITTED}
    assert spent_epsilon(paths.consortium_ledger) == pytest.approx(expected)
    notices = abort_notices(grid)
    assert sorted(notices) == [node(p) for p in range(3)]
    assert all(notice.noisy_output for notice in notices.values())
    for partition in range(3):
        assert states(paths.site_ledger(partition)) == {release_id: ReleaseState.COMMITTED}
        assert spent_epsilon(paths.site_ledger(partition)) == pytest.approx(expected)
    assert_no_artifact(paths, release_id, range(3))


@pytest.mark.parametrize("refusal", ["wrong-model", "budget-too-small"])
def test_a_site_that_refuses_the_plan_is_left_out_of_the_release(
    world: World, paths: Paths, refusal: str
) -> None:
    # Arrange: site 2 overrides its env settings through its node config.
    cases: dict[str, tuple[dict[str, Any], PrivacyBudget]] = {
        "wrong-model": ({"model-path": str(world.other_model)}, BUDGET),
        "budget-too-small": ({"budget-epsilon": 0.5}, PrivacyBudget(0.5, BUDGET.delta)),
    }
    override, budget = cases[refusal]
    config = run_config(world, "one-refuses", 3, selection="all")
    # Act
    report = release(world, paths, config, node_configs=[{}, {}, override])
    # Assert
    signed = assert_released_everywhere(world, paths, report, [0, 1])
    assert report.acknowledged == ("site-0", "site-1")
    assert signed.manifest.num_chunks == chunks([0, 1])
    assert entries(paths.site_ledger(2), budget) == []
    assert not paths.site_artifacts(2).exists()


def test_fewer_accepting_sites_than_min_sites_aborts_and_spends_nothing(
    world: World, paths: Paths
) -> None:
    # Arrange: sites 1 and 2 run another model, so only site 0 accepts; min-sites is 2.
    release_id = "too-few-accept"
    config = run_config(world, release_id, 3, selection="private")
    other = {"model-path": str(world.other_model)}
    grid = InProcessGrid(site_relays(3, [{}, other, other]), num_nodes=3, run_config=config)
    # Act
    with pytest.raises(InsufficientSharesError, match="accepting sites must number at least"):
        release(world, paths, config, grid=grid)
    # Assert
    assert states(paths.consortium_ledger) == {release_id: ReleaseState.ABORTED}
    assert spent_epsilon(paths.consortium_ledger) is None
    assert sorted(abort_notices(grid)) == [node(0)]
    assert states(paths.site_ledger(0)) == {release_id: ReleaseState.ABORTED}
    assert spent_epsilon(paths.site_ledger(0)) is None
    assert entries(paths.site_ledger(1)) == entries(paths.site_ledger(2)) == []
    assert_no_artifact(paths, release_id, range(3))


@pytest.fixture
def server_env(world: World, paths: Paths, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The coordinator's secrets as the ServerApp reads them; its logger restored after."""
    monkeypatch.setenv("DPMTV_SERVER_SIGNING_KEY", str(world.signing_key))
    monkeypatch.setenv("DPMTV_SERVER_LEDGER_PATH", str(paths.consortium_ledger))
    monkeypatch.setenv("DPMTV_SERVER_ARTIFACTS_DIR", str(paths.coordinator_artifacts))
    monkeypatch.setenv("DPMTV_SERVER_BUDGET_EPSILON", str(BUDGET.epsilon))
    monkeypatch.setenv("DPMTV_SERVER_BUDGET_DELTA", str(BUDGET.delta))
    logger = logging.getLogger("server")  # the ServerApp hands it Flower's handlers
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)


@pytest.mark.usefixtures("server_env")
def test_the_server_app_refuses_a_seeded_noise_source_before_anything_happens(
    world: World, paths: Paths, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Arrange: the ServerApp's noise factory now hands out a seeded (test-only) source.
    monkeypatch.setattr(server.app, "secure_noise", lambda: SeededNoise(0))
    config = run_config(world, "seeded-in-production", 3, selection="all")
    grid = InProcessGrid(site_relays(3), num_nodes=3, run_config=config)
    # Act
    with pytest.raises(InsecureRandomnessError, match="cryptographic noise source"):
        server.app.app(grid, make_server_context(config))
    # Assert: no site was contacted and no ledger was opened.
    assert grid.replies == []
    assert not paths.consortium_ledger.exists()


@pytest.mark.usefixtures("server_env")
def test_the_server_app_releases_with_the_secure_noise_source_only(
    world: World, paths: Paths, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Arrange: watch which noise source the real ServerApp hands to the coordinator.
    sources: list[NoiseSource] = []

    def spy(*args: Any) -> ReleaseReport:
        sources.append(args[-1])
        return run_coordinated_release(*args)

    monkeypatch.setattr(server.app, "run_coordinated_release", spy)
    config = run_config(world, "production", 3, selection="all")
    grid = InProcessGrid(site_relays(3), num_nodes=3, run_config=config)
    # Act
    server.app.app(grid, make_server_context(config))
    # Assert
    (source,) = sources
    assert isinstance(source, SecureNoise)
    assert source.is_cryptographic is True
    for partition in range(3):
        assert site_artifact(world, paths, partition, "production").manifest.num_chunks == (
            chunks(range(3))
        )
    assert states(paths.consortium_ledger) == {"production": ReleaseState.COMMITTED}


def spy_on_sites(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[list[np.ndarray], list[tuple[Any, np.ndarray]]]:
    """The sites' clean extract sums, and each (heads, noisy vector) a site is sent."""
    from client.release.site import Site

    clean: list[np.ndarray] = []
    sent: list[tuple[Any, np.ndarray]] = []
    real_compute, real_store = Site._compute, Site.store_reference

    def compute(self: Site, record: Any, request: Any, seed: int) -> list[np.ndarray]:
        arrays = real_compute(self, record, request, seed)
        if request.stage == "extract":
            clean.append(np.array(arrays[0]))
        return arrays

    def store(self: Site, release_id: str, heads: Any, values: Any, *, run_id: int) -> None:
        sent.append((heads, np.array(values)))
        real_store(self, release_id, heads, values, run_id=run_id)

    monkeypatch.setattr(Site, "_compute", compute)
    monkeypatch.setattr(Site, "store_reference", store)
    return clean, sent


def test_release_first_broadcasts_the_noisy_vector_never_the_clean_mean(
    world: World, paths: Paths, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Arrange: record the sites' clean extract sums and the vector they are sent to score.
    clean, sent = spy_on_sites(monkeypatch)
    config = run_config(world, "noisy-reference", 3, selection="private", order="release-first")
    # Act
    report = release(world, paths, config)
    # Assert: what each site was sent is the clean mean plus noise of the stated σ/m: over
    # L*H*D = 128 coordinates the std of the standardised residual lies in [0.7, 1.3] with
    # probability > 1 - 1e-6 (its sd is ~0.063); a clean broadcast gives 0.
    mean = np.sum(clean, axis=0) / report.outcome.num_chunks
    for _, values in sent:
        residual = (values.ravel() - mean) / (report.outcome.noise_std / report.outcome.num_chunks)
        assert 0.7 < float(np.std(residual)) < 1.3


def test_release_first_among_candidates_noises_and_sends_only_the_candidates(
    world: World, paths: Paths, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Arrange: a private release-first plan among four public candidates in both layers of
    # the tiny model (2 x 4 heads); record the sites' clean sums and the vector they are sent
    clean, sent = spy_on_sites(monkeypatch)
    candidates = HeadSet.of([(0, 1), (0, 3), (1, 0), (1, 2)])
    config = run_config(world, "among-candidates", 3, selection="private",
                        order="release-first", candidate_heads="0:1,0:3,1:0,1:2")  # fmt: skip

    # Act
    report = release(world, paths, config)

    # Assert: each site summed the candidates only (4 heads x D) and was sent their noisy
    # rows, zeros elsewhere; the residual over the 4 x 16 candidate coordinates, standardised
    # by the stated σ/m (σ over the candidates' 2 layers), has std in [0.6, 1.4] with
    # probability > 1 - 1e-6 (its sd is ~0.09); the picks are candidates
    outcome = report.outcome
    assert outcome.gaussian_heads == candidates
    assert set(outcome.heads.heads) <= set(candidates.heads)
    assert {a.size for a in clean} == {len(candidates) * HEAD_DIM}
    mean = (np.sum(clean, axis=0) / outcome.num_chunks).reshape(len(candidates), HEAD_DIM)
    rows = [layer * NUM_HEADS + head for layer, head in candidates.heads]
    for heads, values in sent:
        assert heads == candidates
        dense = values.reshape(-1, HEAD_DIM)
        assert not np.delete(dense, rows, axis=0).any()
        residual = (dense[rows] - mean) / (outcome.noise_std / outcome.num_chunks)
        assert 0.6 < float(np.std(residual)) < 1.4


@pytest.mark.parametrize(
    ("selection", "order", "expected"),
    [
        # plan, sum_shares, sum_survivors, sum_unmask, release
        ("all", "select-first", 5),
        # ... and a second sum: sum_collect, sum_survivors, sum_unmask
        ("private", "release-first", 8),
        ("private", "select-first", 8),
    ],
)
def test_a_release_costs_each_site_the_messages_of_one_key_agreement(
    world: World, paths: Paths, selection: str, order: str, expected: int
) -> None:
    # Arrange: every sum of a release reuses the one key each site signed at the plan.
    config = run_config(world, f"messages-{selection}-{order}", 3, selection=selection, order=order)
    grid = InProcessGrid(site_relays(3), num_nodes=3, run_config=config)
    # Act
    release(world, paths, config, grid=grid)
    # Assert
    for partition in range(3):
        received = [stage for node_id, stage, _ in grid.replies if node_id == node(partition)]
        assert len(received) == expected, received
