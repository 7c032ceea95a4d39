"""The shipped embedded models: they load offline, reproduce their documented accuracies, come
from the committed script and command, and a short retraining reproduces the documented curve."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from client.models import load_model
from client.models.embedded import ARCHITECTURES, EMBEDDED_MODEL_DIRS, embedded_model_path
from client.public.task_suite import score_tasks

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "train_embedded_model.py"
SIZES = tuple(EMBEDDED_MODEL_DIRS)
# The documented scores were measured on 200 test queries a task. Re-running the same seeds
# on the same weights gives the same prompts; BLAS differences between CPUs can flip a
# near-tied argmax now and then. 0.05 is 10 such flips in 200, far beyond what was seen.
TOLERANCE = 0.05
# The short retraining compares the held-out 4-shot accuracy (64 queries) and the loss at one
# logged step. On one machine the run is bit-identical (deterministic algorithms, one thread);
# on another CPU, rounding differs and the trajectory drifts. A different SEED is a far larger
# perturbation than rounding, and stays well inside these bounds: at step 200, seeds 1 and 2
# gave 4-shot 0.906 / 0.938 and loss 0.328 / 0.246 against seed 0's documented 0.906 / 0.258
# (measured 2026-12-01, `--seed N --stop-after 200`).
SHORT_STEPS = 200
SHORT_ACCURACY_TOLERANCE = 0.2
SHORT_LOSS_TOLERANCE = 0.3


def _training(size: str) -> dict[str, Any]:
    record: dict[str, Any] = json.loads((EMBEDDED_MODEL_DIRS[size] / "training.json").read_text())
    return record


@pytest.mark.slow
@pytest.mark.reproduction
@pytest.mark.parametrize("size", SIZES)
def test_shipped_weights_reproduce_documented_accuracies(tmp_path, size):
    # Arrange
    scores = json.loads((EMBEDDED_MODEL_DIRS[size] / "scores.json").read_text())
    documented = {entry["task"]: entry for entry in scores["tasks"]}
    loaded = load_model(embedded_model_path(size), device="cpu")
    # Act
    measured = score_tasks(loaded, tmp_path)
    # Assert
    for result in measured:
        expected = documented[result.task]
        assert result.zero_shot == pytest.approx(expected["zero_shot"], abs=TOLERANCE)
        assert result.icl == pytest.approx(expected["icl"], abs=TOLERANCE)
        assert result.task_vector == pytest.approx(expected["task_vector"], abs=TOLERANCE)


@pytest.mark.parametrize("size", SIZES)
def test_embedded_model_loads_through_the_llava_adapter_offline(monkeypatch, size):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_model(embedded_model_path(size), device="cpu")
    shape = loaded.adapter.head_shape(loaded.model)
    assert loaded.model.config.model_type == "llava"
    assert (shape.num_layers, shape.num_heads) == (
        ARCHITECTURES[size]["text_layers"],
        ARCHITECTURES[size]["text_heads"],
    )
    assert loaded.fingerprint.startswith("sha256:")


def test_deep_model_has_at_least_8_layers_and_64_heads():
    arch = ARCHITECTURES["deep"]
    assert arch["text_layers"] >= 8
    assert arch["text_layers"] * arch["text_heads"] >= 64


@pytest.mark.parametrize("size", SIZES)
def test_shipped_weights_come_from_the_documented_command(size):
    # Arrange
    training = _training(size)
    usage = re.findall(
        r"^\s+(\.venv/bin/python scripts/train_embedded_model\.py.*)$",
        SCRIPT.read_text(),
        flags=re.MULTILINE,
    )
    # Assert: the script wrote the record itself, with what decides the weights.
    assert training["command"] == f".venv/bin/python scripts/train_embedded_model.py --size {size}"
    assert training["command"] in usage
    assert training["settings"]["size"] == size
    assert training["settings"]["stop_after"] == "None"
    assert {"torch", "transformers", "tokenizers", "numpy", "python"} <= set(training["libraries"])
    assert training["checkpoints"][-1]["step"] == int(training["settings"]["steps"]) - 1
    assert len(training["task_scores"]) == 4
    weights = (EMBEDDED_MODEL_DIRS[size] / "model.safetensors").stat().st_size
    assert weights < 5_000_000


@pytest.mark.slow
@pytest.mark.reproduction
def test_short_retraining_reproduces_the_documented_checkpoint(tmp_path):
    # Arrange: the small model's schedule, stopped after SHORT_STEPS steps.
    documented = next(c for c in _training("small")["checkpoints"] if c["step"] == SHORT_STEPS)
    # Act
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--size",
            "small",
            "--stop-after",
            str(SHORT_STEPS),
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    # Assert
    assert result.returncode == 0, result.stderr[-2000:]
    retrained = json.loads((tmp_path / "training.json").read_text())
    measured = next(c for c in retrained["checkpoints"] if c["step"] == SHORT_STEPS)
    assert measured["icl_4_shot"] == pytest.approx(
        documented["icl_4_shot"], abs=SHORT_ACCURACY_TOLERANCE
    )
    assert measured["loss"] == pytest.approx(documented["loss"], abs=SHORT_LOSS_TOLERANCE)


def test_training_script_runs_a_few_steps_and_writes_a_loadable_model(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = load_model(tmp_path, device="cpu")
    assert loaded.model.config.model_type == "llava"
    record = json.loads((tmp_path / "training.json").read_text())
    assert record["command"].endswith(f"--smoke --out {tmp_path}")
