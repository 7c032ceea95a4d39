"""What a centred release should carry, chosen on task-agnostic public data alone.

Every public task in turn plays the private one (leave one task out): what a release of it
would do is simulated from public data and public plan numbers only, and the choices that did
best on the held-out tasks are suggested for the real, private task.

1. **Options.** Each planned option — public heads, or private selection, in a release
   order — is simulated as the release would run it. Public heads are the k heads the
   *other* tasks rank first. Private selection picks the held-out task's heads from its own
   chunks' votes under the planned Gumbel noise (:mod:`client.public.picks`): select-first,
   by shift votes among the 2k heads the others rank first (the ``candidate_heads`` the
   release is given); release-first, by attribution votes against each simulated noisy
   vector of those candidates, among them, or (a plan without candidates) against a noisy
   vector of every carried head, among them all. The option whose chosen (k, C') does best
   on the held-out tasks is suggested, unless a private option keeps ``keep`` of its gain
   (:func:`best_option` says why). The *transfer* — the share of each held-out task's
   own-heads gain, its unclipped mean patched, that the others' top k keep — is reported
   beside it; it no longer decides (in the headline benchmarks it pointed to
   the better mode in about half the model-task pairs, each way).
2. **k and C'.** For each option, k and factor f, the held-out task's chunks are centred on
   the other tasks' centre, clipped per layer at C' = f x s (s: the others' median centred
   layer norm over the scope C' bounds: the public heads, the candidates, or every carried
   head), averaged, given the planned release's Gaussian (std 2·z·C'·√L / m, z of the
   planned option) over the scope it covers, and the centre back, patched into the heads
   and scored on the held-out queries. Among the (k, f) keeping ``keep`` of the best gain
   over the centre alone, the largest k is kept (the best, for private picks among every
   head; :func:`_suggest` says why), and within it the smallest f (a smaller C' adds less
   noise).

   **In release-first order** (``PlannedRelease.every_head``) the Gaussian covers more than
   is kept: the candidates (private selection: every pick is among them), or every carried
   head (public heads, where nothing is picked after); s is then the median centred norm of
   those heads' layers, and the noise spans every layer they lie in.

   **Private picks are scored on queries that did not vote** (cross-fitting): a release's
   votes come from the sites' examples and its test queries are others, so the held-out
   task's chunks are split in two (even and odd positions); the heads one half's chunks
   vote for are scored on the other half's queries, and the two halves' scores are pooled.
   Attribution votes read their queries' answers: scored on the queries that voted, they
   would fit those answers and flatter release-first order (on the embedded models'
   headlines cross-fitting lowered its predictions by 0.02-0.05 on average; the larger gaps
   left between a prediction and the test come from the held-out tasks differing from the
   private one, not from the votes).
3. **What more chunks buy** (:func:`held_out_accuracy_by_chunks`): the chosen scope scored the
   same way at other chunk counts, so a consortium sees before spending whether its m is
   enough, and how many more sites or examples would help.

Everything reads public data and public plan numbers (z, m) only: no privacy budget is spent.
The simulated noise comes from ``dpmtv_common.privacy.noise`` and never leaves the process.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

import torch

from client.models import LoadedModel
from client.public.picks import attribution_votes, chunk_terms_of, noisy_pick, shift_votes
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
    "COMPARED_OPTIONS",
    "ComparedOption",
    "HeadsMode",
    "PlannedRelease",
    "ScopeCandidate",
    "ScopeChoice",
    "best_option",
    "choose_each",
    "choose_scope",
    "compared_options",
    "heads_transfer",
    "held_out_accuracy_by_chunks",
    "option_name",
    "query_halves",
]

CENTRED_CLIP_FACTORS = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Multiples of the public median centred layer norm tried for C'."""


class HeadsMode(StrEnum):
    """How the released heads are picked: fixed public heads, or privately among candidates."""

    PUBLIC = "public"
    PRIVATE = "private"


class ComparedOption(NamedTuple):
    """One release option a choice simulates.

    ``among_every_head``: private selection in release-first order among every carried head
    (a plan without candidate heads: the Gaussian covers them all, each chunk votes among
    them all) instead of among the 2k public candidates.
    """

    mode: HeadsMode
    release_first: bool
    among_every_head: bool = False


