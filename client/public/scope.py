"""What a centred release should carry, chosen on task-agnostic public data alone.

Every public task in turn plays the private one (leave one task out): what a release of it
would do is simulated from public data and public plan numbers only, and the choices that did
best on the held-out tasks are suggested for the real, private task.

1. **Public heads or private selection.** Do heads ranked on the *other* tasks carry the
   held-out one? Its own unclipped mean is patched into the k heads the others rank first and
   into the k heads its own gains rank first; the share of the own-heads gain over zero-shot
   that the others' heads keep, averaged over held-out tasks, is the *transfer*. At or above
   ``min_transfer`` (0.8) the public heads are suggested (no budget on selection); below it,
   private selection among the 2k heads all public tasks rank first (``candidate_heads``),
   where the private data picks the task's own heads. The transfer is a weak predictor of
   which mode releases more: in the headline benchmarks it points to the better mode in about
   half the model-task pairs, each way (docs/benchmarks.md); ``mode`` overrides it.
2. **k and C'.** For each k and factor f, the held-out task's chunks are centred on the other
   tasks' centre, clipped per layer at C' = f x s (s: the others' median centred layer norm),
   averaged, given the planned release's Gaussian (std 2·z·C'·√L / m, z of the planned
   plan in that selection mode) and the centre back, patched into the heads (public mode: the
   others' top k; private mode: the held-out task's own top k, what an accurate private pick
   finds — an optimistic stand-in, stated in the record) and scored on the held-out queries.
   The best k is kept, and within it the smallest f keeping ``keep`` of the best gain over
   the centre alone (a smaller C' adds less noise).

   **In release-first order** (``PlannedRelease.every_head``) the Gaussian covers every
   carried head whatever is kept: s is then the median centred norm of whole layers, each
   chunk is clipped over whole layers, the noise spans every carried layer, and in private
   mode the k heads are picked from each simulated noisy vector by the held-out task's
   attribution gains against it, among every head (as the sites' votes score the released
   vector), instead of the optimistic stand-in. Those gains are computed on the held-out
   queries that score the release (optimistic, as the sites' votes score their own
   examples); no candidate set is suggested.
3. **What more chunks buy** (:func:`held_out_accuracy_by_chunks`): the chosen scope scored the
   same way at other chunk counts, so a consortium sees before spending whether its m is
   enough, and how many more sites or examples would help.

Everything reads public data and public plan numbers (z, m) only: no privacy budget is spent.
The simulated noise comes from ``dpmtv_common.privacy.noise`` and never leaves the process.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch

from client.models import LoadedModel
from client.public.selection import top_heads
from client.public.tasks import (
    MIN_PUBLIC_TASKS,
    PublicTask,
    centred_clip_scale,
    centred_mean,
    domain_centre,
    rank_heads,
)
from dpmtv_common.aliases import Float64Array
from dpmtv_common.centre import ActivationCentre
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadLayout, HeadSet
from dpmtv_common.privacy.noise import NoiseSource, secure_noise

__all__ = [
    "CENTRED_CLIP_FACTORS",
    "HeadsMode",
    "PlannedRelease",
    "ScopeCandidate",
    "ScopeChoice",
    "choose_scope",
    "heads_transfer",
    "held_out_accuracy_by_chunks",
]

CENTRED_CLIP_FACTORS = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Multiples of the public median centred layer norm tried for C'."""


class HeadsMode(StrEnum):
    """How the released heads are picked: fixed public heads, or privately among candidates."""

    PUBLIC = "public"
    PRIVATE = "private"


