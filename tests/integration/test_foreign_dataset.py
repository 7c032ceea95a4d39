"""A dataset nobody here made, through ``dpmtv-site`` end to end (issue 11).

Lesion scans stored as 16-bit greyscale (values over all of 0..65535) and palette PNGs of
20x20 and 24x32 pixels, in the image-folder layout with its own question, answered
*benign* / *malignant*: words the embedded model does not have. ``data check`` must say so;
with the embedded model, select-heads and release must refuse in one line before spending
anything; with a tiny model whose tokenizer covers the words, data check -> select-heads ->
release -> infer -> evaluate must work; and the pixels the model sees must be the scan's,
scaled, never thresholded.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from client.cli import main
from client.data.records import load_dataset
from client.models.embedded import EMBEDDED_MODEL_DIR
from dpmtv_common.artifact import load_artifact
from dpmtv_common.crypto import TrustedKeys, VerifyKey
from dpmtv_common.privacy.budget import PrivacyBudget
from dpmtv_common.privacy.ledger import PrivacyLedger

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

LABELS = ("benign", "malignant")
QUESTION = "Is the lesion benign or malignant?"
MID_GREY = 128 * 257  # exactly 128 once scaled to 8 bits
SMALL, TALL = (20, 20), (24, 32)  # (width, height)


def scan_16_bit(rng: np.random.Generator, size: tuple[int, int]) -> np.ndarray:
    """16-bit pixels spread over 0..65535, with a white band and a mid-grey band.

    Thresholding (PIL's own ``convert``, which clips at 255) would turn almost all of it white.
    """
    width, height = size
    pixels = rng.integers(0, 65536, (height, width)).astype(np.uint16)
    pixels[:4] = 65535
    pixels[4:8] = MID_GREY
    return pixels


def write_scans(root: Path, count: int, *, seed: int) -> Path:
    """``count`` scans in class folders: 16-bit and palette images alternate, as do sizes."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        label = LABELS[(i // 2) % 2]  # labels do not follow the image mode
        size = SMALL if i % 4 in (0, 3) else TALL
        if i % 2 == 0:
            image = Image.fromarray(scan_16_bit(rng, size))
        else:
            colours = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            image = Image.fromarray(colours, "RGB").convert("P")
        (root / label).mkdir(parents=True, exist_ok=True)
        image.save(root / label / f"s{i:02d}.png")
    metadata = {"layout": "image-folder", "task": "lesions", "question": QUESTION}
    (root / "dataset.json").write_text(json.dumps(metadata))
    return root


@dataclass(frozen=True)
class Workspace:
    root: Path
    tiny_model: Path
    signing_key: Path
    public_key: Path
    private: Path
    public: Path
    test: Path


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workspace]:
    root = tmp_path_factory.mktemp("foreign")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        for name in list(os.environ):
            if name.startswith("DPMTV_CLIENT_"):
                mp.delenv(name)
        assert main(["make-tiny-model", "llava", str(root / "model"), "--seed", "0"]) == 0
        assert main(["keygen", "--out-dir", str(root / "keys")]) == 0
        yield Workspace(
            root=root,
            tiny_model=root / "model",
            signing_key=root / "keys" / "site.key",
            public_key=root / "keys" / "site.pub",
            private=write_scans(root / "private", 20, seed=0),
            public=write_scans(root / "public", 8, seed=1),
            test=write_scans(root / "test", 6, seed=2),
        )


