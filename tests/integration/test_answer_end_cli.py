"""``--answer-end-from``: a site learns from public data where a one-token answer ends."""

from __future__ import annotations

from pathlib import Path

import pytest

from client.cli import main
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
