"""Empirical privacy audit of a release configuration, with a canary in the production path.

How this connects: a site admin names a release configuration (a :class:`protocol.ReleasePlan`)
and its own data. The audit builds a neighbouring pair — the data as it is, and the same data
with ONE record replaced by a canary record — cuts both with the same secret chunk shuffle
(``client.activations.chunking``), and computes each clipped sum once with the production extraction
code (:class:`client.release.single_holder.LocalSums`). It then runs the production release N times
on each sum with the production noise source and asks how well the outputs tell the two datasets
apart. What one run is depends on the plan's noise mode:

* **central**: the production Gaussian release (:func:`protocol.run_release`; for private
  selection, the plan's own calibrated Gaussian over all heads, which is what
  ``release-first`` privatises), one draw on the sum.
* **distributed**: the secure sum as the coordinator decodes it. This site's share is encoded
  by the production encoder (:func:`encode_site_share`: scale by the plan's γ, CSPRNG
  rounding, a discrete-Gaussian share from ``secure_noise()``), beside the shares of the
  other honest sites, exactly ``plan.min_honest`` honest shares in all: the fewest for which
  the plan claims its guarantee. The shares are added (SecAgg+ adds integers on this grid
  exactly) and decoded by the coordinator's :func:`decode_noisy_sum`; then
  :func:`protocol.run_release` in distributed mode takes the mean (post-processing).

From the outputs:

* **Gaussian-DP μ.** Every output is projected on the canary's direction Δ (the difference of
  the two noise-free sums, known to the auditor). For a Gaussian mechanism the projections are
  N(a, s²) without and N(a + ‖Δ‖, s²) with the canary, so μ̂ = (mean₁ − mean₀)/s estimates
  ‖Δ‖/σ. The plan claims μ ≤ Δ₂/σ for ANY neighbouring pair in central mode
  (Δ₂ = 2·C·√L_scope); in distributed mode the accounting's zCDP ρ at t honest shares, i.e.
  μ = √(2ρ) = Δ̃/(σ_l·√t) = 1/z on the grid, where Δ̃ = γ·Δ₂ + √d also covers rounding
  (KLS21: the summed shares are as private as that Gaussian, up to ξ ≤ 1e-9). The audit
  reports μ̂ with its confidence interval beside that claim and beside ‖Δ‖/σ, what this canary
  should show if the noise is as calibrated (Dong, Roth & Su 2019, Gaussian DP).
* **ε lower bounds.** From μ̂'s lower confidence limit, the ε that a μ-GDP mechanism has at the
  plan's δ (parametric: assumes Gaussian outputs). And a non-parametric one: a threshold on the
  projection, chosen on the first half of the runs, is applied to the second half; Clopper-
  Pearson upper limits on its false-positive and false-negative rates give
  ε ≥ log((1 − δ − FNR)/FPR) with the stated confidence (Jagielski, Ullman & Oprea 2020).
* **Power.** The same pair, released with σ halved and with the noise off (planted bugs in a
  wrapper noise source, never used by a release; in distributed mode every site's share is
  drawn from it), shows what the audit can detect.

What it cannot show: an audit finds violations, it never proves privacy. One canary gives a
lower bound for that pair only (‖Δ‖/Δ₂ says how close the pair is to the worst case); the
private head selection (Gumbel top-k, or the noisy vote histogram in distributed mode) and the
accountant's composition are not audited here. In distributed mode the audit assumes exactly
``min_honest`` honest shares (fewer void the plan's claim; more only add noise), gives the
other honest sites zero sums (their data is the same in both worlds of the pair), and runs no
SecAgg+ masking, dropouts or aborts: it audits a site's own share as the production code draws
it and the coordinator's decoding, not the transport. The report is computed from the private
data without noise (‖Δ‖, the sums' projections): it is for the site's own eyes, is not a
release, and is never written to the ledger.

The pure statistics (``epsilon_of_gdp``, ``clopper_pearson_epsilon``, ``mu_estimate``) live
in :mod:`dpmtv_common.privacy.auditing` (numpy and scipy only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from client.activations.chunking import make_chunks
from client.audit.canary import audited_heads, changed_chunks, releases_whole_scope
from client.data.records import SiteDataset
from client.models import LoadedModel
from client.release.single_holder import LocalSums
from dpmtv_common.aliases import Float64Array, Int64Array
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadLayout, HeadSet
from dpmtv_common.privacy.auditing import clopper_pearson_epsilon, epsilon_of_gdp, mu_estimate
from dpmtv_common.privacy.distributed import (
    decode_noisy_sum,
    encode_site_share,
    release_epsilon,
)
from dpmtv_common.privacy.noise import NoiseSource
from protocol import (
    ActivationSum,
    DistributedRelease,
    NoiseMode,
    ReleasePlan,
    VoteSum,
    plan_calibration,
    run_release,
)

__all__ = [
    "AuditReport",
    "CanaryPair",
    "PlanClaim",
    "ScaledNoise",
    "audit_pair",
    "make_canary_pair",
    "plan_claim",
]


@dataclass(frozen=True)
class ScaledNoise:
    """A PLANTED BUG for the audit's power check: Gaussian noise times ``factor`` (0: none).

    Scales the central draw and, in distributed mode, every site's discrete-Gaussian share
    (so the summed noise is scaled by ``factor`` too). Never pass this to a release: it breaks
    the privacy guarantee on purpose.
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
class PlanClaim:
    """What the plan's accounting states for its activation release over the audited heads.

    Attributes:
        noise_mode: Who adds the noise ("central" or "distributed").
        honest_shares: t, the honest shares the distributed claim holds at (None: central).
        noise_std: σ of the released sum's noise, in real units (central: the one Gaussian
            draw; distributed: t shares summed and decoded, :meth:`DistributedRelease.noise_std`).
        sensitivity: Δ₂ = 2·C·√L_scope of the real-valued sum.
        mu: The GDP μ the plan guarantees for any neighbouring pair (module docstring).
        epsilon: ε at the plan's δ the accounting states for the activation release alone.
    """

    noise_mode: NoiseMode
    honest_shares: int | None
    noise_std: float
    sensitivity: float
    mu: float
    epsilon: float


