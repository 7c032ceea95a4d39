"""Label skew: when each site holds a few classes only, is a site alone weak and the pool strong?

Hospitals and clinics rarely see every class alike: a specialty clinic sees one kind of case.
Here each site of 100 examples holds only ``--classes-per-site`` of the task's four answers
(every combination of that many classes is one site, the classes split evenly), on the
pretrained decoder, first-token accuracy on 40 balanced test scenes no site or training saw:

* **a site alone**: 4-shot ICL from its own examples (mean over four sites), and the
  non-private mean of its own 20 chunks, in the pooled selection's heads and in heads
  attribution picks on its own examples;
* **the pool**: the non-private mean of every site's chunks (K = 4, each chunk one site's) in
  the 16 heads attribution picks on validation queries of the task (MTV's own selection: an
  oracle, and no noise: what a perfect release could at best give).

Non-private throughout: a candidate finder, as ``weak_site_candidates.py``. Writes
``docs/benchmarks/label-skew.md`` (and ``.json``)::

    .venv/bin/python benchmarks/label_skew.py          # ~13 min on 2 cores

``--score answer`` scores the whole first answer span instead (``client.evaluation.run``,
one generation a query), for answers of more than one token such as ``colour-shape``'s
sixteen "red circle" pairs, and beside it the share of answers that *lead* the generated text
(what a reader sees first, whatever follows)::

    .venv/bin/python benchmarks/label_skew.py --tasks colour-shape --classes-per-site 1 \
        --sites 16 --icl-sites 8 --pool 3200 --score answer \
        --out docs/benchmarks/label-skew-colour-shape
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy()  # before torch loads

import torch
from _headline_data import icl_accuracy

from client.activations.chunking import make_chunks
from client.activations.extraction import zero_shot_prompt
from client.data.records import Record, SiteDataset, load_dataset
from client.data.synthetic import write_task_datasets
from client.evaluation.first_token import QuerySet
from client.evaluation.metrics import normalize_answer
from client.evaluation.run import EvaluationMode, evaluate
from client.inference.answers import TaskVectorPatch
from client.models import LoadedModel, load_model
from client.models.pretrained import pretrained_model_path
from client.public.selection import public_activations, select_heads_attribution
from dpmtv_common.heads import HeadSet

SITE = 100  # examples a site holds
K = 16  # heads


def skewed_sites(
    records: list[Record], per_site: int, *, size: int = SITE, sites: int | None = None
) -> list[list[Record]]:
    """Sites of ``size`` examples holding ``per_site`` classes each; no record in two sites.

    Sites take the combinations of ``per_site`` classes in turn (``sites`` of them; default:
    every combination once, twice with one class a site), each class an even share of a site.

    Raises:
        ValueError: Too few records of a class for the sites asked for.
    """
    by_class: dict[str, list[Record]] = collections.defaultdict(list)
    for record in records:
        by_class[record.answer].append(record)
    taken: collections.Counter[str] = collections.Counter()
    combos = list(itertools.combinations(sorted(by_class), per_site))
    count = sites if sites is not None else len(combos) * (2 if per_site == 1 else 1)
    out = []
    for combo in itertools.islice(itertools.cycle(combos), count):
        site: list[Record] = []
        for answer in combo:
            share = size // per_site
            picked = by_class[answer][taken[answer] : taken[answer] + share]
            if len(picked) < share:
                raise ValueError(f"only {len(by_class[answer])} records of {answer!r}")
            site += picked
            taken[answer] += share
        random.Random(len(out)).shuffle(site)
        out.append(site)
    return out


class _FirstToken:
    """First-token accuracy: one forward a query (every task here answers in one token)."""

    def __init__(self, loaded: LoadedModel, test: list[Record]) -> None:
        self.loaded, self.test = loaded, test
        self.queries = QuerySet.build(
            loaded, [zero_shot_prompt(r) for r in test], [r.answer for r in test]
        )

    def zero_shot(self) -> float:
        return self.queries.accuracy(self.loaded)

    def icl(self, support: list[Record]) -> float:
        return icl_accuracy(self.loaded, self.test, support, shots=4, seeds=1)

    def patched(self, heads: HeadSet, values: torch.Tensor) -> float:
        return self.queries.accuracy(self.loaded, (heads, values))


class _Answer:
    """The whole first answer span (one generation a query), and the share it leads."""

    def __init__(self, loaded: LoadedModel, test: list[Record]) -> None:
        self.loaded, self.test = loaded, test

    def _scored(self, **how: Any) -> dict[str, float]:
        result = evaluate(self.loaded, self.test, max_new_tokens=6, **how)
        leads = [
            normalize_answer(text).startswith(normalize_answer(record.answer))
            for text, record in zip(result.predictions, self.test, strict=True)
        ]
        return {"answer": result.accuracy, "leads": statistics.mean(leads)}

    def zero_shot(self) -> dict[str, float]:
        return self._scored(mode=EvaluationMode.ZERO_SHOT)

    def icl(self, support: list[Record]) -> dict[str, float]:
        return self._scored(mode=EvaluationMode.ICL, support=support, shots=4)

    def patched(self, heads: HeadSet, values: torch.Tensor) -> dict[str, float]:
        patch = TaskVectorPatch(heads, values.float())
        return self._scored(mode=EvaluationMode.ARTIFACT, patch=patch)


def _mean(scores: list[Any]) -> Any:
    """The mean of floats, or key by key of dicts of floats."""
    if isinstance(scores[0], dict):
        return {key: statistics.mean(s[key] for s in scores) for key in scores[0]}
    return statistics.mean(scores)


def measure(loaded: LoadedModel, root: Path, task: str, per_site: int, args: Any) -> dict:
    write_task_datasets(
        root, task=task, sites=1, per_site=args.pool, public=0, test=40, validation=32,
        seed=args.seed,
    )  # fmt: skip
    pool = list(load_dataset(root / "site-0").records)
    test = list(load_dataset(root / "test").records)
    sites = skewed_sites(pool, per_site, sites=args.sites)
    score = _Answer(loaded, test) if args.score == "answer" else _FirstToken(loaded, test)
    acts = [
        public_activations(
            loaded, make_chunks(SiteDataset(tuple(s), task), shots=4, seed=1).chunks, progress=False
        )
        for s in sites
    ]  # fmt: skip
    pooled = torch.cat(acts).mean(0)
    heads = select_heads_attribution(
        loaded, pooled, list(load_dataset(root / "validation").records), k=K
    )

    def rows(mean: torch.Tensor, chosen: HeadSet = heads) -> tuple[HeadSet, torch.Tensor]:
        index = torch.as_tensor(chosen.to_array())
        return chosen, mean[index[:, 0], index[:, 1]]

    four = range(4)
    own_heads = [
        select_heads_attribution(loaded, acts[i].mean(0), sites[i][:32], k=K) for i in four
    ]
    return {
        "task": task, "classes_per_site": per_site, "sites": len(sites), "score": args.score,
        "m": sum(len(a) for a in acts),
        "zero_shot": score.zero_shot(),
        "site_icl": _mean([score.icl(sites[i]) for i in range(min(args.icl_sites, len(sites)))]),
        "site_mean_pool_heads": _mean([score.patched(*rows(acts[i].mean(0))) for i in four]),
        "site_mean_own_heads": _mean(
            [score.patched(*rows(acts[i].mean(0), own_heads[i])) for i in four]
        ),
        "pooled_mean": score.patched(*rows(pooled)),
    }  # fmt: skip


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        return f"{value['answer']:.2f} ({value['leads']:.2f})"
    return f"{value:.2f}"


def render(results: dict) -> str:
    rows = results["rows"]
    answer = any(r.get("score") == "answer" for r in rows)
    scoring = (
        "accuracy of the whole first answer span (`client.evaluation.run.evaluate`) on 40 "
        "balanced test scenes, and in brackets the share of them whose generated text begins "
        "with the answer, whatever follows"
        if answer
        else "first-token accuracy on 40 balanced test scenes"
    )
    classes = "the task's answers" if answer else "the task's four answers"
    lines = [
        "# Label skew: a site alone against the pooled examples (non-private)",
        "",
        f"Generated by `{results['command']}` in {results['seconds'] / 60:.0f} min on 2 cores. "
        f"Pretrained decoder; each site holds 100 examples of only some of {classes}; "
        f"{scoring}. Non-private and with the "
        "pooled mean's heads chosen on the task's validation queries (an oracle): what a "
        "perfect release could at best give, not what one gives.",
        "",
        "| task | classes a site | sites (m) | zero-shot | a site alone: 4-shot ICL | a site "
        "alone: its own mean (pooled heads / own heads) | every site's chunks pooled |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['task']} | {r['classes_per_site']} | {r['sites']} ({r['m']}) | "
            f"{_cell(r['zero_shot'])} | {_cell(r['site_icl'])} | "
            f"{_cell(r['site_mean_pool_heads'])} / {_cell(r['site_mean_own_heads'])} | "
            f"{_cell(r['pooled_mean'])} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", nargs="+", default=["position", "colour"])
    parser.add_argument("--classes-per-site", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sites", type=int, default=None,
        help="sites (default: every combination of classes once, twice with one class a site)",
    )  # fmt: skip
    parser.add_argument("--icl-sites", type=int, default=4, help="sites whose ICL is averaged")
    parser.add_argument("--pool", type=int, default=1600, help="examples drawn to fill the sites")
    parser.add_argument(
        "--score", choices=("first-token", "answer"), default="first-token",
        help="first-token accuracy, or the whole first answer span (answers of several tokens)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks/label-skew")
    args = parser.parse_args()
    started = time.monotonic()
    loaded = load_model(pretrained_model_path(), device="cpu")
    results: dict = {
        "command": " ".join([".venv/bin/python", "benchmarks/label_skew.py", *sys.argv[1:]]),
        "rows": [],
    }
    for task in args.tasks:
        for per_site in args.classes_per_site:
            with tempfile.TemporaryDirectory(prefix="dpmtv-skew-") as tmp:
                row = measure(loaded, Path(tmp), task, per_site, args)
            results["rows"].append(row)
            print(row, flush=True)
            results["seconds"] = round(time.monotonic() - started, 1)
            args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
            args.out.with_suffix(".md").write_text(render(results), encoding="utf-8")
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
