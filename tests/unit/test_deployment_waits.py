"""The deployment tests' waits end on silence, not a fixed total; a failure keeps its logs."""

from __future__ import annotations

import time
from pathlib import Path

from scripts.local_consortium import ProgressDeadline, keep_logs


def test_a_deadline_waits_while_the_processes_print_and_ends_when_they_fall_silent() -> None:
    # Arrange: output 0.1 s apart for a while, then none
    quiet = 0.3
    printing_until = time.monotonic() + 3 * quiet
    deadline = ProgressDeadline(lambda: min(time.monotonic(), printing_until), quiet)
    # Act
    while not deadline.expired():
        time.sleep(0.02)
    waited = time.monotonic() - deadline.started
    # Assert: past three quiet periods (it kept printing), ended one quiet period after
    assert 4 * quiet <= waited < ProgressDeadline.CAP_FACTOR * quiet


def test_a_deadline_ends_at_its_cap_even_while_something_prints() -> None:
    deadline = ProgressDeadline(time.monotonic, 0.05)
    while not deadline.expired():
        time.sleep(0.01)
    assert time.monotonic() - deadline.started >= ProgressDeadline.CAP_FACTOR * 0.05
    assert "in all" in deadline.why()


def test_kept_logs_outlive_their_folder_and_the_report_shows_their_tails(tmp_path: Path) -> None:
    # Arrange
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    (logs / "site-0.log").write_text("\n".join(f"line {i}" for i in range(100)))
    # Act
    report = keep_logs(logs, tmp_path / "kept", tail=3)
    (logs / "site-0.log").unlink()
    # Assert
    kept = Path(report.splitlines()[0].removeprefix("logs kept in "))
    assert (kept / "site-0.log").read_text().endswith("line 99")
    assert report.splitlines()[1:] == [
        "--- site-0.log (last 3 of 100 lines)",
        "line 97",
        "line 98",
        "line 99",
    ]