COMPARED_OPTIONS = (
    ComparedOption(HeadsMode.PUBLIC, False),
    ComparedOption(HeadsMode.PRIVATE, False),
    ComparedOption(HeadsMode.PRIVATE, True),
    ComparedOption(HeadsMode.PRIVATE, True, among_every_head=True),
)
"""Options compared by default: public heads select-first (release-first only spreads their
noise over every layer), private selection select-first, and release-first among the public
candidates or among every carried head. The candidates carry less noise (fewer layers); every
head lets the picks reach heads the public tasks do not rank (a task unlike them, such as one
whose sites each hold few of its answers, may need those)."""


def compared_options(release_first: bool | None) -> tuple[ComparedOption, ...]:
    """The options to compare: the default, or those of one release order."""
    if release_first is None:
        return COMPARED_OPTIONS
    both = tuple(ComparedOption(mode, release_first) for mode in HeadsMode)
    if not release_first:
        return both
    return (*both, ComparedOption(HeadsMode.PRIVATE, True, among_every_head=True))


def _order_name(release_first: bool) -> str:
    return "release-first" if release_first else "select-first"


def option_name(mode: HeadsMode, release_first: bool, among_every_head: bool = False) -> str:
    """How an option is named in records and progress: "MODE heads, ORDER[ among every head]"."""
    among = " among every head" if among_every_head else ""
    return f"{mode.value} heads, {_order_name(release_first)}{among}"


