"""How many neighbours a site has in SecAgg+, and how many of them rebuild its secrets.

SecAgg+ (Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead",
CCS 2020) replaces SecAgg's complete graph by a sparse one: each site shares its mask seed
and key with k - 1 neighbours, and any t of the k shares (its own included) rebuild them.
Flower places the sites on a ring in a random order and makes the k - 1 nearest their
neighbours, so each site's neighbours are a uniformly random set of k - 1 others. The
protocol's two conditions then fix k and t for n sites, of which at most a fraction gamma
collude with the coordinator and at most a fraction delta drop out:

* **privacy**: no site has t colluding neighbours (they could rebuild both its mask seed and
  its key, and unmask its vector); union bound over the sites at most 2^-40;
* **correctness**: every site keeps t - 1 surviving neighbours besides its own share (else
  the sum cannot be unmasked and the round aborts); union bound at most 2^-20.

With the neighbours drawn without replacement, each count is hypergeometric; the smallest odd
k (Flower needs it odd) with a t above k/2 meeting both is chosen. k grows like log n, as the
paper intends; below 11 sites, or when no k < n qualifies, every site is every site's
neighbour (classic SecAgg, Bonawitz et al. 2017) with two thirds of the shares rebuilding.
"""

from __future__ import annotations

import math
from functools import lru_cache

from dpmtv_common.errors import ConfigError

__all__ = [
    "CORRECTNESS_FAILURE",
    "DEFAULT_CORRUPT_FRACTION",
    "DEFAULT_DROPOUT_FRACTION",
    "PRIVACY_FAILURE",
    "neighbourhood",
]

DEFAULT_CORRUPT_FRACTION = 0.1
"""gamma: share of the sites assumed to collude with the coordinator."""
DEFAULT_DROPOUT_FRACTION = 0.1
"""delta: share of the sites that may drop out during a sum."""
PRIVACY_FAILURE = 2.0**-40
"""Chance, over the coordinator's random ring, that some site has t colluding neighbours."""
CORRECTNESS_FAILURE = 2.0**-20
"""Chance that some site keeps fewer than t shares after the dropouts."""
_COMPLETE_UP_TO = 10  # sites: every site is every site's neighbour
_COMPLETE_THRESHOLD = 0.67  # of the shares, in a complete graph


def neighbourhood(
    sites: int,
    *,
    corrupt_fraction: float = DEFAULT_CORRUPT_FRACTION,
    dropout_fraction: float = DEFAULT_DROPOUT_FRACTION,
) -> tuple[int | float, int | float]:
    """``(num_shares, reconstruction_threshold)`` for SecAgg+ over ``sites`` sites.

    Returns Flower's fractions ``(1.0, 0.67)`` for a complete graph, else odd ints (k, t).

    Raises:
        ConfigError: ``sites`` is not a positive int, or a fraction is outside [0, 1/2).
    """
    if isinstance(sites, bool) or not isinstance(sites, int) or sites < 1:
        raise ConfigError(f"sites must be a positive int, got {sites!r}.")
    for name, value in (
        ("corrupt_fraction", corrupt_fraction),
        ("dropout_fraction", dropout_fraction),
    ):
        if not 0.0 <= value < 0.5:
            raise ConfigError(f"{name} must be in [0, 0.5), got {value!r}.")
    if sites <= _COMPLETE_UP_TO:
        return 1.0, _COMPLETE_THRESHOLD
    found = _smallest_neighbourhood(sites, corrupt_fraction, dropout_fraction)
    return found if found is not None else (1.0, _COMPLETE_THRESHOLD)


@lru_cache(maxsize=256)
def _smallest_neighbourhood(
    sites: int, corrupt_fraction: float, dropout_fraction: float
) -> tuple[int, int] | None:
    corrupt = math.ceil(corrupt_fraction * sites)
    dropped = math.ceil(dropout_fraction * sites)
    others = sites - 1
    for size in range(3, sites, 2):
        draws = size - 1
        for threshold in range(size // 2 + 1, size + 1):
            leak = sites * _tail(others, corrupt, draws, threshold)
            stuck = sites * (1.0 - _tail(others, others - dropped, draws, threshold - 1))
            if leak <= PRIVACY_FAILURE and stuck <= CORRECTNESS_FAILURE:
                return size, threshold
    return None


def _tail(population: int, marked: int, draws: int, at_least: int) -> float:
    """P[X >= at_least] for X ~ Hypergeometric(population, marked, draws)."""
    total = math.comb(population, draws)
    hits = sum(
        math.comb(marked, count) * math.comb(population - marked, draws - count)
        for count in range(max(at_least, 0), min(marked, draws) + 1)
    )
    return hits / total
