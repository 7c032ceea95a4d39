"""A centred release keeps the mechanism: contributions within C per layer, the same noise once.

Centring subtracts a public vector r from each chunk's activations before the per-layer clip
and adds r back to the noisy mean (``dpmtv_common.centre``). Two things must hold for the
privacy claim to stand unchanged:

1. every chunk's contribution ``clip(a - r)`` has norm at most C in every in-scope layer, for
   activations far from the centre and near it alike (checked on every chunk of every trial,
   up to float rounding, 1e-9 relative);
2. the released mean minus (the exact clipped centred mean plus r) is the Gaussian of the
   plan and nothing else: N(0, (σ/m)²) per coordinate with σ = z·2C·√L_scope, the σ of the
   same plan without a centre. S = Σ r²/(σ/m)² over N coordinates is χ²_N; the check accepts
   iff S lies between the χ²_N quantiles at FALSE_FAILURE_RATE/2 and 1 − that, and the mean
   residual within Z_BOUND standard errors (two-sided FALSE_FAILURE_RATE). With N = 4,096 the
   χ² band is about ±10 % of σ²: a centre added twice or never moves each coordinate by
   several σ/m (the centre here is ~3 a coordinate, σ/m ~0.6), a second draw doubles σ².
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from scipy import stats

from dpmtv_common.aliases import Float64Array
from dpmtv_common.centre import ActivationCentre
from dpmtv_common.heads import HeadLayout, HeadSet
from dpmtv_common.privacy.mechanisms import clip_per_layer
from dpmtv_common.privacy.noise import secure_noise
from protocol import ActivationSum, ReleaseOrder, SelectionMode, VoteSum, run_release
from tests.plans import make_plan

pytestmark = pytest.mark.statistical

FALSE_FAILURE_RATE = 1e-6
Z_BOUND = float(stats.norm.isf(FALSE_FAILURE_RATE / 2))  # 4.89
LAYERS, HEADS, DIM = 4, 8, 128  # 4,096 coordinates a release
CHUNKS = 50
CLIP = 2.0


@dataclass
class CentredChunks:
    """Per-chunk activations of every head; sums clip ``a - r`` per layer, as sites do."""

    activations: Float64Array  # (m, L, H, D)
    centre: ActivationCentre

    def contributions(self, heads: HeadSet) -> Float64Array:
        index = heads.to_array()
        rows = self.activations[:, index[:, 0], index[:, 1]] - self.centre.rows(heads)
        return np.stack(
            [clip_per_layer(r, row_layers=heads.row_layers(), clip_norm=CLIP) for r in rows]
        )

    def activation_sum(self, heads: HeadSet) -> ActivationSum:
        return ActivationSum(heads, self.contributions(heads).sum(0), len(self.activations))

    def vote_sum(self, reference: Float64Array | None) -> VoteSum:
        raise AssertionError("selection 'all' asks for no votes")


def _chunks(seed: int) -> CentredChunks:
    rng = np.random.default_rng(seed)
    shared = rng.normal(size=(LAYERS, HEADS, DIM)) * 3.0  # what every task of the domain shares
    shift = rng.normal(size=(LAYERS, HEADS, DIM)) * 0.05  # this task's part
    # Half the chunks near the centre (clipping idle), half far from it (clipping binds).
    scale = np.where(np.arange(CHUNKS) < CHUNKS // 2, 0.01, 1.0)[:, None, None, None]
    noise = rng.normal(size=(CHUNKS, LAYERS, HEADS, DIM)) * scale
    return CentredChunks(shared + shift + noise, ActivationCentre.from_array(shared))


def test_every_centred_contribution_has_norm_at_most_c_in_every_layer():
    # Arrange
    chunks = _chunks(seed=1)
    heads = HeadLayout(LAYERS, HEADS).all_heads()

    # Act
    contributions = chunks.contributions(heads)

    # Assert
    for layer in heads.layers:
        mask = heads.row_layers() == layer
        norms = np.linalg.norm(contributions[:, mask].reshape(CHUNKS, -1), axis=1)
        assert norms.max() <= CLIP * (1 + 1e-9)
        assert norms.max() > 0.99 * CLIP  # the far chunks bind, so the bound was exercised


def test_the_released_mean_is_the_clipped_centred_mean_plus_r_plus_the_plan_s_gaussian():
    # Arrange
    chunks = _chunks(seed=2)
    layout = HeadLayout(LAYERS, HEADS)
    heads = layout.all_heads()
    centred = make_plan(
        selection=SelectionMode.ALL,
        order=ReleaseOrder.SELECT_FIRST,
        clip_norm=CLIP,
        centre_sha256=chunks.centre.digest(),
    )
    plain = centred.model_copy(update={"centre_sha256": None})
    exact = chunks.contributions(heads).mean(0) + chunks.centre.rows(heads)

    # Act
    outcome = run_release(
        centred,
        sums=chunks,
        layout=layout,
        noise=secure_noise(),
        on_first_noise=lambda: None,
        centre=chunks.centre,
    )

    # Assert: the plain plan's sigma, drawn once, around the recentred exact mean
    plain_std = run_release(
        plain,
        sums=CentredChunks(chunks.activations, chunks.centre),
        layout=layout,
        noise=secure_noise(),
        on_first_noise=lambda: None,
    ).noise_std
    assert outcome.noise_std == plain_std
    residuals = (outcome.values - exact).ravel() / (outcome.noise_std / CHUNKS)
    n = residuals.size
    low = float(stats.chi2.ppf(FALSE_FAILURE_RATE / 2, n))
    high = float(stats.chi2.isf(FALSE_FAILURE_RATE / 2, n))
    assert low <= float(np.sum(residuals**2)) <= high
    assert abs(float(residuals.mean())) < Z_BOUND / np.sqrt(n)