def plan_claim(
    plan: ReleasePlan, heads: HeadSet, *, layout: HeadLayout, head_dim: int
) -> PlanClaim:
    """The claim of ``plan``'s activation release over ``heads``, from the production accounting.

    Central: the plan's calibrated Gaussian (σ, Δ₂; μ = Δ₂/σ; ε of μ-GDP at δ). Distributed:
    the plan's grid for the model's shape (:class:`protocol.DistributedRelease`) at
    t = ``plan.min_honest`` honest shares: σ of the decoded sum, μ = √(2ρ) of its zCDP event,
    ε of :func:`release_epsilon` with no vote sum.
    """
    if plan.noise_mode is NoiseMode.DISTRIBUTED:
        return _distributed_claim(plan, heads, layout=layout, head_dim=head_dim)
    mechanism = plan_calibration(plan).gaussian(clip_norm=plan.clip_norm, heads=heads)
    mu = mechanism.l2_sensitivity / mechanism.noise_std
    return PlanClaim(
        noise_mode=plan.noise_mode,
        honest_shares=None,
        noise_std=mechanism.noise_std,
        sensitivity=mechanism.l2_sensitivity,
        mu=mu,
        epsilon=epsilon_of_gdp(mu, plan.delta),
    )


def _distributed_claim(
    plan: ReleasePlan, heads: HeadSet, *, layout: HeadLayout, head_dim: int
) -> PlanClaim:
    release = DistributedRelease(plan, layout.dense_size, head_dim)
    grid = release.activations(heads)
    t = plan.min_honest
    # ρ-zCDP is the Gaussian's privacy curve at μ = √(2ρ): the μ a Gaussian-looking output
    # may show at most; ξ (≤ 1e-9, KLS21's discretisation term) is left out of μ, kept in ε.
    mu = math.sqrt(2.0 * grid.event(t).rho)
    bound = release_epsilon(grid, None, honest_shares=t, delta=plan.delta)
    return PlanClaim(
        noise_mode=plan.noise_mode,
        honest_shares=t,
        noise_std=release.noise_std(heads),
        sensitivity=grid.l2_sensitivity,
        mu=mu,
        epsilon=bound.epsilon,
    )


def _pair_claim(plan: ReleasePlan, summed: ActivationSum, layout: HeadLayout) -> PlanClaim:
    # D is read off the sum, as run_release does: the grids depend on the shape, not the data.
    return plan_claim(plan, summed.heads, layout=layout, head_dim=int(summed.total.shape[1]))


