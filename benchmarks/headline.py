"""The honest headline: what a consortium's private examples teach that public data cannot.

Per model and private task, everything a consortium chooses is chosen on PUBLIC data that
holds **no example labelled with the private task's answers** (task-agnostic: labelled public
sets of the family's other tasks, ``client.public.tasks``): the centre r, the k heads and the
clip norm C' of a centred release, by leave-one-public-task-out under the noise each
consortium size's release will add. Sites hold ``--per-site`` examples (K = 4: 20 chunks at
100); for 3, 10 and 30 sites the release is central (one Gaussian draw on the secure sum) or
distributed (each site's discrete-Gaussian share on the plan's SecAgg+ grid, sized for
t = ceil(n/2) honest sites), public heads, eps = 1, delta = 1e-5, ``--draws`` noise draws a row.
In central mode the 10-site release is also the single-holder release of the same m chunks.

Beside every DP row, on the same test queries (test scenes no site, public set or model
training showed):

* **zero-shot**;
* **public only**: the task-agnostic centre patched into the same heads (no private data);
  and, in the labelled setting, the mean of a tiny same-task public set (20 examples) patched
  into heads attribution picks on it, and 4-shot ICL from those 20;
* **a site alone**: 4-shot ICL with one site's own examples, and the non-private mean of one
  site's own 20 chunks patched into the public heads (both averaged over three sites);
* **MTV with its own selection** (the paper's non-private method, an oracle: the pooled mean
  of every site's chunks, unclipped, in the k heads attribution ranks first on labelled
  validation queries of the private task) — the ratio's denominator.

The release at each size is the option the public choice picks, as ``select-heads
--public-task`` does: public heads (select-first), private selection select-first (shift
votes, Gumbel top-k among the 2k public heads) or private selection release-first (every head
noised once; each chunk then votes by attribution against the noisy vector, among every
head), each simulated on the held-out public tasks under that size's planned noise and Gumbel
picks; the option ``client.public.scope.best_option`` suggests is released (the best
held-out, or a private option keeping 90 % of its gain). Side by side at 10 sites (and at every
``--every-option-sites`` size), central: each option the choice did not pick, with its own k
and C' (what the pick is worth, and whether the held-out prediction ranks the options as the
test does); and the chosen release without the centre (raw activations, C chosen the same
way). With ``--clip-sweep``, the chosen release at other multiples of the public C' scale
(labelled a diagnostic: which is best is read off test answers).

Writes ``docs/benchmarks/headline-MODEL.md`` and ``.json``::

    .venv/bin/python benchmarks/headline.py --model pretrained --tasks colour position \
        --every-option-sites 3 10 30 --cache-dir CACHE
    .venv/bin/python benchmarks/headline.py --model small
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy()  # before torch loads: its thread pool must not spin on shared cores

import numpy as np
from _headline_data import PUBLIC_QUERIES, SiteActs, TaskData, icl_accuracy, prepare_task
from _headline_report import render

from client.activations.chunking import make_chunks
from client.models import LoadedModel, load_model
from client.models.embedded import embedded_model_path
from client.models.pretrained import pretrained_model_path
from client.public.scope import (
    HeadsMode,
    PlannedRelease,
    ScopeChoice,
    best_option,
    choose_each,
    compared_options,
)
from client.public.selection import public_activations, select_heads_attribution
from dpmtv_common.centre import ActivationCentre
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.distributed import decode_noisy_sum, encode_site_share
from dpmtv_common.privacy.noise import NoiseSource, secure_noise
from protocol import (
    PROTOCOL_VERSION,
    ActivationSum,
    DistributedRelease,
    NoiseMode,
    ReleaseOrder,
    ReleasePlan,
    SelectionMode,
    VoteSum,
    plan_gumbel_scale,
    plan_noise_multiplier,
    run_release,
    vote_slots,
)

MODELS = {  # name: (description, ks tried, MTV reference k)
    "small": ("3 x 4 = 12 heads, embedded", (2, 4), 4),
    "deep": ("8 x 8 = 64 heads, embedded", (4, 8), 8),
    "pretrained": ("SmolLM2-135M-Instruct decoder, 30 x 9 = 270 heads", (8, 16), 16),
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass
class Consortium:
    """``protocol.ReleaseSums`` over the first n sites: centred clipped sums, either mode."""

    sites: list[SiteActs]
    plan: ReleasePlan
    centre: ActivationCentre | None
    grids: DistributedRelease | None
    noise: NoiseSource

    def activation_sum(self, heads: HeadSet) -> ActivationSum:
        """Σ of the sites' centred clipped sums (each a noisy share in distributed mode)."""
        parts = [s.activation(heads, self.plan.clip_norm, self.centre) for s in self.sites]
        chunks = sum(p.num_chunks for p in parts)
        if self.grids is None:
            return ActivationSum(heads, np.sum([p.total for p in parts], axis=0), chunks)
        grid = self.grids.activations(heads)
        shares = [encode_site_share(p.total.ravel(), params=grid, noise=self.noise) for p in parts]
        total = decode_noisy_sum(np.sum(shares, axis=0), params=grid, num_sites=len(parts))
        return ActivationSum(heads, total.reshape(parts[0].total.shape), chunks, len(parts))

    def vote_sum(self, reference: np.ndarray | None) -> VoteSum:
        """Σ of the sites' votes: shift votes, or attribution against ``reference``.

        ``reference``: the noisy vector of a release-first plan (dense); each chunk then votes
        for its top-r heads by attribution against it, as a site's ``LocalSums`` does. Every
        chunk votes among the plan's candidates (``vote_slots``). In distributed mode each
        site's histogram carries its discrete-Gaussian share, as on the plan's vote grid.
        """
        among = vote_slots(self.plan, self.sites[0].layout())
        top_r = self.plan.score_top_r
        if reference is None:
            parts = [site.vote(top_r, among) for site in self.sites]
        else:
            parts = [site.attribution_vote(reference, top_r, among) for site in self.sites]
        chunks = sum(p.num_chunks for p in parts)
        grid = None if self.grids is None else self.grids.votes()
        if grid is None:
            return VoteSum(np.sum([p.total for p in parts], axis=0), chunks)
        shares = [encode_site_share(p.total, params=grid, noise=self.noise) for p in parts]
        return VoteSum(decode_noisy_sum(np.sum(shares, axis=0), params=grid, num_sites=len(parts)),
                       chunks)  # fmt: skip


