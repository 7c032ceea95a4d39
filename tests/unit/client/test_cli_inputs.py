"""Every bad ``dpmtv-site`` input ends in one line naming the option, exit code 2, no traceback.

These run the CLI in-process and need no model: the parser refuses a bad value before any
handler runs, and the commands checked here refuse before they would import torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _pytest.capture import CaptureResult
from PIL import Image
from pydantic import BaseModel, Field, ValidationError

from client.cli import commands
from client.cli._errors import describe
from client.cli.main import main
from dpmtv_common.errors import DataError
from dpmtv_common.privacy.budget import PrivacyBudget
from dpmtv_common.privacy.ledger import PrivacyLedger

REPO_ROOT = Path(__file__).resolve().parents[3]

# (command and its required options, the bad option, its value)
BAD_VALUES = [
    *[("release", "--epsilon", v) for v in ("-1", "0", "nan", "inf", "-inf", "one")],
    *[("release", "--delta", v) for v in ("0", "1", "nan", "-0.1")],
    *[("release", "--clip-norm", v) for v in ("0", "-1", "inf", "nan")],
    ("release", "--heads", "0"),
    ("release", "--heads", "2.5"),
    ("release", "--shots", "0"),
    ("release", "--selection-share", "0"),
    ("release", "--selection-share", "1"),
    ("release", "--max-chunks", "0"),
    ("release", "--budget-epsilon", "-1"),
    ("release", "--budget-delta", "1"),
    ("release", "--batch-size", "0"),
    ("release", "--top-r", "0"),
    ("release", "--top-r", "-3"),
    ("release", "--dtype", "float8"),
    ("evaluate", "--limit", "-1"),
    ("evaluate", "--limit", "0"),
    ("evaluate", "--shots", "0"),
    ("evaluate", "--seed", "-1"),
    ("evaluate", "--max-new-tokens", "0"),
    ("infer", "--rescale-norm", "nan"),
    ("infer", "--rescale-norm", "-1"),
    ("infer", "--batch-size", "-4"),
    ("select-heads", "--queries", "0"),
    ("select-heads", "--steps", "0"),
    ("select-heads", "--samples", "0"),
    ("select-heads", "--k", "0"),
    ("select-heads", "--max-chunks", "0"),
    ("ledger", "--budget-epsilon", "-1"),
    ("ledger", "--budget-delta", "0"),
    ("make-tiny-model", "--seed", "-1"),
    ("serve", "--socket-mode", "9"),
    ("serve", "--socket-mode", "1777"),
    ("serve", "--budget-delta", "1"),
    ("serve", "--threads", "0"),
]
REQUIRED = {
    "release": ["--out", "out"],
    "evaluate": ["--mode", "zero-shot"],
    "infer": ["--artifact", "a"],
    "select-heads": ["--out", "heads.json"],
    "ledger": ["--ledger", "ledger.sqlite"],
    "make-tiny-model": ["llava", "model"],
    "serve": [],
}


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Relative paths land in tmp_path; no DPMTV_CLIENT_* from the caller's shell."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    for name in list(os.environ):
        if name.startswith("DPMTV_CLIENT_"):
            monkeypatch.delenv(name)


def assert_one_line_error(captured: CaptureResult[str], *words: str) -> str:
    err = captured.err
    assert "Traceback" not in err
    last: str = err.strip().splitlines()[-1]
    for word in words:
        assert word in last, f"{word!r} not in {last!r}"
    return last


@pytest.mark.parametrize(
    ("command", "option", "value"), BAD_VALUES, ids=[f"{c} {o} {v}" for c, o, v in BAD_VALUES]
)
def test_a_bad_option_value_is_one_line_naming_the_option_and_exit_2(
    command, option, value, tmp_path, capsys
):
    # Act
    code = main([command, *REQUIRED[command], f"{option}={value}"])

    # Assert: argparse's line is "dpmtv-site CMD: error: argument OPTION: must ..."
    assert code == 2
    line = assert_one_line_error(capsys.readouterr(), f"error: argument {option}")
    assert "must" in line or "choose from" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing created, nothing spent


@pytest.mark.parametrize("command", ["evaluate", "select-heads", "release", "infer"])
def test_a_bad_environment_setting_names_the_option_and_the_variable(command, monkeypatch, capsys):
    # Arrange
    monkeypatch.setenv("DPMTV_CLIENT_BATCH_SIZE", "0")
    data = [] if command == "infer" else ["--data", "d"]

    # Act
    code = main([command, *REQUIRED[command], *data])

    # Assert
    assert code == 2
    assert_one_line_error(capsys.readouterr(), "--batch-size", "DPMTV_CLIENT_BATCH_SIZE", "got '0'")


def test_serve_names_the_option_of_a_setting_out_of_range(monkeypatch, capsys):
    # Arrange: serve sets OMP_WAIT_POLICY for torch; keep that out of this process's env
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")

    # Act
    code = main(["serve", "--min-sites", "1"])

    # Assert
    assert code == 2
    assert_one_line_error(capsys.readouterr(), "--min-sites", "got 1")


def test_keygen_refuses_a_name_whose_public_key_exists_and_writes_no_private_key(tmp_path, capsys):
    # Arrange: someone else's public key already sits where ours would go
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "site.pub").write_text("foreign")

    # Act
    code = main(["keygen", "--out-dir", str(keys)])

    # Assert
    assert code == 2
    assert_one_line_error(capsys.readouterr(), "--name", "site.pub", "never overwritten")
    assert sorted(p.name for p in keys.iterdir()) == ["site.pub"]
    assert (keys / "site.pub").read_text() == "foreign"


def test_keygen_refuses_an_existing_private_key(tmp_path, capsys):
    # Arrange
    assert main(["keygen", "--out-dir", str(tmp_path), "--name", "a"]) == 0
    before = (tmp_path / "a.key").read_bytes()
    capsys.readouterr()

    # Act
    code = main(["keygen", "--out-dir", str(tmp_path), "--name", "a"])

    # Assert
    assert code == 2
    assert_one_line_error(capsys.readouterr(), "--name", "a.key")
    assert (tmp_path / "a.key").read_bytes() == before


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--out-dir", "file.txt"], ["--out-dir", "must be a directory"]),
        (["--name", "../escape"], ["--name", "plain file stem"]),
        (["--name", ""], ["--name"]),
    ],
    ids=["out-dir-is-a-file", "name-with-slash", "empty-name"],
)
def test_keygen_refuses_bad_paths(argv, words, tmp_path, capsys):
    # Arrange
    (tmp_path / "file.txt").write_text("x")

    # Act
    code = main(["keygen", *argv])

    # Assert
    assert code == 2
    assert_one_line_error(capsys.readouterr(), *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


def test_ledger_of_a_missing_file_is_an_error_and_creates_nothing(tmp_path, capsys):
    # Act
    code = main(["ledger", "--ledger", "typo.sqlite"])

    # Assert
    assert code == 2
    line = assert_one_line_error(capsys.readouterr(), "--ledger", "typo.sqlite")
    assert "spent" not in line
    assert list(tmp_path.iterdir()) == []


def test_ledger_with_another_budget_than_at_creation_is_one_line(tmp_path, capsys):
    # Arrange
    path = tmp_path / "l.sqlite"
    PrivacyLedger.open(path, PrivacyBudget(10.0, 1e-5)).close()

    # Act
    code = main(["ledger", "--ledger", str(path), "--budget-epsilon", "3"])

    # Assert
    assert code == 2
    assert_one_line_error(capsys.readouterr(), "budget")


def test_make_tiny_model_refuses_to_overwrite_a_model_without_overwrite(tmp_path, capsys):
    # Arrange
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")

    # Act
    code = main(["make-tiny-model", "llava", str(model)])

    # Assert
    assert code == 2
    assert_one_line_error(capsys.readouterr(), "directory", "--overwrite")
    assert [p.name for p in model.iterdir()] == ["config.json"]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["evaluate", "--mode", "artifact", "--data", "d"], ["--mode artifact", "--artifact"]),
        (["evaluate", "--mode", "icl", "--data", "d"], ["--mode icl", "--support"]),
        (["evaluate", "--mode", "zero-shot"], ["--data"]),
        (["release", "--out", "o"], ["--data", "--signing-key"]),
        (["infer", "--artifact", "a"], ["--image", "--question", "--batch"]),
        (["select-heads", "--out", "h.json"], ["--data"]),
        (["select-heads", "--out", "nowhere/h.json", "--data", "d"], ["--out", "directory"]),
        (
            ["select-heads", "--out", "h.json", "--data", "d", "--for-epsilon", "1"],
            ["--for-epsilon", "--for-chunks", "together"],
        ),
        (
            ["select-heads", "--out", "h.json", "--data", "d", "--for-chunks", "200"],
            ["--for-epsilon", "--for-chunks", "together"],
        ),
    ],
    ids=[
        "artifact-mode",
        "icl-mode",
        "no-data",
        "release-no-key",
        "infer-no-query",
        "no-public",
        "out-dir",
        "epsilon-without-chunks",
        "chunks-without-epsilon",
    ],
)
def test_a_missing_or_misplaced_option_is_one_line_before_any_model_is_loaded(argv, words, capsys):
    # Act
    code = main(argv)

    # Assert
    assert code == 2
    assert_one_line_error(capsys.readouterr(), *words)


def test_a_non_utf8_batch_file_is_one_line_naming_batch(tmp_path, capsys):
    # Arrange
    batch = tmp_path / "q.jsonl"
    batch.write_bytes(b'{"image": "caf\xe9.png", "question": "?"}\n')

    # Act
    code = main(["infer", "--artifact", "a", "--batch", str(batch)])

    # Assert
    assert code == 2
    assert_one_line_error(capsys.readouterr(), "--batch", "UTF-8")


@pytest.mark.parametrize("command", ["infer", "evaluate"])
def test_a_missing_artifact_is_named_before_any_model_is_loaded(command, tmp_path, capsys):
    # Arrange
    assert main(["keygen", "--out-dir", str(tmp_path / "keys")]) == 0
    image = tmp_path / "x.png"
    Image.new("RGB", (8, 8)).save(image)
    query = {
        "infer": ["--image", str(image), "--question", "q"],
        "evaluate": ["--mode", "artifact", "--data", str(tmp_path)],
    }[command]
    capsys.readouterr()

    # Act
    code = main(
        [command, *query, "--artifact", "nowhere", "--trusted-key", str(tmp_path / "keys/site.pub")]
    )

    # Assert
    assert code == 2
    assert_one_line_error(
        capsys.readouterr(), "--artifact must be an artifact directory", "nowhere"
    )


def test_a_pydantic_error_becomes_one_line_with_every_field():
    # Arrange
    class Shape(BaseModel):
        width: int = Field(gt=0)
        height: int = Field(gt=0)

    with pytest.raises(ValidationError) as raised:
        Shape(width=0, height=-1)

    # Act
    code, line = describe(raised.value)

    # Assert
    assert code == 2
    assert "\n" not in line
    assert "width" in line
    assert "height" in line
    assert "got -1" in line


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (DataError("x must be y,\n got z."), 2),
        (FileNotFoundError(2, "No such file", "data"), 2),
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), 2),
        (RuntimeError("bug"), 1),
    ],
    ids=["typed", "path", "utf8", "unexpected"],
)
def test_describe_gives_one_line_and_the_exit_code(error, code):
    # Act
    got, line = describe(error)

    # Assert
    assert got == code
    assert "\n" not in line
    assert ("-v" in line) == (code == 1)


def _boom(sub):
    parser = sub.add_parser("boom")

    def handler(args):
        raise KeyError("unexpected")

    parser.set_defaults(handler=handler)


@pytest.mark.parametrize("verbose", [False, True])
def test_an_unexpected_error_is_one_line_and_its_traceback_only_under_v(
    verbose, monkeypatch, capsys
):
    # Arrange
    monkeypatch.setattr(commands, "REGISTRY", (_boom,))

    # Act
    code = main([*(["-v"] if verbose else []), "boom"])

    # Assert
    err = capsys.readouterr().err
    assert code == 1
    assert "dpmtv-site boom: error: KeyError" in err
    assert ("Traceback" in err) == verbose


FAST = [
    ["keygen", "--out-dir", "{tmp}/keys"],
    ["ledger", "--ledger", "{tmp}/missing.sqlite"],
    ["--help"],
    ["release", "--help"],
    ["release", "--out", "{tmp}/o", "--epsilon", "-1"],
    ["evaluate", "--mode", "icl", "--data", "{tmp}"],
]


@pytest.mark.parametrize("argv", FAST, ids=[" ".join(a[:2]) for a in FAST])
def test_commands_that_need_no_model_never_import_torch_or_flower(argv, tmp_path):
    # Arrange: a fresh interpreter, so nothing imported by other tests counts
    filled = [part.replace("{tmp}", str(tmp_path)) for part in argv]
    code = (
        "import sys; from client.cli.main import main; code = main(sys.argv[1:]); "
        "heavy = sorted(m for m in ('torch', 'transformers', 'flwr') if m in sys.modules); "
        "print('HEAVY', heavy, code)"
    )

    # Act
    done = subprocess.run(
        [sys.executable, "-c", code, *filled],
        cwd=REPO_ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    # Assert
    assert "HEAVY [] " in done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