@dataclass(frozen=True)
class PlannedRelease:
    """What a planned release adds: noise multiplier z over m chunks (public numbers).

    Attributes:
        noise_multiplier: z of the planned plan (``protocol.plan_noise_multiplier``).
        num_chunks: m, the chunks the release will pool.
        draws: Simulated releases a tried (k, C') is scored on.
        every_head: The Gaussian covers every carried head (a release-first plan: the noisy
            vector is released whole, and the kept heads are picked after), so C' bounds
            whole layers and the noise spans every carried layer; else it covers the
            released heads only (select-first).
    """

    noise_multiplier: float
    num_chunks: int
    draws: int = 3
    every_head: bool = False

    def __post_init__(self) -> None:
        if not self.noise_multiplier > 0 or self.num_chunks < 1 or self.draws < 1:
            raise ConfigError(
                "a planned release needs noise_multiplier > 0, num_chunks >= 1 and draws >= 1, "
                f"got {self.noise_multiplier!r}, {self.num_chunks!r}, {self.draws!r}."
            )

    def mean_std(self, clip_norm: float, layers_in_scope: int) -> float:
        """Std a coordinate of the released mean carries: 2·z·C'·√L / m."""
        scale = 2.0 * self.noise_multiplier * clip_norm * math.sqrt(layers_in_scope)
        return scale / self.num_chunks


@dataclass(frozen=True)
class ScopeCandidate:
    """One (k, f) tried: its held-out public accuracy, per task and on average."""

    heads: int
    factor: float
    accuracy: float
    per_task: dict[str, float]


@dataclass(frozen=True)
class ScopeChoice:
    """The suggested heads, k, C' and selection mode of a centred release, and the evidence.

    Attributes:
        mode: Public heads, or private selection among ``candidates``.
        heads: Public mode: the k heads all public tasks rank first (released as they are).
            Private mode: the same ranking's top k (what the noisy picks are scored against).
        candidates: Private mode, select-first: the 2k heads all public tasks rank first;
            else None (release-first private selection picks among every head).
        clip_norm: C' = factor x scale.
        factor: The chosen factor.
        scale: The public median centred layer norm over the Gaussian's scope (factor 1):
            ``heads``, or every carried head when ``every_head``.
        centre: The centre over all public tasks (zeros for a plain release).
        transfer: The share of the held-out own-heads gain the others' heads keep.
        public_only: Held-out accuracy of the centre alone in the others' heads.
        candidates_tried: Every (k, f) tried in the chosen mode.
        every_head: Chosen for a release-first plan (``PlannedRelease.every_head``).
    """

    mode: HeadsMode
    heads: HeadSet
    candidates: HeadSet | None
    clip_norm: float
    factor: float
    scale: float
    centre: ActivationCentre
    transfer: float
    public_only: float
    candidates_tried: tuple[ScopeCandidate, ...]
    every_head: bool = False

    @property
    def k(self) -> int:
        """Heads the release carries."""
        return len(self.heads)

    def as_record(self) -> dict[str, object]:
        """JSON-ready evidence for a heads file."""
        return {
            "scope_rule": "leave one public task out under the planned noise",
            "heads_mode": self.mode.value,
            "release_order": "release-first" if self.every_head else "select-first",
            "heads_transfer": self.transfer,
            "centred_clip_factor": self.factor,
            "centred_clip_scale": self.scale,
            "held_out_public_only": self.public_only,
            "held_out_accuracy": {
                f"k={c.heads} f={c.factor:g}": c.accuracy for c in self.candidates_tried
            },
        }


def heads_transfer(loaded: LoadedModel, tasks: Sequence[PublicTask], *, k: int) -> float:
    """Mean share of each held-out task's own-heads gain that the others' top k keep."""
    shares = []
    for held in tasks:
        mean = held.mean
        zero = held.queries.accuracy(loaded)
        own = rank_heads(loaded, [held], k=k)
        others = rank_heads(loaded, tasks, k=k, exclude=held.name)
        own_gain = held.queries.accuracy(loaded, (own, _rows(mean, own))) - zero
        kept = held.queries.accuracy(loaded, (others, _rows(mean, others))) - zero
        shares.append(1.0 if own_gain <= 0 else max(0.0, min(kept / own_gain, 1.0)))
    return statistics.mean(shares)


def _rows(mean: torch.Tensor, heads: HeadSet) -> torch.Tensor:
    index = torch.as_tensor(heads.to_array())
    return mean[index[:, 0], index[:, 1]]


