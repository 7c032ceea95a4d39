"""Tests of ``client.checks.dataset`` and ``dpmtv-site data check``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from client.activations.chunking import make_chunks
from client.checks.dataset import (
    check_dataset,
    check_with_model,
    chunk_prompt_lengths,
    report_lines,
)
from client.cli.main import main
from client.models import load_model
from client.models.embedded import EMBEDDED_MODEL_DIR
from dpmtv_common.errors import DataError

ONE_ARCH = pytest.mark.parametrize("tiny", ["llava"], indirect=True)
LABELS = ("pneumonia", "normal", "effusion")


def write_foreign_dataset(root: Path, n: int = 24) -> Path:
    """A dataset no one here made: 16-bit and 8-bit greyscale, palette, small images, labels
    outside the embedded model's vocabulary, grouped by patient."""
    rng = np.random.default_rng(0)
    (root / "img").mkdir(parents=True)
    lines = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            image = Image.fromarray(rng.integers(0, 65535, (28, 28)).astype(np.uint16))
        elif kind == 1:
            image = Image.fromarray(rng.integers(0, 255, (28, 28), dtype=np.uint8), "L")
        elif kind == 2:
            pixels = rng.integers(0, 255, (32, 40, 3), dtype=np.uint8)
            image = Image.fromarray(pixels, "RGB").convert("P")
        else:
            image = Image.fromarray(rng.integers(0, 255, (120, 96, 3), dtype=np.uint8), "RGB")
        name = f"img/x{i}.png"
        image.save(root / name)
        lines.append(
            {
                "image": name,
                "question": "What does the scan show?",
                "answer": LABELS[i % 3],
                "group": f"patient{i // 4}",
            }
        )
    (root / "manifest.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (root / "dataset.json").write_text(json.dumps({"task": "xray", "privacy_unit": "group"}))
    return root


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_foreign_dataset(tmp_path_factory.mktemp("foreign") / "data")


@pytest.fixture(scope="module")
def embedded():
    return load_model(EMBEDDED_MODEL_DIR, device="cpu")


def test_check_without_model_counts_records_groups_chunks_modes_and_sizes(foreign):
    # Act
    _, report = check_dataset(foreign, shots=2)

    # Assert
    assert (report.n, report.privacy_unit, report.num_chunks) == (24, "group", 6)
    assert report.group_sizes == (4,) * 6
    assert report.modes == {"I;16": 6, "L": 6, "P": 6, "RGB": 6}
    assert (min(report.widths), max(report.heights)) == (28, 120)
    assert report.answers == {"pneumonia": 8, "normal": 8, "effusion": 8}
    warnings = " ".join(report.warnings)
    assert "6 images are mode I;16 (16-bit greyscale, divided by its bit depth)" in warnings
    assert "18 images have a side under 64 px" in warnings


def test_labels_outside_the_vocabulary_are_reported_as_unk(foreign, embedded):
    # Arrange
    dataset, data = check_dataset(foreign, shots=2)

    # Act
    report = check_with_model(dataset, data, embedded, seed=0)

    # Assert: the embedded model's word vocabulary has none of these labels
    assert report.unk_first_share == 1.0
    assert {t.first_token for t in report.answers} == {"<unk>"}
    assert any("start with the unknown token" in w for w in report.warnings)
    assert any("cannot tell them apart" in w for w in report.warnings)
    assert report.errors == ()


def test_known_labels_are_not_reported(tmp_path, embedded):
    # Arrange: the embedded model's own colour words
    root = tmp_path / "known"
    (root / "img").mkdir(parents=True)
    lines = []
    for i, colour in enumerate(["red", "blue", "green"] * 3):
        Image.new("RGB", (64, 64), colour).save(root / f"img/{i}.png")
        lines.append({"image": f"img/{i}.png", "question": "What colour?", "answer": colour})
    (root / "manifest.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    dataset, data = check_dataset(root, shots=2)

    # Act
    report = check_with_model(dataset, data, embedded, seed=0)

    # Assert
    assert report.unk_first_share == report.unk_any_share == 0.0
    assert [t.answer for t in report.answers] == ["red", "blue", "green"]
    assert report.warnings == ()


@ONE_ARCH
def test_chunk_prompt_lengths_match_the_tokenised_prompts(loaded, foreign):
    # Arrange
    dataset, _ = check_dataset(foreign, shots=2)
    chunks = make_chunks(dataset, shots=2, seed=3).chunks[:2]

    # Act
    lengths = chunk_prompt_lengths(loaded, chunks, instruction=None)

    # Assert
    from client.activations.extraction import chunk_prompt

    for chunk, length in zip(chunks, lengths, strict=True):
        inputs = loaded.adapter.build_batch_inputs(loaded.processor, [chunk_prompt(chunk)])
        assert inputs["input_ids"].shape[1] == length


@ONE_ARCH
def test_chunks_beyond_the_context_are_an_error(loaded, foreign, monkeypatch):
    # Arrange: pretend the context is 100 tokens (a 2-shot llava chunk is longer)
    monkeypatch.setattr(loaded.model.config.get_text_config(), "max_position_embeddings", 100)
    dataset, data = check_dataset(foreign, shots=2)

    # Act
    report = check_with_model(dataset, data, loaded, max_chunks=3, seed=0)

    # Assert
    assert len(report.chunk_lengths) == 3
    assert report.errors
    assert "exceed the model's context of 100 tokens" in report.errors[0]
    assert any(line.startswith("error: ") for line in report_lines(data, report))


def test_cli_data_check_prints_the_report_and_exits_zero(foreign, capsys):
    code = main(["data", "check", str(foreign), "--shots", "2"])

    out = capsys.readouterr().out
    assert code == 0
    assert "n = 24 records, privacy unit: group" in out
    assert "modes: I;16 6, L 6, P 6, RGB 6" in out


def test_cli_data_check_with_the_embedded_model_prints_tokens_and_lengths(foreign, capsys):
    code = main(["data", "check", str(foreign), "--model", str(EMBEDDED_MODEL_DIR), "--shots", "2"])

    out = capsys.readouterr().out
    assert code == 0
    assert "out of vocabulary: 100% first" in out
    assert "chunk prompts (6 of 6 measured)" in out
    assert "model context: 1024 tokens" in out


def test_an_unreadable_image_stops_the_check_with_a_data_error(tmp_path):
    root = write_foreign_dataset(tmp_path / "broken", n=8)
    (root / "img" / "x3.png").write_bytes(b"not a png")

    with pytest.raises(DataError, match="1 of 8 records unusable"):
        check_dataset(root)


def test_cli_reports_a_missing_manifest_in_one_line(tmp_path, capsys):
    code = main(["data", "check", str(tmp_path)])

    assert code != 0
    assert "manifest.jsonl" in capsys.readouterr().err
