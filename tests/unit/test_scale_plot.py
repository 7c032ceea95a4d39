"""The scale page's rows read back for its plot; failed rows are left out."""

from __future__ import annotations

from pathlib import Path

from benchmarks._scale_plot import Point, plot, points_from_page

PAGE = """\
| sites | noise mode | wall (s) | CPU (s) | peak RSS (MiB) | models loaded | stages (s) |
|---:|---|---:|---:|---:|---:|---|
| 3 | central | 1.4 | 1.3 | 516 | 1 | wait 0.0, plan 0.1 |
| 1000 | distributed | 190.2 | 185.0 | 1410 | 1 | wait 0.0, plan 27.0 |
| 300 | central | — | — | — | — | failed: timed out |
"""


def test_measured_rows_are_read_and_failed_ones_skipped() -> None:
    assert points_from_page(PAGE) == [
        Point(3, "central", 1.4, 1.3, 516.0),
        Point(1000, "distributed", 190.2, 185.0, 1410.0),
    ]


def test_the_plot_is_written(tmp_path: Path) -> None:
    path = tmp_path / "scale.png"
    plot(points_from_page(PAGE), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