def _check(tasks: Sequence[PublicTask], ks: Sequence[int], factors: Sequence[float]) -> None:
    names = [task.name for task in tasks]
    if len(tasks) < MIN_PUBLIC_TASKS or len(set(names)) != len(names):
        raise ConfigError(
            f"task-agnostic choices need at least {MIN_PUBLIC_TASKS} public tasks of distinct "
            f"names, got {names!r}."
        )
    if not ks or not factors or min(factors) <= 0 or min(ks) < 1:
        raise ConfigError(
            f"ks and factors must be non-empty and positive, got {list(ks)!r} and "
            f"{list(factors)!r}."
        )


@dataclass(frozen=True)
class _Trial:
    """Everything one held-out task's simulated releases share.

    ``noised``: the Gaussian's scope (``heads``, or every carried head in release-first
    order). ``heads`` None: release-first private selection, whose k heads are picked from
    each noisy vector by the held-out task's attribution gains against it (as the sites'
    votes score the noisy vector), among every head.
    """

    held: PublicTask
    heads: HeadSet | None
    noised: HeadSet
    k: int
    centre: ActivationCentre
    scale: float

    def accuracy(
        self, loaded: LoadedModel, factor: float, planned: PlannedRelease, noise: NoiseSource
    ) -> float:
        clip_norm = factor * self.scale
        mean = centred_mean(self.held.activations, self.noised, self.centre, clip_norm)
        std = planned.mean_std(clip_norm, self.noised.num_layers_in_scope)
        back = self.centre.rows(self.noised)
        scores = []
        for _ in range(planned.draws):
            values = noise.add_gaussian(mean, noise_std=std) + back
            heads = self._picked(loaded, values) if self.heads is None else self.heads
            rows = values[self.noised.rows_of(heads)]
            scores.append(self.held.queries.accuracy(loaded, (heads, rows)))
        return statistics.mean(scores)

    def _picked(self, loaded: LoadedModel, values: Float64Array) -> HeadSet:
        # Every carried head was noised (release-first): place the rows as the release does.
        dense = _layout(loaded).dense_rows(values)
        return top_heads(loaded, self.held.gains_against(torch.as_tensor(dense)), k=self.k)


def _trial(
    loaded: LoadedModel, tasks: Sequence[PublicTask], held: PublicTask, k: int, *,
    mode: HeadsMode, centred: bool, every_head: bool,
) -> _Trial:  # fmt: skip
    centre = domain_centre(tasks, exclude=held.name, centred=centred)
    heads: HeadSet | None
    if mode is HeadsMode.PUBLIC:
        heads = rank_heads(loaded, tasks, k=k, exclude=held.name)
    elif every_head:
        heads = None  # picked from each noisy vector (class docstring)
    else:  # an accurate private pick finds the task's own heads (optimistic; module doc)
        heads = rank_heads(loaded, [held], k=k)
    noised = _carried(loaded) if every_head or heads is None else heads
    others = [task for task in tasks if task.name != held.name]
    return _Trial(held, heads, noised, k, centre, centred_clip_scale(others, noised, centre))


def _layout(loaded: LoadedModel) -> HeadLayout:
    return loaded.adapter.head_shape(loaded.model).layout()


def _carried(loaded: LoadedModel) -> HeadSet:
    return _layout(loaded).all_heads()


