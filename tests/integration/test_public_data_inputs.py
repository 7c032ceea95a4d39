"""Public means public: no command that reads public inputs falls back to the private data setting.

Public inputs (a public dataset, heads chosen on one) steer a release at no privacy cost, so
they must never be the site's private data. The site's ``DPMTV_CLIENT_DATA_PATH`` and its
config file's ``data-path`` name its PRIVATE data. The class: every command option that
carries a public input (found by walking the real parser, so a new one must be classed
here), run with the private setting present and the public argument absent, refuses in one
line naming the option, before any output is written.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from client.cli import main
from client.cli.main import build_parser
from tests.integration.test_site_cli import Workspace, clean_site_env, workspace  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _required_public(ws: Workspace, tmp: Path) -> dict[tuple[str, str], list[str]]:
    """Each public input a command needs, with a command line that leaves it out."""
    model = ws.model_args()
    select = ["select-heads", *model, "--out", str(tmp / "heads.json")]
    return {
        ("select-heads", "--data"): select,
        ("select-heads", "--public-task"): select,  # the task-agnostic alternative to --data
        ("release", "--public-heads"): [
            "release", *model, "--out", str(tmp / "artifact"), "--selection", "public",
            "--clip-norm", "1", "--shots", "2", "--signing-key", str(ws.signing_key), "--quiet",
        ],
        ("audit", "--public-heads"): [
            "audit", *model, "--selection", "public", "--clip-norm", "1", "--shots", "2",
            "--runs", "2", "--quiet",
        ],
    }  # fmt: skip


# Public inputs whose absence reads nothing public: without candidates every head is one;
# without a centre the release is of raw activations; without an answer's end none is patched.
OPTIONAL_PUBLIC = {
    ("release", "--candidate-heads"),
    ("release", "--centre"),
    ("infer", "--answer-end-from"),
    ("evaluate", "--answer-end-from"),
    ("serve", "--answer-end-from"),
}


def _public_path_options() -> set[tuple[str, str]]:
    """Every (command, option) taking a path whose name or help says it is public (data)."""
    found = set()
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in commands.choices.items():
        for action in parser._actions:
            if action.type is not Path or not action.option_strings:
                continue
            said = " ".join([*action.option_strings, action.help or ""]).lower()
            if "public" in said.replace("public key", ""):  # a key's public half is no data
                found.add((name, action.option_strings[0]))
    return found


@pytest.fixture(autouse=True)
def site_env(workspace: Workspace, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:  # noqa: F811
    clean_site_env(monkeypatch, tmp_path)


def test_every_public_input_of_the_commands_is_classed_here(
    workspace: Workspace,  # noqa: F811
    tmp_path: Path,
) -> None:
    classed = set(_required_public(workspace, tmp_path)) | OPTIONAL_PUBLIC
    assert _public_path_options() == classed


@pytest.mark.parametrize("setting", ["environment", "config-file"])
@pytest.mark.parametrize(
    ("command", "option"),
    [
        ("select-heads", "--data"),
        ("select-heads", "--public-task"),
        ("release", "--public-heads"),
        ("audit", "--public-heads"),
    ],
)
def test_a_public_input_never_falls_back_to_the_private_data_setting(
    workspace: Workspace,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
    option: str,
    setting: str,
) -> None:
    # Arrange: the site's private data named where a site admin names it
    if setting == "environment":
        monkeypatch.setenv("DPMTV_CLIENT_DATA_PATH", str(workspace.private))
    else:
        config = tmp_path / "site.toml"
        config.write_text(f'data-path = "{workspace.private}"\n')
        monkeypatch.setenv("DPMTV_CLIENT_CONFIG_FILE", str(config))
    argv = _required_public(workspace, tmp_path)[(command, option)]
    # Act
    code = main(argv)
    # Assert: refused in one line that names the public option; nothing written (a release
    # reads its own private data and model first: transformers' load bar may come before)
    error = [
        line
        for line in capsys.readouterr().err.strip().splitlines()
        if not line.startswith("Loading weights")
    ]
    assert code == 2
    assert len(error) == 1, error
    assert option in error[0]
    assert not (tmp_path / "heads.json").exists()
    assert not (tmp_path / "artifact").exists()


def test_select_heads_refuses_the_private_folder_named_as_public(
    workspace: Workspace,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("DPMTV_CLIENT_DATA_PATH", str(workspace.private))
    argv = [
        "select-heads", *workspace.model_args(), "--out", str(tmp_path / "heads.json"),
        "--data", str(workspace.private / "." ),
    ]  # fmt: skip
    code = main(argv)
    error = capsys.readouterr().err
    assert code == 2
    assert "--data must be PUBLIC data, got the site's private data folder" in error
    assert not (tmp_path / "heads.json").exists()


def _answer_end_argv(ws: Workspace, tmp: Path, command: str, public: Path) -> list[str]:
    """``command`` answering with an artifact, its answer's end learnt from ``public``."""
    artifact = ["--artifact", str(tmp / "no-artifact"), "--answer-end-from", str(public)]
    if command == "infer":
        image = ["--image", str(tmp / "q.png"), "--question", "Which colour?"]
        return ["infer", *ws.model_args(), *artifact, *image]
    return ["evaluate", *ws.model_args(), "--data", str(tmp), "--mode", "artifact", *artifact]


@pytest.mark.parametrize("command", ["infer", "evaluate"])
def test_the_answer_end_refuses_the_private_folder_named_as_public(
    workspace: Workspace,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    monkeypatch.setenv("DPMTV_CLIENT_DATA_PATH", str(workspace.private))

    code = main(_answer_end_argv(workspace, tmp_path, command, workspace.private / "."))

    error = capsys.readouterr().err
    assert code == 2
    assert "--answer-end-from must be PUBLIC data, got the site's private data folder" in error


def test_evaluate_refuses_an_answer_end_learnt_from_the_evaluated_set(
    workspace: Workspace,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(_answer_end_argv(workspace, tmp_path, "evaluate", tmp_path / "."))

    error = capsys.readouterr().err
    assert code == 2
    assert "--answer-end-from must not be the evaluated set --data" in error


def test_evaluate_refuses_an_answer_end_outside_artifact_mode(
    workspace: Workspace,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [
        "evaluate", *workspace.model_args(), "--data", str(workspace.private), "--mode",
        "zero-shot", "--answer-end-from", str(tmp_path),
    ]  # fmt: skip

    code = main(argv)

    assert code == 2
    assert "--answer-end-from is for --mode artifact" in capsys.readouterr().err


def test_serve_refuses_its_private_data_named_as_answer_end_data_before_serving(
    workspace: Workspace,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [
        "serve", *workspace.model_args(), "--data", str(workspace.private),
        "--state-dir", str(tmp_path / "state"), "--socket", str(tmp_path / "s.sock"),
        "--answer-end-from", str(workspace.private),
    ]  # fmt: skip

    code = main(argv)

    error = capsys.readouterr().err
    assert code == 2
    assert "must be PUBLIC data, got the site's private data folder" in error
    assert not (tmp_path / "s.sock").exists()
