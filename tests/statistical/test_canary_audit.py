"""End-to-end GDP canary audit of clip -> sum -> one Gaussian draw (notes/dp.md §4.3 test 6).

A canary chunk with norm 1000*C is replaced by its negation (a replace-one pair). With one
layer in scope, Delta_2 = 2C and the Gaussian mechanism is mu-GDP with mu = Delta_2/sigma
= 1/z. The audit estimates mu from N runs per side projected on the canary direction; its
standard error is sqrt(2/N), and the checks use z = 4.89 (false-failure rate 1e-6).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dpmtv_common.privacy.mechanisms import GaussianSumMechanism, sum_clipped_contributions
from dpmtv_common.privacy.noise import secure_noise

pytestmark = pytest.mark.statistical

Z_BOUND = float(stats.norm.isf(1e-6 / 2))
RUNS = 20_000
CLIP = 1.0
ROW_LAYERS = np.array([0, 0])  # one layer, two heads of two dimensions


def _dataset(canary_sign: float) -> np.ndarray:
    chunks = np.zeros((5, 2, 2))
    chunks[0, 0, 0] = canary_sign * 1000.0 * CLIP
    return chunks


def _clipped_sum(chunks):
    return sum_clipped_contributions(chunks, row_layers=ROW_LAYERS, clip_norm=CLIP)


def _unclipped_sum(chunks):  # the planted bug: clipping skipped
    return chunks.sum(axis=0)


def _estimated_mu(pipeline, mechanism) -> float:
    noise = secure_noise()
    projections = []
    for sign in (+1.0, -1.0):
        summed = pipeline(_dataset(sign))
        runs = np.broadcast_to(summed, (RUNS, *summed.shape))
        noisy = mechanism.privatize_sum(runs, noise=noise)
        projections.append(noisy[:, 0, 0] / mechanism.noise_std)
    return float(projections[0].mean() - projections[1].mean())


def test_clipped_pipeline_meets_its_claimed_mu():
    mechanism = GaussianSumMechanism(clip_norm=CLIP, num_layers_in_scope=1, noise_multiplier=4.0)
    claimed_mu = mechanism.l2_sensitivity / mechanism.noise_std
    mu_hat = _estimated_mu(_clipped_sum, mechanism)
    assert abs(mu_hat - claimed_mu) < Z_BOUND * math.sqrt(2 / RUNS)


def test_skipped_clipping_is_caught_by_the_audit():
    mechanism = GaussianSumMechanism(clip_norm=CLIP, num_layers_in_scope=1, noise_multiplier=4.0)
    claimed_mu = mechanism.l2_sensitivity / mechanism.noise_std
    mu_hat = _estimated_mu(_unclipped_sum, mechanism)
    assert mu_hat > claimed_mu + Z_BOUND * math.sqrt(2 / RUNS)
