from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

import client.release.single_holder as release_module
from client.activations.chunking import Chunk, make_chunks
from client.models import LoadedModel, instruction_digest
from client.release.single_holder import LocalSums, run_single_holder_release
from dpmtv_common.artifact import load_artifact
from dpmtv_common.crypto import SigningKey, TrustedKeys
from dpmtv_common.errors import ConfigError, ModelMismatchError, PrivacyBudgetExceededError
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.budget import PrivacyBudget
from dpmtv_common.privacy.composition import epsilon_bound
from dpmtv_common.privacy.ledger import PrivacyLedger, ReleaseState
from dpmtv_common.privacy.testing import SeededNoise
from protocol import (
    PROTOCOL_VERSION,
    ReleaseOrder,
    ReleasePlan,
    SelectionMode,
    plan_calibration,
)
from tests.site_data import write_site

# One architecture is enough here: the per-architecture behaviour is covered by the
# extraction and scoring tests; this module checks the release flow and the ledger.
pytestmark = pytest.mark.parametrize("tiny", ["llava"], indirect=True)

DELTA = 1e-5
PUBLIC_HEADS = ((0, 1), (1, 2), (1, 3))
ALL_HEADS = HeadSet.all_heads(num_layers=2, num_heads=4)
EPSILON = 0.5  # calibrates in about a second; larger epsilons take the accountant longer


@pytest.fixture(scope="module")
def chunks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Chunk, ...]:
    site = write_site(tmp_path_factory.mktemp("release-site"), 12)
    return make_chunks(site, shots=2, seed=5).chunks  # 4 chunks


@pytest.fixture(scope="module")
def key() -> SigningKey:
    return SigningKey.generate()


@pytest.fixture
def ledger(tmp_path: Path):
    with PrivacyLedger.open(tmp_path / "ledger.sqlite", PrivacyBudget(10.0, DELTA)) as opened:
        yield opened


def make_plan(loaded: LoadedModel, selection=SelectionMode.PRIVATE, order=None, **overrides):
    fields = {
        "protocol_version": PROTOCOL_VERSION,
        "release_id": "r1",
        "task": "shapes",
        "model_fingerprint": loaded.fingerprint,
        "epsilon": EPSILON,
        "delta": DELTA,
        "shots": 2,
        "clip_norm": 0.5,
        "selection": selection,
        "order": order or ReleaseOrder.SELECT_FIRST,
        "num_selected_heads": 3,
        "public_heads": PUBLIC_HEADS if selection is SelectionMode.PUBLIC else None,
        "selection_share": 0.3,
        "score_top_r": 2,
        "min_sites": 1,
        "max_chunks_per_site": None,
        "created": "2026-11-29T00:00:00+00:00",
    }
    fields.update(overrides)
    return ReleasePlan(**fields)


@dataclass
class SpySums(LocalSums):
    """LocalSums that records its calls and can fail in one of them."""

    calls: list[str] = field(default_factory=list)
    fail_in: str | None = None

    def activation_sum(self, heads):
        self.calls.append("activations")
        if self.fail_in == "activations":
            raise RuntimeError("activation sum failed")
        return super().activation_sum(heads)

    def vote_sum(self, reference):
        self.calls.append("votes")
        if self.fail_in == "votes":
            raise RuntimeError("vote sum failed")
        return super().vote_sum(reference)


def spy(loaded, chunks, plan, fail_in=None) -> SpySums:
    return SpySums(loaded, chunks, plan, progress=False, fail_in=fail_in)


def release(plan, sums, ledger, key, output):
    return run_single_holder_release(
        plan, sums=sums, ledger=ledger, signing_key=key, output=output, noise=SeededNoise(0)
    )


def only_entry(ledger: PrivacyLedger):
    (entry,) = ledger.releases()
    return entry


