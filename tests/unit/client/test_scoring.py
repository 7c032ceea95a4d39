from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from client.activations.chunking import Chunk, make_chunks
from client.activations.extraction import chunk_prompt, forward_last_token_heads, zero_shot_prompt
from client.activations.hooks import registered_pre_hooks
from client.activations.scoring import (
    ScoreMethod,
    answer_token_ids,
    attribution_scores,
    chunk_head_votes,
    last_token_attribution,
    shift_scores,
    top_r_votes,
    votes_among,
)
from client.data.records import Record
from dpmtv_common.errors import ConfigError
from tests.site_data import write_site

LAYERS, HEADS, DIM = 2, 4, 16
# Checks that do not depend on the architecture run on one of them.
ONE_ARCH = pytest.mark.parametrize("tiny", ["llava"], indirect=True)


@pytest.fixture(scope="module")
def chunks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Chunk, ...]:
    site = write_site(tmp_path_factory.mktemp("scoring-site"), 9)
    return make_chunks(site, shots=2, seed=3).chunks  # 3 chunks


# ---------------------------------------------------------------- top-r votes


@pytest.mark.parametrize("top_r", [1, 3, 8])
def test_top_r_votes_gives_each_row_exactly_r_ones_on_its_largest_scores(top_r):
    # Arrange
    scores = np.random.default_rng(0).normal(size=(5, 8))

    # Act
    votes = top_r_votes(scores, top_r)

    # Assert
    assert set(np.unique(votes)) <= {0.0, 1.0}
    np.testing.assert_array_equal(votes.sum(axis=1), top_r)
    for row, vote in zip(scores, votes, strict=True):
        assert row[vote == 1].min() >= row[vote == 0].max(initial=-np.inf)


def test_top_r_votes_breaks_ties_to_exactly_r_ones():
    # Act
    votes = top_r_votes(np.zeros((3, 6)), 2)

    # Assert
    np.testing.assert_array_equal(votes.sum(axis=1), 2)


def test_votes_among_candidates_never_reach_the_other_slots():
    # Arrange: the largest scores lie outside the candidates (a hybrid's headless slots)
    scores = np.tile(np.arange(8.0)[::-1], (4, 1))
    candidates = [3, 5, 6, 7]

    # Act
    votes = votes_among(scores, candidates, 2)

    # Assert: r votes a chunk, on the best candidates only
    np.testing.assert_array_equal(votes.sum(axis=1), 2)
    assert not votes[:, [0, 1, 2, 4]].any()
    np.testing.assert_array_equal(votes[:, [3, 5]], 1.0)


def test_attribution_scores_are_the_first_order_gain_of_each_head():
    # Arrange
    generator = torch.Generator().manual_seed(0)
    acts, grads, target = (torch.randn(3, LAYERS, HEADS, DIM, generator=generator) for _ in "agt")

    # Act
    scores = attribution_scores(acts, grads, target)

    # Assert: (target − z)·g per head, by hand, flattened (layer, head)
    assert scores.shape == (3, LAYERS * HEADS)
    for b in range(3):
        for layer in range(LAYERS):
            for head in range(HEADS):
                gain = float(((target - acts)[b, layer, head] * grads[b, layer, head]).sum())
                assert scores[b, layer * HEADS + head] == pytest.approx(gain, rel=1e-5, abs=1e-5)


def test_replacing_one_chunk_moves_every_head_vote_sum_by_at_most_one():
    # Arrange: neighbouring score matrices differ in one chunk's row
    rng = np.random.default_rng(1)
    for trial in range(50):
        scores = rng.normal(size=(6, 8))
        neighbour = scores.copy()
        neighbour[trial % 6] = rng.normal(size=8)

        # Act
        difference = top_r_votes(scores, 3).sum(axis=0) - top_r_votes(neighbour, 3).sum(axis=0)

        # Assert: Δ∞ = 1 per head
        assert np.abs(difference).max() <= 1.0


@pytest.mark.parametrize("top_r", [0, 9])
def test_top_r_outside_one_to_the_head_count_is_a_config_error(top_r):
    # Act / Assert
    with pytest.raises(ConfigError, match="top_r"):
        top_r_votes(np.zeros((2, 8)), top_r)


# ---------------------------------------------------------------- chunk votes


@pytest.mark.parametrize("method", list(ScoreMethod))
def test_chunk_votes_total_lies_in_zero_to_m_and_sums_to_m_times_r(loaded, chunks, method):
    # Act
    votes = chunk_head_votes(loaded, chunks, top_r=3, method=method, progress=False)

    # Assert
    m = len(chunks)
    assert votes.num_chunks == m
    assert votes.total.shape == (LAYERS * HEADS,)
    assert votes.total.min() >= 0
    assert votes.total.max() <= m
    assert votes.total.sum() == m * 3


