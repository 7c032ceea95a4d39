"""Set for the whole test run: torch's thread policy, before any test module imports torch."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy()


@pytest.fixture(autouse=True, scope="module")
def _forget_shared_models() -> Iterator[None]:
    """A process holds its shared models for life; a test module's go with the module."""
    yield
    shared = sys.modules.get("client.shared_model")
    if shared is not None:
        shared.clear_shared_models()
