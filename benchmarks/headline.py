"""The headline: DP-MTV at eps = 1 against MTV with its own heads, single holder and federated.

Models (``--model``): ``small`` (3 x 4 = 12 heads, k = 4) and ``deep`` (8 x 8 = 64 heads,
k = 8), the embedded models; ``pretrained``, the pretrained-decoder LLaVA
(SmolLM2-135M-Instruct, 30 x 9 = 270 heads, k = 16; assemble it with
``scripts/assemble_pretrained_model``). Per task, everything a site admin would choose is
chosen on PUBLIC data with the product's own code, before any private data is read:

* the **candidate set** for private selection: the 2k heads attribution ranks first with the
  public chunks' mean (a public restriction of the domain, so the Gumbel mechanism and its
  eps0 are unchanged; ``release --candidate-heads``);
* the **clip norm C** (``client.clip_choice.choose_clip_norm`` on the top k of those heads):
  for each consortium size, the multiple of their public median layer norm whose clipped
  public mean, plus the noise of the central release that size plans (z, m = sites x chunks a
  site, L), scores best on public queries (``select-heads --for-epsilon --for-chunks``); the
  distributed rows of that size use the same C.

Sites hold ``--per-site`` examples each (K = 4: 20 chunks at 100). For 3, 10 and 30 sites the
sites' production sums (per-chunk activations from the extraction hooks, clipped per layer;
shift-score top-r votes) are combined as the federation combines them (``central``: plain sum,
one Gaussian draw in ``protocol.run_release``; ``distributed``: each site's discrete-Gaussian
share on the plan's SecAgg+ grid, sized for t honest sites), private select-first selection
of k heads, eps = 1, delta = 1e-5, no rescaling. In central mode the 10-site release *is* the
single-holder release of the same m = 200 chunks (one Gaussian draw on the same sum).

Reference rows on the same test queries: zero-shot; **MTV with its own head selection** (the
paper's method, non-private: the unclipped mean of every site's chunks patched into the k
heads attribution ranks first on validation queries), the headline ratio's denominator; MTV
patched into the heads each DP draw picked (the "same heads" diagnostic). Side by side at 10
sites, central, one public choice undone at a time: C = the public median over every head with
every head a candidate (the defaults before), the chosen C with every head a candidate, and
the candidates with C from the noise-free rule (``select-heads`` without ``--for-*``: the
smallest multiple keeping 90 % of the unclipped public gain).

Writes ``docs/benchmarks/headline-MODEL.md`` and ``.json``::

    .venv/bin/python benchmarks/headline.py --model pretrained --jobs 2   # ~15 min a task
    .venv/bin/python benchmarks/headline.py --model small        # ~1 min a task
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy()  # before torch loads: its thread pool must not spin on shared cores

import numpy as np
import torch
from _utility_lib import headline_ratios
from distributed import ConsortiumSums, SiteCache
from distributed import make_plan as consortium_plan

from client.chunking import make_chunks
from client.clip_choice import ClipChoice, PlannedNoise, choose_clip_norm
from client.data import load_dataset
from client.evaluation.first_token import QuerySet
from client.extraction import zero_shot_prompt
from client.models import LoadedModel, load_model
from client.models.embedded import embedded_model_path
from client.models.pretrained import pretrained_model_path
from client.public_selection import public_activations, select_heads_attribution
from client.release import LocalSums
from client.synthetic import write_task_datasets
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.noise import secure_noise
from protocol import DistributedRelease, NoiseMode, ReleasePlan, run_release


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass(frozen=True)
class Setting:
    """One row: consortium size, noise mode, t, and the public choices it runs with."""

    sites: int
    mode: NoiseMode
    min_honest: int
    variant: str  # one of VARIANTS

    @property
    def label(self) -> str:
        """The row's name in the log."""
        t = "-" if self.mode is NoiseMode.CENTRAL else str(self.min_honest)
        return f"{self.sites} sites, {self.mode.value}, t={t}, {self.variant}"


CHOSEN, ALL_HEADS, NOISE_FREE_C, MEDIAN = (
    "chosen",
    "all heads",
    "noise-free C rule",
    "median C, all heads",
)
VARIANTS = (CHOSEN, ALL_HEADS, NOISE_FREE_C, MEDIAN)


def settings(curve: tuple[int, ...]) -> list[Setting]:
    rows = []
    for sites in curve:
        rows.append(Setting(sites, NoiseMode.CENTRAL, 2, "chosen"))
        rows.append(Setting(sites, NoiseMode.DISTRIBUTED, 2, "chosen"))
        if math.ceil(sites / 2) > 2:
            rows.append(Setting(sites, NoiseMode.DISTRIBUTED, math.ceil(sites / 2), "chosen"))
    if 10 in curve:
        rows += [Setting(10, NoiseMode.CENTRAL, 2, v) for v in (ALL_HEADS, NOISE_FREE_C, MEDIAN)]
    return rows