def test_release_writes_a_verifiable_artifact_and_commits_its_cost(
    loaded, chunks, ledger, key, tmp_path
):
    # Arrange
    plan = make_plan(loaded)
    calibration = plan_calibration(plan)

    # Act
    result = release(plan, spy(loaded, chunks, plan), ledger, key, tmp_path / "artifact")

    # Assert: the artifact verifies with the signer's key for this model
    artifact = load_artifact(
        result.artifact,
        trusted_keys=TrustedKeys([key.verify_key]),
        expected_model_fingerprint=loaded.fingerprint,
    )
    assert artifact.heads == result.outcome.heads
    np.testing.assert_array_equal(artifact.values, result.outcome.values.astype(np.float32))
    assert artifact.manifest.release_id == "r1"
    assert artifact.manifest.num_chunks == len(chunks)
    assert artifact.manifest.epsilon == pytest.approx(calibration.bound.epsilon)
    # Assert: the ledger holds one committed release costing the calibrated event
    entry = only_entry(ledger)
    assert entry.release_id == "r1"
    assert entry.state is ReleaseState.COMMITTED
    spent = ledger.spent()
    assert spent is not None
    assert spent.epsilon == pytest.approx(epsilon_bound([calibration.event], delta=DELTA).epsilon)
    assert spent.epsilon <= plan.epsilon * (1 + 1e-6)


@pytest.mark.parametrize("instruction", ["Answer with one word.", None])
def test_the_manifest_records_the_digest_of_the_instruction_the_chunks_were_prompted_with(
    loaded, chunks, ledger, key, tmp_path, instruction
):
    plan = make_plan(loaded, SelectionMode.ALL)
    sums = SpySums(loaded, chunks, plan, instruction=instruction, progress=False)

    result = release(plan, sums, ledger, key, tmp_path / "artifact")

    assert result.manifest.instruction_sha256 == instruction_digest(instruction)


@pytest.mark.parametrize("order", list(ReleaseOrder))
@pytest.mark.parametrize("selection", list(SelectionMode))
def test_every_selection_mode_and_order_releases_its_head_count(
    loaded, chunks, ledger, key, tmp_path, selection, order
):
    # Arrange
    plan = make_plan(loaded, selection, order)
    sums = spy(loaded, chunks, plan)

    # Act
    result = release(plan, sums, ledger, key, tmp_path / "artifact")

    # Assert
    heads = result.outcome.heads
    if selection is SelectionMode.ALL:
        assert heads == ALL_HEADS
    else:
        assert len(heads) == plan.num_selected_heads
        assert set(heads.heads) <= set(ALL_HEADS.heads)
    if selection is SelectionMode.PUBLIC:
        assert heads.heads == PUBLIC_HEADS
    assert result.manifest.num_heads == len(heads)
    assert result.outcome.values.shape == (len(heads), 16)
    assert sums.calls.count("activations") == 1
    assert sums.calls.count("votes") == (selection is SelectionMode.PRIVATE)
    assert only_entry(ledger).state is ReleaseState.COMMITTED


def test_a_plan_for_another_model_is_refused_before_anything_is_reserved(
    loaded, chunks, ledger, key, tmp_path
):
    # Arrange
    plan = make_plan(loaded, model_fingerprint="sha256:another-model")
    sums = spy(loaded, chunks, plan)

    # Act / Assert
    with pytest.raises(ModelMismatchError, match="fingerprint"):
        release(plan, sums, ledger, key, tmp_path / "artifact")
    assert ledger.releases() == []
    assert sums.calls == []