def make_plan(
    loaded: LoadedModel, *, sites: int, chunks: int, clip: float, heads: HeadSet | None,
    mode: NoiseMode = NoiseMode.CENTRAL, centre: ActivationCentre | None = None,
    candidates: HeadSet | None = None, k: int = 1, order: ReleaseOrder = ReleaseOrder.SELECT_FIRST,
) -> ReleasePlan:  # fmt: skip
    """A plan of public heads (``heads``), or private selection of k among ``candidates``."""
    private = heads is None
    return ReleasePlan(
        protocol_version=PROTOCOL_VERSION, release_id="headline", task="headline",
        model_fingerprint=loaded.fingerprint, epsilon=1.0, delta=1e-5, shots=4,
        clip_norm=clip, selection=SelectionMode.PRIVATE if private else SelectionMode.PUBLIC,
        order=order, num_selected_heads=k if private else len(heads),
        public_heads=None if private else heads.heads,
        candidate_heads=candidates.heads if candidates is not None else None,
        selection_share=0.3, score_top_r=k if private else len(heads),
        min_sites=max(math.ceil(sites / 2), 2), noise_mode=mode,
        min_honest=max(math.ceil(sites / 2), 2),
        max_sites=sites if mode is NoiseMode.DISTRIBUTED else None,
        max_chunks_per_site=chunks, centre_sha256=None if centre is None else centre.digest(),
        created=datetime.now(UTC).isoformat(timespec="seconds"),
    )  # fmt: skip


def release_draws(
    loaded: LoadedModel, data: TaskData, plan: ReleasePlan, centre: ActivationCentre | None,
    sites: int, draws: int,
) -> list[float]:  # fmt: skip
    """Test accuracy of ``draws`` independent releases of ``plan`` over the first n sites."""
    shape = loaded.adapter.head_shape(loaded.model)
    grids = None
    if plan.noise_mode is NoiseMode.DISTRIBUTED:
        grids = DistributedRelease(plan, shape.layout().dense_size, shape.head_dim)
    scores = []
    for _ in range(draws):
        noise = secure_noise()
        sums = Consortium(data.sites[:sites], plan, centre, grids, noise)
        outcome = run_release(
            plan, sums=sums, layout=shape.layout(), noise=noise, on_first_noise=lambda: None,
            centre=centre,
        )  # fmt: skip
        scores.append(data.test.accuracy(loaded, (outcome.heads, outcome.values)))
    return scores