@dataclass
class Task:
    """One task's public choices, sites, queries and non-private references."""

    name: str
    candidates: HeadSet
    clip: float  # the noise-free rule's C
    planned: dict[int, ClipChoice]  # consortium size: C scored with that size's planned noise
    median: float  # over every head: the default C before the choice
    heads_median: float  # over the top-k public heads' layers: the choice's factor 1
    clip_record: dict
    sites: list[SiteCache]
    test: QuerySet
    mtv_mean: np.ndarray  # (L, H, D): unclipped mean of every site's chunks
    own_heads: HeadSet
    zero_shot: float
    own_accuracy: float
    majority: float


def _queries(loaded: LoadedModel, folder: Path) -> tuple[QuerySet, list]:
    records = list(load_dataset(folder).records)
    prompts = [zero_shot_prompt(r) for r in records]
    return QuerySet.build(loaded, prompts, [r.answer for r in records]), records


def prepare(args, loaded: LoadedModel, root: Path, task: str) -> Task:
    """Public choices first, then the sites' production sums, then the references."""
    write_task_datasets(
        root, task=task, sites=max(args.curve_sites), per_site=args.per_site,
        public=args.public, test=args.test, validation=args.validation, seed=args.seed,
    )  # fmt: skip
    public = load_dataset(root / "public")
    public_chunks = make_chunks(public, shots=args.shots, seed=0).chunks
    acts = public_activations(loaded, public_chunks, progress=False)
    queries = [c.query for c in public_chunks]
    mean = acts.mean(0)
    candidates = select_heads_attribution(loaded, mean, queries, k=2 * args.heads)
    top = select_heads_attribution(loaded, mean, queries, k=args.heads)
    clip_queries = list(public.records)[: args.clip_queries]
    choice = choose_clip_norm(loaded, acts, top, clip_queries)
    log(f"{task}: noise-free rule C = {choice.clip_norm / choice.median:g} x median")
    caches = []
    for index in range(max(args.curve_sites)):
        chunks = make_chunks(
            load_dataset(root / f"site-{index}"), shots=args.shots, seed=1000 + index
        ).chunks
        plan = _plan(
            args,
            loaded,
            Setting(2, NoiseMode.CENTRAL, 2, "chosen"),
            len(chunks),
            choice.clip_norm,
            None,
        )
        caches.append(SiteCache(LocalSums(loaded, chunks, plan, progress=False)))
        caches[-1].activation(top)  # the site's one forward pass a chunk, kept
        caches[-1].vote()
        if (index + 1) % 5 == 0:
            log(f"{task}: {index + 1} sites extracted")
    planned = {}
    for sites in args.curve_sites:
        setting = Setting(sites, NoiseMode.CENTRAL, 2, CHOSEN)
        chunks = len(caches[0].sums.chunks)
        noise = PlannedNoise.for_plan(
            _plan(args, loaded, setting, chunks, 1.0, candidates),
            num_chunks=sites * chunks,
            layers_in_scope=top.num_layers_in_scope,
        )
        planned[sites] = choose_clip_norm(loaded, acts, top, clip_queries, planned=noise)
        log(f"{task}: {sites} sites: C = {planned[sites].clip_norm / choice.median:g} x median")
    test, test_records = _queries(loaded, root / "test")
    validation = list(load_dataset(root / "validation").records)
    every = np.concatenate([c.chunk_activations for c in caches])  # type: ignore[misc]
    mtv_mean = every.mean(0)
    own = select_heads_attribution(
        loaded, torch.as_tensor(mtv_mean, dtype=torch.float32), validation, k=args.heads
    )
    answers = [r.answer for r in test_records]
    return Task(
        name=task, candidates=candidates, clip=choice.clip_norm, planned=planned,
        median=float(acts.flatten(2).norm(dim=-1).median()), heads_median=choice.median,
        clip_record=choice.as_record(),
        sites=caches, test=test, mtv_mean=mtv_mean, own_heads=own,
        zero_shot=test.accuracy(loaded),
        own_accuracy=test.accuracy(loaded, (own, _rows(mtv_mean, own))),
        majority=max(answers.count(a) for a in set(answers)) / len(answers),
    )  # fmt: skip


def _rows(mean: np.ndarray, heads: HeadSet) -> np.ndarray:
    index = heads.to_array()
    return mean[index[:, 0], index[:, 1]]


def _plan(args, loaded, setting: Setting, chunks: int, clip: float, candidates) -> ReleasePlan:
    plan = consortium_plan(
        argparse.Namespace(task="benchmark", shots=args.shots, heads=args.heads),
        loaded.fingerprint, epsilon=1.0, mode=setting.mode, sites=setting.sites,
        min_honest=setting.min_honest, chunks_per_site=chunks, clip_norm=clip,
    )  # fmt: skip
    if candidates is None:
        return plan
    return ReleasePlan.model_validate(
        {**plan.model_dump(), "candidate_heads": tuple(tuple(h) for h in candidates.heads)}
    )


