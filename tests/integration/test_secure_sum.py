"""Secure sum end to end: real SecAgg+ workflow and mod over the in-process LoopbackGrid."""

from __future__ import annotations

import dataclasses
from typing import cast

import numpy as np
import pytest
from flwr.app import Context, Message
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen as flower_prg
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.secure_aggregation import secaggplus_workflow as flwr_workflow

import server.secagg
from client.secagg import install_secure_mask_prg as install_on_sites
from client.secagg import secaggplus_clipping_range, secure_sum_reply
from dpmtv_common.crypto import mask_prg
from dpmtv_common.errors import ConfigError, InsufficientSharesError
from server.secagg import SecureSumSettings, secure_sum
from server.secagg import install_secure_mask_prg as install_on_coordinator
from tests.flower_harness import FIRST_NODE_ID, LoopbackGrid, flower_process_state
from tests.flower_harness import make_server_context as server_context

pytestmark = pytest.mark.integration

DIM = 1000
MATRIX_SHAPE = (3, 4)
NO_NODE = -1


def site_arrays(node_id: int, salt: int, dim: int, bound: float) -> list[np.ndarray]:
    """Per-node deterministic input within ±bound, including both extremes (never clipped)."""
    rng = np.random.default_rng([node_id, salt])
    flat = rng.uniform(-bound, bound, size=dim)
    flat[:2] = [bound, -bound]
    return [flat, rng.uniform(-bound, bound, size=MATRIX_SHAPE)]


app = ClientApp()


@app.train(mods=[secaggplus_mod])
def train(msg: Message, context: Context) -> Message:
    config = msg.content.config_records["fitins.config"]
    bound = secaggplus_clipping_range(context)
    salt, dim = cast(int, config["salt"]), cast(int, config["dim"])
    arrays = site_arrays(context.node_id, salt, dim, bound)
    if context.node_id == config["overshoot-node"]:
        arrays[0][5] = 1.5 * bound  # a silent clip here would bias the sum
    return secure_sum_reply(msg, arrays, clipping_range=bound)


def settings_for(max_sites: int, **overrides) -> SecureSumSettings:
    return SecureSumSettings.for_plan(
        max_abs_coordinate=1.0, max_sites=max_sites, timeout=30.0, **overrides
    )


def run_sum(grid, settings, *, salt=0, round_id=1, min_sites=2, overshoot=NO_NODE, dim=DIM):
    config = {"salt": salt, "dim": dim, "overshoot-node": overshoot}
    return secure_sum(
        grid,
        server_context(),
        grid.get_node_ids(),
        config,
        round_id=round_id,
        settings=settings,
        min_sites=min_sites,
    )


def assert_exact(result, settings, *, salt=0, dim=DIM):
    bound = settings.clipping_range
    expected = [
        np.sum(parts, axis=0)
        for parts in zip(*(site_arrays(n, salt, dim, bound) for n in result.site_ids), strict=True)
    ]
    # Quantisation bound n * 2c / Q, plus float64 rounding of values up to n * c.
    tolerance = settings.quantization_error_bound(result.num_sites) + 1e-13 * result.num_sites
    for got, want in zip(result.arrays, expected, strict=True):
        assert got.dtype == np.float64
        assert got.shape == want.shape
        assert np.max(np.abs(got - want)) <= tolerance


@pytest.fixture(autouse=True)
def chacha20_masks_on_both_sides():
    with flower_process_state():
        install_on_sites()
        install_on_coordinator()
        yield


@pytest.mark.parametrize("num_sites", [3, 5])
def test_secure_sum_equals_float64_sum_within_quantisation_bound(num_sites):
    # Arrange
    grid = LoopbackGrid(app, num_nodes=num_sites)
    settings = settings_for(num_sites)
    # Act
    result = run_sum(grid, settings)
    # Assert
    assert result is not None
    assert result.num_sites == num_sites
    assert result.site_ids == tuple(grid.node_ids)
    assert result.failures == ()
    assert_exact(result, settings)


def test_the_servers_context_is_left_untouched():
    # Flower's workflow would store the un-noised aggregate in the context it is given.
    grid = LoopbackGrid(app, num_nodes=3)
    context = server_context()

    secure_sum(
        grid,
        context,
        grid.get_node_ids(),
        {"salt": 0, "dim": 10, "overshoot-node": NO_NODE},
        round_id=1,
        settings=settings_for(3),
        min_sites=2,
    )

    assert len(context.state) == 0


def test_two_secure_sums_in_one_run_are_both_exact():
    grid = LoopbackGrid(app, num_nodes=3)
    settings = settings_for(3)

    first = run_sum(grid, settings, salt=1, round_id=1)
    second = run_sum(grid, settings, salt=2, round_id=2)

    assert first is not None
    assert second is not None
    assert_exact(first, settings, salt=1)
    assert_exact(second, settings, salt=2)
    assert not np.allclose(first.arrays[0], second.arrays[0])


@pytest.mark.parametrize(
    ("stage", "vector_counted"),
    [("setup", False), ("share_keys", False), ("collect_masked_vectors", False), ("unmask", True)],
)
def test_dropout_at_any_stage_leaves_the_exact_sum_of_the_survivors(stage, vector_counted):
    # Arrange
    dropped = FIRST_NODE_ID + 2
    grid = LoopbackGrid(app, num_nodes=5, drops={dropped: {stage}})
    settings = settings_for(5)
    # Act
    result = run_sum(grid, settings, min_sites=3)
    # Assert
    assert result is not None
    assert (dropped in result.site_ids) is vector_counted
    assert result.num_sites == (5 if vector_counted else 4)
    assert_exact(result, settings)