@dataclass(frozen=True)
class PlannedRelease:
    """What a planned release adds: noise multiplier z over m chunks (public numbers).

    Attributes:
        noise_multiplier: z of the planned plan (``protocol.plan_noise_multiplier``).
        num_chunks: m, the chunks the release will pool.
        draws: Simulated releases a tried (k, C') is scored on, on each held-out task. The
            default 8: with 3, runs of the same public data picked C' a factor apart (4x and
            6x on the pretrained decoder's colour task at 30 sites), a choice worth 0.15 on
            that task's test accuracy; the simulation's time grows with it.
        every_head: A release-first plan: the noisy vector is released over more heads than
            are kept, and the kept heads are picked after. Its Gaussian covers the
            candidates (private selection) or every carried head (public heads), so C'
            bounds those heads' layers; else (select-first) it covers the released heads.
        among_every_head: Private selection released first among every carried head (a plan
            without candidate heads): the Gaussian covers every carried head and each chunk
            votes among them all. Needs ``every_head``.
        gumbel_scale: β of the planned private selection's Gumbel top-k (its calibration's
            ``gumbel().gumbel_scale``); None for public heads, which pick nothing privately.
        top_r: Heads each chunk votes for (the plan's ``score_top_r``); None: as many as
            the heads kept, the release's default.
    """

    noise_multiplier: float
    num_chunks: int
    draws: int = 8
    every_head: bool = False
    gumbel_scale: float | None = None
    top_r: int | None = None
    among_every_head: bool = False

    def __post_init__(self) -> None:
        if not self.noise_multiplier > 0 or self.num_chunks < 1 or self.draws < 1:
            raise ConfigError(
                "a planned release needs noise_multiplier > 0, num_chunks >= 1 and draws >= 1, "
                f"got {self.noise_multiplier!r}, {self.num_chunks!r}, {self.draws!r}."
            )
        if self.gumbel_scale is not None and not self.gumbel_scale > 0:
            raise ConfigError(f"gumbel_scale must be > 0 or None, got {self.gumbel_scale!r}.")
        if self.top_r is not None and self.top_r < 1:
            raise ConfigError(f"top_r must be >= 1 or None, got {self.top_r!r}.")
        if self.among_every_head and not self.every_head:
            raise ConfigError(
                "among_every_head plans picks after a release of every carried head: it needs "
                "every_head (release-first order), got every_head=False."
            )

    @property
    def order(self) -> str:
        """The release order planned: ``release-first`` or ``select-first``."""
        return _order_name(self.every_head)

    def option(self, mode: HeadsMode) -> str:
        """The option this release plans for ``mode``, named as ``option_name`` does."""
        return option_name(mode, self.every_head, self.among_every_head)

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
        candidates: Private mode: the 2k heads all public tasks rank first (the picks are
            among them, in either order); None for public heads, and for private selection
            released first among every carried head (``among_every_head``).
        clip_norm: C' = factor x scale.
        factor: The chosen factor.
        scale: The public median centred layer norm over the scope C' bounds (factor 1):
            ``heads``, the ``candidates`` (private selection: the picks are among them, and
            a release-first Gaussian covers them), or every carried head for public heads
            released first.
        centre: The centre over all public tasks (zeros for a plain release).
        transfer: The share of the held-out own-heads gain the others' heads keep (shown:
            the options' held-out accuracies decide).
        public_only: Held-out accuracy of the centre alone in the others' heads.
        candidates_tried: Every (k, f) tried in the chosen option.
        every_head: Chosen for a release-first plan (``PlannedRelease.every_head``).
        among_every_head: Chosen for private picks among every carried head, released first
            (``PlannedRelease.among_every_head``): the plan names no candidates.
        held_out: Mean held-out accuracy of the chosen (k, f).
        options_tried: Each option simulated ("MODE heads, ORDER") and its ``held_out``.
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
    among_every_head: bool = False
    held_out: float = 0.0
    options_tried: tuple[tuple[str, float], ...] = ()

    @property
    def k(self) -> int:
        """Heads the release carries."""
        return len(self.heads)

    @property
    def order(self) -> str:
        """The release order this choice was made for."""
        return _order_name(self.every_head)

    @property
    def option(self) -> str:
        """The option chosen, as ``options_tried`` names it (``option_name``)."""
        return option_name(self.mode, self.every_head, self.among_every_head)

    def _picks_among(self) -> str | None:
        if self.mode is HeadsMode.PUBLIC:
            return None
        return "every carried head" if self.among_every_head else "the candidate heads"

    def as_record(self) -> dict[str, object]:
        """JSON-ready evidence for a heads file."""
        return {
            "scope_rule": "leave one public task out under the planned noise",
            "heads_mode": self.mode.value,
            "release_order": self.order,
            "private_picks_among": self._picks_among(),
            "heads_transfer": self.transfer,
            "centred_clip_factor": self.factor,
            "centred_clip_scale": self.scale,
            "held_out_public_only": self.public_only,
            "held_out_accuracy": {
                f"k={c.heads} f={c.factor:g}": c.accuracy for c in self.candidates_tried
            },
            "held_out_chosen": self.held_out,
            "held_out_by_option": dict(self.options_tried),
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

    ``heads``: the public heads released, or None for private selection, whose k heads are
    picked each draw as the release would (:mod:`client.public.picks`). ``noised``: the
    Gaussian's scope, fixed (``heads``; in release-first order every carried head for public
    heads, the candidates for private selection), or None when it is the heads picked first
    (select-first private selection).
    ``candidates``: the dense slots a private pick chooses among. ``scale``: the others'
    median centred layer norm over the scope C' will bound (the candidates' layers when the
    scope is picked per draw).
    """

    held: PublicTask
    heads: HeadSet | None
    noised: HeadSet | None
    k: int
    centre: ActivationCentre
    scale: float
    layout: HeadLayout
    candidates: tuple[int, ...] = ()

    def accuracy(
        self, loaded: LoadedModel, factor: float, planned: PlannedRelease, noise: NoiseSource
    ) -> float:
        clip_norm = factor * self.scale
        fixed = None if self.noised is None else self._noisy_scope(self.noised, clip_norm, planned)
        scores = []
        for _ in range(planned.draws):
            if self.heads is not None:  # public heads: picked on the other tasks' data
                mean, std, back = fixed  # type: ignore[misc]
                values = noise.add_gaussian(mean, noise_std=std) + back
                rows = values[self.noised.rows_of(self.heads)]  # type: ignore[union-attr]
                scores.append(self.held.queries.accuracy(loaded, (self.heads, rows)))
            else:
                scores.append(self._cross_fitted(loaded, clip_norm, planned, noise, fixed))
        return statistics.mean(scores)

    def _cross_fitted(
        self,
        loaded: LoadedModel,
        clip_norm: float,
        planned: PlannedRelease,
        noise: NoiseSource,
        fixed: tuple[Float64Array, float, Float64Array] | None,
    ) -> float:
        """One draw of private selection, each half's picks scored on the other half's queries."""
        values = None
        if fixed is not None:  # release-first: one noisy vector a release, whoever votes
            mean, std, back = fixed
            values = noise.add_gaussian(mean, noise_std=std) + back
        votes = self._votes(planned, values)  # every query's, once; each half keeps its own
        hits = total = 0
        for voters, scored in query_halves(len(chunk_terms_of(self.held))):
            heads = self._pick(votes[voters], planned, noise)
            if values is None:  # select-first: pick, then noise the picks
                mean, std, back = self._noisy_scope(heads, clip_norm, planned)
                rows = noise.add_gaussian(mean, noise_std=std) + back
            else:
                rows = values[self.noised.rows_of(heads)]  # type: ignore[union-attr]
            guesses, answers = self.held.queries.predictions(loaded, (heads, rows))
            hits += int((guesses == answers)[scored].sum())
            total += len(scored)
        return hits / total

    def _noisy_scope(
        self, scope: HeadSet, clip_norm: float, planned: PlannedRelease
    ) -> tuple[Float64Array, float, Float64Array]:
        """The clipped centred mean over ``scope``, its Gaussian's std, and the centre rows."""
        mean = centred_mean(self.held.activations, scope, self.centre, clip_norm)
        std = planned.mean_std(clip_norm, scope.num_layers_in_scope)
        return mean, std, self.centre.rows(scope)

    def _pick(self, votes: Float64Array, planned: PlannedRelease, noise: NoiseSource) -> HeadSet:
        return noisy_pick(
            votes, self.layout, candidates=self.candidates, k=self.k,
            num_chunks=planned.num_chunks, gumbel_scale=_gumbel_scale(planned), noise=noise,
        )  # fmt: skip

    def _votes(self, planned: PlannedRelease, values: Float64Array | None) -> Float64Array:
        """Each held-out query's chunk votes ``(Q, L * H)``, by shift or against ``values``.

        Select-first (``values`` None) votes by shift; release-first by attribution against
        the noisy vector ``values``. Either way among the candidates only, as a site votes.
        """
        top_r = planned.top_r or self.k
        if values is None:
            return shift_votes(self.held, self.candidates, top_r=top_r)
        # The candidates were noised (release-first): place their rows as the release does.
        reference = torch.as_tensor(self.layout.dense_rows(values, heads=self.noised))
        return attribution_votes(self.held, reference, self.candidates, top_r=top_r)