def _sites_at(task: Task, clip: float) -> list[SiteCache]:
    """The task's sites clipping at ``clip`` (same kept activations and votes)."""
    if clip == task.clip:
        return task.sites
    out = []
    for site in task.sites:
        plan = ReleasePlan.model_validate({**site.sums.plan.model_dump(), "clip_norm": clip})
        sums = LocalSums(site.sums.loaded, site.sums.chunks, plan, progress=False)
        out.append(SiteCache(sums, chunk_activations=site.chunk_activations, votes=site.votes))
    return out


def measure(args, loaded: LoadedModel, task: Task, setting: Setting) -> dict:
    clip = {
        CHOSEN: task.planned[setting.sites].clip_norm,
        ALL_HEADS: task.planned[setting.sites].clip_norm,
        NOISE_FREE_C: task.clip,
        MEDIAN: task.median,
    }[setting.variant]
    candidates = task.candidates if setting.variant in (CHOSEN, NOISE_FREE_C) else None
    sites = _sites_at(task, clip)[: setting.sites]
    plan = _plan(args, loaded, setting, len(sites[0].sums.chunks), clip, candidates)
    layout = loaded.adapter.head_shape(loaded.model).layout()
    grids = None
    if setting.mode is NoiseMode.DISTRIBUTED:
        head_dim = loaded.adapter.head_shape(loaded.model).head_dim
        grids = DistributedRelease(plan, layout.dense_size, head_dim)
    accuracy, same, recall = [], [], []
    own = set(task.own_heads.heads)
    for _ in range(args.draws):
        noise = secure_noise()
        sums = ConsortiumSums(sites, plan, grids, noise)
        outcome = run_release(
            plan, sums=sums, layout=layout, noise=noise, on_first_noise=lambda: None
        )
        accuracy.append(task.test.accuracy(loaded, (outcome.heads, outcome.values)))
        same.append(
            task.test.accuracy(loaded, (outcome.heads, _rows(task.mtv_mean, outcome.heads)))
        )
        recall.append(len(own & set(outcome.heads.heads)) / len(own))
    dp = statistics.mean(accuracy)
    return {
        "setting": setting.label, "sites": setting.sites, "mode": setting.mode.value,
        "t": setting.min_honest, "variant": setting.variant, "C": clip,
        "m": setting.sites * len(sites[0].sums.chunks), "accuracy": dp,
        "spread": statistics.pstdev(accuracy), "recall": statistics.mean(recall),
        **headline_ratios(
            zero=task.zero_shot, dp=dp, own_selection=task.own_accuracy,
            same_heads=statistics.mean(same),
        ),
    }  # fmt: skip


def run_task(args, loaded: LoadedModel, root: Path, name: str) -> dict:
    started = time.monotonic()
    task = prepare(args, loaded, root / name, name)
    log(f"{name}: zero-shot {task.zero_shot:.2f}, MTV own selection {task.own_accuracy:.2f}")
    rows = []
    for setting in settings(tuple(args.curve_sites)):
        rows.append(measure(args, loaded, task, setting))
        row = rows[-1]
        log(
            f"  {setting.label}: {row['accuracy']:.2f} +- {row['spread']:.2f}, "
            f"ratio {_pct(row['ratio'])}"
        )
    return {
        "task": name, "zero_shot": task.zero_shot, "own_selection": task.own_accuracy,
        "clip_norm": task.clip, "median": task.median, "heads_median": task.heads_median,
        "clip_choice": task.clip_record,
        "planned_clip": {
            str(n): {"clip_norm": c.clip_norm, **c.as_record()} for n, c in task.planned.items()
        },
        "candidates": len(task.candidates.heads), "majority": task.majority, "rows": rows,
        "seconds": round(time.monotonic() - started, 1),
    }  # fmt: skip


def _pct(value: float) -> str:
    return "n/a" if value != value else f"{100 * value:.0f} %"


