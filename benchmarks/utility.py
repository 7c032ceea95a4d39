"""Utility of DP-MTV on the embedded model: the paper's table in miniature, and our curves.

Rows: zero-shot; K-shot ICL; MTV (same chunks, no clip, no noise); MTV clipped without noise;
DP-MTV at each epsilon for selection public / private / all and both orders (mean +- std over
noise draws). At epsilon = 1: the federation curve (utility against the number of sites, each
holding the same n; 2+ sites through the real federated path with SecAgg+ in-process, 1 site
through the single-holder path), sweeps of K and C, the headline ratio per task, and per-query
latency. Writes docs/benchmarks.md and PNG plots in docs/benchmarks/.

    .venv/bin/python benchmarks/utility.py            # full run, about 20-30 min on 2 cores
    .venv/bin/python benchmarks/utility.py --quick    # a small grid, a few minutes
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _utility_lib import CachedSums, make_plan, release
from _utility_report import write_report

from client.chunking import make_chunks
from client.data import SiteDataset, load_dataset
from client.evaluation.first_token import QuerySet
from client.evaluation.run import icl_prompts
from client.extraction import extract_clipped_sum, zero_shot_prompt
from client.inference import rescale_heads
from client.models import LoadedModel, load_model
from client.models.embedded import embedded_model_path
from client.public_selection import public_activations, select_heads_attribution
from client.release import LocalSums
from client.synthetic import TASKS, write_task_datasets
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.noise import secure_noise
from protocol import ReleaseOrder, SelectionMode


@dataclass
class Row:
    """One line of a table: accuracy (mean, std over draws) and the release's figures."""

    name: str
    accuracy: float
    spread: float = 0.0
    figures: dict[str, str] = field(default_factory=dict)


@dataclass
class Bench:
    """What every measurement of one task shares."""

    loaded: LoadedModel
    task: str
    shots: int
    heads: int
    draws: int
    public_heads: HeadSet
    clip_norm: float
    head_norm: float  # median per-head norm on public data (the rescaling target)
    queries: QuerySet
    sites: dict[str, SiteDataset]
    public: SiteDataset


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def pooled(bench: Bench, sites: int) -> SiteDataset:
    names = [f"site-{i}" for i in range(sites)]
    records = tuple(r for name in names for r in bench.sites[name].records)
    return SiteDataset(records, task=bench.task)


def local_sums(
    bench: Bench, data: SiteDataset, shots: int, clip: float, seed: int = 1
) -> CachedSums:
    chunks = make_chunks(data, shots=shots, seed=seed).chunks
    plan = make_plan(
        epsilon=1.0,
        selection=SelectionMode.ALL,
        order=ReleaseOrder.SELECT_FIRST,
        shots=shots,
        clip_norm=clip,
        heads=bench.heads,
        public_heads=None,
        fingerprint=bench.loaded.fingerprint,
    )
    return CachedSums(LocalSums(bench.loaded, chunks, plan, progress=False))


def figures_of(outcome, plan) -> dict[str, str]:
    return {
        "m": str(outcome.num_chunks),
        "K": str(plan.shots),
        "C": f"{plan.clip_norm:.3g}",
        "|S|": str(len(outcome.heads)),
        "L": str(outcome.gaussian_heads.num_layers_in_scope),
        "sigma": f"{outcome.noise_std:.3g}",
        "SNR": f"{outcome.signal_to_noise:.2f}",
    }


def dp_row(
    bench: Bench,
    sums: CachedSums,
    *,
    epsilon: float,
    selection: SelectionMode,
    order: ReleaseOrder,
    shots: int | None = None,
    clip: float | None = None,
    name: str | None = None,
    rescale: bool = False,
) -> Row:
    plan = make_plan(
        epsilon=epsilon,
        selection=selection,
        order=order,
        shots=shots or bench.shots,
        clip_norm=clip or bench.clip_norm,
        heads=bench.heads,
        public_heads=bench.public_heads,
        fingerprint=bench.loaded.fingerprint,
    )
    noise = secure_noise()
    accuracies, snrs = [], []
    for _ in range(bench.draws):
        outcome = release(plan, sums, bench.loaded, noise)
        values = outcome.values
        if rescale:  # post-processing to the public typical norm: no privacy cost
            values = rescale_heads(values, target_norm=bench.head_norm)
        accuracies.append(bench.queries.accuracy(bench.loaded, (outcome.heads, values)))
        snrs.append(outcome.signal_to_noise)
    figures = figures_of(outcome, plan) | {"SNR": f"{statistics.mean(snrs):.2f}"}
    label = name or f"DP-MTV eps={epsilon:g} {selection.value} {order.value}"
    return Row(label, statistics.mean(accuracies), statistics.pstdev(accuracies), figures)


