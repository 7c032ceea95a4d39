"""Set for the whole test run: torch's thread policy, before any test module imports torch;
and a per-run data folder, so no test writes into the user's own site state."""

from __future__ import annotations

import sys
from collections.abc import Callable, Generator, Iterator

import pytest

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy()


@pytest.fixture(autouse=True, scope="session")
def _private_site_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """$XDG_DATA_HOME for the run: a command's default state (ledger, list of ledgers) is the
    test's, never the developer's ~/.local/share/dpmtv/site (subprocesses inherit it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("xdg-data")))
        yield


@pytest.fixture(autouse=True)
def _own_site_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Each test its own $XDG_DATA_HOME: one test's site ledgers are never another's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("xdg-data")))
        yield


@pytest.fixture(autouse=True, scope="module")
def _forget_shared_models() -> Iterator[None]:
    """A process holds its shared models for life; a test module's go with the module."""
    yield
    shared = sys.modules.get("client.models.shared")
    if shared is not None:
        shared.clear_shared_models()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test that registered ``dpmtv_failure_logs`` gets its logs kept and shown.

    Deployment tests run many processes whose logs live in pytest's temporary folders, of
    which only the last three runs are kept: a failure must name where its logs were copied
    and show their tails in the report itself.
    """
    report = yield
    keep: Callable[[], str] | None = getattr(item, "dpmtv_failure_logs", None)
    if report.failed and keep is not None:
        try:
            report.sections.append(("kept logs", keep()))
        except Exception as exc:  # a report must come out whatever the logs' state
            report.sections.append(("kept logs", f"the logs could not be kept: {exc!r}"))
    return report
