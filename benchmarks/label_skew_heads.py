"""Label skew: where each head choice loses (a diagnostic of ``label_skew_release.py``).

On the label-skew setting (position, sites holding two answers each, the largest size of
``label_skew_release.py``), the release in MTV's own heads beats a site alone while the release
in the heads the public data picks, or privately selects, does not. This scores the *pooled,
non-private* mean in each head set, so only the head choice differs:

* MTV's own k heads (attribution on the task's validation answers: an oracle);
* the public ranking's top k, the same with MTV's heads it lacks added (do its own extra
  heads hurt?), its top 2k (the candidates private selection picks among), and MTV's heads
  found among them;
* the top k by the sites' noise-free vote totals (the private selection's score, no noise),
  among the 2k candidates and among every head;
* the top k by the sites' attribution votes against the pooled mean, among the candidates and
  among every head (release-first's score, with the noise-free mean in place of the
  released vector);

and the private release itself in release-first order, among the candidates and among every
head (each option's k and C' chosen on the public tasks), at the planned selection share and
at larger shares (``--shares``), ``--draws`` noise draws each, beside what a task-agnostic
consortium has without a release (zero-shot, the public centre alone, a site alone). Reads
the sites' activations and votes kept by ``label_skew_release.py --cache-dir CACHE`` (or
computes them). Writes
``docs/benchmarks/label-skew-heads.md``::

    .venv/bin/python benchmarks/label_skew_heads.py --cache-dir CACHE   # ~5 min with CACHE
"""

from __future__ import annotations

import argparse
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

import numpy as np
from headline import choice_plan, choose_all, planned_release, release_draws
from label_skew_release import prepare, rows_of, site_alone

