"""The demo's heartbeat names the latest step (a site's log line among them), stops with its phase.

The integration test of scripts/demo checks the phases' headers and the longest silence; a
release phase may end within one heartbeat on a fast machine, so which step a beat names is
checked here, with a heartbeat short enough to see every step.
"""

from __future__ import annotations

import io
import logging
import time

from scripts.demo_progress import Heartbeat, StepHandler

EVERY_S = 0.02
WAIT_S = 10.0


def _wait_for(out: io.StringIO, text: str) -> bool:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if text in out.getvalue():
            return True
        time.sleep(EVERY_S)
    return False


def test_a_beat_names_the_latest_log_line_of_a_site_while_the_phase_runs() -> None:
    # Arrange
    out = io.StringIO()
    beat = Heartbeat(every=EVERY_S, out=out)
    logger = logging.getLogger("client.release.site.heartbeat-test")
    logger.setLevel(logging.INFO)
    handler = StepHandler(beat)
    logger.addHandler(handler)
    try:
        # Act
        with beat.phase("[2/3]"):
            logger.info("release %s: contributed to the %s secure sum", "r-1", "first")
            seen = _wait_for(out, "release r-1: contributed to the first secure sum")
    finally:
        logger.removeHandler(handler)
    # Assert
    assert seen, out.getvalue()
    assert "      ... [2/3]: release r-1: contributed" in out.getvalue()


def test_beats_say_working_before_any_step_and_stop_when_the_phase_ends() -> None:
    # Arrange
    out = io.StringIO()
    beat = Heartbeat(every=EVERY_S, out=out)
    # Act
    with beat.phase("[1/3]"):
        seen = _wait_for(out, "[1/3]: working")
    printed = out.getvalue()
    time.sleep(10 * EVERY_S)
    # Assert
    assert seen, printed
    assert out.getvalue() == printed  # nothing after the phase
