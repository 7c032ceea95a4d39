"""scripts/demo, the README's first command, runs end to end and is never silent for long.

On the tiny random model (seconds a phase here; minutes on the pretrained decoder), with a
heartbeat of half a second: each phase prints its header, heartbeat lines name its steps
and no two lines are further apart than a few heartbeats, whatever a phase is doing. Which
step a beat names (the sites' own log lines among them) is checked in
tests/unit/test_demo_progress.py: a fast machine may finish the release within one beat.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
EVERY_S = 0.5
# A line at least every heartbeat; a loaded machine may hold a beat back by seconds.
MAX_SILENCE_S = 15.0


def test_the_demo_runs_every_phase_and_reports_progress_throughout(tmp_path: Path) -> None:
    # Act
    command = [
        sys.executable, str(REPO / "scripts" / "demo.py"), "--tiny-random-model",
        "--per-site", "15", "--test", "2", "--workdir", str(tmp_path / "run"),
        "--progress-every", str(EVERY_S),
    ]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path
    )
    assert process.stdout is not None
    stamped: list[tuple[float, str]] = []
    for line in process.stdout:
        stamped.append((time.monotonic(), line.rstrip()))
    code = process.wait(timeout=60)
    process.stdout.close()
    lines = [line for _, line in stamped]
    text = "\n".join(lines)
    # Assert
    assert code == 0, text
    for header in ("[1/3] preparing", "[2/3] federated release over", "[3/3] local inference"):
        assert any(line.startswith(header) for line in lines), text
    assert any(line.startswith("      ... [1/3]: ") for line in lines), text
    gaps = [later - earlier for (earlier, _), (later, _) in itertools.pairwise(stamped)]
    assert max(gaps) < MAX_SILENCE_S, text
    assert lines[-1].startswith("done in"), text