def test_shift_votes_go_to_the_heads_the_demonstrations_move_most(loaded, chunks):
    # Arrange: the shift score of one chunk, by hand
    expected = np.zeros(LAYERS * HEADS)
    for chunk in chunks:
        shots = forward_last_token_heads(loaded, [chunk_prompt(chunk)], instruction=None)
        plain = forward_last_token_heads(loaded, [zero_shot_prompt(chunk.query)], instruction=None)
        expected += top_r_votes((shots - plain).norm(dim=-1).reshape(1, -1).numpy(), 2)[0]

    # Act
    votes = chunk_head_votes(loaded, chunks, top_r=2, progress=False)

    # Assert
    np.testing.assert_array_equal(votes.total, expected)


def test_attribution_votes_score_against_a_layer_head_dim_reference(loaded, chunks):
    # Arrange: a fixed reference (L, H, D), as the release-first order passes the noisy vector
    reference = np.random.default_rng(2).normal(scale=0.1, size=(LAYERS, HEADS, DIM))
    expected = np.zeros(LAYERS * HEADS)
    for chunk in chunks:
        acts, grads = last_token_attribution(
            loaded, [zero_shot_prompt(chunk.query)], [chunk.query.answer], instruction=None
        )
        gain = ((torch.as_tensor(reference, dtype=torch.float32) - acts) * grads).sum(dim=-1)
        expected += top_r_votes(gain.reshape(1, -1).double().numpy(), 2)[0]

    # Act
    votes = chunk_head_votes(
        loaded,
        chunks,
        top_r=2,
        method=ScoreMethod.ATTRIBUTION,
        reference=reference,
        progress=False,
    )

    # Assert
    np.testing.assert_array_equal(votes.total, expected)
    assert votes.total.sum() == len(chunks) * 2


# ---------------------------------------------------------------- attribution gradients


def log_p_with_offset(loaded, inputs, target, *, row, layer, coordinate, offset) -> float:
    """log p(target) of batch row ``row`` with one o_proj input coordinate moved by ``offset``."""

    def hook(module, args):
        hidden = args[0].clone()
        hidden[row, -1, coordinate] += offset
        return (hidden, *args[1:])

    projection = loaded.adapter.output_projections(loaded.model)[layer]
    with torch.no_grad(), registered_pre_hooks([(projection, hook)]):
        logits = loaded.model(**inputs).logits[row, -1].double()
    return float(logits.log_softmax(-1)[target])


def test_attribution_gradient_matches_a_central_finite_difference(loaded, chunks):
    # Arrange: two prompts of different lengths, so row 1 sits behind left padding
    prompts = [chunk_prompt(chunks[0]), zero_shot_prompt(chunks[1].query)]
    answers = [chunks[0].query.answer, chunks[1].query.answer]
    inputs = loaded.adapter.build_batch_inputs(loaded.processor, prompts, instruction=None)
    target = int(answer_token_ids(loaded, answers)[1])

    # Act
    acts, grads = last_token_attribution(loaded, prompts, answers, instruction=None)

    # Assert: the steepest coordinate of row 1 against (f(x + h) - f(x - h)) / 2h
    assert acts.shape == grads.shape == (2, LAYERS, HEADS, DIM)
    layer, head, dim = np.unravel_index(int(grads[1].abs().argmax()), (LAYERS, HEADS, DIM))
    where = {"row": 1, "layer": int(layer), "coordinate": int(head) * DIM + int(dim)}
    step = 1e-2
    up = log_p_with_offset(loaded, inputs, target, offset=step, **where)
    down = log_p_with_offset(loaded, inputs, target, offset=-step, **where)
    assert float(grads[1, layer, head, dim]) == pytest.approx((up - down) / (2 * step), rel=1e-3)


def test_attribution_activations_are_the_captured_last_token_heads(loaded, chunks):
    # Arrange
    prompts = [zero_shot_prompt(chunks[0].query)]

    # Act
    acts, _ = last_token_attribution(loaded, prompts, ["red"], instruction=None)

    # Assert
    captured = forward_last_token_heads(loaded, prompts, instruction=None)
    torch.testing.assert_close(acts, captured, rtol=0, atol=1e-6)


def test_attribution_leaves_parameter_flags_and_hooks_as_they_were(loaded, chunks):
    # Arrange
    flags = [p.requires_grad for p in loaded.model.parameters()]
    projections = loaded.adapter.output_projections(loaded.model)

    # Act
    last_token_attribution(loaded, [zero_shot_prompt(chunks[0].query)], ["red"], instruction=None)

    # Assert
    assert [p.requires_grad for p in loaded.model.parameters()] == flags
    assert all(p.grad is None for p in loaded.model.parameters())
    assert all(not p._forward_pre_hooks for p in projections)