def choose_scope(
    loaded: LoadedModel,
    tasks: Sequence[PublicTask],
    *,
    planned: dict[HeadsMode, PlannedRelease],
    ks: Sequence[int],
    factors: Sequence[float] = CENTRED_CLIP_FACTORS,
    keep: float = 0.9,
    min_transfer: float = 0.8,
    mode: HeadsMode | None = None,
    centred: bool = True,
    noise: NoiseSource | None = None,
    progress: Callable[[str], None] | None = None,
) -> ScopeChoice:
    """Leave-one-task-out choice of the heads mode, k and C' (module docstring).

    Args:
        planned: The planned release in each heads mode (its z differs: private selection
            spends part of ε on the picks).
        mode: Force a heads mode instead of the transfer rule.
        centred: False makes the same choice for a plain release (zero centre).

    Raises:
        ConfigError: Fewer than two public tasks, two with one name, no k or factor, or no
            planned release for the chosen mode.
    """
    _check(tasks, ks, factors)
    transfer = heads_transfer(loaded, tasks, k=max(ks))
    chosen = mode or (HeadsMode.PUBLIC if transfer >= min_transfer else HeadsMode.PRIVATE)
    if chosen not in planned:
        raise ConfigError(f"planned must hold the {chosen.value!r} release, got {list(planned)}.")
    if progress is not None:
        progress(f"heads transfer across public tasks {transfer:.2f}: {chosen.value} heads")
    source = noise if noise is not None else secure_noise()
    tried, floors = [], []
    for k in sorted(ks):
        every_head = planned[chosen].every_head
        trials = [
            _trial(loaded, tasks, h, k, mode=chosen, centred=centred, every_head=every_head)
            for h in tasks
        ]
        floors.append(statistics.mean(_centre_alone(loaded, tasks, t) for t in trials))
        for factor in sorted(factors):
            scores = {
                t.held.name: t.accuracy(loaded, factor, planned[chosen], source) for t in trials
            }
            tried.append(ScopeCandidate(k, factor, statistics.mean(scores.values()), scores))
            if progress is not None:
                progress(f"k = {k}, C' = {factor:g} x scale: held-out {tried[-1].accuracy:.2f}")
    return _suggest(
        loaded, tasks, tried, min(floors), keep, chosen, transfer, centred,
        every_head=planned[chosen].every_head,
    )  # fmt: skip


def _centre_alone(loaded: LoadedModel, tasks: Sequence[PublicTask], trial: _Trial) -> float:
    """Held-out accuracy of the centre alone in the trial's heads (the public-only floor)."""
    heads = trial.heads
    if heads is None:  # picked per draw: the public ranking's top k stands in
        heads = rank_heads(loaded, tasks, k=trial.k, exclude=trial.held.name)
    return trial.held.queries.accuracy(loaded, (heads, trial.centre.rows(heads)))


def _suggest(
    loaded: LoadedModel, tasks: Sequence[PublicTask], tried: list[ScopeCandidate],
    floor: float, keep: float, mode: HeadsMode, transfer: float, centred: bool, *,
    every_head: bool,
) -> ScopeChoice:  # fmt: skip
    """The best k; within it the smallest factor keeping ``keep`` of the best gain."""
    best = max(tried, key=lambda c: c.accuracy)
    near = floor + keep * (best.accuracy - floor)
    chosen = min(
        (c for c in tried if c.heads == best.heads and (c.accuracy >= near or c is best)),
        key=lambda c: c.factor,
    )
    heads = rank_heads(loaded, tasks, k=chosen.heads)
    candidates = None
    if mode is HeadsMode.PRIVATE and not every_head:
        carried = len(_carried(loaded))
        candidates = rank_heads(loaded, tasks, k=min(2 * chosen.heads, carried))
    centre = domain_centre(tasks, centred=centred)
    scale = centred_clip_scale(tasks, _carried(loaded) if every_head else heads, centre)
    return ScopeChoice(
        mode=mode,
        heads=heads,
        candidates=candidates,
        clip_norm=chosen.factor * scale,
        factor=chosen.factor,
        scale=scale,
        centre=centre,
        transfer=transfer,
        public_only=floor,
        candidates_tried=tuple(tried),
        every_head=every_head,
    )


def held_out_accuracy_by_chunks(
    loaded: LoadedModel,
    tasks: Sequence[PublicTask],
    choice: ScopeChoice,
    *,
    planned: PlannedRelease,
    chunk_counts: Sequence[int],
    centred: bool = True,
    noise: NoiseSource | None = None,
) -> dict[int, float]:
    """Mean held-out public accuracy of ``choice`` (its k, its factor) at each m.

    What more chunks buy, from public data alone: the same leave-one-task-out simulation as
    :func:`choose_scope`, with the planned noise at ``m`` chunks instead of the plan's.
    """
    source = noise if noise is not None else secure_noise()
    trials = [
        _trial(loaded, tasks, h, choice.k, mode=choice.mode, centred=centred,
               every_head=planned.every_head)
        for h in tasks
    ]  # fmt: skip
    out = {}
    for count in chunk_counts:
        at_count = PlannedRelease(planned.noise_multiplier, count, planned.draws)
        out[count] = statistics.mean(
            t.accuracy(loaded, choice.factor, at_count, source) for t in trials
        )
    return out
