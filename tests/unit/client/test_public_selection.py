from __future__ import annotations

import numpy as np
import pytest
import torch

from client.activations.chunking import Chunk, make_chunks
from client.activations.extraction import chunk_prompt, forward_last_token_heads, zero_shot_prompt
from client.activations.scoring import last_token_attribution
from client.public.selection import (
    ReinforceSettings,
    public_activations,
    select_heads_attribution,
    select_heads_reinforce,
    suggested_clip_norm,
)
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet
from tests.site_data import write_site

# Checks that do not depend on the architecture run on one of them.
ONE_ARCH = pytest.mark.parametrize("tiny", ["llava"], indirect=True)
TINY_REINFORCE = ReinforceSettings(steps=3, samples=4, final_draws=2, final_queries=2, seed=1)


@pytest.fixture(scope="module")
def chunks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Chunk, ...]:
    site = write_site(tmp_path_factory.mktemp("public-site"), 9)
    return make_chunks(site, shots=2, seed=0).chunks  # 3 chunks


@pytest.fixture
def mean(loaded, chunks) -> torch.Tensor:
    return public_activations(loaded, chunks, progress=False).mean(0)


def test_public_activations_stack_every_chunk_prompt(loaded, chunks):
    # Act
    acts = public_activations(loaded, chunks, batch_size=2, progress=False)

    # Assert
    assert acts.shape == (len(chunks), 2, 4, 16)
    one = forward_last_token_heads(loaded, [chunk_prompt(chunks[2])], instruction=None)
    torch.testing.assert_close(acts[2], one[0], rtol=0, atol=1e-5)


@ONE_ARCH
def test_public_activations_of_no_chunks_is_a_config_error(loaded):
    # Act / Assert
    with pytest.raises(ConfigError, match="chunk"):
        public_activations(loaded, [], progress=False)


def test_attribution_selection_keeps_the_k_heads_of_largest_gain(loaded, chunks, mean):
    # Arrange: the first-order gain of overwriting each head with the mean, by hand
    queries = [chunk.query for chunk in chunks]
    gain = torch.zeros(2, 4)
    for record in queries:
        acts, grads = last_token_attribution(
            loaded, [zero_shot_prompt(record)], [record.answer], instruction=None
        )
        gain += ((mean - acts) * grads).sum(dim=(0, -1))
    flat = gain.flatten().tolist()

    for k in (1, 3, 8):
        # Act
        heads = select_heads_attribution(loaded, mean, queries, k=k, batch_size=2)

        # Assert
        assert len(heads) == k
        chosen = {layer * 4 + head for layer, head in heads.heads}
        others = [flat[i] for i in range(8) if i not in chosen]
        assert min(flat[i] for i in chosen) >= max(others, default=-np.inf) - 1e-5


@ONE_ARCH
@pytest.mark.parametrize("k", [0, 9])
def test_attribution_k_outside_one_to_the_head_count_is_a_config_error(loaded, chunks, mean, k):
    # Act / Assert
    with pytest.raises(ConfigError, match="k must"):
        select_heads_attribution(loaded, mean, [chunks[0].query], k=k)


def test_reinforce_returns_the_same_non_empty_head_set_for_a_seed(loaded, chunks, mean):
    # Arrange
    queries = [chunk.query for chunk in chunks]

    # Act
    first = select_heads_reinforce(loaded, mean, queries, settings=TINY_REINFORCE, progress=False)
    again = select_heads_reinforce(loaded, mean, queries, settings=TINY_REINFORCE, progress=False)

    # Assert
    assert isinstance(first, HeadSet)
    assert len(first) >= 1
    assert all(0 <= layer < 2 and 0 <= head < 4 for layer, head in first.heads)
    assert first == again


@ONE_ARCH
def test_reinforce_without_queries_is_a_config_error(loaded, mean):
    # Act / Assert
    with pytest.raises(ConfigError, match="queries"):
        select_heads_reinforce(loaded, mean, [], settings=TINY_REINFORCE, progress=False)


def test_suggested_clip_norm_is_the_median_per_layer_norm_of_the_heads_in_scope():
    # Arrange: 5 chunks x 3 layers in scope = 15 norms, so the median is one of them
    acts = torch.randn(5, 3, 4, 2, generator=torch.Generator().manual_seed(0))
    heads = HeadSet.of([(0, 1), (0, 3), (1, 0), (2, 2), (2, 3)])
    by_layer = {0: [1, 3], 1: [0], 2: [2, 3]}
    norms = [
        float(np.linalg.norm(acts[chunk, layer, rows].numpy()))
        for chunk in range(5)
        for layer, rows in by_layer.items()
    ]

    # Act
    clip = suggested_clip_norm(acts, heads)

    # Assert
    assert clip == pytest.approx(float(np.median(norms)), rel=1e-6)