def render(results: dict) -> str:
    a = results["args"]
    lines = [
        f"# The headline on the {a['model']} model (benchmarks/headline.py)",
        "",
        f"Model: {a['model']} ({MODELS[a['model']][0]}). "
        f"Generated by `{results['command']}` in {results['seconds'] / 60:.1f} min on 2 cores. "
        f"Sites of {a['per_site']} examples (K = {a['shots']}), private select-first selection "
        f"of k = {a['heads']} heads among the {2 * int(a['heads'])} public candidates, "
        f"eps = 1, delta = 1e-5, no rescaling, C chosen on public data for each consortium "
        "size with that size's planned noise (`select-heads --for-epsilon --for-chunks`), "
        f"{a['draws']} noise draws a row, "
        f"{a['test']} content-disjoint test queries. The 10-site central row is also the "
        "single-holder release of the same m chunks.",
        "",
        "**Ratio** = (DP-MTV - zero-shot) / (MTV with its own head selection - zero-shot); "
        "*same heads* divides by MTV patched into the heads DP picked (a diagnostic); *recall*: "
        "share of MTV's own heads that private selection picked. `distributed`: each site adds "
        "a discrete-Gaussian share sized for t honest sites.",
        "",
    ]
    for task in results["tasks"]:
        lines += [
            f"## {task['task']}",
            "",
            f"Zero-shot {task['zero_shot']:.2f}, MTV own selection {task['own_selection']:.2f}, "
            f"test majority class {task['majority']:.2f}. Public median layer norm of the "
            f"top-k public heads {task['heads_median']:.3g} (over every head "
            f"{task['median']:.3g}, the 'median C' row); the noise-free rule takes "
            f"{task['clip_norm'] / task['heads_median']:g} x, the planned-noise rule "
            + ", ".join(
                f"{c['clip_norm'] / task['heads_median']:g} x at {n} sites"
                for n, c in task["planned_clip"].items()
            )
            + ".",
            "",
            "| sites | m | mode | t | choices | C | DP-MTV (± sd) | **ratio (own)** | "
            "ratio (same heads) | recall |",
            "|---:|---:|---|---:|---|---:|---:|---:|---:|---:|",
        ]
        for r in task["rows"]:
            t = "-" if r["mode"] == "central" else str(r["t"])
            lines.append(
                f"| {r['sites']} | {r['m']} | {r['mode']} | {t} | {r['variant']} | {r['C']:.3g} | "
                f"{r['accuracy']:.2f} ± {r['spread']:.2f} | **{_pct(r['ratio'])}** | "
                f"{_pct(r['ratio_same_heads'])} | {r['recall']:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


MODELS = {  # name: (heads in the model, k)
    "small": ("3 x 4 = 12 heads, embedded", 4),
    "deep": ("8 x 8 = 64 heads, embedded", 8),
    "pretrained": ("SmolLM2-135M-Instruct decoder, 30 x 9 = 270 heads", 16),
}


def model_path(name: str) -> Path:
    return pretrained_model_path() if name == "pretrained" else embedded_model_path(name)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=MODELS, default="pretrained")
    parser.add_argument("--tasks", nargs="+", default=["colour", "shape", "count", "position"])
    parser.add_argument("--curve-sites", type=int, nargs="+", default=[3, 10, 30])
    parser.add_argument("--per-site", type=int, default=100)
    parser.add_argument("--shots", type=int, default=4)
    parser.add_argument("--heads", type=int, help="k (default: 4 / 8 / 16 by model)")
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--public", type=int, default=150)
    parser.add_argument("--clip-queries", type=int, default=40)
    parser.add_argument("--validation", type=int, default=32)
    parser.add_argument("--test", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="tasks run in parallel processes")
    parser.add_argument("--render-only", action="store_true", help="rewrite the .md from the .json")
    parser.add_argument("--out", type=Path, help="default: docs/benchmarks/headline-MODEL")
    args = parser.parse_args()
    args.heads = args.heads or MODELS[args.model][1]
    args.out = args.out or REPO / "docs" / "benchmarks" / f"headline-{args.model}"
    return args


def _task_in_worker(args: argparse.Namespace, name: str) -> dict:
    """One task in its own process (its own model copy, one torch thread)."""
    loaded = load_model(model_path(args.model), device="cpu")
    with tempfile.TemporaryDirectory(prefix="dpmtv-headline-") as tmp:
        return run_task(args, loaded, Path(tmp), name)


def main() -> int:
    args = parse_args()
    if args.render_only:
        results = json.loads(args.out.with_suffix(".json").read_text())
        args.out.with_suffix(".md").write_text(render(results), encoding="utf-8")
        return 0
    started = time.monotonic()
    results: dict = {
        "command": " ".join([".venv/bin/python", "benchmarks/headline.py", *sys.argv[1:]]),
        "args": {k: str(v) for k, v in vars(args).items()},
        "tasks": [],
    }  # fmt: skip
    # Tasks are independent: with --jobs N, N processes share them (one core each).
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=context) as pool:
        futures = [pool.submit(_task_in_worker, args, name) for name in args.tasks]
        for future in futures:  # in task order, each written as soon as it and those before end
            results["tasks"].append(future.result())
            results["seconds"] = round(time.monotonic() - started, 1)
            args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
            args.out.with_suffix(".md").write_text(render(results), encoding="utf-8")
    log(f"done in {time.monotonic() - started:.0f} s; wrote {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