def mtv_rows(bench: Bench, sums: CachedSums, data: SiteDataset) -> list[Row]:
    """Non-private MTV on the same chunks: unclipped mean, and clipped mean without noise."""
    chunks = sums.inner.chunks
    heads = bench.public_heads
    unclipped = extract_clipped_sum(
        bench.loaded, chunks, heads=heads, clip_norm=1e12, progress=False
    )
    clipped = sums.activation_sum(heads)
    rows = []
    for name, summed in (
        ("MTV (no clip, no noise)", unclipped),
        ("MTV clipped, no noise", clipped),
    ):
        values = summed.total / summed.num_chunks
        accuracy = bench.queries.accuracy(bench.loaded, (heads, values))
        rows.append(
            Row(
                name,
                accuracy,
                0.0,
                {
                    "m": str(summed.num_chunks),
                    "K": str(bench.shots),
                    "C": "inf" if "no clip" in name else f"{bench.clip_norm:.3g}",
                    "|S|": str(len(heads)),
                    "L": str(heads.num_layers_in_scope),
                },
            )
        )
    return rows


def baseline_rows(bench: Bench, test, support) -> list[Row]:
    loaded = bench.loaded
    zero = bench.queries.accuracy(loaded)
    icl = QuerySet.build(
        loaded, icl_prompts(test, support, shots=bench.shots, seed=0), [r.answer for r in test]
    ).accuracy(loaded)
    return [
        Row("zero-shot", zero),
        Row(f"{bench.shots}-shot ICL", icl, 0.0, {"K": str(bench.shots)}),
    ]


def setup(args, root: Path, task: str) -> tuple[Bench, list, list]:
    loaded = load_model(args.model)
    write_task_datasets(
        root,
        task=task,
        sites=args.max_sites,
        per_site=args.per_site,
        public=args.public,
        test=args.test,
        seed=args.seed,
    )
    sites = {p.name: load_dataset(p) for p in sorted(root.glob("site-*"))}
    public = load_dataset(root / "public")
    test = list(load_dataset(root / "test").records)
    public_chunks = make_chunks(public, shots=args.shots, seed=0).chunks
    acts = public_activations(loaded, public_chunks, progress=False)
    mean = acts.mean(0)
    public_heads = select_heads_attribution(
        loaded, mean, [c.query for c in public_chunks], k=args.heads
    )
    # C from public data: median per-layer norm over all heads of the public chunks.
    clip = float(acts.flatten(2).norm(dim=-1).median())
    head_norm = float(acts.norm(dim=-1).median())
    queries = QuerySet.build(loaded, [zero_shot_prompt(r) for r in test], [r.answer for r in test])
    bench = Bench(
        loaded,
        task,
        args.shots,
        args.heads,
        args.draws,
        public_heads,
        clip,
        head_norm,
        queries,
        sites,
        public,
    )
    return bench, test, list(public.records)


def main_table(bench: Bench, test, support, args) -> tuple[list[Row], CachedSums]:
    data = pooled(bench, args.table_sites)
    sums = local_sums(bench, data, bench.shots, bench.clip_norm)
    rows = baseline_rows(bench, test, support) + mtv_rows(bench, sums, data)
    for epsilon in args.epsilons:
        for selection in (SelectionMode.PUBLIC, SelectionMode.PRIVATE, SelectionMode.ALL):
            orders = (
                [ReleaseOrder.SELECT_FIRST]
                if selection is SelectionMode.ALL
                else list(ReleaseOrder)
            )
            for order in orders:
                rows.append(dp_row(bench, sums, epsilon=epsilon, selection=selection, order=order))
                log(f"{rows[-1].name}: {rows[-1].accuracy:.3f} +- {rows[-1].spread:.3f}")
    return rows, sums


def sweeps(bench: Bench, args) -> tuple[list[Row], list[Row]]:
    data = pooled(bench, args.table_sites)
    k_rows = []
    for shots in args.k_sweep:
        sums = local_sums(bench, data, shots, bench.clip_norm)
        k_rows.append(
            dp_row(
                bench,
                sums,
                epsilon=1.0,
                selection=SelectionMode.PRIVATE,
                order=ReleaseOrder(args.order),
                shots=shots,
                name=f"K={shots}",
            )
        )
    c_rows = []
    for factor in args.c_sweep:
        clip = bench.clip_norm * factor
        sums = local_sums(bench, data, bench.shots, clip)
        for rescale in (False, True):
            c_rows.append(
                dp_row(
                    bench,
                    sums,
                    epsilon=1.0,
                    selection=SelectionMode.PRIVATE,
                    order=ReleaseOrder(args.order),
                    clip=clip,
                    name=f"C={clip:.3g}" + (" + rescale to public head norm" if rescale else ""),
                    rescale=rescale,
                )
            )
            log(f"{c_rows[-1].name}: {c_rows[-1].accuracy:.3f} +- {c_rows[-1].spread:.3f}")
    return k_rows, c_rows


