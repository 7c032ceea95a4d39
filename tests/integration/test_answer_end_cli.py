"""``--answer-end-from``: a site learns from public data where a one-token answer ends."""

from __future__ import annotations

from pathlib import Path

import pytest

from client.cli import main
from client.cli.evaluate_command import goes_on_note
from tests.integration.test_site_cli import Workspace, clean_site_env, workspace  # noqa: F401
from tests.unit.client.test_service_answer_end import letters_set

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def site_env(workspace: Workspace, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:  # noqa: F811
    clean_site_env(monkeypatch, tmp_path)


def evaluate_argv(ws: Workspace, public: Path) -> list[str]:
    return [
        "evaluate", *ws.model_args(), "--data", str(ws.test), "--mode", "artifact",
        "--artifact", str(ws.artifact), "--trusted-key", str(ws.public_key),
        "--max-new-tokens", "4", "--limit", "4", "--quiet", "--answer-end-from", str(public),
    ]  # fmt: skip


def test_evaluate_learns_the_answer_end_from_public_data_and_says_from_how_much(
    workspace: Workspace,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    public = letters_set(tmp_path / "letters", 12)

    code = main(evaluate_argv(workspace, public))

    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "answer's end learnt from" in captured.err
    assert "0 skipped" in captured.err
    assert captured.out.startswith("artifact: accuracy ")


def test_a_public_set_without_one_token_answers_is_refused_in_one_line(
    workspace: Workspace,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(evaluate_argv(workspace, workspace.public))  # colours: two tokens each here

    error = capsys.readouterr().err
    assert code == 2
    assert "public answers of one token, got none among" in error


@pytest.mark.parametrize(
    ("first_token", "accuracy", "noted"),
    [
        (0.95, 0.0, True),
        (0.5, 0.3, True),
        (0.5, 0.31, False),
        (1.0, 1.0, False),
        (None, 0.0, False),
    ],
)
def test_evaluate_notes_a_model_that_names_the_answer_and_goes_on(first_token, accuracy, noted):
    note = goes_on_note(first_token, accuracy)

    assert (note is not None) == noted
    if note is not None:
        assert "--answer-end-from" in note
        assert f"{first_token:.4f}" in note
