"""The benchmarks' release-first votes are the product's: same chunks, same reference, same sum."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client.activations.chunking import Chunk, make_chunks
from client.public.selection import public_activations
from client.release.single_holder import LocalSums
from protocol import SelectionMode, vote_slots
from tests.plans import make_plan
from tests.site_data import write_site

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
ONE_ARCH = pytest.mark.parametrize("tiny", ["llava"], indirect=True)


@pytest.fixture(scope="module")
def headline_data() -> Any:
    sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module("_headline_data")


@pytest.fixture(scope="module")
def chunks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Chunk, ...]:
    return make_chunks(
        write_site(tmp_path_factory.mktemp("bench-votes"), 9), shots=2, seed=0
    ).chunks


@ONE_ARCH
@pytest.mark.parametrize("candidates", [None, ((0, 1), (0, 3), (1, 0), (1, 2))])
def test_cached_attribution_votes_equal_the_site_path(loaded, chunks, headline_data, candidates):
    # Arrange: a private plan (among every head, or among four candidates), a noisy-looking
    # dense reference
    plan = make_plan(
        selection=SelectionMode.PRIVATE, score_top_r=3, model_fingerprint=loaded.fingerprint,
        candidate_heads=candidates,
    )  # fmt: skip
    sums = LocalSums(loaded, chunks, plan, progress=False, batch_size=1)
    acts = public_activations(loaded, chunks, progress=False).numpy()
    reference = acts.mean(0) + np.random.default_rng(0).normal(size=acts.shape[1:])
    site = headline_data.SiteActs(acts, sums)
    among = vote_slots(plan, site.layout())

    # Act
    production = sums.vote_sum(reference)
    benchmark = site.attribution_vote(reference, plan.score_top_r, among)

    # Assert: the same votes, chunk count included, cast among the plan's candidates only
    np.testing.assert_array_equal(benchmark.total, production.total)
    assert benchmark.num_chunks == production.num_chunks == len(chunks)
    assert benchmark.total.sum() == 3 * len(chunks)
    outside = np.setdiff1d(np.arange(production.total.size), among)
    assert not production.total[outside].any()
