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

The pure statistics (``epsilon_of_gdp``, ``clopper_pearson_epsilon``, ``mu_estimate``) live
in :mod:`dpmtv_common.privacy.auditing` (numpy and scipy only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from client.canary import audited_heads, changed_chunks, releases_whole_scope
from client.chunking import make_chunks
from client.data import SiteDataset
from client.models import LoadedModel
from client.release import LocalSums
from dpmtv_common.aliases import Float64Array, Int64Array
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadLayout, HeadSet
from dpmtv_common.privacy.auditing import clopper_pearson_epsilon, epsilon_of_gdp, mu_estimate
from dpmtv_common.privacy.noise import NoiseSource
from protocol import (
    ActivationSum,
    ReleasePlan,
    VoteSum,
    plan_calibration,
    run_release,
)

__all__ = [
    "AuditReport",
    "CanaryPair",
    "ScaledNoise",
    "audit_pair",
    "make_canary_pair",
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
    heads = audited_heads(plan, loaded.adapter.head_shape(loaded.model).layout())
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
        changed_chunks=changed_chunks(chunks[0], chunks[1]),
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
    if not releases_whole_scope(plan):
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


def _projections(
    plan: ReleasePlan,
    summed: ActivationSum,
    direction: Float64Array,
    *,
    runs: int,
    noise: NoiseSource,
    layout: HeadLayout,
    progress: str | None = None,
) -> Float64Array:
    """``runs`` noisy releases of ``summed`` on ``direction``; a bar named ``progress``."""
    steps = tqdm(range(runs), desc=progress, unit="run", disable=progress is None)
    return np.array(
        [float(np.sum(_released_values(plan, summed, noise, layout) * direction)) for _ in steps]
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
    progress: bool = False,
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
        progress: Show a bar with an estimate of the time left (stderr) for each side.
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
        _projections(
            plan,
            summed,
            direction,
            runs=runs,
            noise=noise,
            layout=layout,
            progress=f"audit {label}, {side}" if progress else None,
        )
        * scale
        for side, summed in (("without canary", pair.without), ("with", pair.with_canary))
    ]
    mechanism = plan_calibration(plan).gaussian(clip_norm=plan.clip_norm, heads=pair.without.heads)
    mu_claimed = mechanism.l2_sensitivity / mechanism.noise_std
    mu_hat, mu_low, mu_high = mu_estimate(sides[0], sides[1], confidence)
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