@dataclass(frozen=True)
class CanaryPair:
    """The two noise-free clipped sums of a neighbouring pair, and how far apart they are.

    Attributes:
        without: The sum over the data as it is.
        with_canary: The sum with the canary planted.
        changed_chunks: Chunks that differ between the two datasets (1 for a replace-one pair).
        distance: ‖Δ‖₂ between the two sums over the audited heads.
        sensitivity: Δ₂ = 2·C·√L_scope, the bound the plan's noise is calibrated to.
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
    layout = loaded.adapter.head_shape(loaded.model).layout()
    heads = audited_heads(plan, layout)
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
    return CanaryPair(
        without=without,
        with_canary=with_canary,
        changed_chunks=changed_chunks(chunks[0], chunks[1]),
        distance=float(np.linalg.norm(with_canary.total - without.total)),
        sensitivity=_pair_claim(plan, without, layout).sensitivity,
    )


@dataclass
class _FixedSums:
    """:class:`protocol.ReleaseSums` that hands out one precomputed sum.

    Central mode: the noise-free clipped sum (run_release draws on it). Distributed mode: one
    run's decoded secure sum, already carrying the honest shares' noise.
    """

    summed: ActivationSum

    def activation_sum(self, heads: HeadSet) -> ActivationSum:
        if heads != self.summed.heads:
            raise ConfigError(f"heads must be the audited scope, got {len(heads)} other heads.")
        return self.summed

    def vote_sum(self, reference: Float64Array | None) -> VoteSum:
        raise ConfigError("the audit runs no selection, got a request for votes.")


def _distributed_sum(
    plan: ReleasePlan, summed: ActivationSum, noise: NoiseSource, layout: HeadLayout
) -> ActivationSum:
    """One distributed secure sum holding ``summed``, decoded as the coordinator decodes it.

    Mechanism (:mod:`protocol.distributed`): privacy unit the plan's, replace-one; sensitivity
    Δ₂ = 2·C·√L_scope, Δ̃ = γ·Δ₂ + √d on the grid; noise: each of t = ``plan.min_honest``
    honest shares is N_Z(0, σ_l²)^d with σ_l = z·Δ̃/√t, drawn by the production encoder from
    ``noise``, so the sum carries exactly the noise the plan's guarantee rests on.
    """
    grid = DistributedRelease(plan, layout.dense_size, int(summed.total.shape[1])).activations(
        summed.heads
    )
    honest = plan.min_honest
    # The other honest sites hold the same data in both worlds of the pair, so their sums
    # move both sides alike; zero sums leave only what matters, their noise shares.
    site_sums = [summed.total.ravel()] + [np.zeros(grid.dimension)] * (honest - 1)
    shares = [encode_site_share(part, params=grid, noise=noise) for part in site_sums]
    # SecAgg+ adds integers on this grid exactly (tests/statistical/test_distributed_secagg.py),
    # so the unmasked total is the plain sum of the shares.
    total = decode_noisy_sum(np.sum(shares, axis=0), params=grid, num_sites=honest)
    return ActivationSum(summed.heads, total.reshape(summed.total.shape), summed.num_chunks, honest)


def _released_values(
    plan: ReleasePlan, summed: ActivationSum, noise: NoiseSource, layout: HeadLayout
) -> Float64Array:
    """One production release of ``summed``: the noisy mean over the audited heads."""
    distributed = plan.noise_mode is NoiseMode.DISTRIBUTED
    if distributed:
        summed = _distributed_sum(plan, summed, noise, layout)
    if not releases_whole_scope(plan):
        # run_release would then keep only some rows (release-first: post-processing) or pick
        # heads first (votes need forward passes each time); the noise it adds is this one:
        # the plan's calibration over the scope, noisy_mean of the sum (central), or the
        # already-noisy decoded sum over m (distributed). Auditing every row before
        # post-processing can only make the pair easier to tell apart.
        if distributed:
            return summed.total / summed.num_chunks
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
        noise_mode: The audited plan's noise mode ("central" or "distributed").
        honest_shares: Honest shares in each audited sum (t; None in central mode).
        runs: Releases per side.
        noise_std: σ the plan claims for the released sum's noise (:class:`PlanClaim`).
        mu_claimed: The GDP parameter the plan guarantees for any neighbouring pair
            (central: Δ₂/σ; distributed: √(2ρ) at t honest shares).
        mu_canary: ‖Δ‖/σ, what this pair shows if the noise is as calibrated.
        mu_hat: The estimate, with its two-sided confidence limits.
        epsilon_claimed: ε the accounting states at ``delta`` for the activation release
            alone (central: of ``mu_claimed``-GDP; distributed: the zCDP bound at t shares).
        epsilon_lower_gdp: ε at ``delta`` of the lower confidence limit of μ̂.
        epsilon_lower_cp: Clopper-Pearson ε lower bound at ``confidence``.
    """

    label: str
    noise_mode: str
    honest_shares: int | None
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
        noise: The production noise source, or a :class:`ScaledNoise` for the power check
            (in distributed mode, the source of every site's share).
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
    claim = _pair_claim(plan, pair.without, layout)  # a plan it cannot meet fails before any run
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
    mu_hat, mu_low, mu_high = mu_estimate(sides[0], sides[1], confidence)
    return AuditReport(
        label=label,
        noise_mode=claim.noise_mode.value,
        honest_shares=claim.honest_shares,
        runs=runs,
        confidence=confidence,
        delta=plan.delta,
        noise_std=claim.noise_std,
        mu_claimed=claim.mu,
        mu_canary=pair.distance / claim.noise_std,
        mu_hat=mu_hat,
        mu_low=mu_low,
        mu_high=mu_high,
        epsilon_claimed=claim.epsilon,
        epsilon_lower_gdp=epsilon_of_gdp(max(mu_low, 0.0), plan.delta),
        epsilon_lower_cp=clopper_pearson_epsilon(
            sides[0], sides[1], delta=plan.delta, confidence=confidence
        ),
    )
