"""A holder's sums prompt their chunks under the plan's crop cap, whoever built them."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import numpy as np
import pytest

from client.activations.chunking import Chunk, make_chunks
from client.activations.extraction import extract_clipped_sum
from client.models import LoadedModel
from client.release.single_holder import LocalSums
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet
from protocol import PROTOCOL_VERSION, ReleaseOrder, ReleasePlan, SelectionMode
from tests.site_data import write_site
from tests.unit.client.test_image_crops import _idefics_tiles, splitting_model

ALL_HEADS = HeadSet.all_heads(num_layers=2, num_heads=4)


@pytest.fixture(scope="module")
def chunks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Chunk, ...]:
    site = write_site(tmp_path_factory.mktemp("crops-site"), 6)
    return make_chunks(site, shots=2, seed=3).chunks  # 2 chunks


@pytest.fixture(scope="module")
def smolvlm() -> LoadedModel:
    return splitting_model("smolvlm", _idefics_tiles)  # 17 crops an image as shipped


def plan(loaded: LoadedModel, max_image_crops: int | None) -> ReleasePlan:
    return ReleasePlan(
        protocol_version=PROTOCOL_VERSION,
        release_id="r-crops",
        task="shapes",
        model_fingerprint=loaded.fingerprint,
        epsilon=1.0,
        delta=1e-5,
        shots=2,
        clip_norm=100.0,  # far above the norms: the sums compare unclipped activations
        selection=SelectionMode.ALL,
        order=ReleaseOrder.SELECT_FIRST,
        num_selected_heads=2,
        public_heads=None,
        selection_share=0.3,
        score_top_r=2,
        min_sites=1,
        max_chunks_per_site=None,
        max_image_crops=max_image_crops,
        created=datetime.now(UTC).isoformat(),
    )


def summed(loaded: LoadedModel, chunks) -> np.ndarray:
    result = extract_clipped_sum(loaded, chunks, heads=ALL_HEADS, clip_norm=100.0, progress=False)
    return np.asarray(result.total)


def test_local_sums_prompt_every_chunk_under_the_plan_s_cap(smolvlm, chunks):
    # Act
    sums = LocalSums(smolvlm, chunks, plan(smolvlm, 1), progress=False)
    released = np.asarray(sums.activation_sum(ALL_HEADS).total)

    # Assert: the sum is the capped model's, not the shipped one's
    assert sums.loaded.max_image_crops == 1
    np.testing.assert_array_equal(released, summed(smolvlm.with_image_crops(1), chunks))
    assert not np.allclose(released, summed(smolvlm, chunks))


def test_local_sums_without_a_cap_use_the_processor_as_shipped(smolvlm, chunks):
    sums = LocalSums(smolvlm, chunks, plan(smolvlm, None), progress=False)

    assert sums.loaded is smolvlm


def test_local_sums_refuse_a_cap_the_adapter_cannot_apply(smolvlm, chunks):
    undeclared = dataclasses.replace(
        smolvlm, adapter=dataclasses.replace(smolvlm.adapter, image_crops=None)
    )

    with pytest.raises(ConfigError, match="max_image_crops must be unset for model type"):
        LocalSums(undeclared, chunks, plan(undeclared, 3), progress=False)
