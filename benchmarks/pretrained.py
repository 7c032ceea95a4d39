"""Does MTV work on a pretrained decoder, and how much of it does DP-MTV keep?

Model: the pretrained-decoder LLaVA (``client.models.pretrained``: SmolLM2-135M-Instruct, 30
layers x 9 heads = 270 heads, with the vision tower and projector trained here); assemble it
first with ``scripts/assemble_pretrained_model``. Data as in ``benchmarks/utility.py``:
sites and public data show ``train`` scenes, heads are chosen on ``validation`` queries, every
figure is on ``test`` scenes no training, site or public set showed.

Per task (the four trained attributes, and the word family whose answers no model here was
trained to say for an image):

1. zero-shot, and K-shot ICL at K = 1, 4, 8 (demonstrations from the public set);
2. **MTV with its own head selection** (the paper's method, non-private): the unclipped mean of
   the pooled chunks' activations, patched into the k heads that attribution ranks first on
   the validation queries, at k = 4, 8, 16, 32; and where those heads are;
3. **DP-MTV at eps = 1, delta = 1e-5** (m = pooled / (K+1) chunks, single holder): private
   selection (select-first; votes by the shift score), public heads (attribution on the
   public set), each rescaled to the public typical head norm (free post-processing); the
   headline ratio (DP-MTV - zero-shot) / (MTV own selection at the same k - zero-shot), with
   MTV on the heads DP picked as a diagnostic column.

Writes ``docs/benchmarks/pretrained.json`` and ``docs/benchmarks/pretrained.md``. Usage:

    .venv/bin/python benchmarks/pretrained.py --tasks colour count-word position shape count \
        --test 40                                   # the shipped table (~25 min a task, 2 cores)
    .venv/bin/python benchmarks/pretrained.py --tasks colour --quick   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy()  # before torch loads: its thread pool must not spin on shared cores

import torch
from _utility_bench import Bench, dp_row, mtv_row, private_plan, setup
from _utility_lib import PerChunkSums, headline_ratios, score

from client.activations.chunking import make_chunks
from client.data.synthetic import TASKS, TRAINED_TASKS
from client.evaluation.first_token import QuerySet
from client.evaluation.run import icl_prompts
from client.models.pretrained import pretrained_model_path
from client.public.selection import select_heads_attribution
from client.release.single_holder import LocalSums
from protocol import ReleaseOrder, SelectionMode

KS = (4, 8, 16, 32)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def icl_rows(bench: Bench) -> dict[str, float]:
    answers = [r.answer for r in bench.test_records]
    out = {"zero-shot": score(bench.loaded, bench.test).accuracy}
    for shots in (1, 4, 8):
        prompts = icl_prompts(bench.test_records, bench.public_records, shots=shots, seed=0)
        out[f"{shots}-shot ICL"] = score(
            bench.loaded, QuerySet.build(bench.loaded, prompts, answers)
        ).accuracy
    return out


def own_selection(bench: Bench, ks: tuple[int, ...]) -> dict[int, dict]:
    """MTV with heads chosen by attribution on validation, at each k (the paper's baseline)."""
    layers, heads = bench.shape
    mean = torch.as_tensor(bench.mtv_mean.reshape(layers, heads, -1), dtype=torch.float32)
    rows = {}
    for k in ks:
        chosen = select_heads_attribution(bench.loaded, mean, bench.validation_records, k=k)
        row = mtv_row(bench, chosen, f"MTV own selection k={k}")
        row["heads"] = [list(h) for h in chosen.heads]
        rows[k] = row
    return rows


def per_chunk_sums(bench: Bench) -> PerChunkSums:
    """Sums of the pooled chunks from their kept activations; votes by the product's path."""
    chunks = make_chunks(bench.pooled, shots=bench.shots, seed=1).chunks
    plan = private_plan(bench, bench.heads)
    inner = LocalSums(bench.loaded, chunks, plan, progress=False)
    return PerChunkSums(inner, bench.clip_norm, bench.chunk_activations)


def dp_rows(bench: Bench, args) -> list[dict]:
    sums = per_chunk_sums(bench)
    rows = []
    for selection in (SelectionMode.PRIVATE, SelectionMode.PUBLIC):
        row = dp_row(
            bench,
            sums,
            epsilon=1.0,
            selection=selection,
            order=ReleaseOrder.SELECT_FIRST,
            rescale=True,
            queries=bench.test,
            draws=args.draws,
            name=f"DP-MTV eps=1 {selection.value} select-first + rescale",
        )
        rows.append(row)
        log(f"  {row['name']}: {row['accuracy']:.3f} +- {row['spread']:.3f} (SNR {row['SNR']:.2f})")
    return rows


def run_task(args, model: Path, root: Path, task: str) -> dict:
    started = time.monotonic()
    bench = setup(args, model, root / task, task, per_chunk=True)
    baselines = icl_rows(bench)
    log(f"{task}: " + ", ".join(f"{k} {v:.3f}" for k, v in baselines.items()))
    own = own_selection(bench, KS)
    log("  MTV own selection: " + ", ".join(f"k={k} {r['accuracy']:.3f}" for k, r in own.items()))
    dp = dp_rows(bench, args)
    ratios = [
        {
            "name": row["name"],
            **headline_ratios(
                zero=baselines["zero-shot"],
                dp=row["accuracy"],
                own_selection=own[args.heads]["accuracy"],
                same_heads=row["same_heads_mtv"],
            ),
        }
        for row in dp
    ]
    return {
        "task": task,
        "baselines": baselines,
        "own_selection": {str(k): v for k, v in own.items()},
        "dp": dp,
        "ratios": ratios,
        "clip_norm": bench.clip_norm,
        "majority": bench.majority,
        "seconds": round(time.monotonic() - started, 1),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="default: the assembled one")
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=[*TRAINED_TASKS, "count-word"])
    parser.add_argument("--shots", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16, help="k of the DP rows")
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--pooled", type=int, default=1000, help="private examples pooled")
    parser.add_argument("--public", type=int, default=150)
    parser.add_argument("--validation", type=int, default=32)
    parser.add_argument("--test", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--render-only", action="store_true", help="rewrite the .md and plot from the .json"
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "pretrained")
    args = parser.parse_args()
    if args.quick:
        args.draws, args.pooled, args.test, args.validation = 2, 100, 30, 16
    return args


