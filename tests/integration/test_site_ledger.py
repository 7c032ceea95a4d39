"""One ledger per site: every command and the service share it, and another is never ignored.

A single-holder ``release`` without ``--ledger`` and the site service's plan acceptance spend
from the same default ledger (so a federated plan sees the single-holder spending); ``ledger``
with no option shows it; a ledger the site used before (named with ``--ledger``, or the old
default in the working directory) is found, named, refused as a silent split of the budget,
and merged on request.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from client.cli import main
from client.release.site import Site
from client.settings import SiteSettings
from dpmtv_common.errors import PrivacyBudgetExceededError
from dpmtv_common.fingerprint import fingerprint_model_dir
from dpmtv_common.privacy.budget import PrivacyBudget
from dpmtv_common.privacy.events import ReleaseEvent
from dpmtv_common.privacy.ledger import PrivacyLedger
from tests.integration.test_site_cli import Workspace, clean_site_env, workspace  # noqa: F401
from tests.plans import make_plan

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def site_env(workspace: Workspace, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:  # noqa: F811
    clean_site_env(monkeypatch, tmp_path)  # the working directory: this test's own folder


def _release(ws: Workspace, out: Path, *extra: str) -> int:
    return main(
        [
            "release", *ws.model_args(), "--data", str(ws.private), "--out", str(out),
            "--selection", "all", "--clip-norm", "1.0", "--shots", "2", "--quiet",
            "--epsilon", "1", "--signing-key", str(ws.signing_key), *extra,
        ]
    )  # fmt: skip


def test_a_single_holder_release_and_the_service_spend_from_one_default_ledger(
    workspace: Workspace,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Act: a single-holder release naming no ledger, on a budget of 1.2
    assert _release(workspace, tmp_path / "a1", "--budget-epsilon", "1.2") == 0
    capsys.readouterr()
    # Assert: `ledger` with no option shows the site's default ledger and that release
    assert main(["ledger"]) == 0
    shown = capsys.readouterr().out
    default = SiteSettings().default_ledger_file
    assert shown.splitlines()[0] == f"ledger: {default} (the site default)"
    assert re.search(r"release-\w+\s+committed\s+eps=[0-9.]+ delta=1e-05 per example", shown)
    # Act: the site service (same user, default settings) is offered a federated plan
    site = Site(
        SiteSettings(
            model_path=workspace.model,
            data_path=workspace.private,
            device="cpu",
            budget_epsilon=1.2,
            min_sites=3,
        )
    )
    plan = make_plan(
        model_fingerprint=fingerprint_model_dir(workspace.model), epsilon=1.0, min_sites=3
    )
    # Assert: it sees the single-holder release: two of epsilon 1 compose above 1.2
    assert site.settings.ledger_file == default
    with pytest.raises(PrivacyBudgetExceededError, match="already spent"):
        site.accept_plan(plan, run_id=1)


def test_a_ledger_named_before_is_found_refused_as_a_split_and_merged_on_request(
    workspace: Workspace,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Arrange: one release kept in a ledger named on the command line (the old README way)
    named = tmp_path / "site.sqlite"
    assert _release(workspace, tmp_path / "named", "--ledger", str(named)) == 0
    capsys.readouterr()
    # Act: a release into the site's default ledger
    code = _release(workspace, tmp_path / "default")
    error = capsys.readouterr().err
    # Assert: refused in one line that names the other ledger and what to do
    assert code == 2
    assert len(error.strip().splitlines()) == 1
    assert str(named) in error
    assert f"dpmtv-site ledger --merge {named}" in error
    assert not (tmp_path / "default").exists()
    # `ledger` names it too, not composed
    assert main(["ledger"]) == 0
    assert f"other ledger of this site, NOT composed here: {named}" in capsys.readouterr().out
    # Act: merge it, then release
    assert main(["ledger", "--merge", str(named)]) == 0
    assert "merged from" in capsys.readouterr().out
    assert _release(workspace, tmp_path / "default") == 0
    capsys.readouterr()
    # Assert: both releases compose in the default ledger; nothing else is reported
    assert main(["ledger"]) == 0
    shown = capsys.readouterr().out
    assert "by 2 releases" in shown
    assert "NOT composed" not in shown
    # A command that names the other ledger on purpose is told, not refused
    assert _release(workspace, tmp_path / "named-again", "--ledger", str(named)) == 0
    assert "other ledger(s) hold releases not composed with" in capsys.readouterr().err


def test_the_old_default_ledger_in_the_working_directory_is_found(
    workspace: Workspace,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Arrange: a ledger where sites once kept it: dpmtv-site-ledger.sqlite, here
    with PrivacyLedger.open(tmp_path / "dpmtv-site-ledger.sqlite", PrivacyBudget(10, 1e-5)) as old:
        old.reserve(
            release_id="old-1",
            plan_hash="p",
            event=ReleaseEvent(5.0),
            epsilon=0.9,
            delta=1e-5,
            accountant="rdp",
        )
        old.commit("old-1")
    # Act / Assert: shown, and the service refuses to start on the default ledger beside it
    assert main(["ledger"]) == 0
    assert "dpmtv-site-ledger.sqlite: 1 counted release(s)" in capsys.readouterr().out
    code = main(
        ["serve", "--model", str(workspace.model), "--data", str(workspace.private),
         "--socket", str(tmp_path / "s.sock"), "--device", "cpu"]
    )  # fmt: skip
    assert code != 0
    assert "dpmtv-site ledger --merge" in capsys.readouterr().err
