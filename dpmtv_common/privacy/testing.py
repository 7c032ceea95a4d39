"""A seeded noise source for tests: reproducible, NOT private.

It exists so that statistical and end-to-end tests can inject randomness explicitly (style
guide §7.8). Its ``is_cryptographic`` is False, so :func:`require_cryptographic` refuses it
at every production entry point. The Gaussian is numpy's float sampler, not an exact one.
"""

from __future__ import annotations

import numpy as np

from dpmtv_common.aliases import Float64Array, Int64Array
from dpmtv_common.privacy.noise import check_gaussian_arguments, check_gumbel_arguments

__all__ = ["SeededNoise"]


class SeededNoise:
    """Deterministic noise from ``numpy.random.Generator(PCG64(seed))``. Tests only."""

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    @property
    def is_cryptographic(self) -> bool:
        """Always false: the stream is fixed by the seed."""
        return False

    def add_gaussian(self, values: Float64Array, *, noise_std: float) -> Float64Array:
        """Add float N(0, noise_std²) noise from the seeded generator."""
        check_gaussian_arguments(values, noise_std=noise_std)
        noise = self._rng.normal(0.0, noise_std, size=values.shape)
        return np.asarray(values, dtype=np.float64) + noise

    def discrete_gaussian(self, size: int, *, noise_std: float) -> Int64Array:
        """Round float Gaussians to integers (an approximation, adequate for tests)."""
        return np.rint(self._rng.normal(0.0, noise_std, size=size)).astype(np.int64)

    def gumbel_top_k(self, scores: Float64Array, *, k: int, scale: float) -> tuple[int, ...]:
        """Gumbel-max trick with seeded Gumbel noise."""
        check_gumbel_arguments(scores, k=k, scale=scale)
        noisy = scores + self._rng.gumbel(0.0, scale, size=scores.shape)
        return tuple(int(i) for i in np.argsort(-noisy, kind="stable")[:k])