def main() -> int:
    args = parse_args()
    if args.render_only:
        results = json.loads(args.out.with_suffix(".json").read_text())
        args.out.with_suffix(".md").write_text(render(results) + recall_section(results, args.out))
        return 0
    model = pretrained_model_path(args.model)
    started = time.monotonic()
    results: dict[str, object] = {
        "command": " ".join([".venv/bin/python", "benchmarks/pretrained.py", *sys.argv[1:]]),
        "args": {k: str(v) for k, v in vars(args).items()},
        "tasks": [],
    }
    with tempfile.TemporaryDirectory(prefix="dpmtv-pretrained-") as tmp:
        for task in args.tasks:
            results["tasks"].append(run_task(args, model, Path(tmp), task))  # type: ignore[union-attr]
            _write(args.out, results, started)
    log(f"done in {time.monotonic() - started:.0f} s; wrote {args.out}.json and .md")
    return 0


def _write(out: Path, results: dict, started: float) -> None:
    results["seconds"] = round(time.monotonic() - started, 1)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(render(results) + recall_section(results, out))


def recall_by_model(results: dict) -> dict[str, tuple[int, list[float]]]:
    """Private selection's recall of MTV's own heads, per model: (number of heads, recalls)."""
    models: dict[str, tuple[int, list[float]]] = {}
    for size, heads in (("small", 12), ("deep", 64)):
        path = REPO / "docs" / "benchmarks" / f"utility-{size}.json"
        if path.is_file():
            runs = json.loads(path.read_text())["families"].values()
            recalls = [h["recall"] for run in runs for h in run["headline"]]
            models[f"{size} embedded"] = (heads, recalls)
    recalls = [row["recall"] for task in results["tasks"] for row in task["dp"] if "recall" in row]
    models["pretrained decoder"] = (270, recalls)
    return models


def recall_section(results: dict, out: Path) -> str:
    """The selection-vs-heads table, and its plot beside the markdown."""
    models = recall_by_model(results)
    lines = [
        "",
        "## Private selection against the number of heads",
        "",
        "Share of MTV's own heads (attribution on validation) that private selection picked, "
        "eps = 1, m = 200, mean over the tasks and draws of each model's runs (embedded "
        "models: `benchmarks/utility.py`, k = 4 / 8, release order chosen on validation; "
        f"pretrained: this run, k = {results['args']['heads']}, select-first).",
        "",
        "| model | heads | recall (mean) | runs |",
        "|---|---:|---:|---:|",
    ]
    for name, (heads, recalls) in models.items():
        mean = statistics.mean(recalls) if recalls else float("nan")
        lines.append(f"| {name} | {heads} | {mean:.2f} | {len(recalls)} |")
    _plot_recall(models, out.with_name("selection-vs-heads.png"))
    lines += ["", "![recall against heads](selection-vs-heads.png)", ""]
    return "\n".join(lines)


