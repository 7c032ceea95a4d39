"""The headline's pretrained release read as a user reads it: the answer, over noise draws.

The headline scores a release by its first greedy token (one forward pass a draw). On the
pretrained decoder a patched model names the answer and goes on, so a user reads nothing
right unless the answer's end, learnt from the public sets, is patched too
(``client.inference.answer_end``, ``--answer-end-from``). Here, per task, the release the
headline makes at ``--sites`` sites (the same data, task-agnostic public choices, central,
eps = 1, delta = 1e-5) is drawn ``--draws`` times and each draw is scored both ways: first
token, and the first answer span (what ``evaluate`` and a reader see) with the answer's end
learnt from the public sets of the other tasks. Beside it, by answer span: zero-shot, the
public data alone (the centre in the same heads, with the answer's end), and a site's own
4-shot ICL. Writes ``docs/benchmarks/answer-span-draws.md`` (and ``.json``)::

    .venv/bin/python benchmarks/answer_span_draws.py --tasks colour position   # ~30 min
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

apply_thread_policy()  # before torch loads

import torch
from _headline_data import prepare_task, public_family
from headline import Consortium, choice_plan, choose, log, make_plan

from client.activations.hooks import PatchPolicy
from client.data.records import load_dataset
from client.evaluation import EvaluationMode, evaluate
from client.inference.answer_end import learn_answer_end
from client.inference.answers import TaskVectorPatch
from client.models import LoadedModel, load_model
from client.models.pretrained import pretrained_model_path
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.noise import secure_noise
from protocol import run_release


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", nargs="+", default=["colour", "position"])
    parser.add_argument("--sites", type=int, default=10)
    parser.add_argument("--per-site", type=int, default=100)
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--test", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks/answer-span-draws")
    parser.add_argument("--render-only", action="store_true", help="rewrite the .md from the .json")
    args = parser.parse_args()
    # What the headline's choice needs of its own arguments.
    args.model, args.shots, args.choice_draws = "pretrained", 4, 3
    return args


def span(loaded: LoadedModel, data, patch: TaskVectorPatch | None, **kwargs) -> float:
    """Answer-span accuracy on the test queries (a patch: artifact mode)."""
    mode = EvaluationMode.ARTIFACT if patch is not None else kwargs.pop("mode")
    return evaluate(loaded, data.test_records, mode=mode, patch=patch, **kwargs).accuracy


def run_task(args: argparse.Namespace, loaded: LoadedModel, root: Path, task: str) -> dict:
    chunks = args.per_site // (args.shots + 1)
    data = prepare_task(
        loaded, root, task, sites=args.sites, per_site=args.per_site, shots=args.shots,
        public_per_task=150, test=args.test, validation=32, seed=args.seed, log=log,
        plan_for_votes=make_plan(loaded, sites=2, chunks=chunks, clip=1.0, heads=None, k=16),
    )  # fmt: skip
    public = [load_dataset(root / f"public-{other}" / "public") for other in public_family(task)]
    choice = choose(args, loaded, data, args.sites, every_head=False)
    plan = choice_plan(loaded, choice, sites=args.sites, chunks=chunks)
    ends: dict[tuple, torch.Tensor] = {}

    def end_for(heads: HeadSet) -> torch.Tensor:
        if heads.heads not in ends:
            ends[heads.heads] = learn_answer_end(loaded, public, heads, shots=args.shots).values
        return ends[heads.heads]

    first, spans = [], []
    shape = loaded.adapter.head_shape(loaded.model)
    for draw in range(args.draws):
        noise = secure_noise()
        sums = Consortium(data.sites[: args.sites], plan, choice.centre, None, noise)
        outcome = run_release(
            plan, sums=sums, layout=shape.layout(), noise=noise, on_first_noise=lambda: None,
            centre=choice.centre,
        )  # fmt: skip
        values = torch.as_tensor(outcome.values, dtype=torch.float32)
        patch = TaskVectorPatch(outcome.heads, values, answer_end=end_for(outcome.heads))
        first.append(data.test.accuracy(loaded, (outcome.heads, outcome.values)))
        spans.append(span(loaded, data, patch))
        log(f"{task}: draw {draw + 1}: first token {first[-1]:.2f}, answer {spans[-1]:.2f}")
    heads = choice.heads
    centre = torch.as_tensor(choice.centre.rows(heads), dtype=torch.float32)
    sites = data.site_records[:3]
    return {
        "task": task, "sites": args.sites, "m": args.sites * chunks, "k": choice.k,
        "heads_mode": choice.mode.value, "draws": args.draws,
        "first_token": first, "answer_span": spans,
        "zero_shot": span(loaded, data, None, mode=EvaluationMode.ZERO_SHOT),
        "public_only": span(loaded, data, TaskVectorPatch(heads, centre, PatchPolicy.PROMPT_LAST_TOKEN, end_for(heads))),  # noqa: E501
        "site_icl": statistics.mean(
            span(loaded, data, None, mode=EvaluationMode.ICL, support=s, shots=4) for s in sites
        ),
    }  # fmt: skip


def _mean_sd(values: list[float]) -> str:
    return f"{statistics.mean(values):.2f} ± {statistics.pstdev(values):.2f}"


def render(results: dict) -> str:
    lines = [
        "# The pretrained release read as a user reads it, over noise draws",
        "",
        f"Generated by `{results['command']}` in {results['seconds'] / 60:.0f} min on 2 cores. "
        "The headline's release (task-agnostic public choices, central, eps = 1, delta = 1e-5, "
        "sites of 100 examples) on the pretrained decoder, each noise draw scored by its first "
        "greedy token (the headline's metric) and by the first answer span with the answer's "
        "end learnt from the public sets of the other tasks (what a site reads with "
        "`--answer-end-from`). Baselines by answer span; a site's own ICL averaged over three "
        "sites. Test scenes no site, public set or training showed. An answer may be right "
        "where its first token is not (normalised answers: a capitalised word, say).",
        "",
        "| task | sites (m) | heads | zero-shot | public only + answer's end | a site's own 4-shot "
        "ICL | release, first token | release, answer with the answer's end | draws whose two "
        "scores differ |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["tasks"]:
        gaps = [
            round(b - a, 6) + 0.0 for a, b in zip(r["first_token"], r["answer_span"], strict=True)
        ]
        differ = sum(abs(gap) > 1e-6 for gap in gaps)  # float sums: a query is 1/40
        lines.append(
            f"| {r['task']} | {r['sites']} ({r['m']}) | {r['heads_mode']}, k = {r['k']} | "
            f"{r['zero_shot']:.2f} | {r['public_only']:.2f} | {r['site_icl']:.2f} | "
            f"{_mean_sd(r['first_token'])} | {_mean_sd(r['answer_span'])} | "
            f"{differ} of {r['draws']} (answer - first token, at most {max(gaps):+.3f}, at "
            f"least {min(gaps):+.3f}) |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    args = parse_args()
    if args.render_only:
        results = json.loads(args.out.with_suffix(".json").read_text())
        args.out.with_suffix(".md").write_text(render(results), encoding="utf-8")
        return 0
    started = time.monotonic()
    loaded = load_model(pretrained_model_path(), device="cpu")
    results: dict = {
        "command": " ".join([".venv/bin/python", "benchmarks/answer_span_draws.py", *sys.argv[1:]]),
        "tasks": [],
    }  # fmt: skip
    for task in args.tasks:
        with tempfile.TemporaryDirectory(prefix="dpmtv-span-draws-") as tmp:
            results["tasks"].append(run_task(args, loaded, Path(tmp), task))
        results["seconds"] = round(time.monotonic() - started, 1)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(render(results), encoding="utf-8")
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
