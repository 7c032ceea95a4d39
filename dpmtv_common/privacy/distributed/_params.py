"""SecAgg+'s integer grid for distributed noise: the public parameters and their headroom.

One :class:`DistributedNoise` fixes a secure sum: the scale γ (a power of two), the rounding-
inflated sensitivity Δ̃, the share std σ_l, and the secure sum's clipping range c, quantization range
Q and modulus M. ``_codec`` uses it to encode a site's share and decode the sum.

Headroom. A discrete Gaussian is σ_l-subgaussian (Canonne, Kamath & Steinke 2020), so
P(|Z_j| > T·σ_l) ≤ 2·exp(−T²/2); with T = √(2·ln(2·n_max·d/p)) no coordinate of any site
exceeds T·σ_l except with probability p. A site's encoded |Y_j| is then at most
B = γ·max|X_j| + 1 + T·σ_l (rounding moves a value by < 1), and the secure sum's clipping range is
c = Q/2 ≥ B, so a site is never clipped; if one would be, it refuses and the round aborts
(probability ≤ p, which is added to δ). Each quantised site value lies in [0, Q], so the sum
of n_max sites lies in [0, n_max·Q] and M > n_max·Q never wraps; the secure sum dequantises in
float64 (``protocol.secure_sum.dequantise``), so n_max·Q ≤ 2⁵² keeps it exact. γ is the
largest power of two with B ≤ 2²⁹: the finest grid, hence the least rounding inflation
√d/(γΔ₂). No random rotation is needed: the worst coordinate (|X_j| ≤ m_max·C, a
coordinate never exceeds its clipped block's norm) is bounded directly.

Why integers fed as float64 (step 1): with c = Q/2 the secure sum's quantiser
(``protocol.secure_sum.quantise``) computes ``rint((y + c)·Q/(2c)) = y + c``, exact for
integers |y| ≤ 2²⁹. Every random bit that matters comes from our CSPRNG; the secure sum only
adds integers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dpmtv_common.errors import ConfigError
from dpmtv_common.privacy.distributed._accounting import (
    XI_RESERVE,
    DistributedGaussianEvent,
    kls21_tau_upper_bound,
)

__all__ = [
    "DistributedNoise",
    "MAX_MODULUS_RANGE",
    "MAX_QUANTIZATION_RANGE",
    "SecAggRangeError",
    "activation_noise",
    "check_min_honest",
    "distributed_noise_for",
    "vote_noise",
]

MAX_QUANTIZATION_RANGE = 2**30  # flwr's stochastic rounding casts to int32
MAX_MODULUS_RANGE = 2**62  # int64 masks (protocol.secure_sum uses the same cap)
_MAX_EXACT_SUM = 2**52  # flwr dequantises the modular sum in float64
_ROUNDING_MARGIN = 2.0**-20
_KLS21_MIN_SHARE_STD = 0.5  # grid units: where KLS21's Theorem 1 starts
_MAX_INTEGRAL_SCALE = 2.0**20  # bounds the search; _check_ranges refuses a γ that does not fit


class SecAggRangeError(ConfigError):
    """The distributed sum cannot fit SecAgg+'s integer range (Q ≤ 2³⁰, M ≤ 2⁶²)."""


