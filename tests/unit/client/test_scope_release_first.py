"""Task-agnostic choices for a release-first plan: the Gaussian's C', picks from the noisy vector.

Public heads released first are noised over every carried head (whole layers); private
selection released first is noised over its candidates and picks among them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from client.public.scope import HeadsMode, PlannedRelease, choose_scope
from client.public.selection import AttributionTerms, QueryTerms
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
from tests.unit.client.scope_fakes import ShareOf, ranking_terms

ONE_ARCH = pytest.mark.parametrize("tiny", ["llava"], indirect=True)
LAYERS, HEADS, DIM = 2, 4, 16  # the tiny LLaVA's text model


def _slots_gains(*slots: int) -> torch.Tensor:
    gains = torch.zeros(LAYERS * HEADS)
    for rank, slot in enumerate(slots):
        gains[slot] = 10.0 - rank
    return gains.reshape(LAYERS, HEADS)


def _task(name: str, seed: int, *, stand_in: tuple[int, ...], attributed: tuple[int, ...]):
    """A task whose own-mean gains rank ``stand_in`` first, but whose gradients reward
    overwriting the ``attributed`` slots with anything near its (positive) activations."""
    generator = torch.Generator().manual_seed(seed)
    acts = torch.rand(40, LAYERS, HEADS, DIM, generator=generator) + 5.0
    gradients = torch.zeros(40, LAYERS * HEADS, DIM)
    gradients[:, list(attributed)] = 1.0 / 40
    # Zero-shot activations at 0: every head's shift is about as large (no shift vote helps).
    chunk_terms = QueryTerms(torch.zeros_like(acts), gradients.reshape(acts.shape))
    favourites = {(slot // HEADS, slot % HEADS) for slot in attributed}
    gains = _slots_gains(*stand_in)
    return PublicTask(name, acts, ShareOf(favourites, len(acts)), gains,  # type: ignore[arg-type]
                      ranking_terms(gains, DIM), chunk_terms)  # fmt: skip


def test_attribution_terms_give_the_summed_gain_of_any_reference():
    # Arrange: three queries' zero-shot activations z and gradients g
    generator = torch.Generator().manual_seed(0)
    z, g = (torch.randn(3, LAYERS, HEADS, DIM, generator=generator) for _ in range(2))
    terms = AttributionTerms(g.sum(0), (z * g).sum(dim=(0, -1)))
    reference = torch.randn(LAYERS, HEADS, DIM, generator=generator)

    # Act / Assert: Σ_q (r − z_q)·g_q, by hand
    by_hand = ((reference - z) * g).sum(dim=(0, -1))
    torch.testing.assert_close(terms.gains(reference), by_hand, atol=1e-5, rtol=1e-5)


def test_a_task_without_its_terms_cannot_score_another_reference():
    task = PublicTask("a", torch.zeros(2, LAYERS, HEADS, DIM), None, torch.zeros(LAYERS, HEADS))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="must carry its attribution terms"):
        task.gains_against(torch.zeros(LAYERS, HEADS, DIM))


@ONE_ARCH
def test_a_release_first_private_choice_picks_heads_from_the_noisy_vector(loaded):
    # Arrange: every task ranks slots 0 and 1 first and 6 and 7 next (the candidates are the
    # four), but its gradients reward overwriting 6 and 7: only scoring the noisy vector finds
    # them among the candidates
    tasks = [_task(n, i, stand_in=(0, 1, 6, 7), attributed=(6, 7)) for i, n in enumerate("abc")]
    planned = {
        HeadsMode.PRIVATE: PlannedRelease(1.0, 100_000, draws=2, every_head=True, gumbel_scale=1.0)
    }
    stand_in = {HeadsMode.PRIVATE: PlannedRelease(1.0, 100_000, draws=2, gumbel_scale=1.0)}

    # Act
    choice = choose_scope(
        loaded, tasks, planned=planned, ks=[2], noise=SeededNoise(0), mode=HeadsMode.PRIVATE
    )
    select_first = choose_scope(
        loaded, tasks, planned=stand_in, ks=[2], noise=SeededNoise(0), mode=HeadsMode.PRIVATE
    )

    # Assert: the rewarded heads every time; select-first's shift votes do not find them
    assert [c.accuracy for c in choice.candidates_tried] == [1.0] * len(choice.candidates_tried)
    assert max(c.accuracy for c in select_first.candidates_tried) < 1.0
    assert choice.every_head
    assert choice.candidates == HeadSet.of([(0, 0), (0, 1), (1, 2), (1, 3)])
    assert choice.as_record()["release_order"] == "release-first"
    assert select_first.as_record()["release_order"] == "select-first"


@ONE_ARCH
def test_a_release_first_clip_scale_is_that_of_the_gaussian_s_heads(loaded):
    # Arrange: public heads released first are noised over every carried head (whole
    # layers); private selection released first over its candidates only
    tasks = [_task(n, i, stand_in=(0, 1, 2, 3), attributed=(0, 1)) for i, n in enumerate("abc")]
    planned = {
        mode: PlannedRelease(1.0, 1000, draws=1, every_head=True, gumbel_scale=1.0)
        for mode in HeadsMode
    }
    every = HeadSet.of([(layer, head) for layer in range(LAYERS) for head in range(HEADS)])
    centre = domain_centre(tasks)
    candidates = rank_heads(loaded, tasks, k=4)  # the 2k heads the public tasks rank first

    # Act
    public, private = (
        choose_scope(loaded, tasks, planned=planned, ks=[2], noise=SeededNoise(0), mode=mode)
        for mode in (HeadsMode.PUBLIC, HeadsMode.PRIVATE)
    )

    # Assert: every head for public heads; the candidates (one layer here) for private
    assert public.scale == pytest.approx(centred_clip_scale(tasks, every, centre))
    assert private.candidates == candidates
    assert private.scale == pytest.approx(centred_clip_scale(tasks, candidates, centre))
    assert public.scale > private.scale
    for choice in (public, private):
        assert np.isclose(choice.clip_norm, choice.factor * choice.scale)


Patched = tuple[str, HeadSet, np.ndarray]


class _Recording:
    """Accuracy 0.5 always; every patch scored is kept, by task."""

    def __init__(self, name: str, log: list[Patched]) -> None:
        self.name, self.log = name, log

    def accuracy(self, loaded, patch=None) -> float:
        if patch is not None:
            self.log.append((self.name, patch[0], np.asarray(patch[1])))
        return 0.5


@ONE_ARCH
def test_a_release_first_public_trial_clips_whole_layers_then_keeps_its_heads(loaded):
    # Arrange: three tasks of different offsets (the bound binds where a task lies far from
    # the others' centre); a release so large that its noise is negligible
    log: list[Patched] = []
    tasks = []
    for i, name in enumerate("abc"):
        task = _task(name, i, stand_in=(0, 5), attributed=(0, 5))
        tasks.append(PublicTask(name, task.activations * (1 + i), _Recording(name, log),  # type: ignore[arg-type]
                                task.gains, task.terms, task.chunk_terms))  # fmt: skip
    planned = {HeadsMode.PUBLIC: PlannedRelease(1.0, 10**9, draws=1, every_head=True)}
    every = HeadSet.of([(layer, head) for layer in range(LAYERS) for head in range(HEADS)])

    # Act
    choose_scope(loaded, tasks, planned=planned, ks=[2], factors=[1.0], mode=HeadsMode.PUBLIC,
                 noise=SeededNoise(0))  # fmt: skip

    # Assert: each held-out release (the last patch of each task: the transfer and the
    # centre-alone floor are scored first) is the whole-layer clip's rows, centre added
    by_name = {task.name: task for task in tasks}
    assert sorted(name for name, _, _ in log[-3:]) == ["a", "b", "c"]
    clipped_otherwise = 0
    for name, heads, values in log[-3:]:
        others = [t for t in tasks if t.name != name]
        centre = domain_centre(tasks, exclude=name)
        clip = centred_clip_scale(others, every, centre)
        whole = centred_mean(by_name[name].activations, every, centre, clip)
        position = {head: i for i, head in enumerate(every.heads)}
        rows = whole[[position[h] for h in heads.heads]] + centre.rows(heads)
        np.testing.assert_allclose(values, rows, atol=1e-6)
        own_heads_clip = centred_mean(by_name[name].activations, heads, centre, clip)
        clipped_otherwise += not np.allclose(values, own_heads_clip + centre.rows(heads))
    assert clipped_otherwise >= 1  # where the bound binds, the kept heads' own clip differs
