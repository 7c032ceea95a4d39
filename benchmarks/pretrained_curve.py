"""How many pooled chunks DP-MTV needs on the pretrained decoder: accuracy against m.

In central mode a federated release is exactly the single-holder release of the pooled chunks
(SecAgg+ sums without error; one Gaussian draw on the sum), so accuracy against the pooled m
*is* the federation curve: m = sites x chunks a site (e.g. 10 sites of 400 examples at K = 4
pool m = 800). One extraction of the largest pool serves every m (its first m chunks).

Public heads (attribution on the public set, k = 16), select-first, eps = 1, 4, 16,
delta = 1e-5, with and without rescaling to the public head norm; the predicted signal/noise
(protocol.signal_estimate) is printed beside the measured one. Writes
``docs/benchmarks/pretrained-curve.md``:

    .venv/bin/python benchmarks/pretrained_curve.py --task colour   # ~10 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy()  # before torch loads: its thread pool must not spin on shared cores

from _utility_bench import dp_row, mtv_row, private_plan, setup
from _utility_lib import PerChunkSums, score

from client.activations.chunking import make_chunks
from client.data.records import load_dataset
from client.models.pretrained import pretrained_model_path
from client.public.selection import public_activations, suggested_clip_norm
from client.release.single_holder import LocalSums
from protocol import ReleaseOrder, SelectionMode, predict_signal_to_noise


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", default="colour")
    parser.add_argument("--ms", nargs="+", type=int, default=[200, 400, 800])
    parser.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 4.0, 16.0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument(
        "--clip-factor", type=float, default=1.0, help="C = this x the public heads' median norm"
    )
    parser.add_argument("--shots", type=int, default=4)
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--public", type=int, default=150)
    parser.add_argument("--validation", type=int, default=32)
    parser.add_argument("--test", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=REPO / "docs" / "benchmarks" / "pretrained-curve"
    )
    args = parser.parse_args()
    args.pooled = max(args.ms) * (args.shots + 1)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dpmtv-curve-") as tmp:
        bench = setup(args, pretrained_model_path(), Path(tmp), args.task, per_chunk=True)
        log(f"setup: m up to {len(bench.chunk_activations)}, C0 = {bench.clip_norm:.3g}")
        zero = score(bench.loaded, bench.test).accuracy
        own = mtv_row(bench, bench.oracle_heads, "MTV own selection")["accuracy"]
        public_mtv = mtv_row(bench, bench.public_heads, "MTV public heads")["accuracy"]
        chunks = make_chunks(bench.pooled, shots=args.shots, seed=1).chunks
        public = make_chunks(load_dataset(Path(tmp) / "public"), shots=args.shots, seed=0).chunks
        # C for the released scope, from public data (what select-heads suggests): the
        # all-heads layer median clips task heads whose norms sit far above the typical head.
        clip = args.clip_factor * suggested_clip_norm(
            public_activations(bench.loaded, public, progress=False), bench.public_heads
        )
        bench.clip_norm = clip
        log(f"clip norm C for the public heads (public data): {clip:.3g}")
        rows = []
        for m in args.ms:
            inner = LocalSums(bench.loaded, chunks[:m], private_plan(bench, args.heads))
            sums = PerChunkSums(inner, clip, bench.chunk_activations[:m])
            for epsilon in args.epsilons:
                for rescale in (False, True):
                    rows.append(curve_row(bench, sums, m, epsilon, rescale, args))
                    log(f"m={m} eps={epsilon:g} rescale={rescale}: DP-MTV "
                        f"{rows[-1]['accuracy']:.3f} +- {rows[-1]['spread']:.3f}, SNR "
                        f"{rows[-1]['SNR']:.2f} (predicted at most "
                        f"{rows[-1]['predicted_SNR']:.2f})")  # fmt: skip
    results = {
        "command": " ".join([".venv/bin/python", "benchmarks/pretrained_curve.py", *sys.argv[1:]]),
        "task": args.task, "zero": zero, "clip_norm": bench.clip_norm,
        "clip_factor": args.clip_factor, "own_selection": own,
        "public_mtv": public_mtv,
        "rows": rows, "seconds": time.monotonic() - started,
    }  # fmt: skip
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(render(results))
    log(f"wrote {args.out}.md")
    return 0


def curve_row(bench, sums, m: int, epsilon: float, rescale: bool, args) -> dict:
    """DP-MTV at (m, eps) with the public heads, and the SNR the plan predicts."""
    row = dp_row(
        bench, sums, epsilon=epsilon, selection=SelectionMode.PUBLIC,
        order=ReleaseOrder.SELECT_FIRST, rescale=rescale, queries=bench.test,
        draws=args.draws, name=f"m={m}, eps={epsilon:g}",
    )  # fmt: skip
    plan = private_plan(bench, args.heads).model_copy(
        update={
            "epsilon": epsilon,
            "selection": SelectionMode.PUBLIC,
            "public_heads": bench.public_heads.heads,
        }
    )
    layers, heads = bench.shape
    row["predicted_SNR"] = predict_signal_to_noise(
        plan, num_chunks=m, num_layers=layers, num_heads=heads,
        head_dim=bench.chunk_activations.shape[-1],
    ).signal_to_noise  # fmt: skip
    row["rescale"] = rescale
    return row


def render(results: dict) -> str:
    lines = [
        f"# DP-MTV on the pretrained decoder against the pooled chunk count ({results['task']})",
        "",
        "Central mode: a federation's release equals the single holder's on the pooled chunks, "
        "so m = sites x chunks a site. Public heads (k = 16), select-first, delta = 1e-5, "
        f"C = {results.get('clip_norm', float('nan')):.3g} ({results.get('clip_factor', 1):g} x "
        "the public heads' median layer norm on public data; clip-choice.md lists the factor "
        "select-heads suggests per task); "
        "each setting with and without rescaling to the public head norm. Zero-shot "
        f"{results['zero']:.2f}; MTV with its own selection {results['own_selection']:.2f}; "
        "MTV on the public heads "
        f"{results['public_mtv']:.2f}. "
        f"Generated by `{results['command']}` in {results['seconds']:.0f} s.",
        "",
        "| m | e.g. | eps | rescaled | DP-MTV (± sd) | SNR measured | SNR predicted "
        "(upper bound) | ratio (own) |",
        "|---:|---|---:|---|---:|---:|---:|---:|",
    ]
    gain = results["own_selection"] - results["zero"]
    for row in results["rows"]:
        ratio = (row["accuracy"] - results["zero"]) / gain if gain > 0 else float("nan")
        lines.append(
            f"| {row['m']} | {row['m'] / 80:g} sites x 400 examples | {row['epsilon']:g} | "
            f"{'yes' if row['rescale'] else 'no'} | "
            f"{row['accuracy']:.2f} ± "
            f"{row['spread']:.2f} | {row['SNR']:.2f} | {row['predicted_SNR']:.2f} | "
            f"{100 * ratio:.0f} % |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
