"""Label skew, private: does the consortium's DP release beat a site alone where pooling helps?

``label_skew.py`` found, without privacy, a setting where pooled examples beat a site alone:
on the pretrained decoder's position task, sites that each hold two of the four answers
(specialty clinics) teach 4-shot ICL 0.73 while the pooled mean gives 0.82. This runs the
product's release there, the headline's way (``headline.py``): every public choice (the centre,
the heads mode, k, C') from the labelled public sets of the *other* tasks only (task-agnostic:
no example carries the task's answers), eps = 1, delta = 1e-5, ``--draws`` noise draws a row,
central and distributed (t = ceil(n/2)), at each ``--sites`` count; sites of ``--per-site``
examples, each holding ``--classes-per-site`` answers (the combinations in turn). The chosen
release is the option the public choice picks among every option ``select-heads`` compares
by default, and side by side, central, each option it did not pick, with its own k and C'
from the public tasks (every size). ``--chosen-among select-first`` chooses as runs before
that option did, among the select-first ones only, beside the other heads mode (every size)
and private selection in release-first order (the 2k public candidates noised, then each
chunk votes by attribution against the noisy vector among them, and the same among every
carried head; ``--release-first-sites``). Also private selection select-first among every
head, not only the 2k public candidates (``--every-head-sites``); and at the largest size the
public-heads release in MTV's own heads (oracle heads: a diagnostic of what the head choice
costs).

Beside the rows, on the same 40 balanced test scenes (the heads: the k public heads the
largest consortium's choice ranks first): zero-shot; public only (the centre in those
heads); **a site alone** (4-shot ICL with its own examples, and its own chunks' mean in those
heads, averaged over one site of each class combination); the pooled mean of the
largest consortium, non-private, in those heads and in MTV's own selection (an oracle);
and, in a separate labelled setting a consortium may not have, 20 public examples of the task
itself (their mean, and 4-shot ICL from them).

Writes ``docs/benchmarks/label-skew-release.md`` (and ``.json``)::

    .venv/bin/python benchmarks/label_skew_release.py --sites 6 12 24 48 --cache-dir CACHE
    # ~50 min on 2 cores; ~36 min again with the sites' activations, votes and
    # attribution terms kept in CACHE
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
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
from _headline_data import (
    PUBLIC_QUERIES,
    TINY_PUBLIC,
    SiteActs,
    TaskData,
    icl_accuracy,
    public_tasks,
    query_set,
    site_activations,
)
from headline import (
    MODELS,
    baselines,
    choice_plan,
    choose,
    dp_row,
    log,
    make_plan,
    option_rows,
    size_rows,
)
from headline import release_first_rows as headline_release_first_rows
from label_skew import skewed_sites

from client.activations.chunking import make_chunks
from client.data.records import SiteDataset, load_dataset
from client.data.synthetic import write_task_datasets
from client.models import LoadedModel, load_model
from client.models.pretrained import pretrained_model_path
from client.public.scope import HeadsMode, ScopeChoice
from client.public.selection import select_heads_attribution
from client.release.single_holder import LocalSums
from dpmtv_common.heads import HeadSet

SHOTS = 4
CHOSEN_AMONG = ("every-option", "select-first")
_SIDE_TEXT = {
    "every-option": "Rows marked 'another option' release each option the chosen rows' choice "
    "did not pick, each with its own k and C' from the public tasks.",
    "select-first": "The two release-first options are each chosen on the public tasks (k, C'); "
    "the one the public tasks predict better comes first, the other is marked 'the other "
    "option' (what `select-heads --picks-among` forces).",
}
_CHOSEN_TEXT = {
    "every-option": "every option `select-heads` compares by default (public heads and private "
    "selection select-first; private selection release-first among the candidates and among "
    "every carried head)",
    "select-first": "the select-first options only (public heads and private selection)",
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", nargs="+", default=["position"])
    parser.add_argument("--classes-per-site", type=int, default=2)
    parser.add_argument("--per-site", type=int, default=200, help="examples a site holds")
    parser.add_argument("--sites", type=int, nargs="+", default=[6, 12, 24])
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument(
        "--every-head-sites", type=int, nargs="*", default=[24, 48],
        help="sizes that also release with private selection among every head",
    )  # fmt: skip
    parser.add_argument(
        "--release-first-sites", type=int, nargs="*", default=[6, 12, 24, 48],
        help="with --chosen-among select-first: sizes that also release in release-first order "
        "(attribution votes; with every-option, every option not picked is released at every size)",
    )  # fmt: skip
    parser.add_argument(
        "--chosen-among", choices=CHOSEN_AMONG, default="every-option",
        help="what the chosen row's public choice compares: every option select-heads compares "
        "by default (public heads and private select-first; private release-first among the "
        "candidates and among every head), or the select-first options only (how runs before "
        "this option chose; their JSONs render so)",
    )  # fmt: skip
    parser.add_argument("--choice-draws", type=int, default=8, help="noise draws a tried (k, C')")
    parser.add_argument("--public-per-task", type=int, default=150)
    parser.add_argument(
        "--public-queries", type=int, default=PUBLIC_QUERIES,
        help="queries a public task keeps to score heads and simulate private selection on",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", type=Path, help="keep the sites' activations between runs")
    parser.add_argument("--render-only", action="store_true", help="rewrite the .md from the .json")
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks/label-skew-release")
    args = parser.parse_args()
    args.model, args.shots = "pretrained", SHOTS  # what headline.py's row functions read
    return args


def prepare(args, loaded: LoadedModel, root: Path, task: str) -> TaskData:
    """Skewed sites of ``task`` (train scenes), its test/validation/tiny sets, public tasks."""
    sites = max(args.sites)
    write_task_datasets(
        root / task, task=task, sites=1, per_site=2 * sites * args.per_site, public=TINY_PUBLIC,
        test=40, validation=32, seed=args.seed,
    )  # fmt: skip
    pool = list(load_dataset(root / task / "site-0").records)
    skewed = skewed_sites(pool, args.classes_per_site, size=args.per_site, sites=sites)
    vote_plan = make_plan(  # private selection's votes (top-r of k), as headline.py's
        loaded, sites=2, chunks=args.per_site // (SHOTS + 1), clip=1.0, heads=None,
        k=MODELS["pretrained"][2],
    )  # fmt: skip
    acts = []
    for index, records in enumerate(skewed):
        chunks = make_chunks(SiteDataset(tuple(records), task), shots=SHOTS, seed=1000 + index)
        name = f"skew-{task}-{args.classes_per_site}-{args.per_site}-{args.seed}-{sites}-{index}"
        acts.append(
            SiteActs(
                site_activations(loaded, chunks.chunks, args.cache_dir, name),
                LocalSums(loaded, chunks.chunks, vote_plan, progress=False),
                scores_path=args.cache_dir and args.cache_dir / f"{name}-shift.npy",
                terms_path=args.cache_dir and args.cache_dir / f"{name}-terms.pt",
            )
        )
        if (index + 1) % 6 == 0 or index + 1 == sites:
            log(f"{task}: {index + 1} of {sites} skewed sites extracted")
    test_records = list(load_dataset(root / task / "test").records)
    return TaskData(
        name=task,
        sites=acts,
        public=public_tasks(
            loaded,
            root,
            task,
            shots=SHOTS,
            public_per_task=args.public_per_task,
            seed=args.seed,
            log=log,
            max_queries=args.public_queries,
        ),
        tiny=load_dataset(root / task / "public"),
        test=query_set(loaded, test_records),
        test_records=test_records,
        validation=list(load_dataset(root / task / "validation").records),
        site_records=skewed,
    )


def rows_of(mean, heads: HeadSet):
    index = heads.to_array()
    return heads, mean[index[:, 0], index[:, 1]]


def site_alone(args, loaded: LoadedModel, data: TaskData, heads: HeadSet) -> dict:
    """A site alone, averaged over one site of each class combination (the first sites)."""
    combos = range(min(len(data.sites), _combinations(args.classes_per_site)))
    icl = [
        icl_accuracy(loaded, data.test_records, data.site_records[i], shots=SHOTS, seeds=1)
        for i in combos
    ]
    own = [
        data.test.accuracy(loaded, rows_of(data.sites[i].activations.mean(0), heads))
        for i in combos
    ]
    return {
        "site_alone_icl": statistics.mean(icl), "site_alone_icl_each": icl,
        "site_alone_mtv": statistics.mean(own), "site_alone_mtv_each": own,
    }  # fmt: skip


def _combinations(per_site: int, classes: int = 4) -> int:
    return math.comb(classes, per_site)


def central_row(
    args, loaded: LoadedModel, data: TaskData, choice: ScopeChoice, sites: int, label: str,
    variant: str,
) -> dict:  # fmt: skip
    """One central DP row of ``choice`` at ``sites``, labelled as a side row (``variant``)."""
    plan = choice_plan(loaded, choice, sites=sites, chunks=len(data.sites[0].activations))
    return dp_row(
        args, loaded, data, label, plan, choice.centre, sites, choice=choice, variant=variant
    )


def other_mode_row(
    args, loaded: LoadedModel, data: TaskData, chosen: ScopeChoice, sites: int
) -> tuple[dict, ScopeChoice]:
    """The heads mode the transfer rule did not choose, central, at one size (side by side)."""
    other = HeadsMode.PRIVATE if chosen.mode is HeadsMode.PUBLIC else HeadsMode.PUBLIC
    choice = choose(args, loaded, data, sites, mode=other, every_head=False)
    label = f"{sites} sites, central, {other.value} heads (the other mode)"
    row = central_row(args, loaded, data, choice, sites, label, "other heads mode")
    return row, choice


def release_first_rows(args, loaded: LoadedModel, data: TaskData, sites: int) -> list[dict]:
    """headline.py's release-first private rows (no noise-free diagnostics: draws pick heads)."""
    return [
        row | {"noise_free": None, "unclipped": None}
        for row in headline_release_first_rows(args, loaded, data, sites)
    ]