def query_halves(count: int) -> tuple[tuple[list[int], list[int]], ...]:
    """(voters, scored) query positions: the even half votes, the odd half is scored; swapped.

    Raises:
        ConfigError: Fewer than two queries: no half would be scored on queries that did not
            vote.
    """
    if count < 2:
        raise ConfigError(
            "a held-out public task must have at least two chunks to score private picks on "
            f"queries that did not vote, got {count}; give each public task more examples."
        )
    even, odd = list(range(0, count, 2)), list(range(1, count, 2))
    return ((even, odd), (odd, even))


def _gumbel_scale(planned: PlannedRelease) -> float:
    if planned.gumbel_scale is None:
        raise ConfigError(
            "a planned private selection needs its Gumbel scale (PlannedRelease.gumbel_scale, "
            "from the planned calibration), got None."
        )
    return planned.gumbel_scale


def _trial(
    loaded: LoadedModel, tasks: Sequence[PublicTask], held: PublicTask, k: int, *,
    mode: HeadsMode, centred: bool, every_head: bool, among_every_head: bool = False,
) -> _Trial:  # fmt: skip
    layout = _layout(loaded)
    centre = domain_centre(tasks, exclude=held.name, centred=centred)
    others = [task for task in tasks if task.name != held.name]
    if mode is HeadsMode.PUBLIC:
        heads = rank_heads(loaded, tasks, k=k, exclude=held.name)
        noised = layout.all_heads() if every_head else heads
        return _Trial(held, heads, noised, k, centre, centred_clip_scale(others, noised, centre),
                      layout)  # fmt: skip
    # Among the 2k heads the others rank first, the candidate set a release is given; or,
    # released first without candidates, among every carried head.
    if among_every_head:
        pool = layout.all_heads()
    else:
        pool = rank_heads(loaded, tasks, k=min(2 * k, len(layout.candidates())), exclude=held.name)
    scale = centred_clip_scale(others, pool, centre)
    slots = tuple(layout.dense_indices(pool))
    # Release-first: the Gaussian covers the candidates, picked among from each noisy vector;
    # select-first: the picks are noised.
    return _Trial(held, None, pool if every_head else None, k, centre, scale, layout, slots)


def _layout(loaded: LoadedModel) -> HeadLayout:
    return loaded.adapter.head_shape(loaded.model).layout()


