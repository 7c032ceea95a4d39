"""Distributed noise end to end: each site adds its own share; nobody holds a clean sum.

Real site services behind relays (in process), the real secure sum (ChaCha20 masks, a roster
the in-process sites share), the real coordinator; tiny random LLaVA (L = 2, H = 4, D = 16),
three sites of 15 records, K = 2 (m_i = 5 chunks each).
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is first imported

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client.data.synthetic import write_task_datasets
from client.models import save_tiny_model
from client.release.site import Site
from client.service.inprocess import open_in_process_sites
from client.settings import SiteSettings
from dpmtv_common.artifact import load_artifact
from dpmtv_common.crypto import SigningKey, TrustedKeys
from dpmtv_common.errors import InsufficientSharesError
from dpmtv_common.fingerprint import fingerprint_model_dir
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.composition import epsilon_bound
from dpmtv_common.privacy.ledger import PrivacyLedger, ReleaseState
from dpmtv_common.privacy.testing import SeededNoise
from protocol import (
    DistributedRelease,
    ErrorCode,
    ErrorReply,
    PlanAccept,
    PlanRequest,
    ReleasePlan,
    SecureSumRequest,
    SumInstructions,
    message_from_record,
    message_to_record,
    plan_release_event,
    ranges_for,
)
from server.coordinator import ReleaseReport, build_plan, run_coordinated_release
from server.messaging import Exchange
from server.secure_sum import SecureSumSession, SumResult
from server.settings import CoordinatorSettings, RunConfig
from server.simulation import InProcessGrid, make_server_context
from tests.flower_harness import flower_process_state

pytestmark = pytest.mark.integration

SHOTS, RECORDS, SITES = 2, 15, 3
NUM_LAYERS, NUM_HEADS, HEAD_DIM = 2, 4, 16
M_I = RECORDS // (SHOTS + 1)


@dataclass(frozen=True)
class World:
    root: Path
    model: Path
    fingerprint: str
    verify_key: Path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    """Three sites of 15 records, a tiny random LLaVA and the coordinator's key pair."""
    root = tmp_path_factory.mktemp("distributed")
    write_task_datasets(
        root / "data", task="colour", sites=SITES, per_site=RECORDS, public=0, test=0, seed=0
    )
    save_tiny_model("llava", root / "model", seed=0)
    key = SigningKey.generate()
    key.save(root / "coordinator.key")
    key.verify_key.save(root / "coordinator.pub")
    return World(
        root, root / "model", fingerprint_model_dir(root / "model"), root / "coordinator.pub"
    )


def site_settings(world: World, tmp: Path, index: int, **overrides: Any) -> SiteSettings:
    fields: dict[str, Any] = {
        "name": f"site-{index}",
        "model_path": world.model,
        "data_path": world.root / "data" / f"site-{index}",
        "state_dir": tmp / f"site-{index}",
        "trusted_keys": (world.verify_key,),
        "device": "cpu",
        "min_sites": 2,
        "noise_mode": "distributed",
    }
    fields.update(overrides)
    return SiteSettings(**fields)


def run_config(world: World, release_id: str, **overrides: Any) -> dict[str, Any]:
    return {
        "model-fingerprint": world.fingerprint,
        "release-id": release_id,
        "epsilon": 1.0,
        "shots": SHOTS,
        "clip-norm": 1.0,
        "num-selected-heads": 2,
        "expected-sites": SITES,
        "min-sites": 2,
        "noise-mode": "distributed",
        "max-chunks-per-site": M_I,
        "node-wait-timeout": 5.0,
        "stage-timeout": 60.0,
        **{name.replace("_", "-"): value for name, value in overrides.items()},
    }


@dataclass
class Run:
    report: ReleaseReport
    settings: list[SiteSettings]
    raw_sums: list[np.ndarray]
    clean_sums: list[list[np.ndarray]]


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[list[Any], list[Any]]]:
    """Record what the coordinator's secure sums return, and each site's un-noised sum."""
    raw: list[Any] = []
    clean: list[Any] = []
    real_sum = SecureSumSession.run_sum
    real_compute = Site._compute

    def run_sum(self: SecureSumSession, *args: Any, **kwargs: Any) -> SumResult:
        result = real_sum(self, *args, **kwargs)
        raw.append(np.array(result.total[:-1]))  # the last coordinate is the count m
        return result

    def compute(self: Site, *args: Any) -> list[np.ndarray]:
        arrays = real_compute(self, *args)
        clean.append(np.array(arrays[0]))
        return arrays

    monkeypatch.setattr(SecureSumSession, "run_sum", run_sum)
    monkeypatch.setattr(Site, "_compute", compute)
    with flower_process_state():
        yield raw, clean