def _select_first_private(
    args, loaded: LoadedModel, data: TaskData, sites: int, *chosen: ScopeChoice
) -> ScopeChoice:
    """The private select-first choice among ``chosen``, else made for it (``every_head_row``)."""
    for choice in chosen:
        if choice.mode is HeadsMode.PRIVATE and not choice.every_head:
            return choice
    return choose(args, loaded, data, sites, mode=HeadsMode.PRIVATE, every_head=False)


def every_head_row(
    args, loaded: LoadedModel, data: TaskData, choice: ScopeChoice, sites: int
) -> dict:
    """Private selection select-first among every head, not only the 2k public candidates.

    Same k, C' and centre as the private select-first choice: what the candidate set costs.
    """
    every = dataclasses.replace(choice, candidates=None)
    label = f"{sites} sites, central, private heads among every head"
    row = central_row(args, loaded, data, every, sites, label, "every head a candidate")
    return row | {"noise_free": None, "unclipped": None}


def oracle_heads_row(
    args, loaded: LoadedModel, data: TaskData, choice: ScopeChoice, sites: int
) -> dict:
    """A diagnostic: the public-heads release in MTV's own heads instead of the public ones.

    MTV's own heads are chosen with the task's validation answers (an oracle no consortium
    has); same k, C' and centre as the public-mode choice. What the release would give if
    the head choice were right, at this size's noise.
    """
    own = select_heads_attribution(loaded, data.pooled_mean, data.validation, k=choice.k)
    oracle = dataclasses.replace(choice, heads=own)
    label = f"{sites} sites, central, MTV's own heads (oracle heads: a diagnostic)"
    row = central_row(args, loaded, data, oracle, sites, label, "oracle heads")
    return row | without_noise(loaded, data, oracle, sites)


