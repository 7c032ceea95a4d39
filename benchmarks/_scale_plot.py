"""The scale benchmark's plot: CPU seconds and peak memory of a release against the sites.

Reads the rows back from the markdown table ``benchmarks/scale.py`` writes (the page is the
record), so the plot can be redrawn from a page without re-running the releases.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_ROW = re.compile(
    r"^\| (?P<sites>\d+) \| (?P<mode>\w+) \| (?P<wall>[0-9.]+) \| (?P<cpu>[0-9.]+) \| "
    r"(?P<peak>[0-9.]+) \|"
)


@dataclass(frozen=True)
class Point:
    """One measured configuration."""

    sites: int
    mode: str
    wall_s: float
    cpu_s: float
    peak_mib: float


def points_from_page(page: str) -> list[Point]:
    """Every measured row of a scale page's table (failed rows have no figures: skipped)."""
    points = []
    for line in page.splitlines():
        match = _ROW.match(line)
        if match is not None:
            points.append(
                Point(
                    int(match["sites"]),
                    match["mode"],
                    float(match["wall"]),
                    float(match["cpu"]),
                    float(match["peak"]),
                )
            )
    return points


def plot(points: list[Point], path: Path) -> None:
    """Two panels, log-log: CPU seconds and peak RSS against sites, one line per noise mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (cpu, memory) = plt.subplots(1, 2, figsize=(8, 3.2))
    for mode in sorted({p.mode for p in points}):
        mine = sorted((p for p in points if p.mode == mode), key=lambda p: p.sites)
        sites = [p.sites for p in mine]
        cpu.plot(sites, [p.cpu_s for p in mine], marker="o", label=mode)
        memory.plot(sites, [p.peak_mib for p in mine], marker="o", label=mode)
    cpu.set(xscale="log", yscale="log", xlabel="sites", ylabel="CPU seconds of one release")
    memory.set(xscale="log", xlabel="sites", ylabel="peak RSS (MiB)")
    memory.set_ylim(bottom=0)
    for axes in (cpu, memory):
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
