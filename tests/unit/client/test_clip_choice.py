"""The clip norm chosen on public data: the clipped mean, and the smallest C keeping the gain."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from client.activations.chunking import Chunk, make_chunks
from client.evaluation.first_token import QuerySet
from client.public.clip import CLIP_FACTORS, PlannedNoise, choose_clip_norm, clipped_mean
from client.public.selection import public_activations, suggested_clip_norm
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet
from protocol import NoiseMode, SelectionMode, plan_calibration, plan_noise_multiplier
from tests.plans import make_plan
from tests.site_data import write_site

ONE_ARCH = pytest.mark.parametrize("tiny", ["llava"], indirect=True)
HEADS = HeadSet.of([(0, 1), (0, 3), (1, 2)])


@pytest.fixture(scope="module")
def chunks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Chunk, ...]:
    site = write_site(tmp_path_factory.mktemp("public-site"), 12)
    return make_chunks(site, shots=2, seed=0).chunks  # 4 chunks


@pytest.fixture
def acts(loaded, chunks) -> torch.Tensor:
    return public_activations(loaded, chunks, progress=False)


def _layer_norms(values: np.ndarray, heads: HeadSet) -> list[float]:
    layers = heads.row_layers()
    return [float(np.linalg.norm(values[layers == layer])) for layer in heads.layers]


def test_a_bound_above_every_norm_leaves_the_plain_mean():
    acts = torch.randn(6, 2, 4, 3, generator=torch.Generator().manual_seed(1))
    index = HEADS.to_array()
    plain = acts[:, index[:, 0], index[:, 1]].double().mean(0).numpy()

    np.testing.assert_allclose(clipped_mean(acts, HEADS, 1e6), plain, rtol=1e-12)


def test_every_chunk_is_clipped_per_layer_before_the_mean():
    acts = 10 * torch.randn(6, 2, 4, 3, generator=torch.Generator().manual_seed(2))
    index = HEADS.to_array()
    rows = acts[:, index[:, 0], index[:, 1]].double().numpy()
    by_hand = []
    for chunk in rows:
        clipped = chunk.copy()
        for layer in HEADS.layers:
            block = HEADS.row_layers() == layer
            norm = np.linalg.norm(chunk[block])
            clipped[block] *= min(1.0, 0.5 / norm)
        by_hand.append(clipped)

    result = clipped_mean(acts, HEADS, 0.5)

    np.testing.assert_allclose(result, np.mean(by_hand, axis=0), rtol=1e-12)
    assert max(_layer_norms(result, HEADS)) <= 0.5 + 1e-12


def _spread_acts() -> torch.Tensor:
    """Tiny-model-shaped activations whose chunk norms differ 200-fold (one outlier chunk)."""
    acts = torch.randn(5, 2, 4, 16, generator=torch.Generator().manual_seed(3))
    return acts * torch.tensor([1.0, 1.0, 1.0, 1.0, 200.0]).view(5, 1, 1, 1)


def _plain_mean(acts: torch.Tensor) -> np.ndarray:
    index = HEADS.to_array()
    return acts[:, index[:, 0], index[:, 1]].double().mean(0).numpy()


def _scripted_accuracy(threshold: float):
    """Accuracy 0.2 unpatched or below ``threshold`` of patched norm, 0.8 at or above it."""

    def accuracy(self, loaded, patch=None):
        if patch is None:
            return 0.2
        return 0.8 if float(np.linalg.norm(np.asarray(patch[1]))) >= threshold else 0.2

    return accuracy


@ONE_ARCH
def test_the_suggestion_is_the_smallest_tried_bound_that_keeps_the_gain(
    loaded, chunks, monkeypatch
):
    # Arrange: the model "works" only once the patched vector is long enough, as a pretrained
    # decoder whose task lives in large heads does; the plain mean is long enough.
    acts = _spread_acts()
    median = suggested_clip_norm(acts, HEADS)
    lengths = {
        f: float(np.linalg.norm(clipped_mean(acts, HEADS, f * median))) for f in CLIP_FACTORS
    }
    assert lengths[2.0] < lengths[4.0] < float(np.linalg.norm(_plain_mean(acts)))
    monkeypatch.setattr(QuerySet, "accuracy", _scripted_accuracy(lengths[4.0] * 0.999))

    # Act
    choice = choose_clip_norm(loaded, acts, HEADS, [chunk.query for chunk in chunks])

    # Assert: 1x and 2x fall short, 4x keeps the gain, larger ones were never tried
    assert choice.kept_gain
    assert choice.median == pytest.approx(median)
    assert choice.clip_norm == pytest.approx(4 * median)
    assert [c.factor for c in choice.candidates] == [1.0, 2.0, 4.0]
    assert [c.accuracy for c in choice.candidates] == [0.2, 0.2, 0.8]
    assert (choice.zero_shot, choice.unclipped) == (0.2, 0.8)


@ONE_ARCH
def test_when_no_bound_keeps_the_gain_the_largest_is_suggested_and_flagged(
    loaded, chunks, monkeypatch
):
    # Arrange: only the unclipped mean works; every clipped one is zero-shot's
    acts = _spread_acts()
    plain = _plain_mean(acts)

    def only_unclipped(self, loaded, patch=None):
        return 0.9 if patch is not None and np.array_equal(patch[1], plain) else 0.2

    monkeypatch.setattr(QuerySet, "accuracy", only_unclipped)

    # Act
    choice = choose_clip_norm(loaded, acts, HEADS, [chunk.query for chunk in chunks])

    # Assert
    assert not choice.kept_gain
    assert [c.factor for c in choice.candidates] == list(CLIP_FACTORS)
    assert choice.clip_norm == pytest.approx(CLIP_FACTORS[-1] * choice.median)


@ONE_ARCH
def test_on_a_real_model_the_record_is_consistent_with_the_rule(loaded, chunks, acts):
    queries = [chunk.query for chunk in chunks]

    choice = choose_clip_norm(loaded, acts, HEADS, queries, keep=0.9)

    target = choice.zero_shot + 0.9 * (choice.unclipped - choice.zero_shot)
    kept = [c.accuracy >= target for c in choice.candidates]
    assert kept[-1] is choice.kept_gain
    assert not any(kept[:-1])  # every smaller bound fell short
    assert all(0.0 <= c.accuracy <= 1.0 for c in choice.candidates)
    record = choice.as_record()["clip_norm_public_accuracy"]
    assert isinstance(record, dict)
    assert record["zero_shot"] == choice.zero_shot


@ONE_ARCH
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"keep": 0.0}, "keep"), ({"keep": 1.5}, "keep"), ({"factors": ()}, "factors")],
)
def test_bad_settings_are_refused_before_any_forward_pass(loaded, chunks, acts, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        choose_clip_norm(loaded, acts, HEADS, [c.query for c in chunks], **kwargs)


@ONE_ARCH
def test_no_query_is_refused(loaded, acts):
    with pytest.raises(ConfigError, match="queries"):
        choose_clip_norm(loaded, acts, HEADS, [])


class _RecordingNoise:
    """Adds nothing; remembers each std asked for (the scripted accuracy reads it)."""

    def __init__(self) -> None:
        self.stds: list[float] = []

    @property
    def is_cryptographic(self) -> bool:
        return False

    def add_gaussian(self, values: np.ndarray, *, noise_std: float) -> np.ndarray:
        self.stds.append(noise_std)
        return np.array(values, dtype=np.float64)

    def discrete_gaussian(self, size: int, *, noise_std: float) -> np.ndarray:
        raise NotImplementedError("the clip choice draws only continuous Gaussian noise")

    def gumbel_top_k(self, scores: np.ndarray, *, k: int, scale: float) -> tuple[int, ...]:
        raise NotImplementedError("the clip choice selects no heads")


def _noise_limited_accuracy(lengths: dict[float, float], noise: _RecordingNoise, limit: float):
    """0.8 from the 4x length on, 0.5 from the 2x length on, 0.2 below; 0.2 past ``limit``."""

    def accuracy(self, loaded, patch=None):
        if patch is None:
            return 0.2
        length = float(np.linalg.norm(np.asarray(patch[1])))
        if noise.stds and noise.stds[-1] > limit:
            return 0.2
        if length >= lengths[4.0] * 0.999:
            return 0.8
        return 0.5 if length >= lengths[2.0] * 0.999 else 0.2

    return accuracy


@ONE_ARCH
@pytest.mark.parametrize(("chunks_planned", "expected"), [(100_000, 4.0), (40, 2.0)])
def test_with_planned_noise_many_chunks_take_the_unbiased_bound_and_few_the_quiet_one(
    loaded, chunks, monkeypatch, chunks_planned, expected
):
    # Arrange: the 4x bound answers best but only while the noise stays under a limit that
    # sits between the 2x and 4x bounds' planned noise at m = 40
    acts = _spread_acts()
    median = suggested_clip_norm(acts, HEADS)
    lengths = {
        f: float(np.linalg.norm(clipped_mean(acts, HEADS, f * median))) for f in CLIP_FACTORS
    }
    planned = PlannedNoise(noise_multiplier=2.0, num_chunks=chunks_planned, layers_in_scope=2)
    at_40 = PlannedNoise(noise_multiplier=2.0, num_chunks=40, layers_in_scope=2)
    limit = (at_40.mean_std(2 * median) + at_40.mean_std(4 * median)) / 2
    noise = _RecordingNoise()
    monkeypatch.setattr(QuerySet, "accuracy", _noise_limited_accuracy(lengths, noise, limit))

    # Act
    choice = choose_clip_norm(
        loaded, acts, HEADS, [c.query for c in chunks], planned=planned, noise=noise
    )

    # Assert: every factor was scored, with the planned std at its own C, draws times each
    assert choice.clip_norm == pytest.approx(expected * median)
    assert [c.factor for c in choice.candidates] == list(CLIP_FACTORS)
    expected_stds = [planned.mean_std(f * median) for f in CLIP_FACTORS for _ in range(8)]
    assert noise.stds == pytest.approx(expected_stds)
    assert choice.planned == planned
    assert "planned noise" in str(choice.as_record()["clip_norm_rule"])


def test_planned_noise_is_2_z_c_root_l_over_m():
    planned = PlannedNoise(noise_multiplier=1.5, num_chunks=200, layers_in_scope=4)

    assert planned.mean_std(3.0) == pytest.approx(1.5 * 2 * 3.0 * 2 / 200)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"noise_multiplier": 0.0, "num_chunks": 10, "layers_in_scope": 1},
        {"noise_multiplier": 1.0, "num_chunks": 0, "layers_in_scope": 1},
        {"noise_multiplier": 1.0, "num_chunks": 10, "layers_in_scope": 0},
        {"noise_multiplier": 1.0, "num_chunks": 10, "layers_in_scope": 1, "draws": 0},
    ],
)
def test_impossible_planned_noise_is_refused(kwargs):
    with pytest.raises(ConfigError, match="planned noise"):
        PlannedNoise(**kwargs)


@ONE_ARCH
def test_on_a_real_model_planned_noise_scores_every_bound_and_suggests_the_smallest_near_best(
    loaded, chunks, acts
):
    planned = PlannedNoise(noise_multiplier=1.0, num_chunks=50, layers_in_scope=2, draws=2)

    choice = choose_clip_norm(
        loaded, acts, HEADS, [c.query for c in chunks], planned=planned, keep=0.9
    )

    near_best = choice.zero_shot + 0.9 * (
        max(c.accuracy for c in choice.candidates) - choice.zero_shot
    )
    assert len(choice.candidates) == len(CLIP_FACTORS)
    chosen = [c for c in choice.candidates if c.clip_norm == choice.clip_norm]
    assert chosen[0].accuracy >= near_best
    assert all(c.accuracy < near_best for c in choice.candidates if c.factor < chosen[0].factor)


@ONE_ARCH
def test_with_planned_noise_a_near_tie_goes_to_the_smaller_bound(loaded, chunks, monkeypatch):
    # Arrange: every bound answers alike up to estimation noise, the largest a hair better
    acts = _spread_acts()
    median = suggested_clip_norm(acts, HEADS)
    noise = _RecordingNoise()
    scores = {f: 0.78 for f in CLIP_FACTORS} | {16.0: 0.8}

    def accuracy(self, loaded, patch=None):
        if patch is None:
            return 0.2
        if not noise.stds:  # the unclipped public mean, scored before any simulated noise
            return 0.8
        factor = next(f for f in CLIP_FACTORS if noise.stds[-1] == planned.mean_std(f * median))
        return scores[factor]

    planned = PlannedNoise(noise_multiplier=1.0, num_chunks=1000, layers_in_scope=2)
    monkeypatch.setattr(QuerySet, "accuracy", accuracy)

    # Act
    choice = choose_clip_norm(
        loaded, acts, HEADS, [c.query for c in chunks], planned=planned, noise=noise
    )

    # Assert: 0.78 keeps 90 % of the best gain (0.6), so the smallest bound is suggested
    assert choice.clip_norm == pytest.approx(median)
    assert choice.kept_gain


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_planned_noise_of_a_plan_carries_the_plans_noise_multiplier(mode):
    extra = {
        "noise_mode": NoiseMode(mode),
        "min_honest": 2,
        "max_sites": 4,
        "max_chunks_per_site": 20,
    }
    plan = make_plan(selection=SelectionMode.PRIVATE, **(extra if mode == "distributed" else {}))

    planned = PlannedNoise.for_plan(plan, num_chunks=200, layers_in_scope=3)

    assert planned.noise_multiplier == pytest.approx(plan_noise_multiplier(plan))
    if mode == "central":
        assert planned.noise_multiplier == pytest.approx(plan_calibration(plan).noise_multiplier)
    assert (planned.num_chunks, planned.layers_in_scope) == (200, 3)


@ONE_ARCH
def test_a_release_first_bound_is_scaled_and_clipped_over_whole_layers(loaded, chunks, monkeypatch):
    # Arrange: the release keeps three heads but clips (and noises) every head of their layers
    acts = _spread_acts()
    every = HeadSet.of([(layer, head) for layer in range(2) for head in range(4)])
    seen: list[np.ndarray] = []

    def record(self, loaded, patch=None):
        if patch is not None:
            seen.append(np.asarray(patch[1]))
        return 0.5

    monkeypatch.setattr(QuerySet, "accuracy", record)

    # Act
    choice = choose_clip_norm(
        loaded, acts, HEADS, [chunk.query for chunk in chunks], clipped_scope=every
    )

    # Assert: the median of whole layers, and the kept heads' rows of the whole-layer clip
    assert choice.median == pytest.approx(suggested_clip_norm(acts, every))
    assert choice.median > suggested_clip_norm(acts, HEADS)
    whole = clipped_mean(acts, every, choice.clip_norm)
    position = {head: i for i, head in enumerate(every.heads)}
    np.testing.assert_allclose(seen[-1], whole[[position[h] for h in HEADS.heads]])
    assert not np.allclose(seen[-1], clipped_mean(acts, HEADS, choice.clip_norm))
