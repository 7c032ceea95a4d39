"""``dpmtv-site`` on a tiny model: mistakes end in one line and exit 2, and spend nothing.

Every release mistake here is caught before the ledger reservation: the ledger file is never
even created. Bad files (a non-UTF-8 batch, a decompression-bomb header, truncated weights)
end in one line naming the file or option, never in a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image

from client.activations.hooks import PatchPolicy
from client.activations.scoring import ScoreMethod
from client.cli import main
from client.cli._choices import (
    ATTENTION_CHOICES,
    DTYPES,
    EVALUATION_MODES,
    PATCH_POLICIES,
    RELEASE_ORDERS,
    SCORE_METHODS,
    SELECTION_METHODS,
    SELECTION_MODES,
)
from client.data.records import write_jsonl_dataset
from client.evaluation import EvaluationMode
from client.models import ATTENTION_IMPLEMENTATIONS
from client.models.loading import _DTYPES
from client.public.selection import SelectionMethod
from dpmtv_common.artifact import load_artifact
from dpmtv_common.crypto import TrustedKeys, VerifyKey
from dpmtv_common.privacy.budget import PrivacyBudget
from dpmtv_common.privacy.ledger import PrivacyLedger
from protocol import ReleaseOrder, SelectionMode

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

QUESTION = "What colour is it?"
COLOURS = ("red", "blue", "green")


@dataclass(frozen=True)
class Site:
    root: Path
    model: Path
    key: Path
    public_key: Path
    data: Path
    image: Path

    def model_args(self, model: Path | None = None) -> list[str]:
        return ["--model", str(model or self.model), "--device", "cpu"]

    def release_argv(self, out: Path, ledger: Path, *extra: str) -> list[str]:
        return [
            "release", *self.model_args(), "--data", str(self.data), "--out", str(out),
            "--shots", "2", "--clip-norm", "1", "--ledger", str(ledger),
            "--signing-key", str(self.key), "--quiet", *extra,
        ]  # fmt: skip


def write_colours(root: Path, count: int) -> Path:
    root.mkdir(parents=True)
    rows = []
    for i in range(count):
        Image.new("RGB", (56, 56), COLOURS[i % 3]).save(root / f"{i}.png")
        rows.append({"id": f"x{i}", "image": f"{i}.png", "question": QUESTION, "answer": "a"})
    return write_jsonl_dataset(root, rows, task="colours")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    root = tmp_path_factory.mktemp("cli-inputs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        for name in list(os.environ):
            if name.startswith("DPMTV_CLIENT_"):
                mp.delenv(name)
        assert main(["make-tiny-model", "llava", str(root / "model")]) == 0
        assert main(["keygen", "--out-dir", str(root / "keys")]) == 0
        data = write_colours(root / "data", 9)
        yield Site(
            root, root / "model", root / "keys" / "site.key", root / "keys" / "site.pub", data,
            data / "0.png",
        )  # fmt: skip


@pytest.fixture(autouse=True)
def _clean_env(site: Site, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    for name in list(os.environ):
        if name.startswith("DPMTV_CLIENT_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def one_line(err: str, *words: str) -> str:
    """The one error line (transformers may also draw a progress bar on stderr)."""
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("dpmtv-site")]
    assert len(lines) == 1, err
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    return lines[0]


def heads_file(path: Path, heads: list[list[int]]) -> Path:
    path.write_text(json.dumps({"heads": heads, "clip_norm_suggestion": 1.0}))
    return path


# The tiny llava has 2 decoder layers of 4 heads: 8 heads in all.
RELEASE_MISTAKES = [
    ("out-exists", ["--selection", "all"], ["--out must not exist", "--overwrite"]),
    ("out-under-a-file", ["--selection", "all"], ["--out must lie in a directory"]),
    (
        "overwrite-foreign-dir",
        ["--selection", "all", "--overwrite"],
        ["--out must hold only artifact files", "notes.txt"],
    ),
    ("heads-above-model", ["--heads", "100"], ["--heads must be at most", "8 heads", "got 100"]),
    ("top-r-above-model", ["--heads", "2", "--top-r", "9"], ["--top-r must be at most"]),
    ("default-top-r-names-heads", ["--heads", "9"], ["--heads must be at most"]),
    ("public-heads-outside", ["--selection", "public"], ["--public-heads must name heads"]),
    (
        "public-heads-missing",
        ["--selection", "public", "--public-heads", "none.json"],
        ["--public-heads"],
    ),
    ("blank-task", ["--selection", "all", "--task", " "], ["--task", "non-empty"]),
    ("bad-signing-key", ["--selection", "all"], ["private key"]),
    ("data-missing", ["--selection", "all"], ["nowhere"]),
    ("too-few-records", ["--selection", "all", "--shots", "20"], ["record"]),
]


@pytest.mark.parametrize(
    ("case", "extra", "words"), RELEASE_MISTAKES, ids=[case for case, _, _ in RELEASE_MISTAKES]
)
def test_a_release_mistake_is_one_line_exit_2_and_reserves_nothing(
    site, tmp_path, capsys, case, extra, words
):
    # Arrange
    out, ledger = tmp_path / "artifact", tmp_path / "ledger.sqlite"
    argv = site.release_argv(out, ledger, *extra)
    if case == "out-exists":
        out.mkdir()
    if case == "out-under-a-file":
        (tmp_path / "file").write_text("x")
        argv[argv.index("--out") + 1] = str(tmp_path / "file" / "artifact")
    if case == "overwrite-foreign-dir":
        out.mkdir()
        (out / "notes.txt").write_text("keep me")
    if case == "public-heads-outside":
        argv += ["--public-heads", str(heads_file(tmp_path / "h.json", [[0, 1], [5, 0]]))]
    if case == "bad-signing-key":
        (tmp_path / "bad.key").write_text("not a key")
        argv[argv.index("--signing-key") + 1] = str(tmp_path / "bad.key")
    if case == "data-missing":
        argv[argv.index("--data") + 1] = str(tmp_path / "nowhere")

    # Act
    code = main(argv)

    # Assert: nothing reserved, because the ledger was never opened
    captured = capsys.readouterr()
    assert code == 2
    one_line(captured.err, *words)
    assert not ledger.exists()
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())
    if case == "overwrite-foreign-dir":
        assert (out / "notes.txt").read_text() == "keep me"


def test_release_overwrite_replaces_an_artifact_only_after_the_new_one_exists(
    site, tmp_path, capsys
):
    # Arrange
    out, ledger = tmp_path / "artifact", tmp_path / "ledger.sqlite"
    first = site.release_argv(out, ledger, "--selection", "all", "--release-id", "first")
    assert main(first) == 0

    # Act: the same --out again, once refused and once with --overwrite
    refused = main(site.release_argv(out, ledger, "--selection", "all", "--release-id", "x"))
    second = site.release_argv(out, ledger, "--selection", "all", "--release-id", "second")
    replaced = main([*second, "--overwrite"])

    # Assert: the refusal spent nothing; the replacement is the second release
    capsys.readouterr()
    assert (refused, replaced) == (2, 0)
    trusted = TrustedKeys([VerifyKey.load(site.public_key)])
    artifact = load_artifact(out, trusted_keys=trusted, expected_model_fingerprint=None)
    assert artifact.manifest.release_id == "second"
    with PrivacyLedger.open(ledger, PrivacyBudget(10.0, 1e-5)) as opened:
        states = {e.release_id: e.state.value for e in opened.releases()}
    assert states == {"first": "committed", "second": "committed"}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _truncate_first_image(data: Path) -> None:
    whole = (data / "0.png").read_bytes()
    (data / "0.png").write_bytes(whole[: len(whole) // 2])


def _non_utf8_manifest(data: Path) -> None:
    manifest = data / "manifest.jsonl"
    manifest.write_bytes(manifest.read_bytes() + b'{"id": "caf\xe9"}\n')


BAD_DATA = {
    "missing-image": lambda data: (data / "3.png").unlink(),
    "truncated-image": _truncate_first_image,
    "non-utf8-manifest": _non_utf8_manifest,
    "missing-manifest": lambda data: (data / "manifest.jsonl").unlink(),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_a_bad_dataset_is_one_line_exit_2_and_reserves_nothing(site, tmp_path, capsys, case):
    # Arrange
    data = tmp_path / "data"
    shutil.copytree(site.data, data)
    BAD_DATA[case](data)
    out, ledger = tmp_path / "artifact", tmp_path / "ledger.sqlite"
    argv = site.release_argv(out, ledger, "--selection", "all")
    argv[argv.index("--data") + 1] = str(data)

    # Act
    code = main(argv)

    # Assert
    assert code == 2
    one_line(capsys.readouterr().err, str(data))
    assert not ledger.exists()
    assert not out.exists()


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` pixels (and holds almost no data)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


@pytest.mark.parametrize(
    "size", [(40_000, 40_000), (10_000, 10_000)], ids=["bomb-error", "bomb-warning"]
)
def test_infer_refuses_an_image_whose_header_claims_a_huge_size(site, tmp_path, capsys, size):
    # Arrange
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(png_claiming(*size))

    # Act
    code = main(
        [
            "infer", *site.model_args(), "--artifact", "a", "--trusted-key", str(site.public_key),
            "--image", str(bomb), "--question", QUESTION,
        ]
    )  # fmt: skip

    # Assert
    assert code == 2
    one_line(capsys.readouterr().err, "bomb.png", "pixels")


@pytest.mark.parametrize("keep", [20, 300_000], ids=["header", "body"])
def test_truncated_weights_are_one_line_naming_the_file(site, tmp_path, capsys, keep):
    # Arrange
    model = tmp_path / "model"
    shutil.copytree(site.model, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:keep])

    # Act
    code = main(
        [
            "evaluate", *site.model_args(model), "--data", str(site.data),
            "--mode", "zero-shot",
        ]
    )  # fmt: skip

    # Assert
    assert code == 2
    one_line(capsys.readouterr().err, "--model", "model.safetensors", "truncated")


def test_select_heads_refuses_k_above_the_model_before_any_forward(site, tmp_path, capsys):
    # Act
    code = main(
        [
            "select-heads", *site.model_args(), "--data", str(site.data),
            "--out", str(tmp_path / "h.json"), "--k", "9",
        ]
    )  # fmt: skip

    # Assert
    assert code == 2
    one_line(capsys.readouterr().err, "--k must be at most", "8 heads")
    assert not (tmp_path / "h.json").exists()


def test_evaluate_limit_keeps_the_first_n_records(site, capsys):
    # Act
    code = main(
        [
            "evaluate", *site.model_args(), "--data", str(site.data), "--mode", "zero-shot",
            "--limit", "2", "--max-new-tokens", "1",
        ]
    )  # fmt: skip

    # Assert
    assert code == 0
    assert "over 2 queries" in capsys.readouterr().out


def test_make_tiny_model_names_the_architectures_for_an_unknown_one(tmp_path, capsys):
    # Act
    code = main(["make-tiny-model", "gpt-9", str(tmp_path / "m")])

    # Assert
    assert code == 2
    one_line(capsys.readouterr().err, "arch must be one of", "llava")
    assert not (tmp_path / "m").exists()


def test_make_tiny_model_overwrite_replaces_a_model(site, tmp_path, capsys):
    # Arrange
    model = tmp_path / "model"
    shutil.copytree(site.model, model)

    # Act
    code = main(["make-tiny-model", "llava", str(model), "--seed", "3", "--overwrite"])

    # Assert
    assert code == 0
    assert (model / "model.safetensors").read_bytes() != (
        site.model / "model.safetensors"
    ).read_bytes()


def test_the_parser_choices_equal_the_enums_they_stand_for():
    # Assert: the torch-free copies in client.cli._choices cannot drift from the enums
    assert tuple(p.value for p in PatchPolicy) == PATCH_POLICIES
    assert tuple(m.value for m in EvaluationMode) == EVALUATION_MODES
    assert tuple(m.value for m in SelectionMethod) == SELECTION_METHODS
    assert tuple(m.value for m in ScoreMethod) == SCORE_METHODS
    assert tuple(_DTYPES) == DTYPES
    assert tuple(m.value for m in SelectionMode) == SELECTION_MODES
    assert tuple(o.value for o in ReleaseOrder) == RELEASE_ORDERS
    assert ATTENTION_IMPLEMENTATIONS == ATTENTION_CHOICES