def release(
    world: World, tmp: Path, spies: tuple[list[Any], list[Any]], release_id: str, **config: Any
) -> Run:
    settings = [site_settings(world, tmp, i) for i in range(SITES)]
    sites = open_in_process_sites(settings)
    values = run_config(world, release_id, **config)
    grid = InProcessGrid(sites.relays, num_nodes=SITES, run_config=values)
    coordinator = CoordinatorSettings(
        signing_key=world.root / "coordinator.key",
        ledger_path=tmp / "consortium.sqlite",
        artifacts_dir=tmp / "coordinator-artifacts",
    )
    report = run_coordinated_release(
        grid,
        make_server_context(values),
        RunConfig.from_context(values),
        coordinator,
        SeededNoise(0),  # the coordinator draws no noise in this mode; it must not matter
    )
    raw, clean = spies
    return Run(report, settings, list(raw), [list(clean)])


def ledger_states(settings: SiteSettings) -> dict[str, ReleaseState]:
    with PrivacyLedger.open(settings.ledger_file, settings.budget) as ledger:
        return {entry.release_id: entry.state for entry in ledger.releases()}


@pytest.mark.parametrize(
    ("selection", "order", "candidates"),
    [
        ("all", "select-first", ""),
        ("private", "select-first", ""),
        ("private", "release-first", ""),
        ("private", "release-first", "0:1,0:3,1:2"),  # noised over the candidates only
    ],
)
def test_a_distributed_release_reaches_every_site_with_the_epsilon_it_states(
    world: World, tmp_path: Path, spies: Any, selection: str, order: str, candidates: str
) -> None:
    # Act
    run = release(
        world, tmp_path, spies, f"dist-{selection}-{order}{'-c' if candidates else ''}",
        selection=selection, order=order, candidate_heads=candidates,
    )  # fmt: skip
    # Assert
    report = run.report
    assert report.acknowledged == ("site-0", "site-1", "site-2")
    assert report.outcome.distributed is not None
    assert report.outcome.bound.epsilon <= 1.0 * (1 + 1e-9)
    ledger_epsilon = epsilon_bound([plan_release_event(report.plan)], delta=1e-5).epsilon
    assert ledger_epsilon <= 1.0 * (1 + 1e-9)
    keys = TrustedKeys.from_files([world.verify_key])
    for settings in run.settings:
        stored = load_artifact(
            settings.artifacts_folder / report.plan.release_id,
            trusted_keys=keys,
            expected_model_fingerprint=world.fingerprint,
        )
        parameters = stored.manifest.accountant_parameters
        assert parameters["noise_mode"] == "distributed"
        assert parameters["min_honest"] == 2
        assert stored.manifest.num_chunks == SITES * M_I
        assert ledger_states(settings) == {report.plan.release_id: ReleaseState.COMMITTED}
    if candidates:  # the Gaussian (each site's shares) covered the candidates, picks among them
        named = {tuple(map(int, head.split(":"))) for head in candidates.split(",")}
        assert set(report.outcome.gaussian_heads.heads) == named
        assert set(report.outcome.heads.heads) <= named


def test_the_coordinator_only_ever_holds_noisy_sums(
    world: World, tmp_path: Path, spies: Any
) -> None:
    # Arrange / Act: one activation sum over all heads (selection all).
    run = release(world, tmp_path, spies, "dist-noisy", selection="all")
    # Assert: what the secure sum handed the coordinator is the clean sum (on the grid) plus
    # noise of the stated size: (raw - γ·clean)/(σ_site·√n) has unit std. 128 coordinates
    # estimate a std to ±6 % (one sd); the band [0.7, 1.3] is 5 sd wide each way: false
    # failure < 1e-6.
    (raw,) = run.raw_sums
    clean = np.sum(run.clean_sums[0], axis=0)
    all_heads = HeadSet.all_heads(num_layers=NUM_LAYERS, num_heads=NUM_HEADS)
    grid = DistributedRelease(run.report.plan, NUM_LAYERS * NUM_HEADS, HEAD_DIM).activations(
        all_heads
    )
    residual = (raw - grid.scale * clean) / (grid.share_noise_std * np.sqrt(SITES))
    assert 0.7 < float(np.std(residual)) < 1.3
    assert abs(float(np.mean(residual))) < 5 / np.sqrt(residual.size)


