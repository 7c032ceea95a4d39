"""The one source of differential-privacy noise: cryptographically secure, exact samplers.

How this connects: every mechanism in :mod:`dpmtv_common.privacy.mechanisms` draws its noise
from a :class:`NoiseSource` passed in by keyword. Production code builds the source with
:func:`secure_noise`, which has no seed parameter; tests may hand a
:class:`dpmtv_common.privacy.testing.SeededNoise` to the mechanisms explicitly, and every
production entry point calls :func:`require_cryptographic` so that such a source can never
reach a real release.

Why OpenDP: its samplers are exact (the Gaussian is sampled on a fine power-of-two grid in
rational arithmetic, so the output has none of the floating-point "holes" that Mironov (CCS
2012) and Jin et al. (S&P 2022) exploit) and draw their bits from OpenSSL's CSPRNG. One-shot
Gumbel top-k is OpenDP's ``make_noisy_top_k`` with zero-concentrated divergence, which is the
Gumbel-max trick sampled exactly (opendp issue #1176).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dpmtv_common.aliases import Float64Array, Int64Array
from dpmtv_common.errors import ConfigError, InsecureRandomnessError

__all__ = ["NoiseSource", "SecureNoise", "require_cryptographic", "secure_noise"]


@runtime_checkable
class NoiseSource(Protocol):
    """Where DP noise comes from. Implementations must be safe to call from one thread."""

    @property
    def is_cryptographic(self) -> bool:
        """True only when every draw comes from a CSPRNG with no user-supplied seed."""
        ...

    def add_gaussian(self, values: Float64Array, *, noise_std: float) -> Float64Array:
        """Return ``values + N(0, noise_std**2 I)`` as a new float64 array."""
        ...

    def discrete_gaussian(self, size: int, *, noise_std: float) -> Int64Array:
        """Return ``size`` independent draws of the discrete Gaussian N_Z(0, noise_std**2)."""
        ...

    def gumbel_top_k(self, scores: Float64Array, *, k: int, scale: float) -> tuple[int, ...]:
        """Return the indices of the ``k`` largest ``scores + Gumbel(0, scale)``, best first."""
        ...


def _check_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be finite and > 0, got {value!r}.")


def check_gumbel_arguments(scores: Float64Array, *, k: int, scale: float) -> None:
    """Validate the arguments of a Gumbel top-k draw (shared by every implementation)."""
    _check_positive("scale", scale)
    if scores.ndim != 1 or not np.all(np.isfinite(scores)):
        raise ConfigError(f"scores must be a finite 1-d array, got shape {scores.shape!r}.")
    if not (1 <= k <= scores.shape[0]):
        raise ConfigError(f"k must lie in [1, {scores.shape[0]}], got {k!r}.")


def check_gaussian_arguments(values: Float64Array, *, noise_std: float) -> None:
    """Validate the arguments of a Gaussian draw (shared by every implementation)."""
    _check_positive("noise_std", noise_std)
    if not np.all(np.isfinite(values)):
        raise ConfigError("values must be finite, got NaN or infinity.")


class SecureNoise:
    """Exact, CSPRNG-backed samplers from OpenDP (OpenSSL randomness; no seed exists)."""

    def __init__(self) -> None:
        # Imported here so that the rest of dpmtv_common stays fast to import.
        import opendp.prelude as dp

        dp.enable_features("contrib")
        self._dp = dp
        # Building an OpenDP measurement costs more than using one; top-k is called in loops.
        self._top_k: dict[tuple[int, float], Any] = {}

    @property
    def is_cryptographic(self) -> bool:
        """Always true: OpenDP draws from OpenSSL's RAND_bytes."""
        return True

    def add_gaussian(self, values: Float64Array, *, noise_std: float) -> Float64Array:
        """Add N(0, noise_std²) to each coordinate with OpenDP's exact float Gaussian."""
        check_gaussian_arguments(values, noise_std=noise_std)
        flat = np.ascontiguousarray(values, dtype=np.float64).ravel()
        if flat.size == 0:
            return flat.reshape(values.shape)
        dp = self._dp
        mechanism = dp.m.make_gaussian(
            dp.vector_domain(dp.atom_domain(T=float, nan=False), size=int(flat.size)),
            dp.l2_distance(T=float),
            scale=float(noise_std),
        )
        noisy = np.asarray(mechanism(flat.tolist()), dtype=np.float64)
        return noisy.reshape(values.shape)

    def discrete_gaussian(self, size: int, *, noise_std: float) -> Int64Array:
        """Draw from N_Z(0, noise_std²) with OpenDP's exact discrete Gaussian (CKS20)."""
        _check_positive("noise_std", noise_std)
        if size < 0:
            raise ConfigError(f"size must be >= 0, got {size!r}.")
        if size == 0:
            return np.zeros(0, dtype=np.int64)
        dp = self._dp
        mechanism = dp.m.make_gaussian(
            dp.vector_domain(dp.atom_domain(T=int), size=size),
            dp.l2_distance(T=int),
            scale=float(noise_std),
        )
        return np.asarray(mechanism([0] * size), dtype=np.int64)

    def gumbel_top_k(self, scores: Float64Array, *, k: int, scale: float) -> tuple[int, ...]:
        """One-shot Gumbel top-k with OpenDP ``make_noisy_top_k`` (zCDP output measure)."""
        check_gumbel_arguments(scores, k=k, scale=scale)
        key = (k, float(scale))
        if key not in self._top_k:
            dp = self._dp
            self._top_k[key] = dp.m.make_noisy_top_k(
                dp.vector_domain(dp.atom_domain(T=float, nan=False)),
                dp.linf_distance(T=float, monotonic=False),
                dp.zero_concentrated_divergence(),
                k=k,
                scale=float(scale),
            )
        picked: Sequence[int] = self._top_k[key]([float(s) for s in scores])
        return tuple(int(i) for i in picked)


def secure_noise() -> SecureNoise:
    """The production noise source. It takes no seed, on purpose."""
    return SecureNoise()


def require_cryptographic(noise: NoiseSource) -> None:
    """Refuse a noise source that is not cryptographic (fail closed; not an ``assert``).

    Raises:
        InsecureRandomnessError: if ``noise.is_cryptographic`` is not exactly ``True``.
    """
    if noise.is_cryptographic is not True:
        raise InsecureRandomnessError(
            f"a production release needs a cryptographic noise source, got {type(noise).__name__}."
            " Seeded sources exist for tests only; use dpmtv_common.secure_noise()."
        )


def secure_uniform(size: int) -> Float64Array:
    """Return ``size`` uniform draws on the grid {k/2^53 : 0 <= k < 2^53} from the OS CSPRNG.

    Used for the randomised rounding of the distributed-noise mode
    (:mod:`dpmtv_common.privacy.distributed`). Every draw is an exact float64: the top 53
    bits of 64 urandom bits, scaled by 2^-53 (a power of two, so no rounding).
    """
    if size < 0:
        raise ConfigError(f"size must be >= 0, got {size!r}.")
    words = np.frombuffer(os.urandom(8 * size), dtype=np.uint64)
    return (words >> np.uint64(11)).astype(np.float64) * 2.0**-53
