"""Task-agnostic choices among options: public heads, private selection in either order.

Private selection is simulated as the release runs it (``client.public.picks``): each held-out
chunk votes for its top-r heads (shift votes select-first, attribution against the noisy
vector release-first), the expected vote sums at m chunks get the planned Gumbel noise, and
the top k are kept. The option whose held-out accuracy is best is suggested.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from client.public.picks import attribution_votes, noisy_pick, shift_votes
from client.public.scope import HeadsMode, PlannedRelease, best_option, choose_each, choose_scope
from client.public.selection import QueryTerms
from client.public.tasks import PublicTask, centred_clip_scale, domain_centre
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadLayout, HeadSet
from dpmtv_common.privacy.testing import SeededNoise
from tests.unit.client.scope_fakes import ShareOf, ranking_terms

ONE_ARCH = pytest.mark.parametrize("tiny", ["llava"], indirect=True)
LAYERS, HEADS, DIM, CHUNKS = 2, 4, 16, 12  # the tiny LLaVA's text model
LAYOUT = HeadLayout(num_layers=LAYERS, num_heads=HEADS)


def _ranked(*slots: int) -> torch.Tensor:
    """Own-mean gains (L, H) that rank the given dense slots first, in that order."""
    gains = torch.zeros(LAYERS * HEADS)
    for rank, slot in enumerate(slots):
        gains[slot] = 10.0 - rank
    return gains.reshape(LAYERS, HEADS)


def _task(
    name: str, seed: int, *, ranked: tuple[int, ...], shifted: tuple[int, ...] = (),
    attributed: tuple[int, ...] = (), favourites: tuple[int, ...],
) -> PublicTask:  # fmt: skip
    """A public task: its gains rank ``ranked``; its chunks' K-shot prompts move the
    ``shifted`` slots most (shift votes); its gradients reward the ``attributed`` slots."""
    generator = torch.Generator().manual_seed(seed)
    acts = torch.rand(CHUNKS, LAYERS * HEADS, DIM, generator=generator) + 5.0
    zero_shot = acts - 1.0  # the demonstrations move every head a little,
    zero_shot[:, list(shifted)] -= 3.0  # the shifted ones most
    gradients = torch.zeros(CHUNKS, LAYERS * HEADS, DIM)
    gradients[:, list(attributed)] = 1.0
    shape = (CHUNKS, LAYERS, HEADS, DIM)
    terms = QueryTerms(zero_shot.reshape(shape), gradients.reshape(shape))
    wanted = {(slot // HEADS, slot % HEADS) for slot in favourites}
    gains = _ranked(*ranked)
    return PublicTask(name, acts.reshape(shape), ShareOf(wanted, CHUNKS), gains,  # type: ignore[arg-type]
                      ranking_terms(gains, DIM), terms)  # fmt: skip


def _options(m: int = 100_000, scale: float = 1.0) -> list[tuple[HeadsMode, PlannedRelease]]:
    return [
        (HeadsMode.PUBLIC, PlannedRelease(1.0, m, draws=2)),
        (HeadsMode.PRIVATE, PlannedRelease(1.0, m, draws=2, gumbel_scale=scale)),
        (HeadsMode.PRIVATE, PlannedRelease(1.0, m, draws=2, gumbel_scale=scale, every_head=True)),
    ]


def _held_out(choice) -> dict[str, float]:
    return dict(choice.options_tried)


@ONE_ARCH
def test_select_first_wins_where_the_task_s_heads_are_among_the_others_candidates(loaded):
    # Arrange: each held-out task's heads rank 3rd-4th on the others (candidates, not their
    # top 2); its chunks shift them; its gradients reward nothing (release-first votes tie)
    tasks = [
        _task("a", 1, ranked=(0, 1), shifted=(0, 1), favourites=(0, 1)),
        _task("b", 2, ranked=(2, 3, 0, 1), shifted=(2, 3), favourites=(2, 3)),
        _task("c", 3, ranked=(2, 3, 1, 0), shifted=(2, 3), favourites=(2, 3)),
    ]

    # Act
    choice = choose_scope(loaded, tasks, planned=_options(), ks=[2], noise=SeededNoise(0))

    # Assert
    held_out = _held_out(choice)
    assert (choice.mode, choice.order) == (HeadsMode.PRIVATE, "select-first")
    assert held_out["private heads, select-first"] == pytest.approx(1.0)
    assert held_out["public heads, select-first"] < 0.5
    assert held_out["private heads, release-first"] < 1.0
    assert choice.held_out == pytest.approx(1.0)
    assert choice.candidates is not None
    assert len(choice.candidates) == 4
    record = choice.as_record()
    assert record["held_out_by_option"] == held_out
    assert record["release_order"] == "select-first"


@ONE_ARCH
def test_release_first_wins_where_attribution_finds_the_candidates_shift_votes_miss(loaded):
    # Arrange: each held-out task's heads rank 3rd-4th on the others (candidates, not their
    # top 2); its chunks shift the other two candidates; its gradients reward its own heads
    tasks = [
        _task("a", 1, ranked=(0, 1), shifted=(2, 3), attributed=(0, 1), favourites=(0, 1)),
        _task("b", 2, ranked=(2, 3, 0, 1), shifted=(0, 1), attributed=(2, 3), favourites=(2, 3)),
        _task("c", 3, ranked=(2, 3, 1, 0), shifted=(0, 1), attributed=(2, 3), favourites=(2, 3)),
    ]

    # Act
    choice = choose_scope(loaded, tasks, planned=_options(), ks=[2], noise=SeededNoise(0))

    # Assert
    held_out = _held_out(choice)
    assert (choice.mode, choice.order) == (HeadsMode.PRIVATE, "release-first")
    assert held_out == {
        "public heads, select-first": 0.0,
        "private heads, select-first": 0.0,
        "private heads, release-first": 1.0,
    }
    assert choice.candidates is not None
    assert len(choice.candidates) == 4
    # C' bounds the candidates' layers, the scope a release-first Gaussian covers
    scale = centred_clip_scale(tasks, choice.candidates, choice.centre)
    assert choice.scale == pytest.approx(scale)


@ONE_ARCH
def test_release_first_never_picks_outside_the_candidates(loaded):
    # Arrange: every task's gradients reward heads 6 and 7, which no task ranks (never
    # candidates); their favourites are those heads
    tasks = [
        _task(n, i, ranked=(0, 1, 2, 3), attributed=(6, 7), favourites=(6, 7))
        for i, n in enumerate("abc")
    ]

    # Act
    choice = choose_scope(loaded, tasks, planned=_options(), ks=[2], noise=SeededNoise(0))

    # Assert: no option reaches heads outside the candidates, release-first included
    assert set(_held_out(choice).values()) == {0.0}
    assert choice.mode is HeadsMode.PUBLIC  # a tie: nothing is spent on picks


def _every_head(
    m: int = 100_000, scale: float = 1.0, draws: int = 2
) -> tuple[HeadsMode, PlannedRelease]:
    planned = PlannedRelease(1.0, m, draws=draws, gumbel_scale=scale, every_head=True,
                             among_every_head=True)  # fmt: skip
    return HeadsMode.PRIVATE, planned


@ONE_ARCH
def test_release_first_among_every_head_reaches_heads_no_public_task_ranks(loaded):
    # Arrange: as above, the tasks' own heads (6 and 7) are no task's candidates; the option
    # that picks among every carried head is compared too
    tasks = [
        _task(n, i, ranked=(0, 1, 2, 3), attributed=(6, 7), favourites=(6, 7))
        for i, n in enumerate("abc")
    ]

    # Act
    choice = choose_scope(
        loaded, tasks, planned=[*_options(), _every_head()], ks=[2], noise=SeededNoise(0)
    )

    # Assert: only it reaches them; it is chosen, names no candidates, and C' bounds every
    # carried head's layers (its Gaussian's scope)
    held_out = _held_out(choice)
    assert held_out == {
        "public heads, select-first": 0.0,
        "private heads, select-first": 0.0,
        "private heads, release-first": 0.0,
        "private heads, release-first among every head": 1.0,
    }
    assert choice.option == "private heads, release-first among every head"
    assert (choice.mode, choice.order, choice.among_every_head) == (
        HeadsMode.PRIVATE, "release-first", True,
    )  # fmt: skip
    assert choice.candidates is None
    assert choice.as_record()["private_picks_among"] == "every carried head"
    everything = LAYOUT.all_heads()
    assert choice.scale == pytest.approx(centred_clip_scale(tasks, everything, choice.centre))


@ONE_ARCH
def test_release_first_among_the_candidates_wins_where_they_hold_the_task_s_heads(loaded):
    # Arrange: the held-out tasks' heads are candidates; among every head the release
    # carries every layer's noise and the picks' Gumbel noise over 8 heads, not 4
    tasks = [
        _task("a", 1, ranked=(0, 1), shifted=(2, 3), attributed=(0, 1), favourites=(0, 1)),
        _task("b", 2, ranked=(2, 3, 0, 1), shifted=(0, 1), attributed=(2, 3), favourites=(2, 3)),
        _task("c", 3, ranked=(2, 3, 1, 0), shifted=(0, 1), attributed=(2, 3), favourites=(2, 3)),
    ]

    # Act: Gumbel noise near the vote margin, so that picking among more heads tells
    among = PlannedRelease(1.0, 4, draws=32, gumbel_scale=2.0, every_head=True)
    choice = choose_scope(
        loaded, tasks, planned=[(HeadsMode.PRIVATE, among), _every_head(4, 2.0, 32)], ks=[2],
        noise=SeededNoise(0),
    )  # fmt: skip

    # Assert
    held_out = _held_out(choice)
    assert choice.option == "private heads, release-first"
    assert (
        held_out["private heads, release-first"]
        > (held_out["private heads, release-first among every head"])
    )
    assert choice.candidates is not None
    assert choice.as_record()["private_picks_among"] == "the candidate heads"


@ONE_ARCH
def test_public_heads_win_a_tie(loaded):
    tasks = [
        _task(n, i, ranked=(0, 1), shifted=(0, 1), attributed=(0, 1), favourites=(0, 1))
        for i, n in enumerate("abc")
    ]
    choice = choose_scope(loaded, tasks, planned=_options(), ks=[2], noise=SeededNoise(0))
    assert set(_held_out(choice).values()) == {1.0}
    assert choice.mode is HeadsMode.PUBLIC


@ONE_ARCH
def test_a_forced_mode_compares_only_its_own_options(loaded):
    tasks = [
        _task(n, i, ranked=(0, 1), shifted=(0, 1), attributed=(0, 1), favourites=(0, 1))
        for i, n in enumerate("abc")
    ]
    choice = choose_scope(
        loaded, tasks, planned=_options(), ks=[2], noise=SeededNoise(0), mode=HeadsMode.PRIVATE
    )
    assert [name for name, _ in choice.options_tried] == [
        "private heads, select-first",
        "private heads, release-first",
    ]
    assert choice.mode is HeadsMode.PRIVATE


@ONE_ARCH
def test_select_first_private_c_prime_is_scaled_to_the_candidates(loaded):
    tasks = [
        _task("a", 1, ranked=(0, 1), shifted=(0, 1), favourites=(0, 1)),
        _task("b", 2, ranked=(2, 3, 0, 1), shifted=(2, 3), favourites=(2, 3)),
        _task("c", 3, ranked=(2, 3, 1, 0), shifted=(2, 3), favourites=(2, 3)),
    ]
    choice = choose_scope(loaded, tasks, planned=_options()[1:2], ks=[2], noise=SeededNoise(0))
    assert choice.candidates is not None
    expected = centred_clip_scale(tasks, choice.candidates, domain_centre(tasks))
    assert choice.scale == pytest.approx(expected)
    assert choice.clip_norm == pytest.approx(choice.factor * expected)


def test_shift_votes_go_to_each_chunk_s_most_moved_heads():
    task = _task("a", 1, ranked=(0,), shifted=(5, 2), favourites=(5,))
    votes = shift_votes(task, LAYOUT.candidates(), top_r=2)
    assert votes.shape == (CHUNKS, LAYERS * HEADS)
    np.testing.assert_array_equal(votes.sum(axis=0), [0, 0, CHUNKS, 0, 0, CHUNKS, 0, 0])


def test_attribution_votes_score_each_chunk_against_the_reference():
    # Arrange: gradients reward slots 1 and 6, whose zero-shot activations differ by chunk
    task = _task("a", 1, ranked=(0,), attributed=(1, 6), favourites=(1,))
    reference = torch.full((LAYERS, HEADS, DIM), 100.0)

    # Act
    votes = attribution_votes(task, reference, LAYOUT.candidates(), top_r=1)

    # Assert: one vote a chunk, on the rewarded slot of the larger gain (by hand)
    assert votes.sum() == CHUNKS
    z = task.chunk_terms.activations.reshape(CHUNKS, -1, DIM)  # type: ignore[union-attr]
    gains = (100.0 - z).sum(-1)[:, [1, 6]]
    best = torch.where(gains[:, 0] >= gains[:, 1], 1, 6)
    np.testing.assert_array_equal(np.argmax(votes, axis=1), best.numpy())
    assert len(set(best.tolist())) == 2  # both slots win some chunks: the test can fail


def test_a_task_without_its_chunk_terms_cannot_vote():
    task = _task("a", 1, ranked=(0,), favourites=(0,))
    bare = dataclasses.replace(task, chunk_terms=None)
    with pytest.raises(ConfigError, match="must carry its chunks' query terms"):
        shift_votes(bare, LAYOUT.candidates(), top_r=1)


def test_the_noisy_pick_keeps_the_most_voted_candidates_and_only_candidates():
    # Arrange: slot 7 has every vote but is not a candidate; 2 and 4 lead among them
    votes = np.zeros((4, LAYERS * HEADS))
    votes[:, 7] = 1.0
    votes[:, [2, 4]] = 1.0
    votes[:2, 3] = 1.0

    # Act: a Gumbel scale far below the vote gaps at m chunks
    picked = noisy_pick(votes, LAYOUT, candidates=[1, 2, 3, 4], k=2, num_chunks=1000,
                        gumbel_scale=1.0, noise=SeededNoise(0))  # fmt: skip

    # Assert
    assert picked == HeadSet.of([(0, 2), (1, 0)])
    with pytest.raises(ConfigError, match="k must lie in"):
        noisy_pick(votes, LAYOUT, candidates=[1], k=2, num_chunks=10, gumbel_scale=1.0,
                   noise=SeededNoise(0))  # fmt: skip


def test_the_planned_gumbel_noise_decides_when_the_votes_are_few():
    # Arrange: the candidates' vote rates are 1.0, 0.9 and 0.0 a chunk
    votes = np.zeros((10, LAYERS * HEADS))
    votes[:, 0] = 1.0
    votes[:9, 1] = 1.0
    candidates = [0, 1, 2]

    def share_of_second(num_chunks: int) -> float:
        noise = SeededNoise(1)
        picks = [
            noisy_pick(votes, LAYOUT, candidates=candidates, k=1, num_chunks=num_chunks,
                       gumbel_scale=5.0, noise=noise)
            for _ in range(2000)
        ]  # fmt: skip
        return sum(p == HeadSet.of([(0, 1)]) for p in picks) / len(picks)

    # Act / Assert: Gumbel top-1 is the exponential mechanism: P(second) = e^{-gap/β} / Z.
    # At m = 10 the gap is 1 vote (P = 0.446); at m = 1000, 100 votes (P ~ 2e-9). The
    # binomial sd at 2000 draws is 0.011: a 5-sd band fails by chance about once in 10^6.
    gap = 1.0 / 5.0
    expected = np.exp(-gap) / (1 + np.exp(-gap) + np.exp(-10 / 5.0))
    assert abs(share_of_second(10) - expected) < 5 * np.sqrt(expected * (1 - expected) / 2000)
    assert share_of_second(1000) == 0.0


def _split_task(name: str, seed: int, even: int, odd: int) -> PublicTask:
    """Even chunks' queries want slot ``even``, odd ones slot ``odd``; each chunk's own shift
    and gradients point at the slot its query wants (votes that fit their own query)."""
    generator = torch.Generator().manual_seed(seed)
    acts = torch.rand(CHUNKS, LAYERS * HEADS, DIM, generator=generator) + 5.0
    zero_shot = acts - 1.0
    gradients = torch.zeros(CHUNKS, LAYERS * HEADS, DIM)
    for chunk in range(CHUNKS):
        wanted = even if chunk % 2 == 0 else odd
        zero_shot[chunk, wanted] -= 3.0
        gradients[chunk, wanted] = 1.0
    shape = (CHUNKS, LAYERS, HEADS, DIM)
    terms = QueryTerms(zero_shot.reshape(shape), gradients.reshape(shape))
    favourites = {(slot // HEADS, slot % HEADS) for slot in (even, odd)}
    gains = _ranked(even, odd)
    return PublicTask(name, acts.reshape(shape), ShareOf(favourites, CHUNKS),  # type: ignore[arg-type]
                      gains, ranking_terms(gains, DIM), terms)  # fmt: skip


@ONE_ARCH
def test_private_picks_are_scored_only_on_queries_that_did_not_vote(loaded):
    # Arrange: one head per query half, each half's chunks voting for their own queries'
    # head; scored on the voters' own queries a pick of either head would score 0.5
    tasks = [_split_task(name, i, even=1, odd=6) for i, name in enumerate("abc")]

    # Act
    choice = choose_scope(
        loaded, tasks, planned=_options(scale=1e-6), ks=[1], noise=SeededNoise(0),
        mode=HeadsMode.PRIVATE,
    )  # fmt: skip

    # Assert: each half picks its own head and is scored on the other half, which wants the
    # other head, in either order
    assert _held_out(choice) == {
        "private heads, select-first": 0.0,
        "private heads, release-first": 0.0,
    }


def test_query_halves_cross_and_refuse_a_single_query():
    from client.public.scope import query_halves

    assert query_halves(5) == (([0, 2, 4], [1, 3]), ([1, 3], [0, 2, 4]))
    with pytest.raises(ConfigError, match="at least two chunks"):
        query_halves(1)


@ONE_ARCH
@pytest.mark.parametrize(
    ("public", "private", "floor", "expected"),
    [
        (0.54, 0.51, 0.0, HeadsMode.PRIVATE),  # keeps 94 % of the gain: the private option
        (0.54, 0.45, 0.0, HeadsMode.PUBLIC),  # keeps 83 %
        (0.60, 0.58, 0.30, HeadsMode.PRIVATE),  # gains counted over the centre alone: 93 %
        (0.60, 0.56, 0.30, HeadsMode.PUBLIC),  # 87 %
        (0.20, 0.20, 0.20, HeadsMode.PUBLIC),  # nothing gained: nothing spent on picks
        (0.40, 0.70, 0.0, HeadsMode.PRIVATE),  # the private option is simply the best
    ],
)
def test_a_private_option_that_keeps_most_of_the_best_gain_is_preferred(
    loaded, public, private, floor, expected
):
    # Arrange: one real choice, its held-out figures rewritten per option
    tasks = [
        _task(n, i, ranked=(0, 1), shifted=(0, 1), attributed=(0, 1), favourites=(0, 1))
        for i, n in enumerate("abc")
    ]
    every = choose_each(loaded, tasks, planned=_options(), ks=[2], noise=SeededNoise(0))
    rewritten = [
        dataclasses.replace(
            c, held_out=public if c.mode is HeadsMode.PUBLIC else private, public_only=floor
        )
        for c in every
    ]

    # Act
    chosen = best_option(rewritten)

    # Assert
    assert chosen.mode is expected
    assert best_option(rewritten, keep=0.5).mode is (
        HeadsMode.PRIVATE if private > floor else HeadsMode.PUBLIC
    )


@ONE_ARCH
def test_of_two_ks_that_tie_the_larger_is_kept_unless_picks_range_over_every_head(loaded):
    # Arrange: every task's own heads (6, 7) are rewarded by attribution and answer its
    # queries; the public ranking puts them 7th-8th, among the candidates of k = 4 (the top 8)
    tasks = [
        _task(n, i, ranked=(0, 1, 2, 3, 4, 5, 6, 7), attributed=(6, 7), favourites=(6, 7))
        for i, n in enumerate("abc")
    ]

    # Act: release-first picks among the 2k candidates, and among every carried head
    candidates = choose_scope(
        loaded, tasks, planned=_options()[2:], ks=[4, 8], noise=SeededNoise(0)
    )
    every = choose_scope(loaded, tasks, planned=[_every_head()], ks=[4, 8], noise=SeededNoise(0))

    # Assert: both reach them with 4 picks as with 8 (a tie); the candidates' reach is fixed
    # by the public ranking and the larger k is kept, every head's is not and the best
    # (the first tried) is
    for choice in (candidates, every):
        assert {(c.heads, c.accuracy) for c in choice.candidates_tried} == {(4, 1.0), (8, 1.0)}
    assert candidates.k == 8
    assert every.k == 4