@pytest.fixture(autouse=True)
def _clean_env(workspace: Workspace, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    for name in list(os.environ):
        if name.startswith("DPMTV_CLIENT_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def model_args(model: Path) -> list[str]:
    return ["--model", str(model), "--device", "cpu", "--batch-size", "4"]


def report_of(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[str]:
    """The lines ``dpmtv-site data check`` prints; it must succeed."""
    code = main(["data", "check", *argv])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0, lines
    return lines


DATA_LINES = [
    "  n = 20 records, privacy unit: example",
    "  chunks at 2 shots: m = 6",
    "  images: width min 20, median 22, max 24; height min 20, median 26, max 32",
    "  modes: I;16 10, P 10",
    "  pixel values: I;16 x10: 12..65535 (16-bit content, divided by 65535)",
    "  pixel values: P x10: 0..255 (8-bit, as stored)",
    "  questions: 1 distinct; answers: 2 distinct, top: 'benign' 10, 'malignant' 10",
]
DATA_WARNINGS = [
    "warning: 10 images are mode I;16 (16-bit greyscale, divided by its bit depth): the model "
    "sees RGB.",
    "warning: 10 images are mode P (palette, looked up): the model sees RGB.",
    "warning: 20 images have a side under 64 px: processors upscale them (and image splitting "
    "may still cut them into several crops).",
]


def test_data_check_reports_the_16_bit_palette_and_small_images(workspace, capsys):
    # Act
    lines = report_of(capsys, [str(workspace.private), "--shots", "2"])

    # Assert: the data part, and no model part without --model
    assert lines[0] == f"dataset {workspace.private} (task 'lesions')"
    assert lines[1:8] == DATA_LINES
    assert lines[8:] == DATA_WARNINGS


def test_data_check_with_the_embedded_model_reports_every_answer_out_of_vocabulary(
    workspace, capsys
):
    # Act
    lines = report_of(
        capsys, [str(workspace.private), "--shots", "2", "--model", str(EMBEDDED_MODEL_DIR)]
    )

    # Assert: the data part is the same, and every answer is <unk> to this model
    assert lines[1:8] == DATA_LINES
    tokens = lines.index("  answers' first tokens (out of vocabulary: 100% first, 100% anywhere):")
    assert lines[tokens + 1 : tokens + 3] == [
        "    'benign' x10 -> '<unk>' (3) <unk>",
        "    'malignant' x10 -> '<unk>' (3) <unk>",
    ]
    warnings = [line for line in lines if line.startswith("warning:")]
    assert warnings[:3] == DATA_WARNINGS
    assert warnings[3].startswith(
        "warning: 100% of answers start with the unknown token: head selection would score p(<unk>)"
    )
    assert "cannot tell them apart" in warnings[4]
    assert warnings[5].startswith("warning: at m = 6 chunks the released vector would be mostly")
    assert len(warnings) == 6


def _ledger_releases(ledger: Path) -> list[str]:
    if not ledger.exists():
        return []
    with PrivacyLedger.open(ledger, PrivacyBudget(10.0, 1e-5)) as opened:
        return [entry.release_id for entry in opened.releases()]


@pytest.mark.parametrize("command", ["select-heads", "release"])
def test_the_embedded_model_refuses_labels_it_cannot_say_and_spends_nothing(
    workspace, tmp_path, capsys, command
):
    # Arrange
    out, ledger = tmp_path / "out", tmp_path / "ledger.sqlite"
    common = [*model_args(EMBEDDED_MODEL_DIR), "--shots", "2", "--out", str(out)]
    argv = {
        "select-heads": [
            "select-heads", *common, "--data", str(workspace.public), "--k", "2",
        ],
        "release": [
            "release", *common, "--data", str(workspace.private), "--selection", "all",
            "--clip-norm", "1", "--ledger", str(ledger),
            "--signing-key", str(workspace.signing_key), "--quiet",
        ],
    }[command]  # fmt: skip

    # Act
    code = main(argv)

    # Assert: one line that names the cause and the check to run; nothing written or reserved
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("dpmtv-site")]
    assert code == 2
    assert len(errors) == 1, err
    assert "answers must be in the model's vocabulary" in errors[0]
    assert "p(<unk>)" in errors[0]
    assert "data check" in errors[0]
    assert not out.exists()
    assert _ledger_releases(ledger) == []


def number_after(label: str, text: str) -> float:
    match = re.search(rf"{re.escape(label)}\s*([-+0-9.eE]+)", text)
    assert match is not None, f"{label!r} not in {text!r}"
    return float(match.group(1))


def test_a_model_that_can_say_the_labels_runs_the_whole_path(workspace, tmp_path, capsys):
    # Arrange
    ws, model = workspace, model_args(workspace.tiny_model)
    heads_file, artifact, ledger = tmp_path / "heads.json", tmp_path / "artifact", tmp_path / "l"

    # Act 1: data check against the tiny model (a byte-level BPE: every word has tokens)
    lines = report_of(capsys, [str(ws.private), "--shots", "2", "--model", str(ws.tiny_model)])

    # Assert 1: the answers have distinct first tokens, none unknown; only the data warnings
    assert "  answers' first tokens (out of vocabulary: 0% first, 0% anywhere):" in lines
    firsts = [line for line in lines if line.startswith(("    'benign'", "    'malignant'"))]
    assert len(firsts) == 2
    assert len({line.split("->")[1] for line in firsts}) == 2
    warnings = [line for line in lines if line.startswith("warning:")]
    assert warnings[:-1] == DATA_WARNINGS
    assert warnings[-1].startswith("warning: at m = 6 chunks the released vector would be mostly")

    # Act 2: heads from the public split, then a release on the private one
    select = main(
        [
            "select-heads", *model, "--data", str(ws.public), "--out", str(heads_file),
            "--k", "2", "--shots", "2", "--queries", "2",
        ]
    )  # fmt: skip
    capsys.readouterr()
    release = main(
        [
            "release", *model, "--data", str(ws.private), "--shots", "2", "--epsilon", "0.5",
            "--selection", "public",
            "--public-heads", str(heads_file), "--out", str(artifact), "--ledger", str(ledger),
            "--signing-key", str(ws.signing_key), "--release-id", "lesions-1", "--quiet",
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out

    # Assert 2: 20 records in chunks of 3 give m = 6; the artifact verifies; the cost is booked
    assert (select, release) == (0, 0)
    assert "released 2 heads" in printed
    assert "m=6 chunks (K=2" in printed
    assert 0.4 < number_after("epsilon=", printed) <= 0.5 * (1 + 1e-6)
    trusted = TrustedKeys([VerifyKey.load(ws.public_key)])
    released = load_artifact(artifact, trusted_keys=trusted, expected_model_fingerprint=None)
    assert released.manifest.num_chunks == 6
    assert [list(h) for h in released.heads.heads] == json.loads(heads_file.read_text())["heads"]
    assert _ledger_releases(ledger) == ["lesions-1"]

    # Act 3: answer a 16-bit and a palette scan with the artifact, then evaluate it
    batch = ws.test / "queries.jsonl"
    queries = [{"image": "benign/s00.png", "question": QUESTION}]
    queries.append({"image": "benign/s01.png", "question": QUESTION})
    batch.write_text("".join(json.dumps(q) + "\n" for q in queries))
    trust = ["--trusted-key", str(ws.public_key), "--max-new-tokens", "4"]
    infer = main(["infer", *model, *trust, "--artifact", str(artifact), "--batch", str(batch)])
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    evaluate = main(
        [
            "evaluate", *model, *trust, "--data", str(ws.test), "--mode", "artifact",
            "--artifact", str(artifact),
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out

    # Assert 3: one answer a query, in order; an accuracy over the 6 test scans
    assert (infer, evaluate) == (0, 0)
    assert [Path(a["image"]).name for a in answers] == ["s00.png", "s01.png"]
    assert all(isinstance(a["answer"], str) for a in answers)
    assert "over 6 queries" in printed
    assert 0.0 <= number_after("artifact: accuracy", printed) <= 1.0


def test_what_the_model_sees_is_the_scan_scaled_never_thresholded(workspace):
    # Arrange: the loader every command uses, on one 16-bit and one palette scan
    dataset = load_dataset(workspace.private)
    by_name = {record.image_path.name: record for record in dataset.records}
    scan = by_name["s00.png"]
    with Image.open(scan.image_path) as stored:
        assert stored.mode == "I;16"
        wide = np.asarray(stored, dtype=np.float64)

    # Act
    seen = np.asarray(scan.load_image())
    palette = by_name["s01.png"]

    # Assert: grey in three equal channels, each pixel v/65535 of white (to the nearest level)
    assert dataset.records[0].question == QUESTION
    assert seen.shape == (*wide.shape, 3)
    assert (seen == seen[..., :1]).all()
    grey = seen[..., 0].astype(np.float64)
    assert np.abs(grey - wide * 255 / 65535).max() <= 0.5 + 1e-9
    # The histogram: white only where the scan is white, mid-grey stays mid-grey, and the
    # spread part keeps its spread (thresholding would make ~all of it 255)
    assert (grey == 255).mean() == pytest.approx((wide >= 65535 - 128).mean(), abs=0.01)
    assert (grey[4:8] == 128).all()
    assert grey[8:].std() == pytest.approx(255 / np.sqrt(12), rel=0.15)
    with Image.open(palette.image_path) as stored:
        assert stored.mode == "P"
        looked_up = np.asarray(stored.convert("RGB"))
    assert (np.asarray(palette.load_image()) == looked_up).all()