@pytest.mark.parametrize(
    ("selection", "order", "fail_in"),
    [
        (SelectionMode.PRIVATE, ReleaseOrder.SELECT_FIRST, "votes"),
        (SelectionMode.ALL, ReleaseOrder.SELECT_FIRST, "activations"),
        (SelectionMode.PUBLIC, ReleaseOrder.RELEASE_FIRST, "activations"),
        (SelectionMode.PRIVATE, ReleaseOrder.RELEASE_FIRST, "activations"),
    ],
)
def test_a_failure_before_the_first_noisy_output_aborts_the_reservation(
    loaded, chunks, ledger, key, tmp_path, selection, order, fail_in
):
    # Arrange
    plan = make_plan(loaded, selection, order)
    output = tmp_path / "artifact"

    # Act
    with pytest.raises(RuntimeError, match=f"{fail_in[:4]}.* sum failed"):
        release(plan, spy(loaded, chunks, plan, fail_in=fail_in), ledger, key, output)

    # Assert: refunded
    entry = only_entry(ledger)
    assert entry.state is ReleaseState.ABORTED
    assert "sum failed" in entry.note
    assert ledger.spent() is None
    assert not output.exists()


def test_a_failure_after_the_noisy_release_keeps_the_cost_spent(
    loaded, chunks, ledger, key, tmp_path
):
    # Arrange: release-first private draws the Gaussian before it asks for votes
    plan = make_plan(loaded, SelectionMode.PRIVATE, ReleaseOrder.RELEASE_FIRST)

    # Act
    with pytest.raises(RuntimeError, match="vote sum failed"):
        release(plan, spy(loaded, chunks, plan, fail_in="votes"), ledger, key, tmp_path / "a")

    # Assert
    assert only_entry(ledger).state is ReleaseState.COMMITTED
    assert ledger.spent() is not None


def test_a_failed_artifact_write_keeps_the_cost_spent(
    loaded, chunks, ledger, key, tmp_path, monkeypatch
):
    # Arrange: the disk fails while the signed artifact is written, after the noise
    plan = make_plan(loaded)
    output = tmp_path / "artifact"

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(release_module, "write_artifact", full_disk)

    # Act
    with pytest.raises(OSError, match="No space left"):
        release(plan, spy(loaded, chunks, plan), ledger, key, output)

    # Assert: noise was drawn, so the release counts (fail closed)
    assert only_entry(ledger).state is ReleaseState.COMMITTED
    spent = ledger.spent()
    assert spent is not None
    event = plan_calibration(plan).event
    assert spent.epsilon == pytest.approx(epsilon_bound([event], delta=DELTA).epsilon)


def _occupied(tmp_path: Path) -> Path:
    output = tmp_path / "occupied"
    output.mkdir()
    (output / "notes.txt").write_text("mine")
    return output


def _under_a_file(tmp_path: Path) -> Path:
    (tmp_path / "a-file").write_text("x")
    return tmp_path / "a-file" / "artifact"


@pytest.mark.parametrize(
    ("output_of", "overrides", "problem"),
    [
        (_occupied, {}, r"output must not exist yet, got .*occupied.* which exists"),
        (_under_a_file, {}, r"output must lie inside a folder, got .* under the file"),
        (
            None,
            {"num_selected_heads": 100},
            r"heads \(num_selected_heads\) must be at most the model's 8 heads",
        ),
        (None, {"score_top_r": 100}, r"top-r \(score_top_r\) must be at most the model's 8 heads"),
    ],
    ids=["output-exists", "output-under-a-file", "heads-100", "top-r-100"],
)
def test_a_mistake_the_holder_could_catch_is_refused_before_any_epsilon_is_reserved(
    loaded, chunks, ledger, key, tmp_path, output_of, overrides, problem
):
    # Arrange
    plan = make_plan(loaded, **overrides)
    output = output_of(tmp_path) if output_of else tmp_path / "artifact"
    sums = spy(loaded, chunks, plan)

    # Act / Assert
    with pytest.raises(ConfigError, match=problem):
        release(plan, sums, ledger, key, output)
    assert ledger.releases() == []
    assert sums.calls == []
    if output_of is _occupied:
        assert (output / "notes.txt").read_text() == "mine"