def without_noise(loaded: LoadedModel, data: TaskData, choice: ScopeChoice, sites: int) -> dict:
    """Where a public-heads row loses: the same release without noise, and without clipping.

    ``noise_free``: the centred clipped sum of the row's sites over their chunks, plus the
    centre (the release with zero noise); ``unclipped``: the plain mean of the same chunks in
    the same heads. A diagnostic (neither is private); None for private-selection rows, whose
    heads each draw chooses.
    """
    if choice.mode is not HeadsMode.PUBLIC:
        return {"noise_free": None, "unclipped": None}
    heads, centre = choice.heads, choice.centre
    sums = [s.activation(heads, choice.clip_norm, centre) for s in data.sites[:sites]]
    mean = sum(p.total for p in sums) / sum(p.num_chunks for p in sums) + centre.rows(heads)
    pooled = np.concatenate([s.activations for s in data.sites[:sites]]).mean(0)
    return {
        "noise_free": data.test.accuracy(loaded, (heads, mean)),
        "unclipped": data.test.accuracy(loaded, rows_of(pooled, heads)),
    }


def _every_option_rows(
    args, loaded: LoadedModel, data: TaskData, sites: int
) -> tuple[list[dict], ScopeChoice, list[ScopeChoice]]:
    """The chosen release (every option compared), then each option it did not pick, central."""
    kept: dict[int, list[ScopeChoice]] = {}
    size, chosen = size_rows(args, loaded, data, sites, every_head=None, others=kept)
    others = kept[sites]
    rows = [row | without_noise(loaded, data, chosen, sites) for row in size]
    side = option_rows(args, loaded, data, others, sites)
    rows += [
        row | without_noise(loaded, data, c, sites) for row, c in zip(side, others, strict=True)
    ]
    return rows, chosen, others