@dataclass(frozen=True, kw_only=True)
class DistributedNoise:
    """Public parameters of one distributed-noise secure sum (identical at every party).

    Build it with :func:`distributed_noise_for` (or :func:`activation_noise`,
    :func:`vote_noise`), which checks the headroom; the fields are not re-validated here.

    Privacy unit: one example (or group); relation: replace-one (one chunk changes).
    Sensitivity: ``l2_sensitivity`` Δ₂ in real units, ``grid_l2_sensitivity`` Δ̃ = γΔ₂ + √d
    after rounding (Δ₂ for integral inputs). Noise: each site adds N_Z(0, σ_l²)^d with
    σ_l = z·Δ̃/√t grid units; n_h honest shares give std σ_l·√n_h, i.e. σ_l·√n_h/γ real.

    Attributes:
        scale: γ, a power of two; real value = grid value / γ.
        l2_sensitivity: Δ₂ in real units.
        grid_l2_sensitivity: Δ̃ in grid units.
        noise_multiplier: z = (std of t shares) / Δ̃.
        min_honest: t, the honest shares every share is sized for (t = 1: a site alone).
        dimension: d, coordinates per site vector.
        max_abs_site_coordinate: bound on |X_j| of a site's un-noised sum (m_max·C or m_max).
        max_sites: most sites whose shares a sum may hold.
        overflow_probability: p, chance that any share coordinate leaves ±c (counted in δ).
        clipping_range: c = Q/2, the secure sum's per-coordinate clipping range.
        quantization_range: Q, a power of two ≤ 2³⁰ (grid step 2c/Q = 1).
        modulus_range: M, the smallest power of two > max_sites·Q.
        integral: True when inputs are integers already (votes): no rounding; γ is 1 unless
            the shares would be too coarse for KLS21's τ (then the smallest power of two that
            is not; see :func:`_integral_scale`).
    """

    scale: float
    l2_sensitivity: float
    grid_l2_sensitivity: float
    noise_multiplier: float
    min_honest: int
    dimension: int
    max_abs_site_coordinate: float
    max_sites: int
    overflow_probability: float
    clipping_range: float
    quantization_range: int
    modulus_range: int
    integral: bool

    @property
    def share_noise_std(self) -> float:
        """σ_l = z·Δ̃/√t in grid units: what each site draws."""
        return self.noise_multiplier * self.grid_l2_sensitivity / math.sqrt(self.min_honest)

    @property
    def modulus_bits(self) -> int:
        """log2 M."""
        return self.modulus_range.bit_length() - 1

    def released_noise_std(self, honest_shares: int) -> float:
        """Std of the decoded (real-unit) sum's noise when ``honest_shares`` shares are in it."""
        return self.share_noise_std * math.sqrt(honest_shares) / self.scale

    def effective_noise_multiplier(self, honest_shares: int) -> float:
        """Released noise std over the real Δ₂: z·(Δ̃/(γΔ₂))·√(n_h/t), rounding included."""
        return self.released_noise_std(honest_shares) / self.l2_sensitivity

    def event(self, honest_shares: int) -> DistributedGaussianEvent:
        """The accounting event when ``honest_shares`` honest shares land in the sum."""
        return DistributedGaussianEvent(
            noise_multiplier=self.noise_multiplier,
            min_honest=self.min_honest,
            honest_shares=honest_shares,
            share_noise_std=self.share_noise_std,
            dimension=self.dimension,
        )


def check_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be finite and > 0, got {value!r}.")


