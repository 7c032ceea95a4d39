"""The deployment benchmark's log reading: per-message hops, a later run's lines, its table."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.deployment import Measured, site_hops, table

_SUPERNODE_LOG = """\
[    1.00] INFO :      Receiving: query.plan message (ID: a)
[    2.00] INFO :      Start `flwr-clientapp` process
[    2.50] INFO :      Sending: query.plan message (ID: b)
[    6.00] INFO :      Receiving: query.sum_shares message (ID: c)
[    7.25] INFO :      Start `flwr-clientapp` process
[    8.00] INFO :      Sending: query.sum_shares message (ID: d)
[   20.00] INFO :      Receiving: query message (ID: e)
[   21.00] INFO :      Start `flwr-clientapp` process
[   21.10] INFO :      Sending: query message (ID: f)
"""


@pytest.fixture
def log(tmp_path: Path) -> Path:
    path = tmp_path / "site-0.log"
    path.write_text(_SUPERNODE_LOG, encoding="utf-8")
    return path


def test_hops_are_read_per_message(log: Path) -> None:
    pickup, start, handling = site_hops(log)
    assert pickup == pytest.approx([3.5, 12.0])
    assert start == pytest.approx([1.0, 1.25, 1.0])
    assert handling == pytest.approx([0.5, 0.75, 0.1])


def test_a_later_run_reads_only_its_own_lines(log: Path) -> None:
    pickup, start, handling = site_hops(log, since=19.0)
    assert pickup == []  # its first message has no earlier reply of its own run
    assert start == pytest.approx([1.0])
    assert handling == pytest.approx([0.1])


def test_the_floor_column_shows_no_release_stages() -> None:
    release = Measured("after", 3, "finished:completed", 30.0, {"plan": 5.0, "sums+noise": 20.0})
    floor = Measured("floor", 3, "finished:completed", 12.0, {"round trips": 8.0})
    rendered = table([release, floor]).splitlines()
    plan_row = next(line for line in rendered if line.startswith("| ServerApp: plan"))
    total_row = next(line for line in rendered if line.startswith("| **ServerApp total"))
    assert plan_row == "| ServerApp: plan (s) | 5.0 | — |"
    assert total_row == "| **ServerApp total (s)** | **25.0** | **8.0** |"