def federation_curve(bench: Bench, args, root: Path) -> list[Row]:
    from _utility_federated import federated_accuracy

    rows = []
    for count in args.site_counts:
        if count == 1:
            sums = local_sums(bench, pooled(bench, 1), bench.shots, bench.clip_norm)
            row = dp_row(
                bench,
                sums,
                epsilon=1.0,
                selection=SelectionMode.PRIVATE,
                order=ReleaseOrder(args.order),
                name="1 site (single-holder path)",
            )
        else:
            row = federated_accuracy(bench, count, root, args)
        rows.append(row)
        log(f"federation {row.name}: {row.accuracy:.3f} +- {row.spread:.3f}")
    return rows


def latency(bench: Bench, test, support) -> dict[str, float]:
    from _utility_latency import per_query_latency

    return per_query_latency(bench, test, support)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="default: the embedded model")
    parser.add_argument("--task", choices=TASKS, default="shape", help="task of the main table")
    parser.add_argument("--shots", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--draws", type=int, default=10)
    parser.add_argument(
        "--order",
        choices=[o.value for o in ReleaseOrder],
        default="release-first",
        help="order of the curve, sweeps and headline (the table has both)",
    )
    parser.add_argument("--per-site", type=int, default=100)
    parser.add_argument("--max-sites", type=int, default=30)
    parser.add_argument("--table-sites", type=int, default=10, help="pooled sites of the table")
    parser.add_argument("--public", type=int, default=150)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    args = parser.parse_args()
    args.model = args.model or embedded_model_path()
    args.epsilons = [0.5, 1.0, 2.0, 4.0, 8.0]
    args.site_counts = [1, 3, 10, 30]
    args.k_sweep = [1, 2, 4, 6]
    args.c_sweep = [0.25, 0.5, 1.0, 2.0, 4.0]
    if args.quick:
        args.epsilons, args.site_counts, args.draws = [1.0, 8.0], [1, 3], 2
        args.k_sweep, args.c_sweep, args.max_sites, args.test = [2, 4], [0.5, 1.0], 3, 80
        args.table_sites = 3
    return args


def main() -> int:
    logging.getLogger("flwr").setLevel(logging.WARNING)  # SecAgg+ logs every stage
    torch.set_num_threads(2)
    args = parse_args()
    started = time.monotonic()
    results: dict[str, object] = {"args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="dpmtv-bench-") as tmp:
        root = Path(tmp)
        bench, test, support = setup(args, root / args.task, args.task)
        log(f"setup done: C={bench.clip_norm:.3g}, public heads {bench.public_heads.heads}")
        results["table"], _ = main_table(bench, test, support, args)
        results["federation"] = federation_curve(bench, args, root / args.task)
        results["k_sweep"], results["c_sweep"] = sweeps(bench, args)
        results["latency"] = latency(bench, test, support)
        results["headline"] = headline_per_task(args, root, bench)
    results["seconds"] = time.monotonic() - started
    write_report(results, args.out)
    log(f"done in {results['seconds']:.0f} s; wrote {args.out / 'benchmarks.md'}")
    return 0


def headline_per_task(args, root: Path, first: Bench) -> list[dict[str, float | str]]:
    """(DP-MTV@eps=1 - zero-shot) / (MTV - zero-shot) for each task, private select-first."""
    rows = []
    for task in TASKS if not args.quick else [args.task]:
        bench = first if task == args.task else setup(args, root / task, task)[0]
        data = pooled(bench, args.table_sites)
        sums = local_sums(bench, data, bench.shots, bench.clip_norm)
        zero = bench.queries.accuracy(bench.loaded)
        mtv = mtv_rows(bench, sums, data)[0].accuracy
        dp = dp_row(
            bench,
            sums,
            epsilon=1.0,
            selection=SelectionMode.PRIVATE,
            order=ReleaseOrder(args.order),
        )
        ratio = (dp.accuracy - zero) / (mtv - zero) if mtv > zero else float("nan")
        rows.append(
            {
                "task": task,
                "zero": zero,
                "mtv": mtv,
                "dp": dp.accuracy,
                "dp_std": dp.spread,
                "ratio": ratio,
                "m": dp.figures["m"],
            }
        )
        log(
            f"headline {task}: zero {zero:.3f} MTV {mtv:.3f} DP {dp.accuracy:.3f} ratio {ratio:.2f}"
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
