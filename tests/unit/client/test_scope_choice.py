"""Task-agnostic public choices: the centre, the heads, the transfer rule, k and C' held out."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from client.public.scope import (
    HeadsMode,
    PlannedRelease,
    choose_scope,
    heads_transfer,
    held_out_accuracy_by_chunks,
)
from client.public.selection import AttributionTerms
from client.public.tasks import (
    PublicTask,
    centred_clip_scale,
    centred_mean,
    domain_centre,
    rank_heads,
)
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.testing import SeededNoise
from tests.unit.client.scope_fakes import ranking_terms

ONE_ARCH = pytest.mark.parametrize("tiny", ["llava"], indirect=True)
LAYERS, HEADS, DIM = 2, 4, 16  # the tiny LLaVA's text model


@dataclass
class ScriptedQueries:
    """A task's queries whose accuracy a test scripts as a function of the patch."""

    name: str
    script: Callable[[str, object], float] = lambda name, patch: 0.0

    def accuracy(self, loaded, patch=None) -> float:
        return self.script(self.name, patch)


def _task(name: str, *, seed: int, gains: torch.Tensor, chunks: int = 6, offset: float = 0.0):
    generator = torch.Generator().manual_seed(seed)
    acts = torch.randn(chunks, LAYERS, HEADS, DIM, generator=generator) + offset
    return PublicTask(name, acts, ScriptedQueries(name), gains, ranking_terms(gains, DIM))  # type: ignore[arg-type]


def _script(tasks: list[PublicTask], script: Callable[[str, object], float]) -> None:
    for task in tasks:
        task.queries.script = script  # type: ignore[attr-defined]


def _gains(*favourite: int) -> torch.Tensor:
    """Gains (L, H) that rank the given dense slots first, in that order."""
    gains = torch.zeros(LAYERS * HEADS)
    for rank, slot in enumerate(favourite):
        gains[slot] = 10.0 - rank
    return gains.reshape(LAYERS, HEADS)


def test_the_centre_weighs_every_task_the_same_whatever_its_chunk_count():
    # Arrange: one task with 6 chunks around +1, one with 60 around -1
    first = _task("a", seed=1, gains=_gains(0), offset=1.0)
    second = _task("b", seed=2, gains=_gains(0), chunks=60, offset=-1.0)

    # Act
    centre = domain_centre([first, second])

    # Assert
    expected = (first.mean.double() + second.mean.double()) / 2
    np.testing.assert_allclose(centre.values, expected.numpy(), atol=1e-12)
    np.testing.assert_allclose(
        domain_centre([first, second], exclude="a").values, second.mean.double().numpy()
    )
    assert not domain_centre([first, second], centred=False).values.any()


@ONE_ARCH
def test_heads_are_ranked_with_every_task_weighing_the_same(loaded):
    # Arrange: task a's gains are a thousand times task b's; both must count
    a = _task("a", seed=1, gains=_gains(0, 1) * 1000)
    b = _task("b", seed=2, gains=_gains(5, 6) * 1.0)

    # Act
    top = rank_heads(loaded, [a, b], k=2)
    without_a = rank_heads(loaded, [a, b], k=2, exclude="a")

    # Assert: the first choice of each task, not task a's two
    assert top == HeadSet.of([(0, 0), (1, 1)])
    assert without_a == HeadSet.of([(1, 1), (1, 2)])


@ONE_ARCH
def test_heads_are_ranked_by_the_gain_of_the_kept_tasks_centre_not_of_each_own_mean(loaded):
    # Arrange: task a's answers rise with whatever is patched into heads (0, 0) and (0, 1); its
    # own mean lies far out in (0, 0), the centre of a and b in (0, 1); b's gains are all zero
    a_acts = torch.zeros(2, LAYERS, HEADS, DIM)
    a_acts[:, 0, 0] = 10.0
    b_acts = torch.zeros(2, LAYERS, HEADS, DIM)
    b_acts[:, 0, 0], b_acts[:, 0, 1] = -10.0, 10.0
    rewarded = torch.zeros(LAYERS, HEADS, DIM)
    rewarded[0, :2] = 1.0
    a_terms = AttributionTerms(rewarded, torch.zeros(LAYERS, HEADS))
    b_terms = AttributionTerms(torch.zeros(LAYERS, HEADS, DIM), torch.zeros(LAYERS, HEADS))
    a = PublicTask("a", a_acts, None, a_terms.gains(a_acts.mean(0)), a_terms)  # type: ignore[arg-type]
    b = PublicTask("b", b_acts, None, b_terms.gains(b_acts.mean(0)), b_terms)  # type: ignore[arg-type]

    # Act
    both = rank_heads(loaded, [a, b], k=1)
    a_alone = rank_heads(loaded, [a, b], k=1, exclude="b")

    # Assert: with b kept the centre's head; a alone, its own mean's
    assert both == HeadSet.of([(0, 1)])
    assert a_alone == HeadSet.of([(0, 0)])


