"""How well the public choice's held-out simulation predicts the test, from the headline JSONs.

Reads ``docs/benchmarks/headline-{pretrained,small,deep}.json`` (``benchmarks/headline.py``
with ``--every-option-sites``: every option released at every size) and reports, for each
model, how often the option the choice picked was the best measured (and within 0.05 of it,
and the mean shortfall), and, for public heads and for the private options, how often an
option's test accuracy fell more than 0.3 below its held-out prediction: the failure
asymmetry behind ``client.public.scope.best_option``'s preference for private selection on a
near-tie. No model is loaded; it takes a second::

    .venv/bin/python benchmarks/choice_calibration.py
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = ("pretrained", "small", "deep")
CLIFF = 0.3  # a prediction missed by more than this is a collapse, not noise
CLOSE = 0.05


def central_cells(task: dict) -> dict[int, list[dict]]:
    """Each size's central rows of every option (the pick and the others)."""
    cells: dict[int, list[dict]] = collections.defaultdict(list)
    for row in task["rows"]:
        if row["mode"] == "central" and row["variant"] in ("chosen", "another option"):
            cells[row["sites"]].append(row)
    return cells


def is_public(row: dict) -> bool:
    return row["selection"] == "public"


def model_lines(name: str, data: dict, misses: dict[str, list[float]]) -> str:
    shortfalls = []
    for task in data["tasks"]:
        for rows in central_cells(task).values():
            picked = next(r["accuracy"] for r in rows if r["variant"] == "chosen")
            shortfalls.append(max(r["accuracy"] for r in rows) - picked)
            for row in rows:
                kind = "public heads" if is_public(row) else "private options"
                misses[kind].append(row["accuracy"] - row["held_out"])
    best = sum(s <= 1e-9 for s in shortfalls)
    close = sum(s <= CLOSE for s in shortfalls)
    return (f"| {name} | {len(shortfalls)} | {best} | {close} | "
            f"{statistics.mean(shortfalls):.2f} |")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=REPO / "docs" / "benchmarks",
                        help="folder of the headline JSONs")  # fmt: skip
    parser.add_argument("--out", type=Path, help="also write the table here (.md)")
    args = parser.parse_args()
    misses: dict[str, list[float]] = {"public heads": [], "private options": []}
    lines = [
        "| model | task-size cells | pick was the best measured | within 0.05 | mean shortfall |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in MODELS:
        data = json.loads((args.dir / f"headline-{name}.json").read_text())
        lines.append(model_lines(name, data, misses))
    lines += ["", f"| options | released | test more than {CLIFF} below held-out |"]
    lines.append("|---|---:|---:|")
    for kind, gaps in misses.items():
        lines.append(f"| {kind} | {len(gaps)} | {sum(g < -CLIFF for g in gaps)} |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out is not None:
        intro = __doc__.split("\n\n")[0]
        args.out.write_text(f"# The public choice against the test\n\n{intro}\n\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