def test_public_heads_outside_the_model_are_refused_before_the_reservation(
    loaded, chunks, ledger, key, tmp_path
):
    plan = make_plan(
        loaded, SelectionMode.PUBLIC, public_heads=((0, 1), (1, 2), (5, 0)), num_selected_heads=3
    )

    with pytest.raises(ConfigError, match=r"public heads must lie in the layers that carry heads"):
        release(plan, spy(loaded, chunks, plan), ledger, key, tmp_path / "artifact")
    assert ledger.releases() == []


def test_overwrite_replaces_an_existing_artifact_and_refuses_a_plain_file(
    loaded, chunks, ledger, key, tmp_path
):
    # Arrange: a first release leaves an artifact at the output path
    first = make_plan(loaded)
    output = tmp_path / "artifact"
    release(first, spy(loaded, chunks, first), ledger, key, output)
    second = make_plan(loaded, release_id="r2")
    a_file = tmp_path / "plain.txt"
    a_file.write_text("x")

    # Act
    result = run_single_holder_release(
        second,
        sums=spy(loaded, chunks, second),
        ledger=ledger,
        signing_key=key,
        output=output,
        noise=SeededNoise(1),
        overwrite=True,
    )

    # Assert
    assert result.manifest.release_id == "r2"
    occupied = _occupied(tmp_path)
    with pytest.raises(ConfigError, match=r"holding other entries \['notes.txt'\]"):
        run_single_holder_release(
            make_plan(loaded, release_id="r3"),
            sums=spy(loaded, chunks, second),
            ledger=ledger,
            signing_key=key,
            output=occupied,
            noise=SeededNoise(2),
            overwrite=True,
        )
    with pytest.raises(ConfigError, match=r"not a folder"):
        run_single_holder_release(
            make_plan(loaded, release_id="r3"),
            sums=spy(loaded, chunks, second),
            ledger=ledger,
            signing_key=key,
            output=a_file,
            noise=SeededNoise(2),
            overwrite=True,
        )
    assert [e.release_id for e in ledger.releases()] == ["r1", "r2"]


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
def test_an_output_folder_this_user_cannot_write_is_refused_before_the_reservation(
    loaded, chunks, ledger, key, tmp_path
):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    plan = make_plan(loaded)
    try:
        with pytest.raises(ConfigError, match=r"output must be writable"):
            release(plan, spy(loaded, chunks, plan), ledger, key, locked / "artifact")
    finally:
        locked.chmod(0o700)
    assert ledger.releases() == []


def test_a_release_over_budget_is_refused_before_any_extraction(loaded, chunks, key, tmp_path):
    # Arrange
    plan = make_plan(loaded)
    sums = spy(loaded, chunks, plan)
    budget = PrivacyBudget(EPSILON / 2, DELTA)

    # Act / Assert
    with PrivacyLedger.open(tmp_path / "small.sqlite", budget) as ledger:
        with pytest.raises(PrivacyBudgetExceededError):
            release(plan, sums, ledger, key, tmp_path / "artifact")
        assert ledger.releases() == []
    assert sums.calls == []
    assert not (tmp_path / "artifact").exists()


def test_a_release_without_chunks_is_a_config_error_and_reserves_nothing(
    loaded, ledger, key, tmp_path
):
    # Arrange
    plan = make_plan(loaded)

    # Act / Assert
    with pytest.raises(ConfigError, match="chunk"):
        release(plan, spy(loaded, (), plan), ledger, key, tmp_path / "artifact")
    assert ledger.releases() == []


def test_local_votes_switch_to_attribution_against_a_reference(loaded, chunks):
    # Arrange
    plan = make_plan(loaded)
    sums = LocalSums(loaded, chunks, plan, progress=False)
    reference = np.zeros((2, 4, 16))

    # Act
    shift = sums.vote_sum(None)
    attribution = sums.vote_sum(reference)

    # Assert: both are top-r votes of every chunk
    assert shift.num_chunks == attribution.num_chunks == len(chunks)
    assert shift.total.sum() == attribution.total.sum() == len(chunks) * plan.score_top_r
