"""Why private selection loses a task on many heads, and what helps: measured side by side.

On the deep embedded model (8 x 8 = 64 heads) private selection at eps = 1 misses the heads
that carry ``position``. For each task this measures, against the oracle heads (MTV's own
selection: attribution on validation queries with the non-private mean):

* **noise-free recall**: the top k of the summed votes with no Gumbel noise. Low here means
  the *score* ranks the wrong heads, and no budget fixes it;
* **private recall**: the same with the calibrated Gumbel noise (50 draws; the gap to the
  noise-free recall is what the noise costs), and the vote margin between the k-th and the
  (k+1)-th head against the Gumbel scale 2/eps0;
* **DP-MTV accuracy** (select-first, eps = 1, rescaled, m chunks), 3 draws.

Variants: the chunk score (``shift``, the default; ``attribution``), the candidate set (every
head, or the 2k heads that attribution on *public* data ranks first: a public restriction of
the domain, so the Gumbel mechanism and its eps0 are unchanged), and more chunks (m = 200,
and 800 as a 10-site consortium of 400 examples each would pool).

Writes ``docs/benchmarks/selection.md`` and ``.json``. Usage:

    .venv/bin/python benchmarks/selection.py          # deep model, position and shape (~10 min)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy()  # before torch loads: its thread pool must not spin on shared cores

from _utility_bench import Bench, private_plan, setup
from _utility_lib import CachedSums, score

from client.activations.chunking import make_chunks
from client.activations.scoring import ScoreMethod
from client.data.records import load_dataset
from client.inference.answers import rescale_heads
from client.models.embedded import embedded_model_path
from client.public.selection import public_activations, select_heads_attribution
from client.release.single_holder import LocalSums
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.noise import secure_noise
from protocol import plan_calibration


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def public_candidates(bench: Bench, public: Path, count: int) -> list[int]:
    """Dense slots of the ``count`` heads attribution ranks first on the public set."""
    chunks = make_chunks(load_dataset(public), shots=bench.shots, seed=0).chunks
    acts = public_activations(bench.loaded, chunks, progress=False)
    ranked = select_heads_attribution(
        bench.loaded, acts.mean(0), [c.query for c in chunks], k=count
    )
    return [layer * bench.shape[1] + head for layer, head in ranked.heads]


def _recall(heads: set[tuple[int, int]], oracle: set[tuple[int, int]]) -> float:
    return len(heads & oracle) / len(oracle)


def measure(bench: Bench, sums, votes: np.ndarray, candidates: list[int], args) -> dict:
    """Noise-free and private recall, margin, and DP-MTV accuracy for one vote histogram."""
    heads_of = [(slot // bench.shape[1], slot % bench.shape[1]) for slot in candidates]
    oracle = set(bench.oracle_heads.heads)
    plan = private_plan(bench, args.heads)
    gumbel = plan_calibration(plan).gumbel()
    scores = votes[candidates]
    order = np.argsort(-scores, kind="stable")
    noise_free = {heads_of[i] for i in order[: args.heads]}
    noise = secure_noise()
    picks = [gumbel.select(scores, noise=noise) for _ in range(args.selection_draws)]
    recalls = [_recall({heads_of[i] for i in p}, oracle) for p in picks]
    accuracy = []
    for chosen in picks[: args.draws]:
        accuracy.append(dp_accuracy(bench, sums, HeadSet.of(heads_of[i] for i in chosen)))
    return {
        "candidates": len(candidates),
        "noise_free_recall": _recall(noise_free, oracle),
        "private_recall": statistics.mean(recalls),
        "margin_k": float(scores[order[args.heads - 1]] - scores[order[args.heads]]),
        "gumbel_scale": gumbel.gumbel_scale,
        "dp_accuracy": statistics.mean(accuracy),
        "dp_spread": statistics.pstdev(accuracy),
    }


def dp_accuracy(bench: Bench, sums, heads: HeadSet) -> float:
    """The Gaussian part of a select-first release on ``heads`` (the picks are given)."""
    # The Gaussian of the private plan that picked ``heads``: its eps split fixes z.
    z = plan_calibration(private_plan(bench, len(heads))).noise_multiplier
    summed = sums.activation_sum(heads)
    # sigma = z * 2C * sqrt(L_scope), one draw on the sum, as protocol.run_release draws it.
    std = z * 2 * bench.clip_norm * np.sqrt(heads.num_layers_in_scope)
    noisy = secure_noise().add_gaussian(summed.total, noise_std=std) / summed.num_chunks
    values = rescale_heads(noisy, target_norm=bench.head_norm)
    return score(bench.loaded, bench.test, (heads, values)).accuracy


def run_task(args, model: Path, root: Path, task: str, pooled: int) -> list[dict]:
    bench = setup(
        argparse.Namespace(**{**vars(args), "pooled": pooled}),
        model,
        root / f"{task}-{pooled}",
        task,
    )
    chunks = make_chunks(bench.pooled, shots=bench.shots, seed=1).chunks
    plan = private_plan(bench, args.heads)
    activations = CachedSums(LocalSums(bench.loaded, chunks, plan, progress=False))
    everything = list(range(bench.shape[0] * bench.shape[1]))
    restricted = public_candidates(bench, root / f"{task}-{pooled}" / "public", 2 * args.heads)
    rows = []
    for method in (ScoreMethod.SHIFT, ScoreMethod.ATTRIBUTION):
        sums = LocalSums(bench.loaded, chunks, plan, score_method=method, progress=False)
        votes = sums.vote_sum(None).total
        for name, candidates in (("all heads", everything), ("public top 2k", restricted)):
            row = {"task": task, "m": len(chunks), "score": method.value, "set": name}
            row |= measure(bench, activations, votes, candidates, args)
            rows.append(row)
            log(
                f"{task} m={row['m']} {method.value:11} {name:13}: noise-free recall "
                f"{row['noise_free_recall']:.2f}, private {row['private_recall']:.2f}, "
                f"margin {row['margin_k']:.1f} vs scale {row['gumbel_scale']:.1f}, "
                f"DP-MTV {row['dp_accuracy']:.3f}"
            )
    return rows


def render(results: dict) -> str:
    lines = [
        "# Private selection on many heads: what it loses, and what helps",
        "",
        f"Model: the deep embedded model (8 x 8 = 64 heads), k = {results['heads']}, eps = 1 "
        "(selection share 0.3), select-first; oracle = MTV's own heads (attribution on "
        "validation with the non-private mean). Generated by "
        f"`{results['command']}` in {results['seconds']:.0f} s.",
        "",
        "| task | m | chunk score | candidates | noise-free recall | private recall | "
        "vote margin k/k+1 | Gumbel scale | DP-MTV (± sd) |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['task']} | {r['m']} | {r['score']} | {r['set']} ({r['candidates']}) | "
            f"{r['noise_free_recall']:.2f} | {r['private_recall']:.2f} | {r['margin_k']:.1f} | "
            f"{r['gumbel_scale']:.1f} | {r['dp_accuracy']:.3f} ± {r['dp_spread']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", nargs="+", default=["position", "shape"])
    parser.add_argument("--pooled", nargs="+", type=int, default=[1000, 4000])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--shots", type=int, default=4)
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--selection-draws", type=int, default=50)
    parser.add_argument("--public", type=int, default=150)
    parser.add_argument("--validation", type=int, default=100)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "selection")
    args = parser.parse_args()
    started = time.monotonic()
    results: dict = {
        "command": " ".join([".venv/bin/python", "benchmarks/selection.py", *sys.argv[1:]]),
        "heads": args.heads,
        "rows": [],
    }
    with tempfile.TemporaryDirectory(prefix="dpmtv-selection-") as tmp:
        for task in args.tasks:
            for pooled in args.pooled:
                results["rows"] += run_task(
                    args, embedded_model_path("deep"), Path(tmp), task, pooled
                )
                results["seconds"] = time.monotonic() - started  # written after every step
                args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
                args.out.with_suffix(".md").write_text(render(results))
    log(f"wrote {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
