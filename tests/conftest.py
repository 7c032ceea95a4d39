"""Set for the whole test run: torch's thread policy, before any test module imports torch;
and a per-run data folder, so no test writes into the user's own site state."""

from __future__ import annotations

import sys
from collections.abc import Iterator

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
    shared = sys.modules.get("client.shared_model")
    if shared is not None:
        shared.clear_shared_models()