def test_a_task_without_its_terms_cannot_rank_heads():
    task = PublicTask("a", torch.zeros(2, LAYERS, HEADS, DIM), None, torch.zeros(LAYERS, HEADS))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="must carry its attribution terms"):
        rank_heads(None, [task], k=1)  # type: ignore[arg-type]


def test_the_centred_mean_clips_each_chunk_s_shift_from_the_centre():
    # Arrange
    task = _task("a", seed=3, gains=_gains(0), offset=5.0)
    other = _task("b", seed=4, gains=_gains(0), offset=5.0)
    centre = domain_centre([other])
    heads = HeadSet.of([(0, 1), (1, 2), (1, 3)])

    # Act
    mean = centred_mean(task.activations, heads, centre, clip_norm=0.5)

    # Assert: clip(a - r) per layer, by hand
    index = heads.to_array()
    rows = task.activations[:, index[:, 0], index[:, 1]].double().numpy() - centre.rows(heads)
    by_hand = []
    for chunk in rows:
        for layer in heads.layers:
            block = heads.row_layers() == layer
            chunk[block] *= min(1.0, 0.5 / np.linalg.norm(chunk[block]))
        by_hand.append(chunk)
    np.testing.assert_allclose(mean, np.mean(by_hand, axis=0), atol=1e-12)
    assert centred_clip_scale([task], heads, centre) > 0.5  # the bound binds here


def _own_heads_accuracy(favourites: dict[str, set[tuple[int, int]]]):
    """Accuracy = share of the task's favourite heads in the patch (0.0 unpatched)."""

    def accuracy(name, patch):
        if patch is None:
            return 0.0
        return len(favourites[name] & set(patch[0].heads)) / len(favourites[name])

    return accuracy


@ONE_ARCH
@pytest.mark.parametrize(
    ("slots", "transfer"),
    [
        ({"a": (0, 1), "b": (0, 1), "c": (0, 1)}, 1.0),
        ({"a": (0, 1), "b": (2, 3), "c": (4, 5)}, 0.0),
    ],
    ids=["shared-heads", "own-heads"],
)
def test_transfer_measures_whether_the_other_tasks_heads_carry_the_held_out_one(
    loaded, slots, transfer
):
    # Arrange
    tasks = [_task(n, seed=i, gains=_gains(*s)) for i, (n, s) in enumerate(slots.items())]
    favourites = {t.name: set(rank_heads(loaded, [t], k=2).heads) for t in tasks}
    _script(tasks, _own_heads_accuracy(favourites))

    # Act / Assert
    assert heads_transfer(loaded, tasks, k=2) == pytest.approx(transfer)


def _closeness_to_the_plain_mean(tasks: list[PublicTask]):
    """Accuracy = exp(-RMS distance of the patch from the task's own unclipped mean).

    A small bound shrinks the clipped mean away from it (bias); a large one lets the planned
    noise carry it away: the best bound depends on the noise, as on a real model.
    """
    means = {task.name: task.mean.double().numpy() for task in tasks}

    def accuracy(name, patch):
        if patch is None:
            return 0.0
        heads, values = patch
        index = heads.to_array()
        target = means[name][index[:, 0], index[:, 1]]
        return float(np.exp(-np.sqrt(np.mean((np.asarray(values) - target) ** 2))))

    return accuracy


@ONE_ARCH
def test_more_noise_makes_the_choice_take_a_smaller_clip_factor(loaded):
    # Arrange: shared heads (public mode); chunks far from the centre, so the bound binds
    tasks = [_task(n, seed=i, gains=_gains(0, 1), offset=3.0 * i) for i, n in enumerate("abc")]
    _script(tasks, _closeness_to_the_plain_mean(tasks))

    def planned(m: int) -> dict[HeadsMode, PlannedRelease]:
        return {HeadsMode.PUBLIC: PlannedRelease(4.0, m, draws=3)}

    # Act
    quiet = choose_scope(
        loaded, tasks, planned=planned(100_000), ks=[2], noise=SeededNoise(0), keep=1.0,
        mode=HeadsMode.PUBLIC,
    )  # fmt: skip
    noisy = choose_scope(
        loaded, tasks, planned=planned(20), ks=[2], noise=SeededNoise(0), keep=1.0,
        mode=HeadsMode.PUBLIC,
    )  # fmt: skip

    # Assert: the quiet release affords a larger bound than the noisy one
    assert quiet.factor > noisy.factor
    assert noisy.clip_norm == pytest.approx(noisy.factor * noisy.scale)
    assert noisy.candidates is None


@ONE_ARCH
def test_a_private_option_without_its_gumbel_scale_is_refused_before_any_simulation(loaded):
    tasks = [_task(n, seed=i, gains=_gains(i)) for i, n in enumerate("abc")]
    planned = {mode: PlannedRelease(1.0, 100, draws=1) for mode in HeadsMode}
    with pytest.raises(ConfigError, match="needs its Gumbel scale"):
        choose_scope(loaded, tasks, planned=planned, ks=[2], noise=SeededNoise(0))


