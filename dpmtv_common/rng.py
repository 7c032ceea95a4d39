"""Ordinary (non-DP) randomness: seeded generators for shuffles, data generation and tests.

DP noise never comes from here: it comes from :mod:`dpmtv_common.privacy.noise`. A chunk
shuffle's secret seed is drawn with :func:`secret_seed` (CSPRNG) and kept by the site.
"""

from __future__ import annotations

import secrets

import numpy as np

__all__ = ["make_rng", "secret_seed"]


def make_rng(seed: int) -> np.random.Generator:
    """A PCG64 generator for work whose randomness is not a privacy mechanism."""
    return np.random.default_rng(seed)


def secret_seed() -> int:
    """A 128-bit seed from the OS CSPRNG (for a site's secret chunk shuffle)."""
    return secrets.randbits(128)
