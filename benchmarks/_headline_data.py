"""The honest headline's data: a private task's sites, task-agnostic public tasks, baselines.

Per private task: ``sites`` folders of ``per_site`` examples (train scenes), a validation set
(validation scenes: MTV's own head selection, the oracle reference), a test set (test scenes
no site, public set or model training showed), and two public settings:

* **task-agnostic**: labelled public sets of the *other* tasks of the family (same images and
  question, other answers), none of the private task's answers;
* **same-task, tiny**: 20 labelled public examples of the private task itself.

Every site's K-shot chunks run once through the production hooks (all heads); every release
then clips from those activations, centred or not, exactly as a site's extraction does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from client.activations.chunking import make_chunks
from client.activations.extraction import zero_shot_prompt
from client.activations.scoring import (
    attribution_scores,
    last_token_attribution,
    shift_scores,
    votes_among,
)
from client.data.records import Record, SiteDataset, load_dataset
from client.data.synthetic import TRAINED_TASKS, write_task_datasets
from client.evaluation.first_token import QuerySet
from client.evaluation.run import icl_prompts
from client.models import LoadedModel
from client.public.selection import public_activations
from client.public.tasks import MAX_PUBLIC_QUERIES, PublicTask, public_task
from client.release.single_holder import LocalSums
from dpmtv_common.centre import ActivationCentre
from dpmtv_common.heads import HeadLayout, HeadSet
from dpmtv_common.privacy.mechanisms import clip_per_layer
from protocol import ActivationSum, ReleasePlan, VoteSum

__all__ = [
    "SiteActs", "TaskData", "icl_accuracy", "prepare_task", "public_family", "public_tasks",
    "query_set", "site_activations",
]  # fmt: skip

TINY_PUBLIC = 20
PUBLIC_QUERIES = MAX_PUBLIC_QUERIES  # public_task's default: the queries a public task keeps


def public_family(task: str) -> tuple[str, ...]:
    """The public tasks of ``task``'s domain: the trained tasks other than itself."""
    return tuple(t for t in TRAINED_TASKS if t != task)


@dataclass
class SiteActs:
    """One site's chunk activations ``(m_i, L, H, D)``; sums clip (centred) rows per layer."""

    activations: np.ndarray
    sums: LocalSums | None = None  # the production vote path, for private selection
    scores: np.ndarray | None = None  # each chunk's shift scores (m_i, L * H)
    terms: tuple[torch.Tensor, torch.Tensor] | None = None
    terms_path: Path | None = None  # where the attribution terms are kept between runs
    scores_path: Path | None = None  # where the shift scores are kept between runs
    cache: dict[tuple, ActivationSum] = field(default_factory=dict)

    def activation(
        self, heads: HeadSet, clip_norm: float, centre: ActivationCentre | None
    ) -> ActivationSum:
        """Σ over chunks of ``clip(a - r)`` (or ``clip(a)``) per layer on ``heads``."""
        key = (heads, clip_norm, None if centre is None else centre.digest())
        if key not in self.cache:
            index = heads.to_array()
            rows = self.activations[:, index[:, 0], index[:, 1], :].astype(np.float64)
            if centre is not None:
                rows = rows - centre.rows(heads)[None]
            layers = heads.row_layers()
            total = sum(clip_per_layer(r, row_layers=layers, clip_norm=clip_norm) for r in rows)
            self.cache[key] = ActivationSum(heads, np.asarray(total), len(rows))
        return self.cache[key]

    def zero_shot_terms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each chunk's zero-shot activations and answer gradients ``(m_i, L, H, D)`` (once).

        The production attribution pass (``last_token_attribution``), one chunk a pass as a
        site's attribution scoring runs it; every release-first draw scores against these.
        Read from ``terms_path`` when kept there, else computed (and kept there).
        """
        if self.terms is None and self.terms_path is not None and self.terms_path.is_file():
            saved = torch.load(self.terms_path)
            self.terms = (saved["activations"], saved["gradients"])
        if self.terms is None:
            self.terms = self._attribution_passes()
            if self.terms_path is not None:
                torch.save(
                    {"activations": self.terms[0], "gradients": self.terms[1]}, self.terms_path
                )
        return self.terms

    def _attribution_passes(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sums is None:
            raise ValueError("this site was prepared without its chunks")
        loaded = self.sums.loaded
        passes = [
            last_token_attribution(
                loaded, [zero_shot_prompt(c.query)], [c.query.answer], instruction=None
            )
            for c in self.sums.chunks
        ]
        return torch.cat([a for a, _ in passes]), torch.cat([g for _, g in passes])

    def attribution_vote(self, reference: np.ndarray, top_r: int, among: list[int]) -> VoteSum:
        """Top-r votes by attribution against ``reference`` ``(L, H, D)``, summed over chunks.

        The production scoring (``attribution_scores``, ``votes_among``) on the chunks'
        zero-shot terms, cast among the dense slots ``among`` (``protocol.vote_slots``).
        """
        acts, grads = self.zero_shot_terms()
        target = torch.as_tensor(reference, dtype=torch.float32)
        scores = attribution_scores(acts, grads, target.expand_as(acts))
        votes = votes_among(scores, among, top_r)
        return VoteSum(votes.sum(axis=0), len(acts))

    def vote(self, top_r: int, among: list[int]) -> VoteSum:
        """The site's top-r shift votes among ``among``, voted as ``chunk_votes`` votes them.

        The production shift scores are computed once for every r (a failed chunk's NaN
        row casts no vote).

        The scores are read from ``scores_path`` when kept there, else computed (and kept).
        """
        if self.scores is None and self.scores_path is not None and self.scores_path.is_file():
            self.scores = np.load(self.scores_path)
        if self.scores is None:
            if self.sums is None:
                raise ValueError("this site was prepared without its vote path")
            self.scores = shift_scores(self.sums.loaded, self.sums.chunks)
            if self.scores_path is not None:
                np.save(self.scores_path, self.scores)
        finite = np.isfinite(self.scores).all(axis=1)
        votes = np.zeros(self.scores.shape)
        votes[finite] = votes_among(self.scores[finite], among, top_r)
        return VoteSum(votes.sum(axis=0), len(self.scores))

    def layout(self) -> HeadLayout:
        """The model's head layout (the site's vote path must be prepared)."""
        if self.sums is None:
            raise ValueError("this site was prepared without its chunks")
        return self.sums.loaded.adapter.head_shape(self.sums.loaded.model).layout()


@dataclass
class TaskData:
    """Everything one private task's rows share."""

    name: str
    sites: list[SiteActs]
    public: list[PublicTask]
    tiny: SiteDataset  # the same-task tiny public set (labelled setting)
    test: QuerySet
    test_records: list[Record]
    validation: list[Record]
    site_records: list[list[Record]]

    @property
    def pooled_mean(self) -> torch.Tensor:
        """The unclipped mean of every site's chunks ``(L, H, D)`` (non-private MTV)."""
        return torch.as_tensor(np.concatenate([s.activations for s in self.sites]).mean(0))