def _plot_recall(models: dict[str, tuple[int, list[float]]], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(5, 3.2))
    for name, (heads, recalls) in models.items():
        if recalls:
            axes.scatter([heads] * len(recalls), recalls, alpha=0.4, s=14)
            axes.plot([heads], [statistics.mean(recalls)], "k_", markersize=18)
            axes.annotate(
                name,
                (heads, statistics.mean(recalls)),
                textcoords="offset points",
                xytext=(6, 6),
                fontsize=8,
            )
    axes.set_xscale("log")
    ticks = sorted(heads for heads, _ in models.values())
    axes.set_xticks(ticks, [str(t) for t in ticks])
    axes.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes.set_xlim(ticks[0] / 1.6, ticks[-1] * 2.5)
    axes.set_xlabel("heads in the model")
    axes.set_ylabel("recall of MTV's own heads")
    axes.set_ylim(-0.05, 1.05)
    axes.set_title("private selection at eps = 1, m = 200", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def render(results: dict) -> str:
    ks = [str(k) for k in KS]
    lines = [
        "# MTV and DP-MTV on a pretrained decoder",
        "",
        "Model: the pretrained-decoder LLaVA (SmolLM2-135M-Instruct, 30 x 9 = 270 heads; "
        "vision tower and projector trained here). Test scenes no training, site or public "
        "set showed; first-token accuracy, greedy. Generated by "
        f"`{results['command']}` in {results.get('seconds', 0):.0f} s.",
        "",
        "## Zero-shot, ICL and MTV with its own head selection (non-private)",
        "",
        "| task | zero-shot | 1-shot | 4-shot | 8-shot | "
        + " | ".join(f"MTV k={k}" for k in ks)
        + " | test majority |",
        "|---|" + "---:|" * (5 + len(ks)),
    ]
    for task in results["tasks"]:
        b, own = task["baselines"], task["own_selection"]
        lines.append(
            f"| {task['task']} | {b['zero-shot']:.2f} | {b['1-shot ICL']:.2f} | "
            f"{b['4-shot ICL']:.2f} | {b['8-shot ICL']:.2f} | "
            + " | ".join(f"{own[k]['accuracy']:.2f}" for k in ks if k in own)
            + f" | {task['majority']:.2f} |"
        )
    lines += [
        "",
        "## Where the task lives: the 16 heads attribution picks (layer, head)",
        "",
        "| task | heads (k = 16, validation attribution) |",
        "|---|---|",
    ]
    for task in results["tasks"]:
        heads = task["own_selection"].get("16", {}).get("heads", [])
        lines.append(
            f"| {task['task']} | {' '.join(f'({layer},{head})' for layer, head in heads)} |"
        )
    lines += [
        "",
        "## DP-MTV at eps = 1, delta = 1e-5 (single holder)",
        "",
        "Ratio = (DP-MTV - zero-shot) / (MTV own selection at the same k - zero-shot): the "
        "headline. *Same heads*: MTV patched into the heads DP picked (a diagnostic: a bad "
        "private pick lowers its numerator and denominator together).",
        "",
        "| task | release | m | SNR | DP-MTV (± sd) | MTV own k | MTV same heads | "
        "ratio (own) | ratio (same heads) | recall of own heads |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for task in results["tasks"]:
        for row, ratio in zip(task["dp"], task["ratios"], strict=True):
            lines.append(
                f"| {task['task']} | {row['selection']} | {row['m']} | {row['SNR']:.2f} | "
                f"{row['accuracy']:.2f} ± {row['spread']:.2f} | {ratio['own_selection']:.2f} | "
                f"{row['same_heads_mtv']:.2f} | {_pct(ratio['ratio'])} | "
                f"{_pct(ratio['ratio_same_heads'])} | {row.get('recall', float('nan')):.2f} |"
            )
    return "\n".join(lines) + "\n"


def _pct(value: float) -> str:
    return "n/a" if value != value else f"{100 * value:.0f} %"


if __name__ == "__main__":
    sys.exit(main())