def _rows(mean, heads: HeadSet) -> np.ndarray:
    index = heads.to_array()
    return np.asarray(mean[index[:, 0], index[:, 1]], dtype=np.float64)


def baselines(args, loaded: LoadedModel, data: TaskData, heads: HeadSet, centre) -> dict:
    """Every non-DP figure of the task (module docstring)."""
    k_ref = MODELS[args.model][2]
    own = select_heads_attribution(loaded, data.pooled_mean, data.validation, k=k_ref)
    tiny_chunks = make_chunks(data.tiny, shots=args.shots, seed=0).chunks
    tiny_mean = public_activations(loaded, tiny_chunks, progress=False).mean(0)
    tiny_records = list(data.tiny.records)
    tiny_heads = select_heads_attribution(loaded, tiny_mean, tiny_records, k=len(heads))
    alone = range(min(3, len(data.sites)))
    out = {
        "zero_shot": data.test.accuracy(loaded),
        "mtv_own_selection": data.test.accuracy(loaded, (own, _rows(data.pooled_mean, own))),
        "mtv_public_heads": data.test.accuracy(loaded, (heads, _rows(data.pooled_mean, heads))),
        "public_only_task_agnostic": data.test.accuracy(loaded, (heads, centre.rows(heads))),
        "public_only_tiny": data.test.accuracy(loaded, (tiny_heads, _rows(tiny_mean, tiny_heads))),
        "public_icl_tiny": icl_accuracy(
            loaded, data.test_records, tiny_records, shots=args.shots, seeds=3
        ),
        "site_alone_icl": statistics.mean(
            icl_accuracy(loaded, data.test_records, data.site_records[i], shots=args.shots, seeds=1)
            for i in alone
        ),
        "site_alone_mtv": statistics.mean(
            data.test.accuracy(loaded, (heads, _rows(data.sites[i].activations.mean(0), heads)))
            for i in alone
        ),
        "own_heads": [list(h) for h in own.heads],
    }
    return out


def planned_options(
    args, loaded: LoadedModel, sites: int, chunks: int, *, every_head: bool | None = None
) -> list[tuple[HeadsMode, PlannedRelease]]:
    """The releases the choice compares at ``sites`` (z and β from the plan, m = n x chunks).

    ``every_head`` None: ``select-heads``' default, public heads select-first and private
    selection select-first and release-first (among the candidates, and among every head);
    True / False: the options of that order only (``compared_options``).
    """
    k = MODELS[args.model][2]

    def planned(mode: HeadsMode, release_first: bool, among_every_head: bool) -> PlannedRelease:
        heads = HeadSet.of([(0, 0)]) if mode is HeadsMode.PUBLIC else None
        plan = make_plan(loaded, sites=sites, chunks=chunks, clip=1.0, heads=heads, k=k)
        return planned_release(
            args, plan, sites * chunks, release_first=release_first,
            among_every_head=among_every_head,
        )  # fmt: skip

    return [(option.mode, planned(*option)) for option in compared_options(every_head)]


def planned_release(
    args, plan: ReleasePlan, m: int, *, release_first: bool, among_every_head: bool = False
) -> PlannedRelease:
    """What the choice simulates for ``plan`` over ``m`` pooled chunks: its z and Gumbel scale."""
    return PlannedRelease(
        plan_noise_multiplier(plan), m, draws=args.choice_draws, every_head=release_first,
        gumbel_scale=plan_gumbel_scale(plan), among_every_head=among_every_head,
    )  # fmt: skip


def choose_all(
    args, loaded: LoadedModel, data: TaskData, sites: int, *, centred: bool = True,
    mode: HeadsMode | None = None, every_head: bool | None = None,
) -> list[ScopeChoice]:  # fmt: skip
    """Each option's public choices at ``sites`` (``planned_options``, of ``mode`` if given)."""
    chunks = len(data.sites[0].activations)
    planned = planned_options(args, loaded, sites, chunks, every_head=every_head)
    return choose_each(
        loaded, data.public, planned=planned,
        ks=MODELS[args.model][1], centred=centred, mode=mode,
        progress=lambda line: log(f"{data.name}: {sites} sites: {line}"),
    )  # fmt: skip


