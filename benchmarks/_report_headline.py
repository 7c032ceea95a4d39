"""The headline section of docs/benchmarks.md, from benchmarks/headline.py's JSON.

Each model's page (``headline-MODEL.md``) has every row; this section puts the models side
by side: what a consortium member has without a private release, MTV's own selection (the
oracle), and the release the public choices make at each consortium size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from _headline_report import MIN_REFERENCE_GAIN, best_baseline, ratio

MODELS = ("small", "deep", "pretrained")
TASK_COLOURS = {"colour": "C0", "shape": "C1", "count": "C2", "position": "C3"}
BASELINE_NAMES = {
    "public_only_task_agnostic": "public only",
    "public_only_tiny": "public same-task mean",
    "public_icl_tiny": "public same-task ICL",
    "site_alone_icl": "a site's own ICL",
}


def load_headlines(folder: Path) -> dict[str, dict[str, Any]]:
    """``headline-MODEL.json`` of every model whose run has the baselines (the current format)."""
    out = {}
    for model in MODELS:
        path = folder / f"headline-{model}.json"
        if path.is_file():
            results = json.loads(path.read_text())
            if all("baselines" in task for task in results["tasks"]):
                out[model] = results
    return out


def _pct(value: float) -> str:
    return "n/a" if value != value else f"{100 * value:.0f} %"


def _variant(row: dict) -> str:
    """``chosen`` for the release the public choices make, else what the side row changes.

    Rows written since the field exists carry it; older JSON is read from its label.
    """
    if "variant" in row:
        return str(row["variant"])
    label = row["label"]
    if "(sweep)" in label:
        return "sweep"
    if "no centre" in label:
        return "no centre"
    if "other mode" in label:
        return "other heads mode"
    return "chosen"


def _chosen(task: dict, sites: int, mode: str, variant: str = "chosen") -> dict | None:
    for row in task["rows"]:
        if row["sites"] == sites and row["mode"] == mode and _variant(row) == variant:
            return row
    return None


# The summary's lines a task: the public choices' release in each noise mode, and private
# selection in release-first order (the product's default order) where it was run.
_SUMMARY_LINES = (
    ("central", "chosen", "central"),
    ("distributed", "chosen", "distributed t = n/2"),
    ("central", "release-first", "central, private heads, release-first"),
)


def _sites(headlines: dict[str, dict[str, Any]]) -> list[int]:
    return sorted(
        {r["sites"] for res in headlines.values() for t in res["tasks"] for r in t["rows"]}
    )


def _cell(task: dict, row: dict | None, *, tagged: bool = False) -> str:
    if row is None:
        return ""
    best = best_baseline(task["baselines"])[1]
    mark = "" if row["accuracy"] > best else " ≤ best"
    tag = f"{option_tag(row)}: " if tagged else ""
    return (
        f"{tag}**{_pct(ratio(row['accuracy'], task['baselines']))}** "
        f"({row['accuracy']:.2f} ± {row['sd']:.2f}{mark})"
    )


def headline_table(headlines: dict[str, dict[str, Any]]) -> list[str]:
    """One line a model, task and noise mode: ratio (accuracy ± sd) at each size."""
    sizes = _sites(headlines)
    lines = [
        "| model | task | zero-shot | public only | a site's own 4-shot ICL | best without a "
        "private release | MTV own selection | noise | "
        + " | ".join(f"{s} sites" for s in sizes)
        + " |",
        "|---|---|---:|---:|---:|---|---:|---|" + "---:|" * len(sizes),
    ]
    for model, results in headlines.items():
        for task in results["tasks"]:
            base = task["baselines"]
            key, best = best_baseline(base)
            for mode, variant, label in _SUMMARY_LINES:
                rows = [_chosen(task, s, mode, variant) for s in sizes]
                if not any(rows):
                    continue
                lines.append(
                    f"| {model} | {task['task']} | {base['zero_shot']:.2f} | "
                    f"{base['public_only_task_agnostic']:.2f} | {base['site_alone_icl']:.2f} | "
                    f"{best:.2f} ({BASELINE_NAMES[key]}) | {base['mtv_own_selection']:.2f} | "
                    f"{label} | "
                    + " | ".join(_cell(task, r, tagged=variant == "chosen") for r in rows)
                    + " |"
                )
    return lines


OPTIONS = (
    ("public", "select-first", "public heads"),
    ("private", "select-first", "private selection, select-first"),
    ("private", "release-first", "private selection, release-first"),
    ("private", "release-first among every head", "private selection, release-first, every head"),
)


def option_of(row: dict) -> tuple[str, str]:
    """(selection, order) of a row; older JSON, without ``order``, is read from its label.

    Private picks released first among every carried head (no candidates) are an order of
    their own: "release-first among every head".
    """
    order = row.get("order") or ("release-first" if "release-first" in row["label"] else
                                 "select-first")  # fmt: skip
    among = " among every head" if row.get("among_every_head") else ""
    return str(row["selection"]), f"{order}{among}"


def option_tag(row: dict) -> str:
    """A chosen row's option, short: public / private s-f / private r-f (/ r-f all heads)."""
    selection, order = option_of(row)
    every = " all heads" if order.endswith("among every head") else ""
    return "public" if selection == "public" else f"private {order[0]}-f{every}"


