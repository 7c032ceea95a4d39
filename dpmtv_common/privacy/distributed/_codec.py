"""Site encoding and coordinator decoding of a distributed-noise secure sum.

Mechanism (KLS21, arXiv 2102.06387 §4, without rotation). A site holds its float sum X of
chunk contributions (activations: each chunk per-layer clipped to C; votes: 0/1 per head).
It encodes ``Y = R(γ·X) + Z``: γ is the public power of two of ``DistributedNoise``, R rounds
every coordinate to an adjacent integer, rounding up with probability equal to the fractional
part (``R(a) = ⌈a − U⌉``, U uniform from the CSPRNG), and Z ~ N_Z(0, σ_l²)^d is its noise
share. The secure sum adds the survivors' Y exactly; the coordinator divides by γ.

Sensitivity. Replacing one chunk moves X by v with ‖v‖₂ ≤ Δ₂ (2·C·√L_scope for activations,
√(2r) for top-r votes). Couple the two worlds' rounding through the same U: then
|R(a) − R(b) − (a − b)| < 1 per coordinate, so ‖R(γX) − R(γX')‖₂ ≤ γΔ₂ + √d. Rényi divergence
is jointly quasi-convex, so the mechanism is as private as the discrete Gaussian with
Δ̃ = γΔ₂ + √d·(1 + 2⁻²⁰) (the margin absorbs float64 error in γ·X and a − U, below 2⁻²¹ per
coordinate for |γX| < 2²⁹). Integral inputs (votes) are not rounded: Δ̃ = Δ₂, γ = 1.
Conditional rounding (KLS21's β) would shrink √d, but it bounds the norm of a vector the
site rounds, and here one unit's change hides inside a site's sum of many chunks; with
the secure sum's 2³⁰ grid the √d term costs < 0.1 % noise in the settings measured, so it
is not used.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from dpmtv_common.aliases import Float64Array
from dpmtv_common.errors import ConfigError, IntegrityError
from dpmtv_common.privacy.distributed._params import (
    DistributedNoise,
    SecAggRangeError,
    check_positive_int,
)
from dpmtv_common.privacy.noise import NoiseSource, secure_uniform

__all__ = ["decode_noisy_sum", "encode_site_share", "top_k_from_noisy_votes"]

_DECODE_TOLERANCE = 0.25  # a correct sum is within ~1e-6 of an integer; anything else is corrupt


def _randomised_round(values: Float64Array, uniform: Float64Array) -> Float64Array:
    # R(a) = ⌈a − U⌉: up with probability frac(a); the shared-U coupling gives the √d bound.
    return np.ceil(values - uniform)


def encode_site_share(
    site_sum: npt.ArrayLike,
    *,
    params: DistributedNoise,
    noise: NoiseSource,
    rounding: Callable[[int], Float64Array] = secure_uniform,
) -> Float64Array:
    """Scale, round and add this site's noise share; the result goes to SecAgg+ as float64.

    Args:
        site_sum: the site's un-noised sum, shape (d,) or any shape with d elements.
        params: the sum's public parameters.
        noise: where the share comes from; production passes ``secure_noise()`` (the caller
            runs ``require_cryptographic``, as for the central mechanisms).
        rounding: U ~ uniform[0, 1) per coordinate. Privacy does not depend on it (any U
            keeps the coupling bound); unbiasedness does, so production keeps the CSPRNG.

    Returns:
        Integer-valued float64 of the input's shape, each |value| ≤ ``clipping_range``.

    Raises:
        ConfigError: if the input is not finite, has the wrong size, exceeds
            ``max_abs_site_coordinate``, or is not integral when ``params.integral``.
        SecAggRangeError: if the share took a value beyond ±c (probability ≤ p): abort.
    """
    values = np.array(site_sum, dtype=np.float64)
    _check_site_sum(values, params)
    flat = values.ravel() * params.scale  # a power of two: exact
    if not params.integral:
        flat = _randomised_round(flat, np.asarray(rounding(flat.size), dtype=np.float64))
    share = noise.discrete_gaussian(flat.size, noise_std=params.share_noise_std)
    encoded = flat + share.astype(np.float64)
    if np.any(np.abs(encoded) > params.clipping_range):
        # The secure sum would refuse it; the abort is the event counted in δ.
        raise SecAggRangeError(
            f"encoded share must lie within ±clipping_range={params.clipping_range}, got "
            f"max |value| {float(np.max(np.abs(encoded)))}: abort this sum."
        )
    return encoded.reshape(values.shape)


def _check_site_sum(values: Float64Array, params: DistributedNoise) -> None:
    if values.size != params.dimension:
        raise ConfigError(
            f"site_sum must have dimension={params.dimension} elements, got {values.size}."
        )
    if not np.all(np.isfinite(values)):
        raise ConfigError("site_sum must be finite, got NaN or infinity.")
    peak = float(np.max(np.abs(values))) if values.size else 0.0
    if peak > params.max_abs_site_coordinate:
        raise ConfigError(
            f"site_sum must satisfy |x| <= max_abs_site_coordinate="
            f"{params.max_abs_site_coordinate}, got {peak!r}."
        )
    if params.integral and not np.array_equal(values, np.rint(values)):
        raise ConfigError("site_sum must hold integers for an integral sum (votes), got fractions.")


def decode_noisy_sum(
    secure_sum: npt.ArrayLike, *, params: DistributedNoise, num_sites: int
) -> Float64Array:
    """Coordinator: turn SecAgg+'s sum of ``num_sites`` encoded shares back into real units.

    The secure sum of integers comes back dequantised in float64, within ~1e-6 of an
    integer; it is rounded to that integer and divided by γ (exact: a power of two).

    Raises:
        IntegrityError: if a coordinate is not near an integer or beyond num_sites·c.
    """
    check_positive_int("num_sites", num_sites)
    values = np.asarray(secure_sum, dtype=np.float64)
    integers = np.rint(values)
    if not np.all(np.isfinite(values)) or np.any(np.abs(values - integers) > _DECODE_TOLERANCE):
        raise IntegrityError(
            "secure_sum must hold integers (a sum of encoded shares), got a coordinate "
            f"{_DECODE_TOLERANCE} or more away from one: wrong SecAgg+ ranges or a wrapped sum."
        )
    if np.any(np.abs(integers) > num_sites * params.clipping_range):
        raise IntegrityError(
            f"secure_sum must satisfy |x| <= num_sites*c = {num_sites * params.clipping_range}, "
            "got more: the modular sum wrapped."
        )
    return integers / params.scale


def top_k_from_noisy_votes(noisy_votes: npt.ArrayLike, *, k: int) -> tuple[int, ...]:
    """Indices of the k largest noisy vote counts, best first (post-processing; ties by index)."""
    votes = np.asarray(noisy_votes, dtype=np.float64)
    if votes.ndim != 1 or not np.all(np.isfinite(votes)):
        raise ConfigError(f"noisy_votes must be a finite 1-d array, got shape {votes.shape!r}.")
    check_positive_int("k", k)
    if k > votes.shape[0]:
        raise ConfigError(f"k must be <= {votes.shape[0]}, got {k!r}.")
    order = np.argsort(-votes, kind="stable")
    return tuple(int(i) for i in order[:k])