@pytest.mark.parametrize("stage", ["setup", "share_keys", "collect_masked_vectors"])
def test_dropout_with_small_neighbourhoods_leaves_the_exact_sum(stage):
    # SecAgg+ proper: each site shares keys with 2 ring neighbours only, threshold 2.
    dropped = FIRST_NODE_ID + 1
    grid = LoopbackGrid(app, num_nodes=5, drops={dropped: {stage}})
    settings = settings_for(5, num_shares=3, reconstruction_threshold=2)

    result = run_sum(grid, settings, min_sites=3)

    assert result is not None
    assert result.num_sites == 4
    assert_exact(result, settings)


def test_stock_flower_workflow_loses_the_sum_on_an_early_dropout(monkeypatch):
    # Documents the flwr 1.42 bug RobustSecAggPlusWorkflow fixes (notes/flower.md §2.4).
    monkeypatch.setattr(server.secagg, "RobustSecAggPlusWorkflow", SecAggPlusWorkflow)
    grid = LoopbackGrid(app, num_nodes=3, drops={FIRST_NODE_ID: {"setup"}})

    result = run_sum(grid, settings_for(3))

    assert result is None


def test_fewer_survivors_than_min_sites_aborts_the_release():
    drops = {FIRST_NODE_ID: {"collect_masked_vectors"}, FIRST_NODE_ID + 1: {"setup"}}
    grid = LoopbackGrid(app, num_nodes=5, drops=drops)

    with pytest.raises(InsufficientSharesError, match="min_sites=4, got 3 of 5"):
        run_sum(grid, settings_for(5), min_sites=4)


def test_fewer_offered_sites_than_min_sites_is_refused_before_any_message():
    grid = LoopbackGrid(app, num_nodes=3)

    with pytest.raises(InsufficientSharesError, match="min_sites=4"):
        run_sum(grid, settings_for(5), min_sites=4)
    assert grid.replies == []


def test_more_sites_than_the_settings_allow_are_refused():
    grid = LoopbackGrid(app, num_nodes=4)

    with pytest.raises(ConfigError, match=r"at most settings\.max_sites=3"):
        run_sum(grid, settings_for(3))


def test_a_coordinate_beyond_the_clipping_range_is_refused_not_clipped():
    # Arrange
    offender = FIRST_NODE_ID + 1
    grid = LoopbackGrid(app, num_nodes=4)
    settings = settings_for(4)
    # Act
    result = run_sum(grid, settings, overshoot=offender)
    # Assert
    assert result is not None
    assert offender not in result.site_ids
    assert result.num_sites == 3
    assert len(result.failures) == 1
    assert "must lie within ±clipping_range=1.0" in str(result.failures[0])
    assert_exact(result, settings)


def test_only_masked_vectors_leave_a_site():
    # Arrange
    grid = LoopbackGrid(app, num_nodes=3)
    settings = settings_for(3)
    # Act
    run_sum(grid, settings)
    # Assert
    collected = [reply for _, stage, reply in grid.replies if stage == "collect_masked_vectors"]
    assert len(collected) == 3
    for reply in collected:
        content = reply.content
        assert all(len(record) == 0 for record in content.array_records.values())
        assert dict(content.config_records["fitres.metrics"]) == {}
        assert dict(content.metric_records["fitres.num_examples"]) == {"num_examples": 1}
        assert list(content.config_records["secaggplus_configs"]) == ["masked_params"]
        assert set(content) == {
            "fitres.parameters",
            "fitres.num_examples",
            "fitres.metrics",
            "fitres.status",
            "secaggplus_configs",
        }


def test_the_chacha20_prg_expands_every_mask_on_both_sides(monkeypatch):
    # Arrange
    seeds = []
    real_expand = mask_prg.expand_mask

    def spy(seed, num_range, shapes):
        seeds.append(seed)
        return real_expand(seed, num_range, shapes)

    monkeypatch.setattr(mask_prg, "expand_mask", spy)
    grid = LoopbackGrid(app, num_nodes=3)
    settings = settings_for(3)
    # Act
    result = run_sum(grid, settings)
    # Assert: sites 3 x (1 private + 2 pairwise), coordinator 3 private masks.
    assert len(seeds) == 3 * 3 + 3
    assert result is not None
    assert_exact(result, settings)


def test_sites_refuse_a_coordinator_running_another_mask_prg(monkeypatch):
    # The sites run ChaCha20; the coordinator has Flower's MT19937 (allowed for this test).
    monkeypatch.setitem(vars(flwr_workflow), "pseudo_rand_gen", flower_prg)
    grid = LoopbackGrid(app, num_nodes=3)

    result = run_sum(grid, dataclasses.replace(settings_for(3), allow_weak_mask_prg=True))

    assert result is None
    errors = [r.error.reason for _, _, r in grid.replies if r.has_error()]
    assert len(errors) == 3
    assert all("mask PRG must match" in str(reason) for reason in errors)


def test_coordinator_refuses_flowers_weak_prg_unless_allowed(monkeypatch):
    monkeypatch.setitem(vars(flwr_workflow), "pseudo_rand_gen", flower_prg)
    grid = LoopbackGrid(app, num_nodes=3)

    with pytest.raises(ConfigError, match="install_secure_mask_prg"):
        run_sum(grid, settings_for(3))
    assert grid.replies == []
