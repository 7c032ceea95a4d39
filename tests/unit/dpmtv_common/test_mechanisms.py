import math

import numpy as np
import pytest
from hypothesis import given, settings

from dpmtv_common.errors import ConfigError
from dpmtv_common.privacy.mechanisms import (
    GaussianSumMechanism,
    GumbelTopKMechanism,
    clip_per_layer,
    clip_scores,
)
from dpmtv_common.privacy.testing import SeededNoise
from tests.strategies import clip_norms, layered_activations


def _layer_norms(values, layers):
    return {int(layer): float(np.linalg.norm(values[layers == layer])) for layer in set(layers)}


@settings(max_examples=200, deadline=None)
@given(data=layered_activations(), clip_norm=clip_norms)
def test_clipped_layers_never_exceed_the_bound(data, clip_norm):
    values, layers = data
    clipped = clip_per_layer(values, row_layers=layers, clip_norm=clip_norm)
    for norm in _layer_norms(clipped, layers).values():
        assert norm <= clip_norm * (1 + 1e-12)


@settings(max_examples=100, deadline=None)
@given(data=layered_activations())
def test_clip_is_identity_below_the_bound(data):
    values, layers = data
    largest = max(_layer_norms(values, layers).values())
    clipped = clip_per_layer(values, row_layers=layers, clip_norm=largest + 1.0)
    np.testing.assert_array_equal(clipped, values)


def test_clip_scales_each_layer_separately():
    # Arrange: layer 0 holds norm 5, layer 1 holds norm 0.5.
    values = np.array([[3.0, 4.0], [0.3, 0.4]])
    # Act
    clipped = clip_per_layer(values, row_layers=[0, 1], clip_norm=1.0)
    # Assert
    np.testing.assert_allclose(clipped, [[0.6, 0.8], [0.3, 0.4]])


def test_zero_vector_is_safe_to_clip():
    clipped = clip_per_layer(np.zeros((3, 4)), row_layers=[0, 0, 1], clip_norm=1.0)
    assert np.all(clipped == 0.0)
    assert np.all(np.isfinite(clipped))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_activations_are_refused(bad):
    values = np.ones((2, 2))
    values[0, 1] = bad
    with pytest.raises(ConfigError, match="finite"):
        clip_per_layer(values, row_layers=[0, 1], clip_norm=1.0)


def test_clip_does_not_mutate_its_input():
    values = np.full((2, 2), 10.0)
    clip_per_layer(values, row_layers=[0, 0], clip_norm=1.0)
    assert np.all(values == 10.0)


@pytest.mark.parametrize("clip_norm", [0.0, -1.0, math.inf, math.nan])
def test_invalid_clip_norm_is_refused(clip_norm):
    with pytest.raises(ConfigError, match="clip_norm"):
        clip_per_layer(np.ones((1, 1)), row_layers=[0], clip_norm=clip_norm)


def test_layer_shape_mismatch_is_refused():
    with pytest.raises(ConfigError, match="row_layers"):
        clip_per_layer(np.ones((3, 2)), row_layers=[0, 1], clip_norm=1.0)


def test_scores_are_clamped_to_unit_interval():
    np.testing.assert_array_equal(clip_scores([-0.5, 0.25, 3.0]), [0.0, 0.25, 1.0])


def test_gaussian_sensitivity_is_two_c_root_layers_under_replace_one():
    mechanism = GaussianSumMechanism(clip_norm=0.5, num_layers_in_scope=9, noise_multiplier=2.0)
    assert mechanism.l2_sensitivity == pytest.approx(2 * 0.5 * 3)
    assert mechanism.noise_std == pytest.approx(2.0 * 3.0)


def test_noisy_mean_divides_by_the_public_chunk_count():
    mechanism = GaussianSumMechanism(clip_norm=1.0, num_layers_in_scope=1, noise_multiplier=1e-9)
    mean = mechanism.noisy_mean(np.full(4, 10.0), num_chunks=5, noise=SeededNoise(0))
    np.testing.assert_allclose(mean, 2.0, atol=1e-6)


def test_noisy_mean_refuses_zero_chunks():
    mechanism = GaussianSumMechanism(clip_norm=1.0, num_layers_in_scope=1, noise_multiplier=1.0)
    with pytest.raises(ConfigError, match="num_chunks"):
        mechanism.noisy_mean(np.zeros(2), num_chunks=0, noise=SeededNoise(0))


def test_gumbel_scale_is_two_over_epsilon_for_non_monotone_scores():
    mechanism = GumbelTopKMechanism(picks=8, epsilon_per_pick=0.05)
    assert mechanism.gumbel_scale == pytest.approx(40.0)
    assert mechanism.zcdp_rho == pytest.approx(8 * 0.05**2 / 8)


def test_gumbel_selection_returns_k_distinct_heads():
    mechanism = GumbelTopKMechanism(picks=3, epsilon_per_pick=1.0)
    picked = mechanism.select(np.arange(10.0), noise=SeededNoise(1))
    assert len(picked) == 3
    assert len(set(picked)) == 3


def test_gumbel_with_overwhelming_scores_picks_the_top():
    mechanism = GumbelTopKMechanism(picks=2, epsilon_per_pick=10.0)
    scores = np.array([0.0, 1e6, 0.0, 2e6])
    assert mechanism.select(scores, noise=SeededNoise(2)) == (3, 1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"picks": 0, "epsilon_per_pick": 1.0},
        {"picks": 1, "epsilon_per_pick": 0.0},
        {"picks": 1, "epsilon_per_pick": 1.0, "score_sensitivity": -1.0},
    ],
)
def test_invalid_gumbel_parameters_are_refused(kwargs):
    with pytest.raises(ConfigError):
        GumbelTopKMechanism(**kwargs)
