"""The predicted SNR matches what a real release measures when clipping binds (its premise)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadLayout, HeadSet
from dpmtv_common.privacy.testing import SeededNoise
from protocol import (
    PROTOCOL_VERSION,
    ActivationSum,
    NoiseMode,
    ReleaseOrder,
    ReleasePlan,
    SelectionMode,
    VoteSum,
    predict_signal_to_noise,
    run_release,
)

LAYERS, HEADS, DIM = 4, 6, 16


def _plan(selection: SelectionMode, order: ReleaseOrder, **overrides: Any) -> ReleasePlan:
    fields: dict[str, Any] = {
        "protocol_version": PROTOCOL_VERSION,
        "release_id": "r1",
        "task": "t",
        "model_fingerprint": "sha256:abc",
        "epsilon": 1.0,
        "delta": 1e-5,
        "shots": 4,
        "clip_norm": 2.0,
        "selection": selection,
        "order": order,
        "num_selected_heads": 3,
        "public_heads": ((0, 1), (1, 2), (3, 0)) if selection is SelectionMode.PUBLIC else None,
        "selection_share": 0.3,
        "score_top_r": 3,
        "min_sites": 1,
        "max_chunks_per_site": None,
        "created": "2026-12-01T00:00:00+00:00",
    }
    fields.update(overrides)
    return ReleasePlan(**fields)


@dataclass
class BindingSums:
    """Every chunk's activation: each layer's in-scope heads have norm exactly C, spread evenly."""

    clip_norm: float
    num_chunks: int

    def activation_sum(self, heads: HeadSet) -> ActivationSum:
        per_layer: dict[int, int] = {}
        for layer, _ in heads.heads:
            per_layer[layer] = per_layer.get(layer, 0) + 1
        rows = [
            np.full(DIM, self.clip_norm / math.sqrt(per_layer[layer] * DIM))
            for layer, _ in heads.heads
        ]
        return ActivationSum(heads, np.array(rows) * self.num_chunks, self.num_chunks)

    def vote_sum(self, reference: np.ndarray | None) -> VoteSum:
        return VoteSum(np.arange(LAYERS * HEADS, dtype=float) * self.num_chunks, self.num_chunks)


def _measured(plan: ReleasePlan, num_chunks: int, draws: int = 40) -> float:
    sums = BindingSums(plan.clip_norm, num_chunks)
    ratios = [
        run_release(
            plan,
            sums=sums,
            layout=HeadLayout(LAYERS, HEADS),
            noise=SeededNoise(seed),
            on_first_noise=lambda: None,
        ).signal_to_noise
        for seed in range(draws)
    ]
    return float(np.mean(ratios))


@pytest.mark.parametrize(
    ("selection", "order"),
    [
        (SelectionMode.PUBLIC, ReleaseOrder.SELECT_FIRST),
        (SelectionMode.PUBLIC, ReleaseOrder.RELEASE_FIRST),
        (SelectionMode.ALL, ReleaseOrder.SELECT_FIRST),
        (SelectionMode.PRIVATE, ReleaseOrder.SELECT_FIRST),
    ],
)
def test_prediction_matches_a_release_whose_clipping_binds(selection, order):
    # Arrange: m chosen so the predicted SNR is about 2 (the debiased estimate is accurate there)
    plan = _plan(selection, order)
    unit = predict_signal_to_noise(
        plan, num_chunks=1, num_layers=LAYERS, num_heads=HEADS, head_dim=DIM
    )
    num_chunks = math.ceil(2.0 / unit.signal_to_noise)
    # Act
    predicted = predict_signal_to_noise(
        plan, num_chunks=num_chunks, num_layers=LAYERS, num_heads=HEADS, head_dim=DIM
    )
    measured = _measured(plan, num_chunks)
    # Assert: 40 draws of a ratio near 2 with k*d >= 48 coordinates: within 15 % (a few sd)
    assert measured == pytest.approx(predicted.signal_to_noise, rel=0.15)


def test_select_first_beats_release_first_by_the_coordinate_ratio():
    kwargs = {"num_chunks": 500, "num_layers": LAYERS, "num_heads": HEADS, "head_dim": DIM}
    first = predict_signal_to_noise(
        _plan(SelectionMode.PUBLIC, ReleaseOrder.SELECT_FIRST), **kwargs
    )
    later = predict_signal_to_noise(
        _plan(SelectionMode.PUBLIC, ReleaseOrder.RELEASE_FIRST), **kwargs
    )
    assert first.signal_to_noise / later.signal_to_noise == pytest.approx(
        math.sqrt(LAYERS * HEADS / 3)
    )


def test_snr_grows_with_chunks_and_epsilon_and_chunks_for_inverts_it():
    plan = _plan(SelectionMode.PUBLIC, ReleaseOrder.SELECT_FIRST)
    kwargs = {"num_layers": LAYERS, "num_heads": HEADS, "head_dim": DIM}
    small = predict_signal_to_noise(plan, num_chunks=100, **kwargs)
    assert predict_signal_to_noise(plan, num_chunks=200, **kwargs).signal_to_noise == pytest.approx(
        2 * small.signal_to_noise
    )
    richer = predict_signal_to_noise(
        plan.model_copy(update={"epsilon": 4.0}), num_chunks=100, **kwargs
    )
    assert richer.signal_to_noise > 2 * small.signal_to_noise
    needed = small.chunks_for(5.0)
    assert predict_signal_to_noise(plan, num_chunks=needed, **kwargs).signal_to_noise >= 5.0
    assert predict_signal_to_noise(plan, num_chunks=needed - 1, **kwargs).signal_to_noise < 5.0


def test_distributed_mode_uses_its_own_calibration():
    kwargs = {"num_chunks": 300, "num_layers": LAYERS, "num_heads": HEADS, "head_dim": DIM}
    central = predict_signal_to_noise(_plan(SelectionMode.ALL, ReleaseOrder.SELECT_FIRST), **kwargs)
    plan = _plan(
        SelectionMode.ALL,
        ReleaseOrder.SELECT_FIRST,
        noise_mode=NoiseMode.DISTRIBUTED,
        min_honest=2,
        max_sites=3,
        min_sites=2,
        max_chunks_per_site=1000,
    )
    distributed = predict_signal_to_noise(plan, **kwargs)
    assert distributed.noise_multiplier != central.noise_multiplier
    assert distributed.signal_to_noise > 0


@pytest.mark.parametrize("bad", [{"num_chunks": 0}, {"num_layers": 0}, {"head_dim": 0}])
def test_bad_shapes_are_refused_with_the_value(bad):
    kwargs = {"num_chunks": 10, "num_layers": 2, "num_heads": 2, "head_dim": 4, **bad}
    with pytest.raises(ConfigError, match="got 0"):
        predict_signal_to_noise(_plan(SelectionMode.ALL, ReleaseOrder.SELECT_FIRST), **kwargs)
