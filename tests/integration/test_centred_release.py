"""A centred release end to end: the centre rides beside the plan, sites check and use it.

Real site services behind real relays over ``server.simulation.InProcessGrid`` (the world and
helpers of ``tests/integration/test_federated_release.py``). The centre is the same large
constant c in every slot, far from the tiny model's activations (~0.1), so every chunk's
centred contribution ``clip(a - c)`` is, to 1e-4, the same vector: -C/sqrt(h*D) in each
coordinate of a layer with h heads in the sum's scope. The released mean is then that plus c
in every coordinate, plus the noise (at eps = 4 its std is ~0.15 a coordinate); a site that
clipped the raw activation instead would give c plus a vector of the activations' own
directions.
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is first imported

import numpy as np
import pytest

from dpmtv_common.centre import ActivationCentre
from dpmtv_common.errors import InsufficientSharesError
from dpmtv_common.privacy.testing import SeededNoise
from protocol import plan_hash
from server.coordinator import Coordinator, build_plan
from server.settings import RunConfig
from server.simulation import InProcessGrid, make_server_context
from tests.integration import test_federated_release as federated
from tests.integration.test_federated_release import (
    NUM_HEADS,
    NUM_LAYERS,
    Paths,
    World,
    assert_released_everywhere,
    coordinator_settings,
    entries,
    release,
    run_config,
    site_relays,
)

pytestmark = pytest.mark.integration
world = federated.world  # the federated tests' fixtures: one model, site data, keys
paths = federated.paths

HEAD_DIM = 16
CENTRE_VALUE = 1000.0


def _centre(value: float = CENTRE_VALUE) -> ActivationCentre:
    return ActivationCentre.from_array(np.full((NUM_LAYERS, NUM_HEADS, HEAD_DIM), value))


@pytest.mark.parametrize("noise_mode", ["central", "distributed"])
def test_a_centred_release_reaches_every_site_with_the_centre_added_back(
    world: World, paths: Paths, tmp_path, monkeypatch: pytest.MonkeyPatch, noise_mode: str
) -> None:
    # Arrange
    monkeypatch.setenv("DPMTV_CLIENT_NOISE_MODE", noise_mode)  # each site's own mode agrees
    centre_file = tmp_path / "centre.safetensors"
    _centre().save(centre_file)
    config = run_config(
        world,
        f"centred-{noise_mode}",
        3,
        selection="public",
        public_heads="0:1,1:2",
        noise_mode=noise_mode,
        max_chunks_per_site=10,
        centre_path=str(centre_file),
        epsilon=4.0,
    )

    # Act
    report = release(world, paths, config)

    # Assert: every site stored it; the values are the centre plus the centred clipped mean
    signed = assert_released_everywhere(world, paths, report, range(3))
    assert report.plan.centre_sha256 == _centre().digest()
    assert signed.manifest.plan["centre_sha256"] == _centre().digest()
    shift = signed.values - CENTRE_VALUE
    # The Gaussian's scope (all heads in the default release-first order): H heads a layer.
    heads_a_layer = len(report.outcome.gaussian_heads) // NUM_LAYERS
    expected = -report.plan.clip_norm / np.sqrt(heads_a_layer * HEAD_DIM)
    noise_of_mean = report.outcome.noise_std / report.outcome.num_chunks / np.sqrt(shift.size)
    assert abs(float(shift.mean()) - expected) < 6 * noise_of_mean + 1e-3


def test_a_site_refuses_a_centre_that_is_not_the_one_its_plan_pins(
    world: World, paths: Paths
) -> None:
    # Arrange: the plan pins one centre, the coordinator sends another beside it
    config = run_config(world, "centre-swap", 3, selection="public", public_heads="0:1,1:2")
    run = RunConfig.from_context(dict(config))
    plan = build_plan(run, _centre(1.0))
    grid = InProcessGrid(site_relays(3), num_nodes=3, run_config=config)
    coordinator = Coordinator(
        grid,
        make_server_context(config),
        run,
        coordinator_settings(world, paths),
        SeededNoise(0),
        centre=_centre(2.0),
    )

    # Act / Assert: every site refuses before reserving anything
    with pytest.raises(InsufficientSharesError, match=r"plan-mismatch|PlanMismatch"):
        coordinator.plan_stage(plan, coordinator.wait_for_sites())
    for partition in range(3):
        assert entries(paths.site_ledger(partition)) == []
    assert plan_hash(plan) != plan_hash(build_plan(run, _centre(2.0)))