def choose(
    args, loaded: LoadedModel, data: TaskData, sites: int, *, centred: bool = True,
    mode: HeadsMode | None = None, every_head: bool | None = None,
) -> ScopeChoice:  # fmt: skip
    """The public choices at ``sites``: the best of ``choose_all`` (``best_option``)."""
    choice = best_option(
        choose_all(args, loaded, data, sites, centred=centred, mode=mode, every_head=every_head)
    )
    log_choice(data, sites, choice, centred=centred)
    return choice


def log_choice(data: TaskData, sites: int, choice: ScopeChoice, *, centred: bool) -> None:
    """The option chosen at ``sites``, beside every option's held-out accuracy."""
    log(
        f"{data.name}: {sites} sites ({'centred' if centred else 'raw'}): chosen "
        f"{choice.option} (held-out: "
        + ", ".join(f"{name} {acc:.2f}" for name, acc in choice.options_tried)
        + f"), k = {choice.k}, C' = {choice.factor:g} x {choice.scale:.3g}"
    )


def choice_plan(
    loaded: LoadedModel, choice: ScopeChoice, *, sites: int, chunks: int,
    mode: NoiseMode = NoiseMode.CENTRAL, centred: bool = True,
) -> ReleasePlan:  # fmt: skip
    """The plan a choice makes: its heads (public) or its candidates (private), its C'.

    A choice made for a release-first plan (``choice.every_head``) makes one.
    """
    private = choice.mode is HeadsMode.PRIVATE
    order = ReleaseOrder.RELEASE_FIRST if choice.every_head else ReleaseOrder.SELECT_FIRST
    return make_plan(
        loaded, sites=sites, chunks=chunks, clip=choice.clip_norm,
        heads=None if private else choice.heads, mode=mode,
        centre=choice.centre if centred else None, candidates=choice.candidates, k=choice.k,
        order=order,
    )  # fmt: skip


def dp_row(
    args, loaded, data, label, plan, centre, sites, *, choice: ScopeChoice, variant: str
) -> dict:  # fmt: skip
    """One DP row over ``args.draws`` noise draws, labelled for the report.

    ``variant``: "chosen" (the public choices' release), or what a side row changes:
    "no centre", "another option", "release-first", "sweep". ``held_out``: the choice's
    prediction on held-out public tasks, beside what the private task measures.
    """
    scores = release_draws(loaded, data, plan, centre, sites, args.draws)
    log(f"  {label}: {statistics.mean(scores):.2f} +- {statistics.pstdev(scores):.2f}")
    return {
        "label": label, "variant": variant, "sites": sites,
        "m": sites * len(data.sites[0].activations),
        "mode": plan.noise_mode.value, "t": plan.min_honest,
        "selection": plan.selection.value, "centred": centre is not None,
        "k": plan.num_selected_heads, "C": plan.clip_norm, "factor": choice.factor,
        "accuracy": statistics.mean(scores), "sd": statistics.pstdev(scores),
        "draws": scores, "order": choice.order, "among_every_head": choice.among_every_head,
        "held_out": choice.held_out,
        "options_held_out": dict(choice.options_tried),
    }  # fmt: skip


def _option_label(choice: ScopeChoice) -> str:
    order = ", release-first" if choice.every_head else ""
    among = " among every head" if choice.among_every_head else ""
    return f"{choice.mode.value} heads{order}{among}"


def size_rows(
    args, loaded, data: TaskData, sites: int, *, every_head: bool | None = None,
    others: dict[int, list[ScopeChoice]] | None = None,
) -> tuple[list[dict], ScopeChoice]:  # fmt: skip
    """The chosen release at one size, central and distributed (t = ceil(n/2)).

    ``every_head``: choose among the options of that order only (``planned_options``).
    ``others``: where given, the options not chosen are kept there under ``sites``.
    """
    every = choose_all(args, loaded, data, sites, every_head=every_head)
    choice = best_option(every)
    log_choice(data, sites, choice, centred=True)
    if others is not None:
        others[sites] = [c for c in every if c is not choice]
    chunks = len(data.sites[0].activations)
    rows = []
    for mode in (NoiseMode.CENTRAL, NoiseMode.DISTRIBUTED):
        plan = choice_plan(loaded, choice, sites=sites, chunks=chunks, mode=mode)
        label = f"{sites} sites, {mode.value}" + (
            f" t={plan.min_honest}" if mode is NoiseMode.DISTRIBUTED else ""
        )
        label += f", {_option_label(choice)}"
        rows.append(
            dp_row(args, loaded, data, label, plan, choice.centre, sites, choice=choice,
                   variant="chosen")
        )  # fmt: skip
    return rows, choice


