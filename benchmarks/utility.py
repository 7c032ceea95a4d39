"""Utility of DP-MTV on an embedded model: content-disjoint test, same-head baselines.

Data (``client.data.synthetic``'s public scene split): sites and public data show ``train`` scenes,
choices are made on ``validation`` queries, and the reported figures are on ``test`` queries,
whose scenes no site, no public set and no model training ever showed.

1. **Choices on validation** (main task, eps = 1, private selection): the release order and
   rescaling to the public head norm, then the clip norm C (x0.5, x1, x2 the public median).
2. **Main table** (main task, test queries): zero-shot, K-shot ICL, an oracle (non-private MTV
   mean with the heads attribution picks on the validation queries using it), MTV with the
   public heads, and DP-MTV at each eps for public / private / all heads. Every DP row has
   beside it **MTV with the same heads** (the non-private mean of the chunks patched into the
   heads that draw released), the share of queries given the most frequent answer (1.0 = the
   patch collapsed the model to one answer; the test's majority-class rate is printed), the
   SNR, and for private selection the recall of the oracle heads.
3. **Headline per task** of the main task's family: (DP-MTV - zero-shot) / (MTV with its own
   head selection, the oracle row - zero-shot) at eps = 1; MTV on the same heads DP picked is a
   diagnostic column. Two families (``client.data.synthetic.task_family``): the four tasks the
   embedded models were trained on, and the ``-merged`` tasks they never saw.
4. **Latency** per query.

Writes the family's entry of ``docs/benchmarks/utility-<size>.json`` (``{"families": {family:
run}}``; the other family's entry is kept); ``benchmarks/report.py`` turns it into
docs/benchmarks.md. Usage (one thread, as the shipped numbers were run):

    .venv/bin/python benchmarks/utility.py --size small
    .venv/bin/python benchmarks/utility.py --size deep
    .venv/bin/python benchmarks/utility.py --size small --task shape-merged
    .venv/bin/python benchmarks/utility.py --size deep --task shape-merged
    .venv/bin/python benchmarks/utility.py --size small --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy()  # before torch loads: its thread pool must not spin on shared cores

from _utility_bench import Bench, dp_row, local_sums, mtv_row, setup

from client.data.synthetic import TASKS, task_family
from client.evaluation.first_token import QuerySet
from client.evaluation.run import icl_prompts
from client.models.embedded import embedded_model_path
from protocol import ReleaseOrder, SelectionMode


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def choose_on_validation(bench: Bench, args) -> tuple[dict[str, object], list[dict]]:
    """Order, rescaling and C, each picked by mean validation accuracy at eps = 1 (private)."""
    rows = []
    sums = local_sums(bench, bench.clip_norm)
    best: tuple[float, ReleaseOrder, bool] | None = None
    for order in ReleaseOrder:
        for rescale in (False, True):
            row = dp_row(
                bench,
                sums,
                epsilon=1.0,
                selection=SelectionMode.PRIVATE,
                order=order,
                rescale=rescale,
                queries=bench.validation,
                draws=args.choice_draws,
                name=f"{order.value}{' + rescale' if rescale else ''}, C x1",
            )
            rows.append(row)
            log(f"validation {row['name']}: {row['accuracy']:.3f}")
            if best is None or row["accuracy"] > best[0]:
                best = (row["accuracy"], order, rescale)
    best = best or (0.0, ReleaseOrder.RELEASE_FIRST, False)  # unreachable: two orders
    _, order, rescale = best
    best_factor, best_accuracy = 1.0, best[0]
    for factor in args.c_factors:
        row = dp_row(
            bench,
            local_sums(bench, bench.clip_norm * factor),
            epsilon=1.0,
            selection=SelectionMode.PRIVATE,
            order=order,
            rescale=rescale,
            clip=bench.clip_norm * factor,
            queries=bench.validation,
            draws=args.choice_draws,
            name=f"{order.value}{' + rescale' if rescale else ''}, C x{factor:g}",
        )
        rows.append(row)
        log(f"validation {row['name']}: {row['accuracy']:.3f}")
        if row["accuracy"] > best_accuracy:
            best_factor, best_accuracy = factor, row["accuracy"]
    choice = {"order": order.value, "rescale": rescale, "clip_factor": best_factor}
    return choice, rows


def baseline_rows(bench: Bench, sums) -> list[dict]:
    loaded = bench.loaded
    icl = QuerySet.build(
        loaded,
        icl_prompts(bench.test_records, bench.public_records, shots=bench.shots, seed=0),
        [r.answer for r in bench.test_records],
    )
    from _utility_lib import score

    zero = score(loaded, bench.test)
    in_context = score(loaded, icl)
    return [
        {"name": "zero-shot", "accuracy": zero.accuracy, "modal_share": zero.modal_share},
        {
            "name": f"{bench.shots}-shot ICL",
            "accuracy": in_context.accuracy,
            "modal_share": in_context.modal_share,
        },
        mtv_row(bench, bench.oracle_heads, "oracle: MTV, heads by attribution on validation"),
        mtv_row(bench, bench.public_heads, "MTV, public heads (no clip, no noise)"),
    ]


def main_table(bench: Bench, choice: dict, args) -> list[dict]:
    clip = bench.clip_norm * choice["clip_factor"]
    sums = local_sums(bench, clip)
    rows = baseline_rows(bench, sums)
    order = ReleaseOrder(choice["order"])
    for epsilon in args.epsilons:
        for selection in (SelectionMode.PUBLIC, SelectionMode.PRIVATE, SelectionMode.ALL):
            rows.append(
                dp_row(
                    bench,
                    sums,
                    epsilon=epsilon,
                    selection=selection,
                    order=ReleaseOrder.SELECT_FIRST if selection is SelectionMode.ALL else order,
                    rescale=choice["rescale"],
                    clip=clip,
                    queries=bench.test,
                    draws=args.draws,
                    name=f"DP-MTV eps={epsilon:g} {selection.value}",
                )
            )
            log(f"{rows[-1]['name']}: {rows[-1]['accuracy']:.3f} +- {rows[-1]['spread']:.3f}")
    return rows


def headline(bench: Bench, choice: dict, args, row: dict | None = None) -> dict[str, float | str]:
    """The headline of one task; ``row``: its eps = 1 private row when already measured."""
    from _utility_lib import headline_ratios, score

    clip = bench.clip_norm * choice["clip_factor"]
    row = row or dp_row(
        bench,
        local_sums(bench, clip),
        epsilon=1.0,
        selection=SelectionMode.PRIVATE,
        order=ReleaseOrder(choice["order"]),
        rescale=choice["rescale"],
        clip=clip,
        queries=bench.test,
        draws=args.draws,
        name="headline",
    )
    zero = score(bench.loaded, bench.test).accuracy
    oracle = mtv_row(bench, bench.oracle_heads, "oracle")["accuracy"]
    same = row["same_heads_mtv"]
    ratios = headline_ratios(zero=zero, dp=row["accuracy"], own_selection=oracle, same_heads=same)
    return {
        "task": bench.task,
        "zero": zero,
        "oracle": oracle,
        "mtv_same_heads": same,
        "dp": row["accuracy"],
        "dp_std": row["spread"],
        "m": row["m"],
        "ratio": ratios["ratio"],
        "ratio_same_heads": ratios["ratio_same_heads"],
        "recall": row.get("recall", float("nan")),
        "majority": bench.majority,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=("small", "deep"), default="small")
    parser.add_argument("--task", choices=TASKS, default="shape", help="task of the main table")
    parser.add_argument("--shots", type=int, default=4)
    parser.add_argument("--heads", type=int, default=None, help="k (default: 4 small, 8 deep)")
    parser.add_argument("--draws", type=int, default=5)
    parser.add_argument("--choice-draws", type=int, default=3)
    parser.add_argument("--pooled", type=int, default=1000, help="private examples pooled")
    parser.add_argument("--public", type=int, default=150)
    parser.add_argument("--validation", type=int, default=100)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.heads = args.heads or {"small": 4, "deep": 8}[args.size]
    args.epsilons = [0.1, 0.25, 0.5, 1.0, 2.0, 8.0]
    args.c_factors = [0.5, 2.0]
    args.family = task_family(args.task)
    args.tasks = [task for task in TASKS if task_family(task) == args.family]
    if args.quick:
        args.epsilons, args.draws, args.choice_draws, args.c_factors = [1.0], 2, 1, [2.0]
        args.pooled, args.test, args.validation, args.tasks = 200, 60, 40, [args.task]
    args.out = args.out or REPO / "docs" / "benchmarks" / f"utility-{args.size}.json"
    return args


def main() -> int:
    logging.getLogger("flwr").setLevel(logging.WARNING)
    args = parse_args()
    apply_thread_policy(args.threads)
    model = embedded_model_path(args.size)
    started = time.monotonic()
    results: dict[str, object] = {
        "command": " ".join([".venv/bin/python", "benchmarks/utility.py", *sys.argv[1:]]),
        "args": {k: _recorded(v) for k, v in vars(args).items()},
    }
    with tempfile.TemporaryDirectory(prefix="dpmtv-bench-") as tmp:
        root = Path(tmp)
        bench = setup(args, model, root / args.task, args.task)
        log(
            f"setup: C0={bench.clip_norm:.3g}, public {bench.public_heads.heads}, "
            f"oracle {bench.oracle_heads.heads}"
        )
        results["shape"] = bench.shape
        results["clip_norm_public"] = bench.clip_norm
        results["choice"], results["validation"] = choose_on_validation(bench, args)
        log(f"choice: {results['choice']}")
        results["table"] = main_table(bench, results["choice"], args)
        measured = next(r for r in results["table"] if r["name"] == "DP-MTV eps=1 private")
        rows = [headline(bench, results["choice"], args, measured)]
        for task in args.tasks:
            if task != args.task:
                other = setup(args, model, root / task, task)
                rows.append(headline(other, results["choice"], args))
            log(f"headline {rows[-1]}")
        results["headline"] = rows
        from _utility_latency import per_query_latency

        results["latency"] = per_query_latency(bench, bench.test_records, bench.public_records)
    results["seconds"] = time.monotonic() - started
    _write_family(args.out, args.family, results)
    log(f"done in {results['seconds']:.0f} s; wrote {args.family!r} of {args.out}")
    return 0


def _recorded(value: object) -> str:
    """An argument as the JSON records it: paths inside the repository relative to it."""
    if isinstance(value, Path) and value.is_absolute() and value.is_relative_to(REPO):
        return str(value.relative_to(REPO))
    return str(value)


def _write_family(out: Path, family: str, results: dict[str, object]) -> None:
    """Replace ``family``'s run in ``out``, keeping the other family's (one file per size)."""
    document = json.loads(out.read_text()) if out.is_file() else {}
    families = document.get("families", {})
    families[family] = json.loads(json.dumps(results, default=_json_default))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"families": families}, indent=2) + "\n")


def _json_default(value: object) -> object:
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)  # type: ignore[arg-type]
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