def side_table(headlines: dict[str, dict[str, Any]]) -> list[str]:
    """At the side-by-side size, central: each option's own release and the chosen one bare.

    The chosen option is marked; the last column is it without the centre.
    """
    lines = [
        "| model | task | sites | "
        + " | ".join(label for _, _, label in OPTIONS)
        + " | the chosen option without the centre |",
        "|---|---|---:|" + "---:|" * (len(OPTIONS) + 1),
    ]
    for model, results in headlines.items():
        for task in results["tasks"]:
            raw = [r for r in task["rows"] if _variant(r) == "no centre"]
            if not raw:
                continue
            sites = raw[0]["sites"]
            central = [
                r for r in task["rows"]
                if r["sites"] == sites and r["mode"] == "central" and _variant(r) != "sweep"
                and _variant(r) != "no centre"
            ]  # fmt: skip
            cells = []
            for selection, order, _ in OPTIONS:
                row = next((r for r in central if option_of(r) == (selection, order)), None)
                mark = " (chosen)" if row is not None and _variant(row) == "chosen" else ""
                cells.append(_cell(task, row) + mark)
            lines.append(
                f"| {model} | {task['task']} | {sites} | " + " | ".join(cells)
                + f" | {_cell(task, raw[0])} |"
            )  # fmt: skip
    return lines


def commands(headlines: dict[str, dict[str, Any]]) -> list[str]:
    """Each model's command and its run time."""
    return [
        f"- {model}: `{r['command']}` ({r['seconds'] / 60:.0f} min; "
        f"[headline-{model}.md](benchmarks/headline-{model}.md))"
        for model, r in headlines.items()
    ]


def plot_headline(headlines: dict[str, dict[str, Any]], path: Path) -> None:
    """Accuracy against consortium size, one panel a model (central, solid).

    Each task's dashed line is the best figure a member has without a private release.
    """
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(headlines), figsize=(4 * len(headlines), 3.4), sharey=True)
    axes = [axes] if len(headlines) == 1 else list(axes)
    for axis, (model, results) in zip(axes, headlines.items(), strict=True):
        sizes = sorted({r["sites"] for t in results["tasks"] for r in t["rows"]})
        for task in results["tasks"]:
            colour = TASK_COLOURS.get(task["task"], "k")
            rows = [_chosen(task, s, "central") for s in sizes]
            points = [(r["sites"], r["accuracy"], r["sd"]) for r in rows if r is not None]
            axis.errorbar(
                [p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points],
                marker="o", color=colour, label=task["task"], capsize=2,
            )  # fmt: skip
            axis.axhline(best_baseline(task["baselines"])[1], color=colour, linestyle="--")
        axis.set_xscale("log")
        axis.set_xticks(sizes, [str(s) for s in sizes])
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.set_ylim(-0.05, 1.05)
        axis.legend(fontsize=7)
        axis.set_title(f"{model} model", fontsize=9)
        axis.set_xlabel("sites (100 examples each)")
    axes[0].set_ylabel("test accuracy")
    figure.suptitle(
        "eps = 1, delta = 1e-5, task-agnostic public choices, central; dashed: the best "
        "figure without a private release",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


__all__ = [
    "MIN_REFERENCE_GAIN",
    "commands",
    "headline_table",
    "load_headlines",
    "plot_headline",
    "side_table",
]
