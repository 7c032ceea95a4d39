"""Who masks with whom in a secure sum, drawn so that no one can bias it, and the bound it gives.

SecAgg+ (Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead",
CCS 2020) replaces SecAgg's complete graph (Bonawitz et al. 2017) by a sparse random graph of
logarithmic degree: each site shares its self-mask seed with, and masks against, its d
neighbours only. Here the graph is a **uniformly labelled random d-regular graph**: a random
d-regular graph (the pairing model with restarts, Steger and Wormald 1999; random regular
graphs are expanders with high probability, Friedman 2008, so a few dropouts do not cut
them) whose node labels are then permuted uniformly at random. The permutation makes the
law of the graph invariant under any relabelling, so each site's neighbourhood is exactly a
uniformly random d-subset of the others: the counts below are exactly hypergeometric.

**No one chooses the graph.** Its randomness is :func:`graph_seed`: a hash of the key
transcript and of one 32-byte nonce per participant, each committed to inside the member's
signed key advertisement (``protocol.sum_keys.nonce_commitment``) and revealed only once
every advertisement is fixed. A colluder commits before it sees any honest nonce, so the
graph is uniform given the colluders' choices; after the reveals its only choice is to abort
(withhold its nonce), and each abort costs a release, which each site bounds by its policy.
Complete graphs (below :data:`COMPLETE_UP_TO` + 1 sites, or where no sparse degree qualifies)
need no randomness and skip the reveal.

**The bound** (:func:`graph_shape`). For n participants, a minimum of m *honest* sites per
computable sum (the plan's ``min_sites``), at most ⌊γ n⌋ colluding with the coordinator
(γ = :data:`DEFAULT_CORRUPT_FRACTION`, fixed before the nonces are revealed) and any dropouts
the coordinator claims:

* ĉ (``colluding_neighbours``) is the least c with n · P[Hyp(n-1, ⌊γ n⌋, d) > c] ≤ 2^-40
  (:data:`PRIVACY_FAILURE`): except with that probability over the graph, no honest site
  has more than ĉ colluding neighbours (in a complete graph ĉ = ⌊γ n⌋ exactly).
* A site takes part in an unmask only with r = max(t - 1, m - 1 + ĉ) surviving neighbours
  (:meth:`GraphShape.required_neighbours`). A site's masked input can only be unmasked
  together with every survivor whose pair mask with it stays hidden (an honest surviving
  neighbour's): with at most ĉ of its r neighbours colluding, at least m - 1 honest survivors
  are tied to it, so every sum the coordinator can compute that holds an honest site's input
  holds at least m honest inputs. No dropout pattern changes that: it is checked per site.
* t (``threshold``, the self-mask seed's Shamir threshold over the d + 1 holders, the owner's
  own share counted, as the site does) is at least ĉ + 1, so a site named as dropped, which
  reveals nothing, never has its seed rebuilt from colluding neighbours' shares, and a majority
  of the holders. A survivor's seed is revealed by design (its own share among the t): what
  keeps its input hidden is its pair masks with its honest surviving neighbours, hence r.
* Correctness: with ⌈δ n⌉ random dropouts (δ = :data:`DEFAULT_DROPOUT_FRACTION`), some site
  keeps fewer than r surviving neighbours with probability at most 2^-20
  (:data:`CORRECTNESS_FAILURE`; the sum then aborts, nothing is revealed).

The smallest even-product degree meeting both is chosen, in exact integer arithmetic (every
party computes the same one). A coordinator that aborts to re-draw gets one draw a release
and a site's policy bounds the draws a day, so the bound over a day is the draws times 2^-40.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from types import MappingProxyType

from dpmtv_common.crypto.mask_prg import expand_mask
from dpmtv_common.errors import ConfigError, IntegrityError

__all__ = [
    "COMPLETE_UP_TO",
    "CORRECTNESS_FAILURE",
    "DEFAULT_CORRUPT_FRACTION",
    "DEFAULT_DROPOUT_FRACTION",
    "GRAPH_SEED_BYTES",
    "PRIVACY_FAILURE",
    "GraphShape",
    "SumGraph",
    "build_graph",
    "graph_seed",
    "graph_shape",
]

DEFAULT_CORRUPT_FRACTION = 0.1
"""γ: at most ⌊γ n⌋ of the n participants collude with the coordinator."""
DEFAULT_DROPOUT_FRACTION = 0.1
"""δ: the share of random dropouts a sum is sized to survive (correctness only)."""
PRIVACY_FAILURE_BITS = 40
PRIVACY_FAILURE = 2.0**-PRIVACY_FAILURE_BITS
"""Chance, over one graph draw, that some honest site has more than ĉ colluding neighbours."""
CORRECTNESS_FAILURE_BITS = 20
CORRECTNESS_FAILURE = 2.0**-CORRECTNESS_FAILURE_BITS
"""Chance that random dropouts leave some site fewer than r surviving neighbours."""
COMPLETE_UP_TO = 10
"""Sites up to which every site is every site's neighbour (no graph to draw)."""
GRAPH_SEED_BYTES = 32
_DOMAIN_SEED = b"dpmtv/secure-sum/graph-seed/v1"
_DOMAIN_DRAWS = b"dpmtv/secure-sum/graph-draws/v1"
_DRAW_BLOCK = 1024
_PAIRING_TRIES = 64  # random point pairs tried before a pairing restarts
_PAIRING_RESTARTS = 10_000


