"""Empirical privacy audit of a release configuration, with a canary in the production path.

How this connects: a site admin names a release configuration (a :class:`protocol.ReleasePlan`)
and its own data. The audit builds a neighbouring pair — the data as it is, and the same data
with ONE record replaced by a canary record — cuts both with the same secret chunk shuffle
(``client.chunking``), and computes each clipped sum once with the production extraction code
(:class:`client.release.LocalSums`). It then runs the production Gaussian release N times on
each sum with the production noise source (:func:`protocol.run_release`; for private
selection, the plan's own calibrated Gaussian over all heads, which is what ``release-first``
privatises) and asks how well the outputs tell the two datasets apart:

* **Gaussian-DP μ.** Every output is projected on the canary's direction Δ (the difference of
  the two noise-free sums, known to the auditor). For a Gaussian mechanism the projections are
  N(a, s²) without and N(a + ‖Δ‖, s²) with the canary, so μ̂ = (mean₁ − mean₀)/s estimates
  ‖Δ‖/σ. The plan claims μ ≤ Δ₂/σ for ANY neighbouring pair (Δ₂ = 2·C·√L_scope); the audit
  reports μ̂ with its confidence interval beside that claim and beside ‖Δ‖/σ, what this canary
  should show if the noise is as calibrated (Dong, Roth & Su 2019, Gaussian DP).
* **ε lower bounds.** From μ̂'s lower confidence limit, the ε that a μ-GDP mechanism has at the
  plan's δ (parametric: assumes Gaussian outputs). And a non-parametric one: a threshold on the
  projection, chosen on the first half of the runs, is applied to the second half; Clopper-
  Pearson upper limits on its false-positive and false-negative rates give
  ε ≥ log((1 − δ − FNR)/FPR) with the stated confidence (Jagielski, Ullman & Oprea 2020).
* **Power.** The same pair, released with σ halved and with the noise off (planted bugs in a
  wrapper noise source, never used by a release), shows what the audit can detect.

What it cannot show: an audit finds violations, it never proves privacy. One canary gives a
lower bound for that pair only (‖Δ‖/Δ₂ says how close the pair is to the worst case); the
private head selection (Gumbel top-k) and the accountant's composition are not audited here;
and the report is computed from the private data without noise (‖Δ‖, the sums' projections):
it is for the site's own eyes, is not a release, and is never written to the ledger.

Size: about 500 lines, over the house's 400. The pure statistics (``epsilon_of_gdp``,
``clopper_pearson_epsilon``, the μ estimate) belong in ``dpmtv_common.privacy`` (numpy and
scipy only); they stay here until that move is made by its owner.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps
from scipy import optimize, stats

from client.chunking import Chunk, make_chunks
from client.data import Record, SiteDataset
from client.extraction import chunk_contributions
from client.models import LoadedModel
from client.release import LocalSums
from dpmtv_common.aliases import Float64Array, Int64Array
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadLayout, HeadSet
from dpmtv_common.privacy.noise import NoiseSource
from protocol import (
    ActivationSum,
    ReleaseOrder,
    ReleasePlan,
    SelectionMode,
    VoteSum,
    plan_calibration,
    run_release,
)

__all__ = [
    "AuditReport",
    "CanaryPair",
    "ScaledNoise",
    "audit_pair",
    "canary_candidates",
    "choose_canary",
    "clopper_pearson_epsilon",
    "epsilon_of_gdp",
    "make_canary_pair",
    "plant_canary",
]


@dataclass(frozen=True)
class ScaledNoise:
    """A PLANTED BUG for the audit's power check: Gaussian noise times ``factor`` (0: none).

    Never pass this to a release: it breaks the privacy guarantee on purpose.
    """

    inner: NoiseSource
    factor: float

    @property
    def is_cryptographic(self) -> bool:
        """False: a release must refuse it."""
        return False

    def add_gaussian(self, values: Float64Array, *, noise_std: float) -> Float64Array:
        """``values`` + N(0, (factor·noise_std)²), or ``values`` unchanged when factor is 0."""
        if self.factor == 0.0:
            return np.array(values, dtype=np.float64)
        return self.inner.add_gaussian(values, noise_std=noise_std * self.factor)

    def discrete_gaussian(self, size: int, *, noise_std: float) -> Int64Array:
        """Scaled like :meth:`add_gaussian`."""
        if self.factor == 0.0:
            return np.zeros(size, dtype=np.int64)
        return self.inner.discrete_gaussian(size, noise_std=noise_std * self.factor)

    def gumbel_top_k(self, scores: Float64Array, *, k: int, scale: float) -> tuple[int, ...]:
        """Unchanged: the audit does not use selection."""
        return self.inner.gumbel_top_k(scores, k=k, scale=scale)


def plant_canary(dataset: SiteDataset, canary: Record, *, index: int) -> SiteDataset:
    """``dataset`` with record ``index`` replaced by ``canary`` (a replace-one neighbour)."""
    if not 0 <= index < len(dataset.records):
        raise ConfigError(
            f"index must lie in [0, {len(dataset.records)}), got {index!r} (the canary replaces "
            "one existing record)."
        )
    if dataset.privacy_unit == "group":
        canary = replace(canary, group=dataset.records[index].group)
    records = list(dataset.records)
    records[index] = replace(canary, id=records[index].id)
    return replace(dataset, records=tuple(records))


def _changed_chunks(first: Sequence[Chunk], second: Sequence[Chunk]) -> int:
    return sum(a != b for a, b in zip(first, second, strict=True))


def canary_candidates(dataset: SiteDataset, folder: Path) -> list[Record]:
    """Canary records to try, their images written to ``folder``.

    Extreme images (noise, black, white, an inverted record), each with a frequent and a rare
    answer of ``dataset``: the audit keeps the one that moves its chunk most.
    """
    folder.mkdir(parents=True, exist_ok=True)
    first = dataset.records[0]
    size = first.load_image().size
    rng = np.random.default_rng(0)  # public canary content, not DP noise
    images = {
        "noise": Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)),
        "black": Image.new("RGB", size, (0, 0, 0)),
        "white": Image.new("RGB", size, (255, 255, 255)),
        "inverted": ImageOps.invert(first.load_image()),
    }
    counts = Counter(r.answer for r in dataset.records)
    answers = dict.fromkeys([counts.most_common()[0][0], counts.most_common()[-1][0]])
    candidates = []
    for name, image in images.items():
        path = folder / f"canary-{name}.png"
        image.save(path)
        for answer in answers:
            candidates.append(Record(f"canary-{name}", path, first.question, (answer,)))
    return candidates


def choose_canary(
    loaded: LoadedModel,
    dataset: SiteDataset,
    candidates: Sequence[Record],
    plan: ReleasePlan,
    *,
    chunk_seed: int,
) -> tuple[Record, int, float]:
    """The canary and position that move their chunk's clipped contribution most.

    Positions tried: the query and the first demonstration of the first chunk. Returns the
    canary, the index of the record it replaces and ‖Δ‖ of that chunk's contribution.
    """
    heads = _audited_heads(plan, loaded.adapter.head_shape(loaded.model).layout())

    def first_chunk(data: SiteDataset) -> Chunk:
        cut = make_chunks(
            data, shots=plan.shots, seed=chunk_seed, max_chunks=plan.max_chunks_per_site
        )
        return cut.chunks[0]

    target = first_chunk(dataset)
    index_of = {record.id: i for i, record in enumerate(dataset.records)}
    positions = [index_of[target.query.id], index_of[target.demonstrations[0].id]]

    def contribution(chunk: Chunk) -> Float64Array:
        (rows,) = chunk_contributions(loaded, [chunk], heads=heads, clip_norm=plan.clip_norm)
        return rows

    base = contribution(target)
    best: tuple[Record, int, float] | None = None
    for index in positions:
        for candidate in candidates:
            planted = plant_canary(dataset, candidate, index=index)
            distance = float(np.linalg.norm(contribution(first_chunk(planted)) - base))
            if best is None or distance > best[2]:
                best = (candidate, index, distance)
    if best is None:
        raise ConfigError("candidates must hold at least one canary record, got none.")
    return best


@dataclass(frozen=True)
class CanaryPair:
    """The two noise-free clipped sums of a neighbouring pair, and how far apart they are.

    Attributes:
        without: The sum over the data as it is.
        with_canary: The sum with the canary planted.
        changed_chunks: Chunks that differ between the two datasets (1 for a replace-one pair).
        distance: ‖Δ‖₂ between the two sums over the audited heads.
        sensitivity: Δ₂ = 2·C·√L_scope, the bound the plan's Gaussian is calibrated to.
    """

    without: ActivationSum
    with_canary: ActivationSum
    changed_chunks: int
    distance: float
    sensitivity: float


def _through_run_release(plan: ReleasePlan) -> bool:
    """Whether run_release's output is exactly the Gaussian's scope (no heads dropped after)."""
    if plan.selection is SelectionMode.ALL:
        return True
    return plan.selection is SelectionMode.PUBLIC and plan.order is ReleaseOrder.SELECT_FIRST


def _audited_heads(plan: ReleasePlan, layout: HeadLayout) -> HeadSet:
    # The scope of the Gaussian draw: every carried head, except a public list selected first.
    if plan.public_heads and _through_run_release(plan) and plan.selection is SelectionMode.PUBLIC:
        return HeadSet(plan.public_heads)
    return layout.all_heads()


def make_canary_pair(
    loaded: LoadedModel,
    dataset: SiteDataset,
    canary: SiteDataset,
    plan: ReleasePlan,
    *,
    chunk_seed: int,
) -> CanaryPair:
    """Clipped sums of ``dataset`` and ``canary`` (its neighbour) by the production code.

    Both are cut with the same secret ``chunk_seed`` and summed by :class:`LocalSums` over the
    plan's Gaussian scope, once each (one forward pass per chunk, as a release does).
    """
    heads = _audited_heads(plan, loaded.adapter.head_shape(loaded.model).layout())
    max_chunks = plan.max_chunks_per_site
    chunks = [
        make_chunks(data, shots=plan.shots, seed=chunk_seed, max_chunks=max_chunks).chunks
        for data in (dataset, canary)
    ]
    sums = [
        LocalSums(loaded, part, plan, instruction=data.instruction, progress=False)
        for part, data in zip(chunks, (dataset, canary), strict=True)
    ]
    without, with_canary = (s.activation_sum(heads) for s in sums)
    mechanism = plan_calibration(plan).gaussian(clip_norm=plan.clip_norm, heads=heads)
    return CanaryPair(
        without=without,
        with_canary=with_canary,
        changed_chunks=_changed_chunks(chunks[0], chunks[1]),
        distance=float(np.linalg.norm(with_canary.total - without.total)),
        sensitivity=mechanism.l2_sensitivity,
    )


@dataclass
class _FixedSums:
    """:class:`protocol.ReleaseSums` that hands out one precomputed sum (noise-free, cached)."""

    summed: ActivationSum

    def activation_sum(self, heads: HeadSet) -> ActivationSum:
        if heads != self.summed.heads:
            raise ConfigError(f"heads must be the audited scope, got {len(heads)} other heads.")
        return self.summed

    def vote_sum(self, reference: Float64Array | None) -> VoteSum:
        raise ConfigError("the audit runs no selection, got a request for votes.")


def _released_values(
    plan: ReleasePlan, summed: ActivationSum, noise: NoiseSource, layout: HeadLayout
) -> Float64Array:
    """One production release of ``summed``: the noisy mean over the audited heads."""
    if not _through_run_release(plan):
        # run_release would then keep only some rows (release-first: post-processing) or pick
        # heads first (votes need forward passes each time); the Gaussian it runs is this one:
        # the plan's calibration over the scope, noisy_mean of the sum. Auditing every row
        # before post-processing can only make the pair easier to tell apart.
        mechanism = plan_calibration(plan).gaussian(clip_norm=plan.clip_norm, heads=summed.heads)
        return mechanism.noisy_mean(summed.total, num_chunks=summed.num_chunks, noise=noise)
    outcome = run_release(
        plan,
        sums=_FixedSums(summed),
        layout=layout,
        noise=noise,
        on_first_noise=lambda: None,
    )
    return np.asarray(outcome.values, dtype=np.float64)


@dataclass(frozen=True)
class AuditReport:
    """What one audit of a pair measured (see the module docstring for each figure).

    Attributes:
        label: Which noise was used ("production", "sigma halved", "noise off").
        runs: Releases per side.
        noise_std: σ the plan claims for its Gaussian draw.
        mu_claimed: Δ₂/σ, the GDP parameter the plan guarantees for any neighbouring pair.
        mu_canary: ‖Δ‖/σ, what this pair shows if the noise is as calibrated.
        mu_hat: The estimate, with its two-sided confidence limits.
        epsilon_claimed: ε of a ``mu_claimed``-GDP mechanism at ``delta`` (the Gaussian part).
        epsilon_lower_gdp: ε at ``delta`` of the lower confidence limit of μ̂.
        epsilon_lower_cp: Clopper-Pearson ε lower bound at ``confidence``.
    """

    label: str
    runs: int
    confidence: float
    delta: float
    noise_std: float
    mu_claimed: float
    mu_canary: float
    mu_hat: float
    mu_low: float
    mu_high: float
    epsilon_claimed: float
    epsilon_lower_gdp: float
    epsilon_lower_cp: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def noise_as_calibrated(self) -> bool:
        """True when ‖Δ‖/σ (what this canary shows at the claimed σ) lies in μ̂'s interval."""
        return self.mu_low <= self.mu_canary <= self.mu_high

    @property
    def violates_claim(self) -> bool:
        """True when even the lower confidence limit of μ̂ exceeds the claimed μ."""
        return self.mu_low > self.mu_claimed


