"""apply_thread_policy: a sleeping, sized torch pool, set before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpmtv_common.errors import ConfigError
from dpmtv_common.thread_policy import ThreadPolicy, apply_thread_policy

REPO = Path(__file__).resolve().parents[3]


def run_fresh(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return result.stdout.strip()


def test_a_fresh_process_gets_a_passive_pool_sized_as_asked() -> None:
    # Arrange
    code = (
        "from dpmtv_common.thread_policy import apply_thread_policy as a;"
        "p = a(1); import os, torch;"
        "print(os.environ['OMP_WAIT_POLICY'], torch.get_num_threads(), p.threads)"
    )

    # Act
    printed = run_fresh(code)

    # Assert
    assert printed == "PASSIVE 1 1"


def test_the_default_keeps_an_operators_settings() -> None:
    # Arrange
    code = (
        "from dpmtv_common.thread_policy import apply_thread_policy as a;"
        "p = a(); import torch; print(p.wait_policy, p.threads, torch.get_num_threads())"
    )

    # Act
    printed = run_fresh(code, OMP_WAIT_POLICY="ACTIVE", OMP_NUM_THREADS="1")

    # Assert
    assert printed == "ACTIVE 1 1"


@pytest.mark.parametrize("env", [{}, {"OMP_NUM_THREADS": ""}], ids=["unset", "empty"])
def test_the_default_uses_the_cores_this_process_may_run_on(env: dict[str, str]) -> None:
    # Arrange
    code = "from dpmtv_common.thread_policy import apply_thread_policy as a; print(a().threads)"

    # Act
    printed = run_fresh(code, **env)

    # Assert
    assert int(printed) == len(os.sched_getaffinity(0))


def test_torch_loaded_first_without_a_wait_policy_is_refused() -> None:
    # Arrange
    code = (
        "import torch\n"
        "from dpmtv_common.thread_policy import apply_thread_policy as a\n"
        "try:\n    a()\nexcept ValueError as e:\n    print(type(e).__name__, e)\n"
    )

    # Act
    printed = run_fresh(code)

    # Assert
    assert printed.startswith("ConfigError apply_thread_policy must run before torch is imported")


def test_a_later_call_resizes_a_loaded_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrange: this test process set the policy in tests/conftest.py
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    before = torch.get_num_threads()

    # Act
    policy = apply_thread_policy(1)
    try:
        resized = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)

    # Assert
    assert policy == ThreadPolicy(wait_policy=os.environ["OMP_WAIT_POLICY"], threads=1)
    assert resized == 1


@pytest.mark.parametrize("threads", [0, -2, True, 1.5])
def test_threads_must_be_a_positive_integer(threads: object) -> None:
    # Act / Assert
    with pytest.raises(ConfigError, match="threads must be a positive integer, got"):
        apply_thread_policy(threads)  # type: ignore[arg-type]


@pytest.mark.parametrize("given", ["0", "two", "-1"])
def test_omp_num_threads_must_be_a_positive_integer(
    given: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Arrange
    monkeypatch.setenv("OMP_NUM_THREADS", given)

    # Act / Assert
    with pytest.raises(ConfigError, match="OMP_NUM_THREADS must be a positive integer, got"):
        apply_thread_policy()