@dataclass(frozen=True)
class GraphShape:
    """The graph's numbers for n sites and a minimum of m honest sites (module docstring).

    Attributes:
        sites: n, the participants.
        minimum: m, the fewest honest sites a computable sum may hold.
        degree: d, every site's neighbours (n - 1: complete).
        threshold: t, shares (the owner's counted) that rebuild a self-mask seed.
        colluding_neighbours: ĉ, the most colluding neighbours an honest site has (but with
            probability :data:`PRIVACY_FAILURE`; exactly in a complete graph).
    """

    sites: int
    minimum: int
    degree: int
    threshold: int
    colluding_neighbours: int

    @property
    def complete(self) -> bool:
        """Whether every site is every site's neighbour (no randomness, no reveal round)."""
        return self.degree == self.sites - 1

    def required_neighbours(self, minimum: int | None = None) -> int:
        """r: surviving neighbours a site needs before it signs a survivor set.

        ``minimum`` is the site's own (default: the shape's m); the rebuild needs t - 1.
        """
        honest = self.minimum if minimum is None else minimum
        return max(self.threshold - 1, honest - 1 + self.colluding_neighbours)


@dataclass(frozen=True)
class SumGraph:
    """One drawn graph: every participant's neighbours (sorted), and its shape."""

    shape: GraphShape
    neighbours: Mapping[int, tuple[int, ...]]

    @property
    def nodes(self) -> tuple[int, ...]:
        """Every participant, sorted."""
        return tuple(sorted(self.neighbours))

    def of(self, node: int) -> tuple[int, ...]:
        """The neighbours of ``node``.

        Raises:
            ConfigError: ``node`` is not a participant.
        """
        found = self.neighbours.get(node)
        if found is None:
            raise ConfigError(
                f"node must be one of the {self.shape.sites} participants, got {node}."
            )
        return found

    def component(self, node: int, within: Iterable[int]) -> frozenset[int]:
        """The nodes of ``within`` that ``node`` reaches through edges inside ``within``."""
        allowed = set(within)
        if node not in allowed:
            return frozenset()
        seen, frontier = {node}, [node]
        while frontier:
            current = frontier.pop()
            for other in self.of(current):
                if other in allowed and other not in seen:
                    seen.add(other)
                    frontier.append(other)
        return frozenset(seen)