def _carried(loaded: LoadedModel) -> HeadSet:
    return _layout(loaded).all_heads()


ReleaseOption = tuple[HeadsMode, PlannedRelease]
"""A heads mode and the release planned for it (its order, z, m and Gumbel scale)."""


def _options(
    planned: Mapping[HeadsMode, PlannedRelease] | Sequence[ReleaseOption], mode: HeadsMode | None
) -> list[ReleaseOption]:
    given = list(planned.items()) if isinstance(planned, Mapping) else list(planned)
    kept = [(m, p) for m, p in given if mode is None or m is mode]
    if not kept:
        wanted = "a release" if mode is None else f"the {mode.value!r} release"
        raise ConfigError(f"planned must hold {wanted}, got {[p.option(m) for m, p in given]}.")
    return kept


def choose_scope(
    loaded: LoadedModel,
    tasks: Sequence[PublicTask],
    *,
    planned: Mapping[HeadsMode, PlannedRelease] | Sequence[ReleaseOption],
    ks: Sequence[int],
    factors: Sequence[float] = CENTRED_CLIP_FACTORS,
    keep: float = 0.9,
    mode: HeadsMode | None = None,
    centred: bool = True,
    noise: NoiseSource | None = None,
    progress: Callable[[str], None] | None = None,
) -> ScopeChoice:
    """Leave-one-task-out choice of the heads mode, release order, k and C' (module docstring).

    Every planned option (a heads mode in one release order) is simulated on the held-out
    public tasks (:func:`choose_each`); the option whose chosen (k, C') scores best is
    suggested (:func:`best_option`).

    Args:
        planned: The planned release of each option: a mapping of one release per heads mode,
            or (mode, release) pairs, e.g. private selection in both orders. Their z differ:
            private selection spends part of ε on the picks.
        mode: Only the options of this heads mode.
        centred: False makes the same choice for a plain release (zero centre).

    Raises:
        ConfigError: Fewer than two public tasks, two with one name, no k or factor, no
            planned option of ``mode``, or a private option without its Gumbel scale.
    """
    return best_option(
        choose_each(loaded, tasks, planned=planned, ks=ks, factors=factors, keep=keep,
                    mode=mode, centred=centred, noise=noise, progress=progress),
        keep=keep,
    )  # fmt: skip


def best_option(choices: Sequence[ScopeChoice], *, keep: float = 0.9) -> ScopeChoice:
    """The best held-out option, or private selection where it keeps ``keep`` of its gain.

    Held-out accuracies a few hundredths apart do not tell options apart (each is a mean over
    a few public tasks and draws), and the options fail differently when the private task is
    unlike the public ones: public heads are fixed by the other tasks, so a task whose heads
    lie elsewhere loses them all, while private picks follow the task's own votes. In each of
    two runs of the headline benchmarks public heads' test accuracy fell more than 0.3 below
    their held-out prediction in 12 of 30 cells, private options' in 8-9 of 90. So where the
    best private option keeps ``keep`` of the best option's gain over the centre alone, it
    is suggested; where no option gains anything, public heads are (nothing spent on picks).
    """
    best = max(choices, key=lambda c: (c.held_out, c.mode is HeadsMode.PUBLIC))
    private = [c for c in choices if c.mode is HeadsMode.PRIVATE]
    if best.held_out <= best.public_only or not private:
        return best
    runner = max(private, key=lambda c: c.held_out)
    return runner if runner.held_out >= _near(best.held_out, best.public_only, keep) else best


def _near(best: float, floor: float, keep: float) -> float:
    """The score keeping ``keep`` of the best's gain over ``floor``: at or above it is a tie."""
    return floor + keep * (best - floor)


