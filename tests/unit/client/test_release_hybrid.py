"""A single holder releases on a hybrid model: only the heads the model carries, L_scope of those.

The tiny Qwen3.5 has 2 decoder layers of 4 heads; layer 0 is Gated DeltaNet (linear attention,
no heads), layer 1 softmax attention. Every release mode must stay in layer 1: votes, the
Gaussian's scope (so its noise is sized for one layer, not two), the released heads and the
artifact, and a plan naming a head of layer 0 costs nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client.activations.chunking import Chunk, make_chunks
from client.activations.scoring import ScoreMethod, chunk_head_votes
from client.models import LoadedModel, adapter_for, build_tiny_model
from client.release.single_holder import LocalSums, run_single_holder_release
from dpmtv_common.artifact import load_artifact
from dpmtv_common.crypto import SigningKey, TrustedKeys
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.budget import PrivacyBudget
from dpmtv_common.privacy.ledger import PrivacyLedger
from dpmtv_common.privacy.testing import SeededNoise
from protocol import PROTOCOL_VERSION, ReleaseOrder, ReleasePlan, SelectionMode, plan_calibration
from tests.site_data import write_site

HEADS = 4
CARRIED = HeadSet.of((1, head) for head in range(HEADS))  # layer 0 carries no heads
DELTA = 1e-5


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    model, processor = build_tiny_model("qwen3_5", seed=7)
    return LoadedModel(model, processor, adapter_for(model), "sha256:test-qwen3_5")


@pytest.fixture(scope="module")
def chunks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Chunk, ...]:
    site = write_site(tmp_path_factory.mktemp("hybrid-site"), 9)
    return make_chunks(site, shots=2, seed=3).chunks  # 3 chunks


def make_plan(loaded: LoadedModel, selection: SelectionMode, order: ReleaseOrder, **overrides):
    fields: dict[str, Any] = {
        "protocol_version": PROTOCOL_VERSION,
        "release_id": "r1",
        "task": "shapes",
        "model_fingerprint": loaded.fingerprint,
        "epsilon": 0.5,
        "delta": DELTA,
        "shots": 2,
        "clip_norm": 0.5,
        "selection": selection,
        "order": order,
        "num_selected_heads": 2,
        "public_heads": ((1, 0), (1, 3)) if selection is SelectionMode.PUBLIC else None,
        "selection_share": 0.3,
        "score_top_r": 2,
        "min_sites": 1,
        "max_chunks_per_site": None,
        "created": "2026-11-29T00:00:00+00:00",
    }
    fields.update(overrides)
    return ReleasePlan(**fields)


def release(plan, loaded, chunks, tmp_path: Path, method=ScoreMethod.SHIFT):
    key = SigningKey.generate()
    sums = LocalSums(loaded, chunks, plan, score_method=method, progress=False)
    with PrivacyLedger.open(tmp_path / "ledger.sqlite", PrivacyBudget(10.0, DELTA)) as ledger:
        result = run_single_holder_release(
            plan,
            sums=sums,
            ledger=ledger,
            signing_key=key,
            output=tmp_path / "artifact",
            noise=SeededNoise(0),
        )
        entries = ledger.releases()
    artifact = load_artifact(
        result.artifact,
        trusted_keys=TrustedKeys([key.verify_key]),
        expected_model_fingerprint=loaded.fingerprint,
    )
    return result, artifact, entries


CASES = [
    (SelectionMode.PRIVATE, ReleaseOrder.SELECT_FIRST, ScoreMethod.SHIFT),
    (SelectionMode.PRIVATE, ReleaseOrder.SELECT_FIRST, ScoreMethod.ATTRIBUTION),
    (SelectionMode.PRIVATE, ReleaseOrder.RELEASE_FIRST, ScoreMethod.ATTRIBUTION),
    (SelectionMode.ALL, ReleaseOrder.RELEASE_FIRST, ScoreMethod.SHIFT),
    (SelectionMode.PUBLIC, ReleaseOrder.SELECT_FIRST, ScoreMethod.SHIFT),
]


@pytest.mark.parametrize(
    ("selection", "order", "method"), CASES, ids=[f"{s}-{o}-{m}" for s, o, m in CASES]
)
def test_a_hybrid_release_stays_in_the_layers_that_carry_heads(
    loaded, chunks, tmp_path, selection, order, method
):
    # Arrange
    plan = make_plan(loaded, selection, order)

    # Act
    result, artifact, _ = release(plan, loaded, chunks, tmp_path, method)

    # Assert: no released or noised head in layer 0; sigma sized for one layer
    outcome = result.outcome
    assert set(artifact.heads.heads) <= set(CARRIED.heads)
    assert set(outcome.gaussian_heads.heads) <= set(CARRIED.heads)
    if selection is SelectionMode.ALL:
        assert artifact.heads == CARRIED
    parameters = artifact.manifest.accountant_parameters
    assert parameters["num_layers_in_scope"] == 1
    one_layer = plan_calibration(plan).gaussian(clip_norm=plan.clip_norm, heads=CARRIED)
    assert outcome.noise_std == pytest.approx(one_layer.noise_std)
    assert np.isfinite(artifact.values).all()


@pytest.mark.parametrize("method", list(ScoreMethod))
def test_chunks_vote_only_for_carried_heads(loaded, chunks, method):
    # top-r of 4 = every carried head: a vote in layer 0 would show as a non-zero there
    votes = chunk_head_votes(loaded, chunks, top_r=HEADS, method=method, progress=False)

    assert votes.total.shape == (2 * HEADS,)
    np.testing.assert_array_equal(votes.total[:HEADS], 0.0)
    np.testing.assert_array_equal(votes.total[HEADS:], len(chunks))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            {"selection": SelectionMode.PUBLIC, "public_heads": ((0, 1), (1, 2))},
            r"public heads must lie in the layers that carry heads \[1\] \(of 2\)",
        ),
        ({"num_selected_heads": 5}, r"num_selected_heads\) must be at most the model's 4 heads"),
        ({"score_top_r": 5}, r"score_top_r\) must be at most the model's 4 heads"),
    ],
)
def test_heads_the_hybrid_does_not_carry_are_refused_before_the_reservation(
    loaded, chunks, tmp_path, overrides, match
):
    fields = {"selection": SelectionMode.PRIVATE, "order": ReleaseOrder.SELECT_FIRST} | overrides
    if "public_heads" in overrides:
        fields["num_selected_heads"] = len(overrides["public_heads"])
    plan = make_plan(loaded, **fields)
    ledger_file = tmp_path / "ledger.sqlite"

    with pytest.raises(ConfigError, match=match):
        release(plan, loaded, chunks, tmp_path)

    with PrivacyLedger.open(ledger_file, PrivacyBudget(10.0, DELTA)) as ledger:
        assert ledger.releases() == []
