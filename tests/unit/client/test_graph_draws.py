"""The site's log of secure-sum graph draws: one a release, a bounded number a window."""

from __future__ import annotations

from pathlib import Path

import pytest

from client.release.graph_draws import GraphDrawLog
from dpmtv_common.errors import LedgerError, PolicyError

DAY = 86_400.0


def test_a_draw_is_recorded_durably_with_its_release_and_time(tmp_path: Path) -> None:
    # Arrange
    log = GraphDrawLog(tmp_path / "state" / "ledger.sqlite.graph-draws.json")

    # Act
    log.record("r1", now=1000.0, limit=8, window_seconds=DAY)

    # Assert: a fresh reader (a restarted service) sees it.
    assert GraphDrawLog(log.path).draws_since(0.0) == [("r1", 1000.0)]


def test_a_release_draws_one_graph(tmp_path: Path) -> None:
    # Arrange
    log = GraphDrawLog(tmp_path / "draws.json")
    log.record("r1", now=1000.0, limit=8, window_seconds=DAY)

    # Act / Assert
    with pytest.raises(PolicyError, match="one secure-sum graph at this site, got a second"):
        log.record("r1", now=1001.0, limit=8, window_seconds=DAY)
    assert log.draws_since(0.0) == [("r1", 1000.0)]


def test_draws_past_the_limit_in_the_window_are_refused_naming_the_setting(
    tmp_path: Path,
) -> None:
    # Arrange: a coordinator that aborts after every draw to get another graph.
    log = GraphDrawLog(tmp_path / "draws.json")
    for index in range(3):
        log.record(f"r{index}", now=1000.0 + index, limit=3, window_seconds=DAY)

    # Act / Assert
    with pytest.raises(PolicyError, match="at most secagg_max_graph_draws=3 in any 86400 s"):
        log.record("r3", now=2000.0, limit=3, window_seconds=DAY)
    assert [release for release, _ in log.draws_since(0.0)] == ["r0", "r1", "r2"]


def test_the_window_moves_on_and_old_draws_are_forgotten(tmp_path: Path) -> None:
    # Arrange
    log = GraphDrawLog(tmp_path / "draws.json")
    for index in range(3):
        log.record(f"r{index}", now=1000.0 + index, limit=3, window_seconds=DAY)

    # Act: the first draw is more than a day old.
    log.record("r3", now=1000.5 + DAY, limit=3, window_seconds=DAY)

    # Assert
    assert [release for release, _ in log.draws_since(0.0)] == ["r1", "r2", "r3"]


def test_a_damaged_log_fails_closed(tmp_path: Path) -> None:
    # Arrange
    path = tmp_path / "draws.json"
    path.write_text("{not json", encoding="utf-8")

    # Act / Assert
    with pytest.raises(LedgerError, match=r"graph draw log .* must be valid"):
        GraphDrawLog(path).record("r1", now=1.0, limit=8, window_seconds=DAY)