@ONE_ARCH
def test_public_heads_planned_among_every_head_are_refused_before_any_simulation(loaded):
    tasks = [_task(n, seed=i, gains=_gains(i)) for i, n in enumerate("abc")]
    planned = [(HeadsMode.PUBLIC, PlannedRelease(1.0, 100, every_head=True, among_every_head=True))]
    with pytest.raises(ConfigError, match="public heads pick nothing"):
        choose_scope(loaded, tasks, planned=planned, ks=[2], noise=SeededNoise(0))


@ONE_ARCH
def test_task_agnostic_choices_need_two_distinct_public_tasks(loaded):
    one = [_task("a", seed=1, gains=_gains(0))]
    twins = [_task("a", seed=1, gains=_gains(0)), _task("a", seed=2, gains=_gains(1))]
    planned = {HeadsMode.PUBLIC: PlannedRelease(1.0, 10)}
    with pytest.raises(ConfigError, match="must hold the 'private' release"):
        choose_scope(loaded, [*twins[:1], _task("b", seed=3, gains=_gains(2))], planned=planned,
                     ks=[2], mode=HeadsMode.PRIVATE)  # fmt: skip
    for tasks in (one, twins):
        with pytest.raises(ConfigError, match="at least 2 public tasks of distinct names"):
            choose_scope(loaded, tasks, planned=planned, ks=[2])


def test_a_planned_release_refuses_impossible_numbers():
    with pytest.raises(ConfigError, match="noise_multiplier > 0"):
        PlannedRelease(0.0, 10)
    with pytest.raises(ConfigError, match="gumbel_scale must be > 0"):
        PlannedRelease(1.0, 10, gumbel_scale=0.0)
    with pytest.raises(ConfigError, match="top_r must be >= 1"):
        PlannedRelease(1.0, 10, top_r=0)
    with pytest.raises(ConfigError, match="needs every_head"):
        PlannedRelease(1.0, 10, among_every_head=True)
    assert PlannedRelease(2.0, 100).mean_std(3.0, 4) == pytest.approx(2 * 2.0 * 3.0 * 2 / 100)


@ONE_ARCH
def test_more_chunks_raise_the_held_out_accuracy_of_the_chosen_scope(loaded):
    # Arrange
    tasks = [_task(n, seed=i, gains=_gains(0, 1), offset=3.0 * i) for i, n in enumerate("abc")]
    _script(tasks, _closeness_to_the_plain_mean(tasks))
    planned = {HeadsMode.PUBLIC: PlannedRelease(4.0, 20, draws=3)}
    choice = choose_scope(
        loaded, tasks, planned=planned, ks=[2], noise=SeededNoise(0), mode=HeadsMode.PUBLIC
    )

    # Act
    by_chunks = held_out_accuracy_by_chunks(
        loaded, tasks, choice, planned=planned[HeadsMode.PUBLIC], chunk_counts=[5, 100_000],
        noise=SeededNoise(1),
    )  # fmt: skip

    # Assert
    assert by_chunks[100_000] > by_chunks[5]


def _score_by_heads_count(tasks: list[PublicTask], by_count: dict[int, float]):
    """Accuracy by the number of heads patched; the centre alone (the floor) scores 0.0."""

    def accuracy(name, patch):
        if patch is None:
            return 0.0
        heads, values = patch
        centre = domain_centre(tasks, exclude=name).rows(heads)
        return 0.0 if np.allclose(values, centre) else by_count[len(heads)]

    return accuracy


@ONE_ARCH
@pytest.mark.parametrize(
    ("by_count", "chosen"),
    [({2: 0.96, 4: 0.95}, 4), ({2: 0.95, 4: 0.96}, 4), ({2: 0.96, 4: 0.5}, 2)],
)
def test_of_two_ks_that_score_alike_the_larger_is_chosen(loaded, by_count, chosen):
    # Arrange: every task ranks the same four heads first; the score depends on k alone
    tasks = [_task(n, seed=i, gains=_gains(0, 1, 2, 3), offset=3.0) for i, n in enumerate("abc")]
    _script(tasks, _score_by_heads_count(tasks, by_count))
    planned = {HeadsMode.PUBLIC: PlannedRelease(1.0, 100_000, draws=1)}

    # Act
    choice = choose_scope(
        loaded, tasks, planned=planned, ks=[2, 4], noise=SeededNoise(0), mode=HeadsMode.PUBLIC
    )

    # Assert: within 90 % of the best gain the larger k; below it the better
    assert choice.k == chosen
    assert choice.held_out == pytest.approx(by_count[chosen])
    assert choice.factor == min(c.factor for c in choice.candidates_tried)
