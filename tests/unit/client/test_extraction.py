from __future__ import annotations

import numpy as np
import pytest
import torch

import client.activations.fixed_shape as fixed_shape
from client.activations.chunking import Chunk, make_chunks
from client.activations.extraction import (
    batched,
    chunk_prompt,
    extract_clipped_sum,
    forward_last_token_heads,
    select_heads,
    zero_shot_prompt,
)
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.mechanisms import clip_per_layer
from tests.site_data import write_site

SUBSET = HeadSet.of([(0, 1), (0, 3), (1, 0), (1, 2)])
# Checks that do not depend on the architecture run on one of them.
ONE_ARCH = pytest.mark.parametrize("tiny", ["llava"], indirect=True)
TINY_CLIP = 0.01  # far below every tiny model's per-layer norm (about 0.1 to 0.7): clipping binds


@pytest.fixture(scope="module")
def chunks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Chunk, ...]:
    site = write_site(tmp_path_factory.mktemp("extraction-site"), 12)
    return make_chunks(site, shots=2, seed=7).chunks  # 4 chunks of 2 shots + 1 query


def hand_clipped_sum(loaded, chunks, heads, clip_norm) -> np.ndarray:
    """The reference: one chunk a forward pass, clipped per layer with the public helper."""
    total = np.zeros((len(heads), 16))
    for chunk in chunks:
        acts = forward_last_token_heads(loaded, [chunk_prompt(chunk)], instruction=None)
        rows = acts[0, heads.to_array()[:, 0], heads.to_array()[:, 1]].double().numpy()
        total += clip_per_layer(rows, row_layers=heads.row_layers(), clip_norm=clip_norm)
    return total


def layer_norms(rows: np.ndarray, heads: HeadSet) -> list[float]:
    return [float(np.linalg.norm(rows[heads.row_layers() == layer])) for layer in heads.layers]


@pytest.mark.parametrize("clip_norm", [TINY_CLIP, 1e3], ids=["binding", "loose"])
def test_clipped_sum_equals_the_sum_of_each_chunk_clipped_by_hand(loaded, chunks, clip_norm):
    # Arrange
    expected = hand_clipped_sum(loaded, chunks, SUBSET, clip_norm)

    # Act
    summed = extract_clipped_sum(loaded, chunks, heads=SUBSET, clip_norm=clip_norm, progress=False)

    # Assert
    assert summed.heads == SUBSET
    assert summed.total.dtype == np.float64
    assert summed.total.shape == (len(SUBSET), 16)
    np.testing.assert_allclose(summed.total, expected, rtol=0, atol=1e-5)


def test_each_chunk_moves_the_sum_by_at_most_the_clip_norm_per_layer(loaded, chunks):
    # Arrange
    heads = HeadSet.all_heads(num_layers=2, num_heads=4)

    # Act
    singles = [
        extract_clipped_sum(loaded, [c], heads=heads, clip_norm=TINY_CLIP, progress=False)
        for c in chunks
    ]

    # Assert: the bound binds, so every layer of every chunk sits exactly on it
    for single in singles:
        norms = layer_norms(single.total, heads)
        assert max(norms) <= TINY_CLIP * (1 + 1e-6)
        assert norms == pytest.approx([TINY_CLIP] * len(heads.layers), rel=1e-6)


@ONE_ARCH
def test_num_chunks_counts_the_summed_chunks(loaded, chunks):
    # Act
    counts = [
        extract_clipped_sum(
            loaded, chunks[:count], heads=SUBSET, clip_norm=1.0, progress=False
        ).num_chunks
        for count in (1, 3, 4)
    ]

    # Assert
    assert counts == [1, 3, 4]


@pytest.mark.parametrize("batch_size", [0, -2])
def test_batched_refuses_a_size_below_one(chunks, batch_size):
    # Act / Assert
    with pytest.raises(ConfigError, match="batch_size"):
        list(batched(chunks, batch_size))