def _select_first_rows(
    args, loaded: LoadedModel, data: TaskData, sites: int
) -> tuple[list[dict], ScopeChoice, list[ScopeChoice]]:
    """As runs before ``--chosen-among``: the select-first options' pick and the other mode.

    And the release-first options, each chosen apart (``--release-first-sites``).
    """
    size, chosen = size_rows(args, loaded, data, sites, every_head=False)
    side, other = other_mode_row(args, loaded, data, chosen, sites)
    rows = [row | without_noise(loaded, data, chosen, sites) for row in size]
    rows.append(side | without_noise(loaded, data, other, sites))
    if sites in args.release_first_sites:
        rows += release_first_rows(args, loaded, data, sites)
    return rows, chosen, [other]


def run_task(args, loaded: LoadedModel, root: Path, task: str) -> dict:
    started = time.monotonic()
    data = prepare(args, loaded, root, task)
    rows, choices = [], {}
    for sites in sorted(args.sites):
        by_size = _every_option_rows if args.chosen_among == "every-option" else _select_first_rows
        size, choices[sites], others = by_size(args, loaded, data, sites)
        rows += size
        if sites in args.every_head_sites:
            private = _select_first_private(args, loaded, data, sites, choices[sites], *others)
            rows.append(every_head_row(args, loaded, data, private, sites))
        if sites == max(args.sites):
            public = next(c for c in (choices[sites], *others) if c.mode is HeadsMode.PUBLIC)
            rows.append(oracle_heads_row(args, loaded, data, public, sites))
    reference = choices[max(choices)]
    base = baselines(args, loaded, data, reference.heads, reference.centre)
    base.update(site_alone(args, loaded, data, reference.heads))
    log(f"{task}: site alone ICL {base['site_alone_icl']:.2f}, own {base['site_alone_mtv']:.2f}")
    return {
        "task": task, "baselines": base, "rows": rows,
        "choices": {str(n): {"k": c.k, **c.as_record()} for n, c in choices.items()},
        "public_tasks": [t.name for t in data.public],
        "seconds": round(time.monotonic() - started, 1),
    }  # fmt: skip


BASELINES = (  # key, label, setting
    ("zero_shot", "zero-shot", "task-agnostic"),
    ("public_only_task_agnostic", "public only (the centre in the public heads)", "task-agnostic"),
    ("site_alone_icl", "a site alone: 4-shot ICL with its own examples", "task-agnostic"),
    ("site_alone_mtv", "a site alone: its own chunks' mean in the public heads", "task-agnostic"),
    ("mtv_public_heads", "every site's chunks pooled, in the public heads (not private)", "oracle"),
    ("mtv_own_selection", "MTV with its own selection (not private; oracle heads)", "oracle"),
    ("public_only_tiny", "20 public examples of the task: their mean", "labelled"),
    ("public_icl_tiny", "20 public examples of the task: 4-shot ICL", "labelled"),
)