def plan_and_ask(
    grid: InProcessGrid, plan: ReleasePlan, nodes: list[int] | None = None
) -> list[Any]:
    answers = []
    for node in nodes if nodes is not None else grid.node_ids:
        message = grid.create_message(
            message_to_record(PlanRequest(plan=plan)), "query.plan", node, "g"
        )
        (reply,) = grid.send_and_receive([message])
        answers.append(message_from_record(reply.content))
    return answers


def test_a_central_site_refuses_a_distributed_plan_and_a_distributed_site_a_central_one(
    world: World, tmp_path: Path, spies: Any
) -> None:
    # Arrange
    central = site_settings(world, tmp_path, 0, noise_mode="central", state_dir=tmp_path / "c")
    distributed = site_settings(world, tmp_path, 1, state_dir=tmp_path / "d")
    grid = InProcessGrid(open_in_process_sites([central, distributed]).relays, num_nodes=2)
    distributed_plan = build_plan(RunConfig.from_context(run_config(world, "p-d")))
    central_plan = build_plan(
        RunConfig.from_context(run_config(world, "p-c", noise_mode="central"))
    )
    # Act
    (to_central,) = plan_and_ask(grid, distributed_plan, [grid.node_ids[0]])
    (to_distributed,) = plan_and_ask(grid, central_plan, [grid.node_ids[1]])
    # Assert
    for answer in (to_central, to_distributed):
        assert isinstance(answer, ErrorReply)
        assert answer.code is ErrorCode.POLICY


def test_a_site_refuses_shares_sized_for_more_honest_sites_than_it_assumes(
    world: World, tmp_path: Path, spies: Any
) -> None:
    # Arrange: a roster needs two members; both sites assume at most 2 honest shares.
    settings = [site_settings(world, tmp_path, i, min_honest=2) for i in range(2)]
    grid = InProcessGrid(open_in_process_sites(settings).relays, num_nodes=2)
    plan = build_plan(RunConfig.from_context(run_config(world, "t3", min_honest=3, min_sites=3)))
    # Act
    answers = plan_and_ask(grid, plan)
    # Assert
    assert all(isinstance(answer, ErrorReply) for answer in answers)
    assert {answer.error_type for answer in answers} == {"ConfigError"}


def test_a_distributed_sum_on_other_ranges_than_the_plan_s_gets_nothing(
    world: World, tmp_path: Path, spies: Any
) -> None:
    # Arrange: three distributed sites accept; the coordinator then asks for a sum on the
    # central mode's ranges instead of the plan's integer grid.
    settings = [site_settings(world, tmp_path, i) for i in range(SITES)]
    grid = InProcessGrid(open_in_process_sites(settings).relays, num_nodes=SITES)
    plan = build_plan(RunConfig.from_context(run_config(world, "ranges", selection="all")))
    accepts = plan_and_ask(grid, plan)
    assert all(isinstance(a, PlanAccept) and a.keys is not None for a in accepts)
    adverts = {node: a.keys for node, a in zip(grid.node_ids, accepts, strict=True)}
    session = SecureSumSession(Exchange(grid, timeout=60.0), "ranges", adverts, 2)
    request = SecureSumRequest(
        release_id="ranges", stage="extract", heads=None, clip_norm=1.0, score_top_r=None
    )
    central = SumInstructions(sum_index=0, request=request, ranges=ranges_for(64.0, SITES))
    # Act
    with pytest.raises(InsufficientSharesError, match="masked input arrived"):
        session.run_sum(central)
    # Assert: every site refused before anything of its data left it.
    answers = [
        message_from_record(reply.content)
        for _, stage, reply in grid.replies
        if stage == "query.sum_shares"
    ]
    refusals = [answer for answer in answers if isinstance(answer, ErrorReply)]
    assert len(refusals) == len(answers) == SITES
    assert {answer.error_type for answer in refusals} == {"PlanMismatchError"}
    for site in settings:
        assert ledger_states(site) == {"ranges": ReleaseState.RESERVED}
