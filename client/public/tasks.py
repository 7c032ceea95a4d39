"""Task-agnostic public data: labelled examples of OTHER tasks of a domain, and what they give.

A consortium rarely holds public labelled examples of its private task, and where it holds
many their plain mean already answers the task (measured on the pretrained decoder: 1.00 on
colour with no private data), so a release measured against them measures the public set. What
it can honestly bring is labelled public data of *other* tasks of its domain: the same kind
of images and question, other answers (at least two tasks). From them alone, with no example
of the private task, this module makes every public choice of a centred release:

* **the centre** r (:func:`domain_centre`): the mean activation of the public tasks' K-shot
  chunks, each task weighing the same — what every task of the domain shares;
* **the heads** (:func:`rank_heads`): attribution gains (``client.public.selection``) of each
  public task with the centre patched in, each task's gains scaled to sum to 1 over the heads,
  summed: heads where what the domain's tasks share raises each task's answers;
* **the scale of C'** (:func:`centred_clip_scale`): the median centred layer norm of the
  public chunks over the chosen heads.

How k, C' and the selection mode are chosen from them is :mod:`client.public.scope`.

Everything reads public data and public plan numbers (z, m) only: no privacy budget is spent.
The simulated noise comes from ``dpmtv_common.privacy.noise`` and never leaves the process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from client.activations.chunking import make_chunks
from client.activations.extraction import zero_shot_prompt
from client.data.records import Record, SiteDataset
from client.evaluation.first_token import QuerySet
from client.models import LoadedModel
from client.public.defaults import MAX_PUBLIC_QUERIES
from client.public.selection import (
    AttributionTerms,
    QueryTerms,
    public_activations,
    query_terms,
    top_heads,
)
from dpmtv_common.aliases import Float64Array
from dpmtv_common.centre import ActivationCentre
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.mechanisms import clip_per_layer

__all__ = [
    "MAX_PUBLIC_QUERIES",
    "MIN_PUBLIC_TASKS",
    "PublicTask",
    "centred_clip_scale",
    "centred_mean",
    "domain_centre",
    "public_task",
    "rank_heads",
]

MIN_PUBLIC_TASKS = 2
"""Leave-one-task-out needs a task to hold out and one to learn from."""


@dataclass(frozen=True)
class PublicTask:
    """One labelled public task: its chunks' activations, its queries, its head gains.

    Attributes:
        name: The task's name (its dataset's ``task``).
        activations: Last-token activations of its K-shot chunks, ``(m_t, L, H, D)``.
        queries: Its zero-shot queries, tokenised once (first answer token scored).
        gains: Attribution gain of each head ``(L, H)`` with the task's own mean.
        terms: What the gains of any other reference need (None: only ``gains`` is known).
        chunk_terms: The first chunks' own query terms, one a query, in chunk order (query q
            is chunk q's query): what simulated private selection votes with (None: not
            simulated).
    """

    name: str
    activations: torch.Tensor
    queries: QuerySet
    gains: torch.Tensor
    terms: AttributionTerms | None = None
    chunk_terms: QueryTerms | None = None

    def gains_against(self, reference: torch.Tensor) -> torch.Tensor:
        """Attribution gain ``(L, H)`` of each head overwritten with ``reference`` ``(L, H, D)``.

        Raises:
            ConfigError: The task was built without its attribution terms.
        """
        if self.terms is None:
            raise ConfigError(
                f"public task {self.name!r} must carry its attribution terms to score heads "
                "against another reference, got none (build it with public_task)."
            )
        return self.terms.gains(reference)

    @property
    def mean(self) -> torch.Tensor:
        """The task's mean chunk activation ``(L, H, D)``."""
        return self.activations.mean(0)