def choose_each(
    loaded: LoadedModel,
    tasks: Sequence[PublicTask],
    *,
    planned: Mapping[HeadsMode, PlannedRelease] | Sequence[ReleaseOption],
    ks: Sequence[int],
    factors: Sequence[float] = CENTRED_CLIP_FACTORS,
    keep: float = 0.9,
    mode: HeadsMode | None = None,
    centred: bool = True,
    noise: NoiseSource | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[ScopeChoice]:
    """Each planned option's own choice of k and C', in ``planned``'s order.

    Every choice records every option's held-out accuracy (``options_tried``). Arguments
    and errors as :func:`choose_scope`.
    """
    _check(tasks, ks, factors)
    options = _options(planned, mode)
    for option_mode, option in options:  # fail before any simulation runs
        if option_mode is HeadsMode.PRIVATE:
            _gumbel_scale(option)
        elif option.among_every_head:
            raise ConfigError(
                "among_every_head plans private picks; public heads pick nothing, got it for "
                f"{option.option(option_mode)!r}."
            )
    transfer = heads_transfer(loaded, tasks, k=max(ks))
    if progress is not None:
        progress(f"heads transfer across public tasks {transfer:.2f}")
    source = noise if noise is not None else secure_noise()
    choices = []
    for option_mode, option in options:
        name = option.option(option_mode)
        say = None if progress is None else (lambda line, n=name: progress(f"{n}: {line}"))
        choices.append(
            _choose_in(loaded, tasks, option_mode, option, ks=ks, factors=factors, keep=keep,
                       transfer=transfer, centred=centred, noise=source, progress=say)
        )  # fmt: skip
    tried = tuple((c.option, c.held_out) for c in choices)
    return [dataclasses.replace(c, options_tried=tried) for c in choices]


def _choose_in(
    loaded: LoadedModel, tasks: Sequence[PublicTask], mode: HeadsMode, planned: PlannedRelease,
    *, ks: Sequence[int], factors: Sequence[float], keep: float, transfer: float,
    centred: bool, noise: NoiseSource, progress: Callable[[str], None] | None,
) -> ScopeChoice:  # fmt: skip
    """One option's k and C', by its held-out public accuracy."""
    tried, floors = [], []
    for k in sorted(ks):
        trials = [
            _trial(loaded, tasks, h, k, mode=mode, centred=centred, every_head=planned.every_head,
                   among_every_head=planned.among_every_head)
            for h in tasks
        ]  # fmt: skip
        floors.append(statistics.mean(_centre_alone(loaded, tasks, t) for t in trials))
        for factor in sorted(factors):
            scores = {t.held.name: t.accuracy(loaded, factor, planned, noise) for t in trials}
            tried.append(ScopeCandidate(k, factor, statistics.mean(scores.values()), scores))
            if progress is not None:
                progress(f"k = {k}, C' = {factor:g} x scale: held-out {tried[-1].accuracy:.2f}")
    return _suggest(
        loaded, tasks, tried, min(floors), keep, mode, transfer, centred,
        every_head=planned.every_head, among_every_head=planned.among_every_head,
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
    every_head: bool, among_every_head: bool,
) -> ScopeChoice:  # fmt: skip
    """Among the (k, f) keeping ``keep`` of the best gain, the largest k, then the smallest f.

    A smaller f adds less noise. Where the public ranking fixes the heads a release can
    reach (public heads; private picks among the 2k candidates), a larger k is the safer of
    two near-equal scores: too few can miss the private task's heads altogether (on the
    pretrained decoder the pooled position mean answers 0.03 in the public top 8 heads and
    1.00 in the top 16), while each head more costs a little noise, which the held-out score
    counts. Private picks among every carried head reach any head whatever k, so there the
    best k is kept.
    """
    best = max(tried, key=lambda c: c.accuracy)
    near = _near(best.accuracy, floor, keep)
    kept = [c for c in tried if c.accuracy >= near or c is best]
    widest = best.heads if among_every_head else max(c.heads for c in kept)
    chosen = min((c for c in kept if c.heads == widest), key=lambda c: c.factor)
    heads = rank_heads(loaded, tasks, k=chosen.heads)
    candidates = None
    if mode is HeadsMode.PRIVATE and not among_every_head:
        carried = len(_carried(loaded))
        candidates = rank_heads(loaded, tasks, k=min(2 * chosen.heads, carried))
    centre = domain_centre(tasks, centred=centred)
    # C' bounds the scope the trials scaled it to: the candidates, every head (public heads
    # or private picks released first without candidates), or the heads.
    scope = candidates or (_carried(loaded) if every_head else heads)
    scale = centred_clip_scale(tasks, scope, centre)
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
        among_every_head=among_every_head,
        held_out=chosen.accuracy,
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
               every_head=planned.every_head, among_every_head=planned.among_every_head)
        for h in tasks
    ]  # fmt: skip
    out = {}
    for count in chunk_counts:
        at_count = dataclasses.replace(planned, num_chunks=count)
        out[count] = statistics.mean(
            t.accuracy(loaded, choice.factor, at_count, source) for t in trials
        )
    return out