def epsilon_of_gdp(mu: float, delta: float) -> float:
    """The smallest ε ≥ 0 with δ(ε) ≤ ``delta`` for a μ-GDP mechanism (Dong, Roth & Su 2019).

    δ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2); infinite μ gives infinite ε.
    """
    if not 0.0 < delta < 1.0:
        raise ConfigError(f"delta must lie in (0, 1), got {delta!r}.")
    if mu <= 0.0:
        return 0.0
    if mu > 100.0:  # ε > 5000 at any δ of interest; e^ε overflows in floating point
        return math.inf

    def excess(epsilon: float) -> float:
        tail = float(stats.norm.cdf(-epsilon / mu + mu / 2))
        # e^ε·Φ(·) in log space: ε reaches hundreds for large μ, where e^ε alone overflows.
        shifted = math.exp(epsilon + float(stats.norm.logcdf(-epsilon / mu - mu / 2)))
        return tail - shifted - delta

    if excess(0.0) <= 0.0:
        return 0.0
    upper = mu * mu / 2 + mu * 10.0  # δ(ε) is far below any δ of interest there
    return float(optimize.brentq(excess, 0.0, upper, xtol=1e-9))


def _clopper_pearson_upper(failures: int, trials: int, alpha: float) -> float:
    if failures >= trials:
        return 1.0
    return float(stats.beta.ppf(1 - alpha, failures + 1, trials - failures))