from client.models import load_model
from client.models.pretrained import pretrained_model_path
from client.public.scope import HeadsMode, ScopeChoice, choose_each
from client.public.selection import select_heads_attribution
from client.public.tasks import rank_heads
from dpmtv_common.heads import HeadSet
from protocol import ReleasePlan


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sites", type=int, default=48)
    parser.add_argument("--per-site", type=int, default=200)
    parser.add_argument("--classes-per-site", type=int, default=2)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--choice-draws", type=int, default=3)
    parser.add_argument("--public-per-task", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", type=Path)
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks/label-skew-heads.md")
    args = parser.parse_args()
    # what label_skew_release.prepare and headline.py's row functions read
    args.sites = [args.sites]
    args.model, args.shots = "pretrained", 4
    return args


def held_out_at(args, loaded, data, choice: ScopeChoice, plan: ReleasePlan, m: int) -> float:
    """What the public choice predicts for ``choice``'s k and C' under ``plan``'s noise.

    The simulation on held-out public tasks that chose them (then at the planned share), over
    ``m`` pooled chunks.
    """
    planned = planned_release(
        args, plan, m, release_first=True, among_every_head=choice.among_every_head
    )
    (again,) = choose_each(
        loaded, data.public, planned=[(HeadsMode.PRIVATE, planned)], ks=[choice.k],
        factors=[choice.factor], mode=HeadsMode.PRIVATE,
    )  # fmt: skip
    return again.held_out


def main() -> int:
    args = parse_args()
    started = time.monotonic()
    sites = args.sites[0]
    loaded = load_model(pretrained_model_path(), device="cpu")
    with tempfile.TemporaryDirectory(prefix="dpmtv-skew-heads-") as tmp:
        data = prepare(args, loaded, Path(tmp), "position")
        own = select_heads_attribution(loaded, data.pooled_mean, data.validation, k=args.k)
        top_k = rank_heads(loaded, data.public, k=args.k)
        top_2k = rank_heads(loaded, data.public, k=2 * args.k)
        shape = loaded.adapter.head_shape(loaded.model)
        carried = shape.layout().candidates()  # every head a vote may go to
        votes = sum(s.vote(args.k, carried).total for s in data.sites)
        votes = votes.reshape(shape.num_layers, shape.num_heads)

        def by_votes(pool: list[tuple[int, int]]) -> HeadSet:
            ranked = sorted(pool, key=lambda h: float(votes[h[0], h[1]]), reverse=True)
            return HeadSet.of(sorted(ranked[: args.k]))

        def by_attribution(among) -> HeadSet:
            # Release-first's score without its noise: each chunk's top-k heads by attribution
            # of the pooled mean on its own answer (the production scoring), summed over sites.
            reference = data.pooled_mean.numpy()
            totals = sum(
                site.attribution_vote(reference, args.k, among).total for site in data.sites
            )
            ranked = np.argsort(-np.asarray(totals), kind="stable")[: args.k]
            return HeadSet.of(
                sorted((int(i) // shape.num_heads, int(i) % shape.num_heads) for i in ranked)
            )

        every = [
            (layer, head) for layer in range(shape.num_layers) for head in range(shape.num_heads)
        ]
        sets = {
            "MTV's own heads (oracle)": own,
            "public ranking, top k": top_k,
            "public ranking, top k, with MTV's heads it lacks added": HeadSet.of(
                sorted(set(top_k.heads) | set(own.heads))
            ),
            "public ranking, top 2k (the candidates)": top_2k,
            "MTV's heads among the 2k candidates": HeadSet.of(
                sorted(set(own.heads) & set(top_2k.heads))
            ),
            "noise-free shift votes, top k of the candidates": by_votes(list(top_2k.heads)),
            "noise-free shift votes, top k of every head": by_votes(every),
            "attribution votes against the pooled mean, top k of the candidates": by_attribution(
                sorted(shape.layout().dense_indices(top_2k))
            ),
            "attribution votes against the pooled mean, top k of every head": by_attribution(
                carried
            ),
        }
        rows = []
        for label, heads in sets.items():
            accuracy = data.test.accuracy(loaded, rows_of(data.pooled_mean, heads))
            shared = len(set(heads.heads) & set(own.heads))
            rows.append(f"| {label} | {len(heads)} | {shared} | {accuracy:.2f} |")
        releases = []
        chunks = len(data.sites[0].activations)
        options = choose_all(args, loaded, data, sites, mode=HeadsMode.PRIVATE, every_head=True)
        alone = site_alone(args, loaded, data, top_k)
        public_only = data.test.accuracy(loaded, (top_k, options[0].centre.rows(top_k)))
        baselines = [
            f"| zero-shot | {data.test.accuracy(loaded):.2f} |",
            f"| public only (the public centre in the public top k) | {public_only:.2f} |",
            f"| a site alone: 4-shot ICL with its own examples | {alone['site_alone_icl']:.2f} |",
            f"| a site alone: its own chunks' mean in the public top k | "
            f"{alone['site_alone_mtv']:.2f} |",
        ]
        for choice in options:
            base = choice_plan(loaded, choice, sites=sites, chunks=chunks)
            among = "every head" if choice.among_every_head else "the candidates"
            for share in args.shares:
                plan = base.model_copy(update={"selection_share": share})
                predicted = held_out_at(args, loaded, data, choice, plan, sites * chunks)
                scores = release_draws(loaded, data, plan, choice.centre, sites, args.draws)
                releases.append(
                    f"| release-first among {among} (k {choice.k}, C' {choice.clip_norm:.3g}) | "
                    f"{share:g} | {predicted:.2f} | {statistics.mean(scores):.2f} ± "
                    f"{statistics.pstdev(scores):.2f} | {statistics.median(scores):.2f} |"
                )
                print(releases[-1], flush=True)
    command = " ".join([".venv/bin/python", "benchmarks/label_skew_heads.py", *sys.argv[1:]])
    text = [
        "# Label skew: where each head choice loses",
        "",
        f"Generated by `{command}` in {(time.monotonic() - started) / 60:.0f} min on 2 cores. "
        f"Position on the pretrained decoder, {sites} sites of {args.per_site} examples holding "
        f"{args.classes_per_site} answers each (m = {sites * len(data.sites[0].activations)}), "
        "40 balanced test scenes. The pooled, non-private mean of every site's chunks in each "
        "head set (only the heads differ); then the private release in release-first order, "
        "among the public candidates and among every head (k and C' chosen on the public "
        f"tasks, {args.choice_draws} simulated draws a tried k and C'), at each selection "
        f"share of eps (eps = 1, {args.draws} draws), beside what the public choice's "
        "simulation on held-out public tasks predicts for it.",
        "",
        "| heads | count | of MTV's own | pooled mean's accuracy |",
        "|---|---:|---:|---:|",
        *rows,
        "",
        "| without a private release (task-agnostic) | accuracy |",
        "|---|---:|",
        *baselines,
        "",
        "| private release | selection share of eps | held-out prediction (public tasks) | "
        "accuracy | median |",
        "|---|---:|---:|---:|---:|",
        *releases,
    ]
    args.out.write_text("\n".join(text) + "\n", encoding="utf-8")
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