def render(results: dict) -> str:
    a = results["args"]
    lines = [
        "# Label skew, private: the consortium's release against a site alone",
        "",
        f"Generated by `{results['command']}` in {results['seconds'] / 60:.0f} min on 2 cores. "
        f"Pretrained decoder; each site holds {a['per_site']} examples of "
        f"{a['classes_per_site']} of the task's four answers (the combinations in turn); "
        "first-token accuracy on 40 balanced test scenes no site, public set or training "
        "showed. Every public choice (centre, heads mode, k, C') from labelled public sets of "
        f"the *other* tasks only ({a.get('public_per_task', 150)} examples a task; heads "
        # 40 where the run predates --public-queries (what public_task kept then)
        f"scored on the queries of at most {a.get('public_queries', 40)} of its "
        "chunks); "
        "the chosen rows (central and distributed) release the option "
        f"the public choice picks among {_CHOSEN_TEXT[a.get('chosen_among', 'select-first')]}; "
        "eps = 1, delta = 1e-5, "
        f"{a['draws']} noise draws a row. A site alone is averaged over one site of each "
        "class combination. Rows marked oracle or labelled are not available to a "
        "task-agnostic consortium: oracle rows use every private chunk without noise (and MTV's "
        "own heads use validation answers); labelled rows assume public examples of the task "
        "itself. *Without noise* and *without noise or clipping* diagnose a public-heads "
        "row (not private, n/a for private selection, whose heads each draw picks): the same "
        "sites' centred clipped mean with zero noise, and their plain mean, in the row's heads. "
        "Private rows are select-first (each chunk's shift votes, among the 2k public "
        "candidates unless said otherwise) except those marked release-first: the Gaussian "
        "noises the candidates once (or, where said, every carried head), then each chunk "
        "votes by attribution against the noisy vector on its own answer, among them, with "
        "C' chosen for their layers. " + _SIDE_TEXT[a.get("chosen_among", "select-first")],
    ]
    for task in results["tasks"]:
        base = task["baselines"]
        best = max(base[k] for k, _, setting in BASELINES if setting == "task-agnostic")
        lines += ["", f"## {task['task']}", "", "| without a private release | setting | "
                  "accuracy |", "|---|---|---:|"]  # fmt: skip
        lines += [f"| {label} | {setting} | {base[k]:.2f} |" for k, label, setting in BASELINES]
        lines += [
            "",
            f"Best task-agnostic figure without a release: {best:.2f}. A site alone by class "
            "combination, ICL: " + ", ".join(f"{v:.2f}" for v in base["site_alone_icl_each"]),
            "",
            "| release | m | heads | k | C' | DP-MTV mean ± sd | min / median / max | above "
            f"the best task-agnostic baseline ({best:.2f}) | without noise | without noise "
            "or clipping |",
            "|---|---:|---|---:|---:|---:|---|---|---:|---:|",
        ]
        for r in task["rows"]:
            d = r["draws"]
            gap = r["accuracy"] - best
            lines.append(
                f"| {r['label']} | {r['m']} | {r['selection']} | {r['k']} | {r['C']:.3g} | "
                f"{r['accuracy']:.2f} ± {r['sd']:.2f} | {min(d):.2f} / "
                f"{statistics.median(d):.2f} / {max(d):.2f} | "
                f"{'yes' if gap > 0 else 'no'} ({gap:+.2f}) | {_cell(r.get('noise_free'))} | "
                f"{_cell(r.get('unclipped'))} |"
            )
    return "\n".join(lines) + "\n"


def _cell(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def main() -> int:
    args = parse_args()
    if args.render_only:
        results = json.loads(args.out.with_suffix(".json").read_text())
        args.out.with_suffix(".md").write_text(render(results), encoding="utf-8")
        return 0
    started = time.monotonic()
    results: dict = {
        "command": " ".join([".venv/bin/python", "benchmarks/label_skew_release.py", *sys.argv[1:]]),  # noqa: E501
        "args": {k: v for k, v in vars(args).items() if isinstance(v, int | float | str | list)},
        "tasks": [],
    }  # fmt: skip
    loaded = load_model(pretrained_model_path(), device="cpu")
    for task in args.tasks:
        with tempfile.TemporaryDirectory(prefix="dpmtv-skew-release-") as tmp:
            results["tasks"].append(run_task(args, loaded, Path(tmp), task))
        results["seconds"] = round(time.monotonic() - started, 1)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(render(results), encoding="utf-8")
    log(f"done in {time.monotonic() - started:.0f} s; wrote {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