@ONE_ARCH
def test_an_answer_without_tokens_is_a_config_error(loaded):
    # Act / Assert
    with pytest.raises(ConfigError, match="answer"):
        answer_token_ids(loaded, ["red", ""])


# ---------------------------------------------------------------- failures and bad input


@ONE_ARCH
@pytest.mark.parametrize("top_r", [0, LAYERS * HEADS + 1])
def test_chunk_head_votes_refuses_a_top_r_outside_the_model_before_any_pass(loaded, top_r):
    # A chunk that could never be scored would also fail: the check must come first and
    # raise, not turn every chunk into zero votes.
    broken = [Chunk(demonstrations=(), query=Record("x", Path("/absent.png"), "q?", ("a",)))]

    with pytest.raises(ConfigError, match=r"top_r must lie in \[1, 8\]"):
        chunk_head_votes(loaded, broken, top_r=top_r, progress=False)


@ONE_ARCH
def test_chunk_head_votes_refuses_a_reference_of_the_wrong_shape(loaded, chunks):
    with pytest.raises(ConfigError, match=r"reference must be finite with shape"):
        chunk_head_votes(
            loaded,
            chunks,
            top_r=2,
            method=ScoreMethod.ATTRIBUTION,
            reference=np.zeros((LAYERS, HEADS, DIM + 1)),
            progress=False,
        )


@ONE_ARCH
def test_a_chunk_whose_image_is_gone_casts_zero_votes_and_still_counts(
    loaded, chunks, tmp_path, caplog
):
    # Arrange: the query image of chunk 1 disappears after the dataset was loaded
    gone = dataclasses.replace(chunks[1].query, image_path=tmp_path / "vanished.png")
    broken = (chunks[0], dataclasses.replace(chunks[1], query=gone), chunks[2])
    intact = chunk_head_votes(loaded, [chunks[0], chunks[2]], top_r=2, progress=False)

    # Act
    with caplog.at_level(logging.WARNING, logger="client.activations.extraction"):
        votes = chunk_head_votes(loaded, broken, top_r=2, progress=False)

    # Assert
    assert (votes.num_chunks, votes.num_replaced) == (3, 1)
    np.testing.assert_array_equal(votes.total, intact.total)
    assert "score: 1 of 3 chunks failed (FileNotFoundError x1)" in caplog.text


@ONE_ARCH
def test_shift_scores_vote_as_chunk_votes_at_every_r_and_a_failed_chunk_is_nan(
    loaded, chunks, tmp_path
):
    # Arrange: chunk 1's query image is gone
    gone = dataclasses.replace(chunks[1].query, image_path=tmp_path / "vanished.png")
    broken = (chunks[0], dataclasses.replace(chunks[1], query=gone), chunks[2])
    candidates = list(range(LAYERS * HEADS))

    # Act
    scores = shift_scores(loaded, broken)

    # Assert: one row a chunk, NaN where it failed; the others vote as the release path does
    assert scores.shape == (3, LAYERS * HEADS)
    assert np.isnan(scores[1]).all()
    assert np.isfinite(scores[[0, 2]]).all()
    for top_r in (1, 3):
        by_release = chunk_head_votes(loaded, broken, top_r=top_r, progress=False)
        voted = votes_among(scores[[0, 2]], candidates, top_r).sum(axis=0)
        np.testing.assert_array_equal(voted, by_release.total)


@ONE_ARCH
def test_every_chunk_failing_is_logged_as_an_error_but_still_counts(
    loaded, chunks, tmp_path, caplog
):
    gone = [
        dataclasses.replace(c, query=dataclasses.replace(c.query, image_path=tmp_path / "x.png"))
        for c in chunks
    ]

    with caplog.at_level(logging.WARNING, logger="client.activations.extraction"):
        votes = chunk_head_votes(loaded, gone, top_r=2, progress=False)

    assert (votes.num_chunks, votes.num_replaced) == (3, 3)
    assert not votes.total.any()
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    assert "every chunk failed" in caplog.text


def test_answers_the_model_cannot_read_are_refused_and_a_partial_share_is_reported():
    # The embedded model has a word-level tokenizer: a foreign label is its <unk>.
    from client.activations.scoring import check_answer_vocabulary
    from client.models import load_model
    from client.models.embedded import EMBEDDED_MODEL_DIR
    from dpmtv_common.errors import DataError

    loaded = load_model(EMBEDDED_MODEL_DIR, device="cpu")
    with pytest.raises(DataError, match="answers must be in the model's vocabulary"):
        check_answer_vocabulary(loaded, ["pneumonia", "effusion"])
    assert check_answer_vocabulary(loaded, ["pneumonia", "red"]) == pytest.approx(0.5)
    assert check_answer_vocabulary(loaded, ["red", "blue"]) == 0.0