def query_set(loaded: LoadedModel, records: list[Record]) -> QuerySet:
    prompts = [zero_shot_prompt(r) for r in records]
    return QuerySet.build(loaded, prompts, [r.answer for r in records])


def prepare_task(
    loaded: LoadedModel,
    root: Path,
    task: str,
    *,
    sites: int,
    per_site: int,
    shots: int,
    public_per_task: int,
    test: int,
    validation: int,
    seed: int,
    log,
    plan_for_votes: ReleasePlan | None = None,
    cache: Path | None = None,
    public_queries: int = PUBLIC_QUERIES,
) -> TaskData:
    """Write and run everything public and private for ``task`` (module docstring).

    ``cache``: a folder keeping each site's activations (and, once computed, its chunks'
    attribution terms) between runs (same data, same model: the data are seeded, so a rerun
    with other rows skips the sites' forward passes).
    """
    write_task_datasets(
        root / task, task=task, sites=sites, per_site=per_site, public=TINY_PUBLIC,
        test=test, validation=validation, seed=seed,
    )  # fmt: skip
    public = public_tasks(
        loaded, root, task, shots=shots, public_per_task=public_per_task, seed=seed, log=log,
        max_queries=public_queries,
    )  # fmt: skip
    caches, records = [], []
    for index in range(sites):
        dataset = load_dataset(root / task / f"site-{index}")
        chunks = make_chunks(dataset, shots=shots, seed=1000 + index).chunks
        name = f"{task}-{per_site}-{seed}-k{shots}-{index}"  # K changes every chunk
        acts = site_activations(loaded, chunks, cache, name)
        sums = None
        if plan_for_votes is not None:
            sums = LocalSums(loaded, chunks, plan_for_votes, progress=False)
        terms = scores = None
        if cache is not None:
            terms = cache / f"{loaded.fingerprint[-16:]}-{name}-terms.pt"
            scores = cache / f"{loaded.fingerprint[-16:]}-{name}-shift.npy"
        caches.append(SiteActs(acts, sums, terms_path=terms, scores_path=scores))
        records.append(list(dataset.records))
        if (index + 1) % 5 == 0 or index + 1 == sites:
            log(f"{task}: {index + 1} of {sites} sites extracted")
    test_records = list(load_dataset(root / task / "test").records)
    return TaskData(
        name=task,
        sites=caches,
        public=public,
        tiny=load_dataset(root / task / "public"),
        test=query_set(loaded, test_records),
        test_records=test_records,
        validation=list(load_dataset(root / task / "validation").records),
        site_records=records,
    )


def public_tasks(
    loaded: LoadedModel, root: Path, task: str, *, shots: int, public_per_task: int, seed: int,
    log, max_queries: int = PUBLIC_QUERIES,
) -> list[PublicTask]:  # fmt: skip
    """The task-agnostic public setting of ``task``: a labelled set of each other family task.

    ``max_queries``: the chunks' queries each task keeps (``public_task``), on which the
    public choices score heads and simulate private selection.
    """
    public = []
    for offset, other in enumerate(public_family(task), start=1):
        folder = root / f"public-{other}"
        write_task_datasets(
            folder, task=other, sites=0, per_site=1, public=public_per_task, test=0,
            seed=seed + 100 * offset,
        )  # fmt: skip
        dataset = load_dataset(folder / "public")
        public.append(
            public_task(
                loaded, dataset, shots=shots, max_chunks=public_per_task, max_queries=max_queries
            )
        )
        log(f"{task}: public task {other}: {len(public[-1].activations)} chunks")
    return public


def site_activations(loaded: LoadedModel, chunks, cache: Path | None, name: str) -> np.ndarray:
    path = None if cache is None else cache / f"{loaded.fingerprint[-16:]}-{name}.npy"
    if path is not None and path.is_file():
        return np.load(path)
    acts = public_activations(loaded, chunks, progress=False).numpy()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, acts)
    return acts


def icl_accuracy(
    loaded: LoadedModel, queries: list[Record], support: list[Record], *, shots: int, seeds: int
) -> float:
    """Mean K-shot ICL accuracy, demonstrations drawn from ``support`` (``seeds`` draws)."""
    answers = [r.answer for r in queries]
    scores = [
        QuerySet.build(
            loaded, icl_prompts(queries, support, shots=shots, seed=s), answers
        ).accuracy(loaded)
        for s in range(seeds)
    ]
    return float(np.mean(scores))
