"""Who masks with whom in a secure sum, and how many shares rebuild a site's self-mask seed.

SecAgg+ (Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead",
CCS 2020) replaces SecAgg's complete graph by a sparse one: each site shares its mask seed
and key with k - 1 neighbours, and any t of the k shares (its own included) rebuild them.
:func:`neighbours` places the sites on a ring in an order no party can choose (sorted by a
hash of the whole key transcript, to which every site adds a fresh key) and makes the k - 1
nearest their neighbours, so each site's neighbours are a uniformly random set of k - 1
others. Every site computes the ring itself: the coordinator only relays the keys. The
protocol's two conditions then fix k and t for n sites, of which at most a fraction gamma
collude with the coordinator and at most a fraction delta drop out:

* **privacy**: no site has t colluding neighbours (they could rebuild its self-mask seed and,
  holding their own pairwise seeds with it, unmask its vector); union bound over the sites
  at most 2^-40;
* **correctness**: every site keeps t - 1 surviving neighbours besides its own share (else
  the sum cannot be unmasked and the round aborts); union bound at most 2^-20.

With the neighbours drawn without replacement, each count is hypergeometric; the smallest odd
k with a t above k/2 meeting both is chosen. k grows like log n, as the paper intends; below
11 sites, or when no k < n qualifies, every site is every site's neighbour (classic SecAgg,
Bonawitz et al. 2017) and a majority of the n shares rebuilds a seed.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from functools import lru_cache

from dpmtv_common.errors import ConfigError

__all__ = [
    "CORRECTNESS_FAILURE",
    "DEFAULT_CORRUPT_FRACTION",
    "DEFAULT_DROPOUT_FRACTION",
    "PRIVACY_FAILURE",
    "neighbourhood",
    "neighbours",
    "ring_order",
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


def neighbourhood(
    sites: int,
    *,
    corrupt_fraction: float = DEFAULT_CORRUPT_FRACTION,
    dropout_fraction: float = DEFAULT_DROPOUT_FRACTION,
) -> tuple[int, int]:
    """``(k, t)``: neighbourhood size (the site included) and shares that rebuild a seed.

    A complete graph (k = n) below 11 sites or when no smaller k qualifies, with a majority
    t = n // 2 + 1 (at least 2); else the smallest odd k < n meeting both conditions.

    Raises:
        ConfigError: ``sites`` is not an int >= 2, or a fraction is outside [0, 1/2).
    """
    if isinstance(sites, bool) or not isinstance(sites, int) or sites < 2:
        raise ConfigError(
            f"sites must be an int >= 2 (a sum of one site is public), got {sites!r}."
        )
    for name, value in (
        ("corrupt_fraction", corrupt_fraction),
        ("dropout_fraction", dropout_fraction),
    ):
        if not 0.0 <= value < 0.5:
            raise ConfigError(f"{name} must be in [0, 0.5), got {value!r}.")
    complete = (sites, max(2, sites // 2 + 1))
    if sites <= _COMPLETE_UP_TO:
        return complete
    found = _smallest_neighbourhood(sites, corrupt_fraction, dropout_fraction)
    return found if found is not None else complete


def neighbours(ring: Sequence[int], node: int, size: int) -> tuple[int, ...]:
    """The ``size - 1`` nodes nearest ``node`` on ``ring`` (half on each side), sorted.

    Args:
        ring: Every participant, in ring order (:func:`ring_order`).
        node: A participant.
        size: k from :func:`neighbourhood` (the node included); ``len(ring)`` for all.

    Raises:
        ConfigError: ``node`` is not on the ring, or ``size`` is out of range.
    """
    count = len(ring)
    if node not in ring:
        raise ConfigError(f"node must be on the ring of {count} participants, got {node!r}.")
    if size == count:
        return tuple(sorted(other for other in ring if other != node))
    if not 3 <= size < count or size % 2 == 0:  # odd: the relation must be symmetric
        raise ConfigError(f"a neighbourhood must be odd in [3, {count}) or {count}, got {size!r}.")
    position, half = ring.index(node), (size - 1) // 2
    offsets = [*range(1, half + 1), *range(-half, 0)]
    return tuple(sorted(ring[(position + offset) % count] for offset in offsets))


def ring_order(nodes: Sequence[int], transcript: bytes) -> tuple[int, ...]:
    """The ring: ``nodes`` sorted by SHA-256 of the key transcript and the node id.

    ``transcript`` is the digest of every participant's signed key advertisement, so the
    order is fixed only once the last fresh key is in: the coordinator cannot choose a
    site's neighbours, and a colluding member that grinds keys for a position needs about
    1 / PRIVACY_FAILURE tries.
    """

    def position(node: int) -> bytes:
        return hashlib.sha256(transcript + node.to_bytes(8, "big")).digest()

    return tuple(sorted(nodes, key=position))


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
