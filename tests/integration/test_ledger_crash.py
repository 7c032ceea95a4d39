from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dpmtv_common.privacy.budget import PrivacyBudget
from dpmtv_common.privacy.composition import epsilon_bound
from dpmtv_common.privacy.events import ReleaseEvent
from dpmtv_common.privacy.ledger import PrivacyLedger, ReleaseState

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
DELTA = 1e-5
EVENT = ReleaseEvent(5.0, 8, 0.1)
BUDGET = PrivacyBudget(epsilon=3.0, delta=DELTA)

# Shared by every child: open the ledger given as argv[1] with BUDGET, and a reserve helper.
CHILD_PRELUDE = """
import os, signal, sys
from dpmtv_common.privacy.budget import PrivacyBudget
from dpmtv_common.privacy.events import ReleaseEvent
from dpmtv_common.privacy.ledger import PrivacyLedger
ledger = PrivacyLedger.open(sys.argv[1], PrivacyBudget(epsilon=3.0, delta=1e-5))
def reserve(release_id):
    ledger.reserve(release_id=release_id, plan_hash="plan", event=ReleaseEvent(5.0, 8, 0.1),
                   epsilon=0.99, delta=1e-6, accountant="rdp")
"""


def run_child(body: str, path: Path) -> subprocess.CompletedProcess[str]:
    code = CHILD_PRELUDE + textwrap.dedent(body)
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    # run() waits for the child, so a killed child is reaped and its pid no longer exists.
    return subprocess.run(
        [sys.executable, "-c", code, str(path)],
        env={**os.environ, "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_open_resolves_the_entries_of_a_killed_process(tmp_path: Path) -> None:
    # Arrange: the child reserves one release, exposes a second, then dies without cleanup.
    path = tmp_path / "ledger.sqlite"
    child = run_child(
        """
        reserve("never-exposed")
        reserve("exposed")
        ledger.mark_exposed("exposed")
        print(os.getpid(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """,
        path,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    pid = int(child.stdout.strip())
    # Act
    with PrivacyLedger.open(path, BUDGET) as ledger:
        entries = {entry.release_id: entry for entry in ledger.releases()}
        spent = ledger.spent()
    # Assert: no noise existed for the first (refunded); the second may have leaked (spent).
    assert entries["never-exposed"].state is ReleaseState.ABORTED
    assert entries["exposed"].state is ReleaseState.COMMITTED
    for entry in entries.values():
        assert entry.pid == pid
        assert entry.note == f"recovered after crash of pid {pid}"
    assert spent == epsilon_bound([EVENT], delta=DELTA)


def test_another_opener_leaves_a_live_process_reservation_alone(tmp_path: Path) -> None:
    # Arrange: this (live) process holds a reservation and an exposed release.
    path = tmp_path / "ledger.sqlite"
    with PrivacyLedger.open(path, BUDGET) as ledger:
        for release_id in ("live", "live-exposed"):
            ledger.reserve(
                release_id=release_id,
                plan_hash="plan",
                event=EVENT,
                epsilon=0.99,
                delta=1e-6,
                accountant="rdp",
            )
        ledger.mark_exposed("live-exposed")
        # Act: another process opens the ledger (running crash recovery) and reports.
        child = run_child(
            """
            print(";".join(f"{e.release_id}={e.state.value}" for e in ledger.releases()))
            ledger.close()
            """,
            path,
        )
        # Assert
        assert child.returncode == 0, child.stderr
        assert child.stdout.strip() == "live=reserved;live-exposed=exposed"
        ledger.abort("live", "stopped before noise")
        ledger.commit("live-exposed")
        assert [entry.state for entry in ledger.releases()] == [
            ReleaseState.ABORTED,
            ReleaseState.COMMITTED,
        ]
