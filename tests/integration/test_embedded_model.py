"""The shipped embedded model: it loads offline, reproduces its documented accuracies, and its
training script still runs (a few steps; CI never retrains it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from client.evaluation.task_suite import score_tasks
from client.models import load_model
from client.models.embedded import EMBEDDED_MODEL_DIR, embedded_model_path

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
# The documented scores were measured on 200 test queries a task. Re-running the same seeds
# on the same weights gives the same prompts; BLAS differences between CPUs can flip a
# near-tied argmax now and then. 0.05 is 10 such flips in 200, far beyond what was seen.
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def documented() -> dict[str, dict[str, float]]:
    scores = json.loads((EMBEDDED_MODEL_DIR / "scores.json").read_text())
    return {entry["task"]: entry for entry in scores["tasks"]}


@pytest.mark.slow
def test_shipped_weights_reproduce_documented_accuracies(tmp_path, documented):
    # Arrange
    loaded = load_model(embedded_model_path(), device="cpu")
    # Act
    measured = score_tasks(loaded, tmp_path)
    # Assert
    for scores in measured:
        expected = documented[scores.task]
        assert scores.zero_shot == pytest.approx(expected["zero_shot"], abs=TOLERANCE)
        assert scores.icl == pytest.approx(expected["icl"], abs=TOLERANCE)
        assert scores.task_vector == pytest.approx(expected["task_vector"], abs=TOLERANCE)


def test_embedded_model_loads_through_the_llava_adapter_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_model(embedded_model_path(), device="cpu")
    shape = loaded.adapter.head_shape(loaded.model)
    assert loaded.model.config.model_type == "llava"
    assert shape.num_layers * shape.num_heads >= 8
    assert loaded.fingerprint.startswith("sha256:")


def test_training_script_runs_a_few_steps_and_writes_a_loadable_model(tmp_path):
    result = subprocess.run(
        [sys.executable, "scripts/train_embedded_model.py", "--smoke", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = load_model(tmp_path, device="cpu")
    assert loaded.model.config.model_type == "llava"