def test_batch_size_does_not_change_the_clipped_sum_beyond_rounding(loaded, chunks):
    # Act
    one_at_a_time = extract_clipped_sum(
        loaded, chunks, heads=SUBSET, clip_norm=0.2, batch_size=1, progress=False
    )
    three_at_a_time = extract_clipped_sum(
        loaded, chunks, heads=SUBSET, clip_norm=0.2, batch_size=3, progress=False
    )

    # Assert
    np.testing.assert_allclose(one_at_a_time.total, three_at_a_time.total, rtol=0, atol=1e-5)


@ONE_ARCH
@pytest.mark.parametrize("batch_size", [0, -2])
def test_a_batch_size_below_one_is_a_config_error(loaded, chunks, batch_size):
    # Act / Assert
    with pytest.raises(ConfigError, match="batch_size"):
        extract_clipped_sum(
            loaded, chunks, heads=SUBSET, clip_norm=1.0, batch_size=batch_size, progress=False
        )


def test_batched_yields_consecutive_slices_of_at_most_size(chunks):
    # Act
    slices = list(batched(chunks, 3))

    # Assert
    assert [len(s) for s in slices] == [3, 1]
    assert tuple(c for s in slices for c in s) == chunks


def test_select_heads_takes_the_rows_of_the_head_set_as_float64(loaded, chunks):
    # Arrange
    acts = forward_last_token_heads(loaded, [chunk_prompt(c) for c in chunks[:2]], instruction=None)

    # Act
    rows = select_heads(acts, SUBSET)

    # Assert
    assert acts.shape == (2, 2, 4, 16)
    assert rows.shape == (2, len(SUBSET), 16)
    assert rows.dtype == np.float64
    np.testing.assert_array_equal(rows[1, 2], acts[1, 1, 0].double().numpy())


def test_chunk_prompt_shows_the_demonstrations_and_withholds_the_query_answer(chunks):
    # Act
    prompt = chunk_prompt(chunks[0])

    # Assert
    assert [d.answer for d in prompt.demonstrations] == [r.answer for r in chunks[0].demonstrations]
    assert prompt.query.answer is None
    assert prompt.query.question == chunks[0].query.question


def test_zero_shot_prompt_has_no_demonstrations_and_no_answer(chunks):
    # Act
    prompt = zero_shot_prompt(chunks[0].query)

    # Assert
    assert prompt.demonstrations == ()
    assert prompt.query.answer is None


def test_a_prompt_with_an_unpaddable_per_token_input_runs_alone_and_unpadded():
    # A tensor as long as the prompt that is not (1, seq) (a cross-attention mask, say) is
    # not something to guess how to pad: such a chunk runs alone, at its own length.
    plain = {"input_ids": torch.zeros(1, 20), "pixel_values": torch.zeros(3, 3, 8, 8)}
    crossed = {**plain, "cross_attention_mask": torch.zeros(1, 20, 3, 1)}

    assert fixed_shape._signature(plain, 2) == (32, -1, (("pixel_values", (3, 3, 8, 8)),))
    length, alone, _ = fixed_shape._signature(crossed, 2)
    assert (length, alone) == (20, 2)


@ONE_ARCH
def test_the_alone_path_gives_exactly_the_unpadded_single_pass(loaded, chunks, monkeypatch):
    # Arrange: force every chunk onto the alone path
    monkeypatch.setattr(
        fixed_shape,
        "_signature",
        lambda inputs, position: (inputs["input_ids"].shape[1], position, ()),
    )

    # Act
    summed = extract_clipped_sum(
        loaded, chunks, heads=SUBSET, clip_norm=TINY_CLIP, batch_size=4, progress=False
    )

    # Assert: bit for bit the sum of one unpadded pass a chunk
    np.testing.assert_array_equal(summed.total, hand_clipped_sum(loaded, chunks, SUBSET, TINY_CLIP))