def side_rows(args, loaded, data: TaskData, choice: ScopeChoice, sites: int) -> list[dict]:
    """At one size, central: the chosen release without the centre."""
    chunks = len(data.sites[0].activations)
    raw = choose(args, loaded, data, sites, centred=False, mode=choice.mode,
                 every_head=choice.every_head)  # fmt: skip
    plan = choice_plan(loaded, raw, sites=sites, chunks=chunks, centred=False)
    label = f"{sites} sites, no centre, {_option_label(raw)}"
    return [dp_row(args, loaded, data, label, plan, None, sites, choice=raw, variant="no centre")]


def option_rows(args, loaded, data: TaskData, others: list[ScopeChoice], sites: int) -> list[dict]:
    """At one size, central: every option the public choice did not pick, each chosen alone.

    What the rule's pick is worth: each option's own k and C' from the public tasks, its
    held-out prediction beside its test accuracy.
    """
    chunks = len(data.sites[0].activations)
    rows = []
    for other in others:
        plan = choice_plan(loaded, other, sites=sites, chunks=chunks)
        label = f"{sites} sites, central, {_option_label(other)} (another option)"
        rows.append(
            dp_row(args, loaded, data, label, plan, other.centre, sites, choice=other,
                   variant="another option")
        )  # fmt: skip
    return rows


def release_first_rows(args, loaded, data: TaskData, sites: int) -> list[dict]:
    """Private selection in release-first order (the product's default order), central.

    The Gaussian covers the candidates (or, the other option, every carried head); each
    chunk then votes for its top-r heads by attribution against the noisy vector (on its own
    answer), among them; the k most voted are kept. Each option's centre, k and C' are chosen
    for it from the public tasks alone; the one they predict best comes first (variant
    ``release-first``), the other beside it (``release-first, the other option``).
    """
    every = choose_all(args, loaded, data, sites, mode=HeadsMode.PRIVATE, every_head=True)
    chosen = best_option(every)
    log_choice(data, sites, chosen, centred=True)
    rows = []
    for choice in [chosen, *(c for c in every if c is not chosen)]:
        plan = choice_plan(loaded, choice, sites=sites, chunks=len(data.sites[0].activations))
        among = "every head" if choice.among_every_head else "the public candidates"
        other = "" if choice is chosen else ", the other option"
        label = (
            f"{sites} sites, central, private heads, release-first among {among} "
            f"(attribution votes{other})"
        )
        variant = "release-first" if choice is chosen else "release-first, the other option"
        rows.append(
            dp_row(args, loaded, data, label, plan, choice.centre, sites, choice=choice,
                   variant=variant)
        )  # fmt: skip
    return rows


def sweep_rows(args, loaded, data: TaskData, choice: ScopeChoice, sites: int) -> list[dict]:
    """At one size, central, the chosen heads and centre: C' at each ``--clip-sweep`` factor.

    A diagnostic of what the public C' choice costs: its best row is chosen with the private
    task's test answers, which no product path sees.
    """
    chunks = len(data.sites[0].activations)
    rows = []
    for factor in args.clip_sweep:
        swept = dataclasses.replace(choice, clip_norm=factor * choice.scale, factor=factor)
        plan = choice_plan(loaded, swept, sites=sites, chunks=chunks)
        label = f"{sites} sites, C' = {factor:g} x scale (sweep)"
        rows.append(
            dp_row(args, loaded, data, label, plan, swept.centre, sites, choice=swept,
                   variant="sweep")
        )  # fmt: skip
    return rows


