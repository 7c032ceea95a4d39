"""Writes docs/benchmarks.md and the PNG plots of the utility benchmark."""

from __future__ import annotations

import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path

FIGURE_KEYS = ["m", "K", "C", "|S|", "L", "sigma", "SNR"]


def _table(rows, extra_keys=()) -> str:
    keys = [*FIGURE_KEYS, *extra_keys]
    lines = [
        "| row | accuracy | std | " + " | ".join(keys) + " |",
        "|---|---:|---:|" + "---:|" * len(keys),
    ]
    for row in rows:
        cells = [row.figures.get(key, "") for key in keys]
        lines.append(
            f"| {row.name} | {row.accuracy:.3f} | {row.spread:.3f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def _plot(results, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    table = results["table"]
    base = {row.name: row.accuracy for row in table if not row.name.startswith("DP-MTV")}
    names = []
    fig, ax = plt.subplots(figsize=(6.5, 4))
    series: dict[str, list] = {}
    for row in table:
        if row.name.startswith("DP-MTV"):
            _, eps, selection, order = row.name.split(" ")
            series.setdefault(f"{selection} {order}", []).append(
                (float(eps.split("=")[1]), row.accuracy, row.spread)
            )
    for label, points in series.items():
        xs, ys, es = zip(*points, strict=True)
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=label)
    for name, style in (("zero-shot", ":"), ("MTV (no clip, no noise)", "--")):
        if name in base:
            ax.axhline(base[name], linestyle=style, color="grey", label=name)
    icl = next((row for row in table if row.name.endswith("ICL")), None)
    if icl:
        ax.axhline(icl.accuracy, linestyle="-.", color="black", label=icl.name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("epsilon (delta = 1e-5)")
    ax.set_ylabel("accuracy")
    ax.set_title("DP-MTV on the embedded model")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "utility_vs_epsilon.png", dpi=120)
    names.append("utility_vs_epsilon.png")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    curve = results["federation"]
    xs = [int(row.name.split()[0]) for row in curve]
    ax.errorbar(
        xs, [r.accuracy for r in curve], yerr=[r.spread for r in curve], marker="o", capsize=3
    )
    if "zero-shot" in base:
        ax.axhline(base["zero-shot"], linestyle=":", color="grey", label="zero-shot")
    if "MTV (no clip, no noise)" in base:
        ax.axhline(base["MTV (no clip, no noise)"], linestyle="--", color="grey", label="MTV")
    ax.set_xscale("log")
    ax.set_xlabel("sites (same n each)")
    ax.set_ylabel("accuracy at epsilon = 1")
    ax.set_title("One site drowns in noise; a consortium does not")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "federation_curve.png", dpi=120)
    names.append("federation_curve.png")
    plt.close(fig)
    return names


def write_report(results, out: Path) -> None:
    args = results["args"]
    plots = _plot(results, out / "benchmarks")
    headline = results["headline"]
    latency = results["latency"]
    torch_version = subprocess.run(
        [
            ".venv/bin/python",
            "-c",
            "import torch, transformers; print(torch.__version__, transformers.__version__)",
        ],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    lines = [
        "# Utility of DP-MTV on the embedded model",
        "",
        f"Reproduce: `.venv/bin/python benchmarks/utility.py{' --quick' if args['quick'] else ''}` "
        f"({results['seconds'] / 60:.1f} min on this machine, {datetime.now(UTC):%Y-%m-%d}).",
        f"Machine: 2 cores, Python {platform.python_version()}, "
        f"torch/transformers {torch_version}.",
        "",
        f"Task of the tables: **{args['task']}** (the same question for four tasks; only the "
        "answers tell which). Accuracy = greedy first answer token equals the answer, on "
        f"{args['test']} held-out test images, zero-shot prompt patched with the released "
        f"vector. Each DP row: mean and std over {args['draws']} independent noise draws (the "
        f"noise-free sums are computed once). Chunks: K={args['shots']} demonstrations + 1 "
        f"query; the table pools {args['table_sites']} sites x {args['per_site']} examples. C: "
        "median per-layer norm on public data. Public heads: attribution on public data. "
        "delta = 1e-5 everywhere.",
        "",
        "## Headline",
        "",
        f"(DP-MTV at eps=1 - zero-shot) / (MTV - zero-shot), private selection, {args['order']} "
        "(the paper, on VizWiz: (50 - 35)/(55 - 35) = 75 %):",
        "",
        "| task | zero-shot | MTV | DP-MTV eps=1 | std | m | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *[
            f"| {h['task']} | {h['zero']:.3f} | {h['mtv']:.3f} | {h['dp']:.3f} | "
            f"{h['dp_std']:.3f} | {h['m']} | {h['ratio']:.0%} |"
            for h in headline
        ],
        "",
        "## Main table",
        "",
        _table(results["table"]),
        "",
        f"![utility vs epsilon](benchmarks/{plots[0]})",
        "",
        f"## Federation curve (eps = 1, private selection, {args['order']})",
        "",
        f"Each site holds {args['per_site']} examples; 2+ sites run the real federated path "
        "(ClientApp sites, SecAgg+ with ChaCha20 masks, in one process); 1 site runs the "
        "single-holder path (a secure sum needs two sites).",
        "",
        _table(results["federation"], ("seconds/release",)),
        "",
        f"![federation curve](benchmarks/{plots[1]})",
        "",
        f"## Sweeps at eps = 1 (private selection, {args['order']}; K sweep, then C sweep)",
        "",
        _table(results["k_sweep"]),
        "",
        _table(results["c_sweep"]),
        "",
        "## Latency per query (batch 1, 3 new tokens, median of 20)",
        "",
        "| mode | seconds | ratio to zero-shot |",
        "|---|---:|---:|",
        *[
            f"| {name} | {seconds:.4f} | {seconds / latency['zero-shot']:.2f} |"
            for name, seconds in latency.items()
        ],
        "",
    ]
    (out / "benchmarks.md").write_text("\n".join(lines))