def check_positive_int(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1, got {value!r}.")


def _tail_multiplier(max_sites: int, dimension: int, overflow_probability: float) -> float:
    """T with max_sites·d·2·exp(−T²/2) = p (subgaussian tail, union bound)."""
    return math.sqrt(2.0 * math.log(2.0 * max_sites * dimension / overflow_probability))


def _largest_power_of_two_at_most(value: float) -> float:
    _, exponent = math.frexp(value)
    return math.ldexp(1.0, exponent - 1)


def distributed_noise_for(
    *,
    l2_sensitivity: float,
    max_abs_site_coordinate: float,
    dimension: int,
    noise_multiplier: float,
    min_honest: int,
    max_sites: int,
    integral: bool = False,
    overflow_probability: float = 1e-12,
) -> DistributedNoise:
    """Choose γ, c, Q and M so a distributed sum is exact and never wraps (module docstring).

    γ is the largest power of two whose worst site value B fits c ≤ 2²⁹ (the finest grid,
    the least rounding inflation); for integer inputs it is 1, or the smallest power of two
    whose shares pass KLS21's τ (:func:`_integral_scale`). c is the smallest power of two ≥ B,
    Q = 2c, M the next power of two above max_sites·Q.

    Raises:
        ConfigError: on an argument out of range.
        SecAggRangeError: if no γ ≥ 2⁻⁶⁰ fits Q ≤ 2³⁰ (or the integral sum does not fit),
            if max_sites·Q exceeds 2⁵², or if the shares are too small for the KLS21 τ.
    """
    for name, value in (
        ("l2_sensitivity", l2_sensitivity),
        ("max_abs_site_coordinate", max_abs_site_coordinate),
        ("noise_multiplier", noise_multiplier),
        ("overflow_probability", overflow_probability),
    ):
        check_positive(name, value)
    if overflow_probability >= 1.0:
        raise ConfigError(f"overflow_probability must be < 1, got {overflow_probability!r}.")
    for name, count in (("dimension", dimension), ("min_honest", min_honest)):
        check_positive_int(name, count)
    if not isinstance(max_sites, int) or max_sites < max(2, min_honest):
        raise ConfigError(f"max_sites must be an int >= max(2, min_honest), got {max_sites!r}.")
    tail = _tail_multiplier(max_sites, dimension, overflow_probability)
    if integral:
        scale = _integral_scale(l2_sensitivity, noise_multiplier, min_honest, max_sites, dimension)
        grid_sens = scale * l2_sensitivity
    else:
        scale = _finest_scale(
            l2_sensitivity, max_abs_site_coordinate, dimension, noise_multiplier, min_honest, tail
        )
        grid_sens = scale * l2_sensitivity + math.sqrt(dimension) * (1.0 + _ROUNDING_MARGIN)
    share_std = noise_multiplier * grid_sens / math.sqrt(min_honest)
    bound = scale * max_abs_site_coordinate + (0.0 if integral else 1.0) + tail * share_std
    clipping = 2.0 ** math.ceil(math.log2(max(bound, 1.0)))
    quantization = int(2 * clipping)
    _check_ranges(quantization, max_sites, bound)
    _check_tau(share_std, max_sites, dimension)
    return DistributedNoise(
        scale=scale,
        l2_sensitivity=l2_sensitivity,
        grid_l2_sensitivity=grid_sens,
        noise_multiplier=noise_multiplier,
        min_honest=min_honest,
        dimension=dimension,
        max_abs_site_coordinate=max_abs_site_coordinate,
        max_sites=max_sites,
        overflow_probability=overflow_probability,
        clipping_range=clipping,
        quantization_range=quantization,
        modulus_range=1 << (max_sites * quantization).bit_length(),
        integral=integral,
    )


def _finest_scale(
    sensitivity: float, max_abs: float, dimension: int, z: float, t: int, tail: float
) -> float:
    # B(γ) = γ·(max_abs + T·z·Δ₂/√t) + 1 + T·z·√d·(1 + margin)/√t must stay ≤ Q_max/2.
    per_unit = max_abs + tail * z * sensitivity / math.sqrt(t)
    fixed = 1.0 + tail * z * math.sqrt(dimension) * (1.0 + _ROUNDING_MARGIN) / math.sqrt(t)
    room = MAX_QUANTIZATION_RANGE / 2 - fixed
    if room <= 0 or room / per_unit < 2.0**-60:
        raise SecAggRangeError(
            f"the rounding noise alone must fit the secure sum's range ±2^29, got a worst "
            f"site value of {fixed:.4g} grid units before any signal (d={dimension}, z={z!r}, "
            f"t={t}); lower the dimension or the noise, or raise min_honest."
        )
    return _largest_power_of_two_at_most(room / per_unit)


def _integral_scale(sensitivity: float, z: float, t: int, max_sites: int, dimension: int) -> float:
    """γ for integer inputs (votes): 1, or the smallest power of two whose shares pass KLS21's τ.

    With many honest shares (large t) each share's std z·Δ₂/√t falls to a grid unit or two,
    where the sum of discrete Gaussians is far from a discrete Gaussian (τ·d above the reserve).
    Multiplying the integer votes by a power of two keeps them integers, needs no rounding, and
    scales Δ̃ and σ_l alike: the same z, so the same privacy, with shares coarse enough for τ.
    """
    scale = 1.0
    while scale <= _MAX_INTEGRAL_SCALE:
        share_std = z * scale * sensitivity / math.sqrt(t)
        # KLS21's bound holds from half a grid unit; below it, only a larger scale can help.
        if share_std >= _KLS21_MIN_SHARE_STD and (
            kls21_tau_upper_bound(share_noise_std=share_std, max_shares=max_sites) * dimension
            <= XI_RESERVE
        ):
            return scale
        scale *= 2.0
    return _MAX_INTEGRAL_SCALE  # _check_tau then refuses it, naming the share std


def _check_ranges(quantization: int, max_sites: int, bound: float) -> None:
    if quantization > MAX_QUANTIZATION_RANGE:
        raise SecAggRangeError(
            f"a site's worst value must fit the secure sum's quantization range 2^30 "
            f"(c = 2^29), got {bound:.6g} grid units: fewer chunks per site or less noise per "
            f"share needed."
        )
    if max_sites * quantization > _MAX_EXACT_SUM:
        raise SecAggRangeError(
            f"max_sites * quantization_range must be <= 2^52 (the secure sum dequantises in "
            f"float64), got {max_sites} * {quantization}."
        )


def _check_tau(share_std: float, max_sites: int, dimension: int) -> None:
    xi = kls21_tau_upper_bound(share_noise_std=share_std, max_shares=max_sites) * dimension
    if xi > XI_RESERVE:
        raise SecAggRangeError(
            f"the share std must make KLS21's tau*d <= {XI_RESERVE!r}, got {xi!r} at "
            f"share std {share_std!r} grid units; raise the noise or the scale."
        )


def activation_noise(
    *,
    clip_norm: float,
    num_layers_in_scope: int,
    dimension: int,
    max_chunks_per_site: int,
    noise_multiplier: float,
    min_honest: int,
    max_sites: int,
    overflow_probability: float = 1e-12,
) -> DistributedNoise:
    """Parameters of the activation sum: Δ₂ = 2·C·√L_scope, |X_j| ≤ m_max·C."""
    check_positive("clip_norm", clip_norm)
    check_positive_int("num_layers_in_scope", num_layers_in_scope)
    check_positive_int("max_chunks_per_site", max_chunks_per_site)
    return distributed_noise_for(
        l2_sensitivity=2.0 * clip_norm * math.sqrt(num_layers_in_scope),
        max_abs_site_coordinate=max_chunks_per_site * clip_norm,
        dimension=dimension,
        noise_multiplier=noise_multiplier,
        min_honest=min_honest,
        max_sites=max_sites,
        overflow_probability=overflow_probability,
    )


def vote_noise(
    *,
    top_r: int,
    num_heads: int,
    max_chunks_per_site: int,
    noise_multiplier: float,
    min_honest: int,
    max_sites: int,
    overflow_probability: float = 1e-12,
) -> DistributedNoise:
    """Parameters of the vote histogram: each chunk gives r ones, Δ₂ = √(2r), |X_j| ≤ m_max."""
    check_positive_int("top_r", top_r)
    check_positive_int("num_heads", num_heads)
    check_positive_int("max_chunks_per_site", max_chunks_per_site)
    if top_r > num_heads:
        raise ConfigError(f"top_r must be <= num_heads={num_heads}, got {top_r!r}.")
    return distributed_noise_for(
        l2_sensitivity=math.sqrt(2.0 * top_r),
        max_abs_site_coordinate=float(max_chunks_per_site),
        dimension=num_heads,
        noise_multiplier=noise_multiplier,
        min_honest=min_honest,
        max_sites=max_sites,
        integral=True,
        overflow_probability=overflow_probability,
    )


def check_min_honest(*, plan_min_honest: int, site_min_honest: int, min_sites: int) -> None:
    """Refuse a plan whose shares are sized for more honest sites than this site assumes.

    Every share is sized for t_plan honest shares: σ_l² = σ²/t_plan. A site that assumes at
    least t_site honest participants among the survivors gets noise variance
    ≥ t_site·σ²/t_plan, which is ≥ σ² (its calibrated ε) iff t_plan ≤ t_site. A plan with
    t_plan > min_sites could release with fewer shares than it sized for even when every
    survivor is honest.

    Raises:
        ConfigError: if t_plan > t_site, t_plan > min_sites, or any count is below 1.
    """
    for name, value in (
        ("plan_min_honest", plan_min_honest),
        ("site_min_honest", site_min_honest),
        ("min_sites", min_sites),
    ):
        check_positive_int(name, value)
    if plan_min_honest > site_min_honest:
        raise ConfigError(
            f"plan_min_honest must be <= this site's min_honest={site_min_honest} (shares "
            f"sized for more honest sites than this site trusts), got {plan_min_honest!r}."
        )
    if plan_min_honest > min_sites:
        raise ConfigError(
            f"plan_min_honest must be <= min_sites={min_sites} (a release may go on with "
            f"min_sites survivors), got {plan_min_honest!r}."
        )
