"""The three-model headline section of docs/benchmarks.md, from benchmarks/headline.py's JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MODELS = ("small", "deep", "pretrained")
# Below this gain of MTV's own selection over zero-shot a ratio divides by test noise (40-200
# queries): shown as n/a and left out of the plot.
MIN_REFERENCE_GAIN = 0.2
TASK_COLOURS = {"colour": "C0", "shape": "C1", "count": "C2", "position": "C3", "count-word": "C4"}


def has_reference(task: dict) -> bool:
    """Whether MTV's own selection gains enough over zero-shot to divide by."""
    return bool(task["own_selection"] - task["zero_shot"] >= MIN_REFERENCE_GAIN)


MODES = (("central", "central"), ("distributed t=2", "t2"), ("distributed t=n/2", "half"))


def load_headlines(folder: Path) -> dict[str, dict[str, Any]]:
    """``headline-MODEL.json`` of every model that has one."""
    out = {}
    for model in MODELS:
        path = folder / f"headline-{model}.json"
        if path.is_file():
            out[model] = json.loads(path.read_text())
    return out


def _pct(value: float) -> str:
    return "n/a" if value != value else f"{100 * value:.0f} %"


def _mode_key(row: dict) -> str | None:
    """Which of the MODES a row of the chosen setting is (None: a side-by-side row)."""
    if row["variant"] != "chosen":
        return None
    if row["mode"] == "central":
        return "central"
    return "t2" if row["t"] == 2 else "half"


def _cell(rows: list[dict], sites: int, key: str, reference: bool = True) -> str:
    for row in rows:
        if row["sites"] == sites and _mode_key(row) == key:
            ratio = _pct(row["ratio"]) if reference else "n/a"
            return f"**{ratio}** ({row['accuracy']:.2f})"
    # t = n/2 is t = 2 at 3 sites: the row is the t = 2 one
    return "= t=2" if key == "half" else ""


def _sites(results: dict) -> list[int]:
    return sorted({r["sites"] for task in results["tasks"] for r in task["rows"]})


def headline_table(headlines: dict[str, dict[str, Any]]) -> list[str]:
    """One row per model, task and noise mode: ratio (accuracy) at each consortium size."""
    sizes = sorted({s for results in headlines.values() for s in _sites(results)})
    lines = [
        "| model | task | zero-shot | MTV own selection | noise | "
        + " | ".join(f"{s} sites (m = {s} x chunks)" for s in sizes)
        + " |",
        "|---|---|---:|---:|---|" + "---:|" * len(sizes),
    ]
    for model, results in headlines.items():
        for task in results["tasks"]:
            for label, key in MODES:
                cells = [_cell(task["rows"], s, key, has_reference(task)) for s in sizes]
                lines.append(
                    f"| {model} | {task['task']} | {task['zero_shot']:.2f} | "
                    f"{task['own_selection']:.2f} | {label} | " + " | ".join(cells) + " |"
                )
    return lines


def choices_table(headlines: dict[str, dict[str, Any]]) -> list[str]:
    """At 10 sites, central: what each public choice adds, side by side in one run."""
    variants = ("median C, all heads", "all heads", "noise-free C rule", "chosen")
    lines = [
        "| model | task | C = median of every head, every head a candidate | planned-noise C, "
        "every head a candidate | noise-free-rule C, public candidates | planned-noise C, "
        "public candidates (the headline) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for model, results in headlines.items():
        for task in results["tasks"]:
            cells = []
            for variant in variants:
                match = [
                    r
                    for r in task["rows"]
                    if r["sites"] == 10 and r["mode"] == "central" and r["variant"] == variant
                ]
                cells.append(
                    f"{_pct(match[0]['ratio'])} ({match[0]['accuracy']:.2f})" if match else ""
                )
            lines.append(f"| {model} | {task['task']} | " + " | ".join(cells) + " |")
    return lines


def commands(headlines: dict[str, dict[str, Any]]) -> list[str]:
    """Each model's command and its run time."""
    return [
        f"- {model}: `{r['command']}` ({r['seconds'] / 60:.0f} min; "
        f"[headline-{model}.md](benchmarks/headline-{model}.md))"
        for model, r in headlines.items()
    ]


def _is_curve_row(row: dict, *, half: bool) -> bool:
    """A chosen-setting row of the central curve, or of distributed with t = max(2, n/2)."""
    if row["variant"] != "chosen":
        return False
    if not half:
        return bool(row["mode"] == "central")
    return row["mode"] == "distributed" and row["t"] == max(2, -(-row["sites"] // 2))


def plot_headline(headlines: dict[str, dict[str, Any]], path: Path) -> None:
    """Ratio against consortium size, one panel a model, one line a task (central solid)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(headlines), figsize=(4 * len(headlines), 3.4), sharey=True)
    axes = [axes] if len(headlines) == 1 else list(axes)
    for axis, (model, results) in zip(axes, headlines.items(), strict=True):
        for task in results["tasks"]:
            if not has_reference(task):
                continue
            colour = TASK_COLOURS.get(task["task"], "k")
            for half, style in ((False, "-"), (True, ":")):
                rows = sorted(
                    (r for r in task["rows"] if _is_curve_row(r, half=half)),
                    key=lambda r: r["sites"],
                )
                axis.plot(
                    [r["sites"] for r in rows],
                    [100 * r["ratio"] for r in rows],
                    style,
                    marker="o",
                    color=colour,
                    label=None if half else task["task"],
                )
        axis.axhline(90, color="grey", linewidth=0.6, linestyle="--")
        axis.set_xscale("log")
        sizes = _sites(results)
        axis.set_xticks(sizes, [str(s) for s in sizes])
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.legend(fontsize=7)
        axis.set_title(f"{model} model", fontsize=9)
        axis.set_xlabel("sites")
    axes[0].set_ylabel("DP-MTV gain / MTV own-selection gain (%)")
    figure.suptitle(
        "eps = 1, delta = 1e-5, private selection; solid: central, dotted: distributed t = n/2 "
        f"(tasks where MTV gains < {MIN_REFERENCE_GAIN} over zero-shot left out)",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