def _threshold_epsilon(fpr: float, fnr: float, delta: float) -> float:
    if fpr <= 0.0:
        return math.inf
    return max(math.log(max(1 - delta - fnr, 1e-300) / fpr), 0.0)


def _best_threshold(without: Float64Array, with_canary: Float64Array, delta: float) -> float:
    """The threshold of the largest empirical ε on the selection half (outputs above: 'in')."""
    candidates = np.unique(np.concatenate([without, with_canary]))
    best, best_epsilon = float(candidates[0]), -1.0
    for threshold in candidates[:: max(1, len(candidates) // 400)]:
        fpr = float(np.mean(without > threshold))
        fnr = float(np.mean(with_canary <= threshold))
        epsilon = _threshold_epsilon(max(fpr, 0.5 / len(without)), fnr, delta)
        if epsilon > best_epsilon:
            best, best_epsilon = float(threshold), epsilon
    return best


def clopper_pearson_epsilon(
    without: Float64Array, with_canary: Float64Array, *, delta: float, confidence: float
) -> float:
    """Non-parametric ε lower bound: threshold from the first half, rates from the second."""
    half0, half1 = len(without) // 2, len(with_canary) // 2
    threshold = _best_threshold(without[:half0], with_canary[:half1], delta)
    test0, test1 = without[half0:], with_canary[half1:]
    alpha = (1 - confidence) / 2  # both rates at once (union bound)
    fpr = _clopper_pearson_upper(int(np.sum(test0 > threshold)), len(test0), alpha)
    fnr = _clopper_pearson_upper(int(np.sum(test1 <= threshold)), len(test1), alpha)
    return _threshold_epsilon(fpr, fnr, delta)


def _mu_estimate(
    without: Float64Array, with_canary: Float64Array, confidence: float
) -> tuple[float, float, float]:
    """μ̂ = mean difference / pooled sd, with a normal-approximation confidence interval.

    Var(μ̂) ≈ 1/n₀ + 1/n₁ + μ̂²/(2(n₀ + n₁ − 2)) (difference of means over an estimated sd).
    """
    n0, n1 = len(without), len(with_canary)
    difference = float(with_canary.mean() - without.mean())
    pooled = math.sqrt(
        (float(without.var(ddof=1)) * (n0 - 1) + float(with_canary.var(ddof=1)) * (n1 - 1))
        / (n0 + n1 - 2)
    )
    if pooled == 0.0:
        mu = math.inf if difference > 0 else 0.0
        return mu, mu, mu
    mu = difference / pooled
    spread = math.sqrt(1 / n0 + 1 / n1 + mu * mu / (2 * (n0 + n1 - 2)))
    z = float(stats.norm.isf((1 - confidence) / 2))
    return mu, mu - z * spread, mu + z * spread


def _projections(
    plan: ReleasePlan,
    summed: ActivationSum,
    direction: Float64Array,
    *,
    runs: int,
    noise: NoiseSource,
    layout: HeadLayout,
) -> Float64Array:
    return np.array(
        [
            float(np.sum(_released_values(plan, summed, noise, layout) * direction))
            for _ in range(runs)
        ]
    )


def audit_pair(
    plan: ReleasePlan,
    pair: CanaryPair,
    *,
    noise: NoiseSource,
    runs: int,
    layout: HeadLayout,
    confidence: float = 0.95,
    label: str = "production",
) -> AuditReport:
    """Release each side of ``pair`` ``runs`` times with ``noise`` and measure (module doc).

    Args:
        plan: The audited release configuration.
        pair: The neighbouring sums (:func:`make_canary_pair`).
        noise: The production noise source, or a :class:`ScaledNoise` for the power check.
        runs: Releases per side (at least 20).
        layout: The model's head layout (which layers carry heads).
        confidence: Of every interval and lower bound (two-sided for μ̂).
        label: Names the noise in the report.
    """
    if runs < 20:
        raise ConfigError(f"runs must be >= 20 per side, got {runs!r}.")
    if not 0.5 <= confidence < 1.0:
        raise ConfigError(f"confidence must lie in [0.5, 1), got {confidence!r}.")
    if pair.distance == 0.0:
        raise ConfigError(
            "the canary must change the clipped sum, got a canary that changes nothing; choose "
            "another canary record."
        )
    direction = (pair.with_canary.total - pair.without.total) / pair.distance
    scale = pair.without.num_chunks  # projections of the sum, not the mean
    sides = [
        _projections(plan, summed, direction, runs=runs, noise=noise, layout=layout) * scale
        for summed in (pair.without, pair.with_canary)
    ]
    mechanism = plan_calibration(plan).gaussian(clip_norm=plan.clip_norm, heads=pair.without.heads)
    mu_claimed = mechanism.l2_sensitivity / mechanism.noise_std
    mu_hat, mu_low, mu_high = _mu_estimate(sides[0], sides[1], confidence)
    return AuditReport(
        label=label,
        runs=runs,
        confidence=confidence,
        delta=plan.delta,
        noise_std=mechanism.noise_std,
        mu_claimed=mu_claimed,
        mu_canary=pair.distance / mechanism.noise_std,
        mu_hat=mu_hat,
        mu_low=mu_low,
        mu_high=mu_high,
        epsilon_claimed=epsilon_of_gdp(mu_claimed, plan.delta),
        epsilon_lower_gdp=epsilon_of_gdp(max(mu_low, 0.0), plan.delta),
        epsilon_lower_cp=clopper_pearson_epsilon(
            sides[0], sides[1], delta=plan.delta, confidence=confidence
        ),
    )