def graph_shape(
    sites: int,
    *,
    minimum: int,
    corrupt_fraction: float = DEFAULT_CORRUPT_FRACTION,
    dropout_fraction: float = DEFAULT_DROPOUT_FRACTION,
) -> GraphShape:
    """The smallest degree meeting the bounds of the module docstring, else the complete graph.

    Raises:
        ConfigError: ``sites`` is not an int >= 2, ``minimum`` not an int in [1, sites], or
            a fraction is outside [0, 1/2).
    """
    for name, value, low in (("sites", sites, 2), ("minimum", minimum, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(
                f"{name} must be an int >= {low} (a sum of one site is public), got {value!r}."
            )
    for name, fraction in (
        ("corrupt_fraction", corrupt_fraction),
        ("dropout_fraction", dropout_fraction),
    ):
        if not 0.0 <= fraction < 0.5:
            raise ConfigError(f"{name} must be in [0, 0.5), got {fraction!r}.")
    return _shape(sites, minimum, _exact(corrupt_fraction), _exact(dropout_fraction))


def build_graph(nodes: Sequence[int], shape: GraphShape, seed: bytes | None) -> SumGraph:
    """The graph of ``shape`` over ``nodes``; a sparse one from ``seed`` (:func:`graph_seed`).

    Raises:
        ConfigError: ``nodes`` are not ``shape.sites`` distinct ids, or a sparse graph got no
            32-byte seed.
    """
    ordered = tuple(sorted(set(nodes)))
    if len(ordered) != shape.sites or len(ordered) != len(nodes):
        raise ConfigError(f"nodes must be {shape.sites} distinct ids, got {len(nodes)} ids.")
    if shape.complete:
        near = {node: tuple(o for o in ordered if o != node) for node in ordered}
        return SumGraph(shape, MappingProxyType(near))
    if seed is None or len(seed) != GRAPH_SEED_BYTES:
        raise ConfigError(f"a sparse graph needs a {GRAPH_SEED_BYTES}-byte seed, got {seed!r:.40}.")
    return SumGraph(shape, MappingProxyType(dict(_random_regular(ordered, shape.degree, seed))))


def graph_seed(transcript: bytes, nonces: Mapping[int, bytes]) -> bytes:
    """SHA-256 of the key transcript and every participant's revealed nonce, by node id."""
    digest = hashlib.sha256(_DOMAIN_SEED)
    digest.update(len(transcript).to_bytes(4, "big") + transcript)
    for node in sorted(nonces):
        nonce = nonces[node]
        digest.update(node.to_bytes(8, "big") + len(nonce).to_bytes(4, "big") + nonce)
    return digest.digest()


# ---------------------------------------------------------------------- the bound


def _exact(fraction: float) -> Fraction:
    """The fraction as the decimal a person wrote (0.1 is 1/10, not 0.1000000000000000055)."""
    return Fraction(fraction).limit_denominator(10**6)


@lru_cache(maxsize=1024)
def _shape(sites: int, minimum: int, corrupt: Fraction, dropout: Fraction) -> GraphShape:
    colluders = math.floor(corrupt * sites)
    dropped = math.ceil(dropout * sites)
    if sites > COMPLETE_UP_TO:
        for degree in range(2, sites - 1):
            if (sites * degree) % 2:  # a d-regular graph on n nodes needs n * d even
                continue
            shape = _sparse(sites, minimum, degree, colluders, dropped)
            if shape is not None:
                return shape
    threshold = max(2, sites // 2 + 1)
    return GraphShape(sites, minimum, sites - 1, threshold, colluders)


def _sparse(
    sites: int, minimum: int, degree: int, colluders: int, dropped: int
) -> GraphShape | None:
    others = sites - 1
    total = math.comb(others, degree)
    # ĉ: the least c with n * P[Hyp(n - 1, colluders, d) > c] <= 2^-40 (integers only).
    counts = [
        math.comb(colluders, k) * math.comb(others - colluders, degree - k)
        for k in range(min(colluders, degree) + 1)
    ]
    bound, above = 0, total - counts[0]
    while (sites * above) << PRIVACY_FAILURE_BITS > total:
        bound += 1
        above -= counts[bound]
    threshold = max(bound + 1, (degree + 1) // 2 + 1)
    shape = GraphShape(sites, minimum, degree, threshold, bound)
    need = shape.required_neighbours()
    if need > degree:
        return None
    alive = others - min(dropped, others)
    short = sum(
        math.comb(alive, kept) * math.comb(others - alive, degree - kept)
        for kept in range(max(0, degree - (others - alive)), need)
    )
    return shape if (sites * short) << CORRECTNESS_FAILURE_BITS <= total else None


# ---------------------------------------------------------------------- the draw


class _Draws:
    """Uniform integers from ChaCha20 keyed by the seed: the same on every machine."""

    def __init__(self, seed: bytes) -> None:
        self._seed = seed
        self._block = 0
        self._buffer: list[int] = []

    def below(self, bound: int) -> int:
        """A uniform integer in ``[0, bound)`` (rejection sampling: no modulo bias)."""
        limit = (2**32 // bound) * bound
        while True:
            if not self._buffer:
                key = hashlib.sha256(_DOMAIN_DRAWS + self._seed + self._block.to_bytes(8, "big"))
                self._buffer = expand_mask(key.digest(), 2**32, [(_DRAW_BLOCK,)])[0].tolist()
                self._block += 1
            value = self._buffer.pop()
            if value < limit:
                return value % bound


@lru_cache(maxsize=64)
def _random_regular(
    nodes: tuple[int, ...], degree: int, seed: bytes
) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """A uniformly labelled random ``degree``-regular graph on ``nodes`` (module docstring)."""
    count = len(nodes)
    draws = _Draws(seed)
    dense = degree > (count - 1) // 2  # pair the sparser complement, then invert it
    base = _pairing(count, count - 1 - degree if dense else degree, draws)
    if dense:
        base = [set(range(count)) - near - {index} for index, near in enumerate(base)]
    labels = list(nodes)
    for index in range(count - 1, 0, -1):  # Fisher-Yates: a uniform relabelling
        other = draws.below(index + 1)
        labels[index], labels[other] = labels[other], labels[index]
    return tuple(
        sorted(
            (labels[index], tuple(sorted(labels[other] for other in near)))
            for index, near in enumerate(base)
        )
    )


def _pairing(count: int, degree: int, draws: _Draws) -> list[set[int]]:
    """A simple ``degree``-regular graph on ``range(count)``: random pairs of free points.

    Each node has ``degree`` points; two random free points of different, not yet adjacent
    nodes are joined until none are left, restarting when no such pair turns up.
    """
    for _ in range(_PAIRING_RESTARTS):
        adjacency: list[set[int]] = [set() for _ in range(count)]
        points = [node for node in range(count) for _ in range(degree)]
        while points:
            pair = _free_pair(points, adjacency, draws)
            if pair is None:
                break
            first, second = pair
            adjacency[points[first]].add(points[second])
            adjacency[points[second]].add(points[first])
            for index in sorted(pair, reverse=True):
                points[index] = points[-1]
                points.pop()
        else:
            return adjacency
    raise IntegrityError(
        f"a {degree}-regular graph on {count} nodes must be drawn within "
        f"{_PAIRING_RESTARTS} restarts, got none."
    )


def _free_pair(
    points: list[int], adjacency: list[set[int]], draws: _Draws
) -> tuple[int, int] | None:
    for _ in range(_PAIRING_TRIES):
        first, second = draws.below(len(points)), draws.below(len(points))
        a, b = points[first], points[second]
        if a != b and b not in adjacency[a]:
            return first, second
    return None