def run_task(args, loaded: LoadedModel, root: Path, task: str) -> dict:
    started = time.monotonic()
    chunks = args.per_site // (args.shots + 1)
    vote_plan = make_plan(
        loaded, sites=2, chunks=chunks, clip=1.0, heads=None, k=MODELS[args.model][2]
    )
    data = prepare_task(
        loaded, root, task, sites=max(args.curve_sites), per_site=args.per_site,
        shots=args.shots, public_per_task=args.public_per_task, test=args.test,
        validation=args.validation, seed=args.seed, log=log, plan_for_votes=vote_plan,
        cache=args.cache_dir, public_queries=args.public_queries,
    )  # fmt: skip
    rows, choices, others = [], {}, {}
    side = args.side_sites if args.side_sites in args.curve_sites else max(args.curve_sites)
    for sites in args.curve_sites:
        size, choices[sites] = size_rows(args, loaded, data, sites, others=others)
        rows += size
        if sites in args.every_option_sites or sites == side:
            rows += option_rows(args, loaded, data, others[sites], sites)
    rows += side_rows(args, loaded, data, choices[side], side)
    rows += sweep_rows(args, loaded, data, choices[side], side)
    reference = choices[side]
    base = baselines(args, loaded, data, reference.heads, reference.centre)
    log(f"{task}: " + ", ".join(f"{k} {v:.2f}" for k, v in base.items() if k != "own_heads"))
    return {
        "task": task, "baselines": base, "rows": rows,
        "choices": {
            str(n): {"k": c.k, "clip_norm": c.clip_norm, "heads": [list(h) for h in
                     c.heads.heads], **c.as_record()} for n, c in choices.items()
        },
        "public_tasks": [t.name for t in data.public],
        "seconds": round(time.monotonic() - started, 1),
    }  # fmt: skip


def model_path(name: str) -> Path:
    return pretrained_model_path() if name == "pretrained" else embedded_model_path(name)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=MODELS, default="pretrained")
    parser.add_argument("--tasks", nargs="+", default=["colour", "shape", "count", "position"])
    parser.add_argument("--curve-sites", type=int, nargs="+", default=[3, 10, 30])
    parser.add_argument("--side-sites", type=int, default=10, help="size of the side-by-side rows")
    parser.add_argument(
        "--every-option-sites", type=int, nargs="*", default=[],
        help="also release, central, every option the public choice did not pick (public "
        "heads; private selection select-first; private selection release-first) at these "
        "sizes (always at --side-sites)",
    )  # fmt: skip
    parser.add_argument("--per-site", type=int, default=100)
    parser.add_argument("--shots", type=int, default=4)
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--choice-draws", type=int, default=8, help="noise draws a tried (k, C')")
    parser.add_argument("--public-per-task", type=int, default=150, help="examples a public task")
    parser.add_argument(
        "--public-queries", type=int, default=PUBLIC_QUERIES,
        help="queries a public task keeps to score heads and simulate private selection on",
    )  # fmt: skip
    parser.add_argument("--validation", type=int, default=32)
    parser.add_argument("--test", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--clip-sweep", type=float, nargs="*", default=[],
        help="also release at the side-by-side size with C' = each factor x the public scale "
        "(a diagnostic: the best is picked with test answers)",
    )  # fmt: skip
    parser.add_argument("--jobs", type=int, default=1, help="tasks run in parallel processes")
    parser.add_argument(
        "--cache-dir", type=Path, help="keep the sites' activations here between runs"
    )
    parser.add_argument("--render-only", action="store_true", help="rewrite the .md from the .json")
    parser.add_argument("--out", type=Path, help="default: docs/benchmarks/headline-MODEL")
    args = parser.parse_args()
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
        args.out.with_suffix(".md").write_text(render(results, MODELS), encoding="utf-8")
        return 0
    started = time.monotonic()
    results: dict = {
        "command": " ".join([".venv/bin/python", "benchmarks/headline.py", *sys.argv[1:]]),
        "args": {k: str(v) for k, v in vars(args).items()},
        "tasks": [],
    }  # fmt: skip
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=context) as pool:
        futures = [pool.submit(_task_in_worker, args, name) for name in args.tasks]
        for future in futures:  # in task order, each written as soon as it and those before end
            results["tasks"].append(future.result())
            results["seconds"] = round(time.monotonic() - started, 1)
            args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
            args.out.with_suffix(".md").write_text(render(results, MODELS), encoding="utf-8")
    log(f"done in {time.monotonic() - started:.0f} s; wrote {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