def public_task(
    loaded: LoadedModel,
    dataset: SiteDataset,
    *,
    shots: int,
    max_chunks: int = 60,
    max_queries: int = MAX_PUBLIC_QUERIES,
    seed: int = 0,
    batch_size: int = 4,
) -> PublicTask:
    """Cut ``dataset`` into chunks, run them once, score head gains on its queries.

    Queries are the chunks' own query records (public, labelled), ``max_queries`` at most;
    their attribution terms are kept one a query (``PublicTask.chunk_terms``).

    Raises:
        ConfigError: The dataset holds no chunk of ``shots + 1`` examples.
    """
    chunks = make_chunks(dataset, shots=shots, seed=seed, max_chunks=max_chunks).chunks
    if not chunks:
        raise ConfigError(
            f"public dataset {dataset.task!r} must hold at least {shots + 1} examples, got "
            f"{len(dataset.records)}."
        )
    acts = public_activations(
        loaded, chunks, batch_size=batch_size, instruction=dataset.instruction, progress=False
    )
    records: list[Record] = [chunk.query for chunk in chunks][:max_queries]
    per_query = query_terms(loaded, records, batch_size=batch_size, instruction=dataset.instruction)
    queries = QuerySet.build(
        loaded,
        [zero_shot_prompt(r) for r in records],
        [r.answer for r in records],
        instruction=dataset.instruction,
    )
    terms = per_query.summed()
    return PublicTask(dataset.task, acts, queries, terms.gains(acts.mean(0)), terms, per_query)


def _others(tasks: Sequence[PublicTask], exclude: str | None) -> list[PublicTask]:
    kept = [task for task in tasks if task.name != exclude]
    if len(kept) < 1:
        raise ConfigError("at least one public task must remain, got none.")
    return kept


def domain_centre(
    tasks: Sequence[PublicTask], *, exclude: str | None = None, centred: bool = True
) -> ActivationCentre:
    """The mean of the public tasks' means (each task weighs the same), without ``exclude``.

    ``centred=False`` gives the zero centre: a plain release, scored the same way.
    """
    kept = _others(tasks, exclude)
    mean = torch.stack([task.mean.double() for task in kept]).mean(0)
    return ActivationCentre.from_array(mean.numpy() if centred else np.zeros(mean.shape))


def rank_heads(
    loaded: LoadedModel, tasks: Sequence[PublicTask], *, k: int, exclude: str | None = None
) -> HeadSet:
    """The k heads where the kept tasks' centre most raises their answers, each task alike.

    Each task kept (all but ``exclude``) scores every head by its attribution gain with the
    kept tasks' centre (:func:`domain_centre`, the reference a centred release adds its noisy
    shift to) patched in; its positive gains are scaled to sum to 1 and summed over the tasks.
    With one task the centre is its own mean, so its ranking is its own gains.

    Why the centre, not each task's own mean: a centred release patches the centre plus a
    noisy shift, so the heads are scored with the reference they will be patched around. On
    the pretrained decoder's headline (the other three tasks public, 16 heads) the pooled
    non-private mean of the private chunks answers colour 0.97 in heads ranked so, 0.72 in
    heads ranked by each task's own-mean gain (docs/benchmarks/headline-pretrained.md and
    the run before it).

    Raises:
        ConfigError: A kept task carries no attribution terms (:meth:`PublicTask.gains_against`).
    """
    kept = _others(tasks, exclude)
    # Copied (torch.tensor): the centre's array is read-only.
    centre = torch.tensor(domain_centre(kept).values, dtype=torch.float32)
    total = torch.zeros_like(kept[0].gains)
    for task in kept:
        positive = task.gains_against(centre).clamp(min=0)
        total += positive / max(float(positive.sum()), 1e-12)
    return top_heads(loaded, total, k=k)


def _centred_rows(
    activations: torch.Tensor, heads: HeadSet, centre: ActivationCentre
) -> Float64Array:
    index = heads.to_array()
    rows = activations[:, index[:, 0], index[:, 1]].double().numpy()
    return np.asarray(rows - centre.rows(heads)[None], dtype=np.float64)


def centred_clip_scale(
    tasks: Sequence[PublicTask], heads: HeadSet, centre: ActivationCentre
) -> float:
    """Median, over the tasks' chunks and the heads' layers, of the centred layer norm."""
    layers = heads.row_layers()
    norms = []
    for task in tasks:
        rows = _centred_rows(task.activations, heads, centre)
        for layer in heads.layers:
            norms.extend(np.linalg.norm(rows[:, layers == layer].reshape(len(rows), -1), axis=1))
    return float(np.median(norms))


def centred_mean(
    activations: torch.Tensor, heads: HeadSet, centre: ActivationCentre, clip_norm: float
) -> Float64Array:
    """Mean over chunks of ``clip(a - r)`` per layer (what a centred release sums, no noise)."""
    rows = _centred_rows(activations, heads, centre)
    layers = heads.row_layers()
    clipped = [clip_per_layer(chunk, row_layers=layers, clip_norm=clip_norm) for chunk in rows]
    return np.asarray(np.mean(clipped, axis=0), dtype=np.float64)
