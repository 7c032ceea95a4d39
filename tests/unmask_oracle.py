"""What a coordinator can unmask from what it holds: the invariant the hostile tests check.

A coordinator (with the colluding roster members it controls) holds, for one secure sum of
one release: the honest sites' masked inputs ``y_v = x_v + PRG(b_v) + Σ ±PRG(s_vu)`` (over v's
neighbours u among the participants *v* believed in, + when v < u), the shares of self-mask
seeds and the pair seeds the sites revealed, and every colluder's secrets (its pair seeds
with its neighbours, the shares sealed to it). A linear combination Σ c_v y_v reveals
something about the x's only when every uniform mask in it cancels or is known: c_v = 0
wherever b_v is unknown, and c_v = c_u across every pair mask whose seed is unknown and that
both v and u added (a term only one side added never cancels). So the finest sums it can
compute are over the *components* of the unknown-pair-mask graph on the honest inputs it
holds whose seeds it knows; :func:`exposures` finds them, and proves each one by computing
its sum and checking that the count coordinate is the group's true chunk count.

The invariant (``docs/design.md``, threat model): every such group holds at least the
minimum of honest sites of each of its members.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from dpmtv_common.aliases import Int64Array
from dpmtv_common.crypto import mask_prg, shamir
from protocol.secure_sum import SumRanges, dequantise

__all__ = ["Exposure", "HonestInput", "KeyView", "SumView", "exposures", "violations"]


@dataclass(frozen=True)
class KeyView:
    """An honest site's own public key and the keys it took for the others (its session)."""

    own_public: bytes
    publics: Mapping[int, bytes]


@dataclass(frozen=True)
class HonestInput:
    """An honest site's masked input the coordinator holds, and what the site masked with.

    ``participants`` and ``neighbours`` are read from the site's own session when it
    answered (the truth of what is in ``vector``), never from the coordinator's side.
    """

    node: int
    vector: Int64Array
    participants: frozenset[int]
    neighbours: tuple[int, ...]
    count: int
    minimum: int
    threshold: int


@dataclass
class SumView:
    """One sum of one release as the coordinator holds it (with its colluders' secrets)."""

    release_id: str
    sum_index: int
    ranges: SumRanges
    colluders: frozenset[int]
    keys: dict[int, KeyView] = field(default_factory=dict)
    inputs: dict[int, HonestInput] = field(default_factory=dict)
    shares: dict[int, dict[bytes, bytes]] = field(default_factory=dict)  # owner: index -> share
    pair_seeds: dict[tuple[int, int], bytes] = field(default_factory=dict)
    """(v, u) -> the seed of the pair mask v added for u (revealed by v, or v's colluding u)."""

    def add_share(self, owner: int, share: bytes) -> None:
        """A share of ``owner``'s self-mask seed (revealed, or opened by a colluder)."""
        self.shares.setdefault(owner, {})[share[:4]] = share

    def seed_of(self, node: int) -> bytes | None:
        """``node``'s self-mask seed if t distinct shares of it are held."""
        held = self.shares.get(node, {})
        if len(held) < self.inputs[node].threshold:
            return None
        return _combined(tuple(sorted(held.values())))


@dataclass(frozen=True)
class Exposure:
    """A group of honest inputs whose sum the coordinator can compute, and that sum."""

    release_id: str
    sum_index: int
    nodes: frozenset[int]
    minimum: int
    total: np.ndarray


def exposures(view: SumView) -> list[Exposure]:
    """Every finest group of honest inputs the coordinator can unmask, each proven by its sum."""
    seeds = {node: view.seed_of(node) for node in view.inputs}
    unknown = {node: _unknown_terms(view, view.inputs[node]) for node in view.inputs}
    found, seen = [], set[int]()
    for start in view.inputs:
        if start in seen:
            continue
        group, clean = _component(view, start, unknown, seeds)
        seen |= group
        if clean:
            found.append(_proven(view, frozenset(group), seeds))
    return found


def violations(view: SumView) -> list[Exposure]:
    """The groups below the minimum of one of their members: must be none."""
    return [exposure for exposure in exposures(view) if len(exposure.nodes) < exposure.minimum]


def _unknown_terms(view: SumView, item: HonestInput) -> list[int]:
    """The partners of ``item``'s pair masks whose seed the coordinator does not know."""
    return [
        partner
        for partner in item.neighbours
        if partner in item.participants and _seed(view, item.node, partner) is None
    ]


def _seed(view: SumView, node: int, partner: int) -> bytes | None:
    """The seed of the pair mask ``node`` added for ``partner``, if the coordinator has it."""
    found = view.pair_seeds.get((node, partner))
    if found is None and _same_keys(view, node, partner):
        found = view.pair_seeds.get((partner, node))  # the same seed, revealed by the partner
    return found


def _same_keys(view: SumView, node: int, partner: int) -> bool:
    """Whether two honest sites took each other's real keys (so derive one pair seed)."""
    mine, theirs = view.keys.get(node), view.keys.get(partner)
    if mine is None or theirs is None:
        return False
    return mine.publics.get(partner) == theirs.own_public and (
        theirs.publics.get(node) == mine.own_public
    )


def _component(
    view: SumView,
    start: int,
    unknown: Mapping[int, list[int]],
    seeds: Mapping[int, bytes | None],
) -> tuple[set[int], bool]:
    """The inputs tied to ``start`` by unknown pair masks; clean when all of it can cancel."""
    group, frontier, clean = {start}, [start], True
    while frontier:
        node = frontier.pop()
        clean &= seeds[node] is not None
        for partner in unknown[node]:
            if not _reciprocal(view, node, partner):
                clean = False  # a mask only one side added never cancels
                continue
            if partner not in group:
                group.add(partner)
                frontier.append(partner)
    return group, clean


def _reciprocal(view: SumView, node: int, partner: int) -> bool:
    """Whether ``partner``'s input is held and carries the same pair mask with ``node``."""
    theirs = view.inputs.get(partner)
    if theirs is None or node not in theirs.participants or node not in theirs.neighbours:
        return False
    return _same_keys(view, node, partner)


def _proven(view: SumView, group: frozenset[int], seeds: Mapping[int, bytes | None]) -> Exposure:
    """Compute the group's sum from the coordinator's view; its count must be the truth."""
    modulus = view.ranges.modulus_range
    size = next(iter(view.inputs.values())).vector.size
    total = np.zeros(size, dtype=np.int64)
    for node in group:
        item = view.inputs[node]
        seed = seeds[node]
        if seed is None:
            raise AssertionError(f"node {node} in an exposed group without its seed")
        total = (total + item.vector - _expand(seed, modulus, size)) % modulus
        for partner in item.neighbours:
            if partner not in item.participants:
                continue
            if partner in group and _reciprocal(view, node, partner):
                continue  # added by both, with opposite signs: it cancels
            seed_of_pair = _seed(view, node, partner)
            if seed_of_pair is None:
                raise AssertionError(f"pair ({node}, {partner}) left in a group, seed unknown")
            pair = _expand(seed_of_pair, modulus, size)
            total = (total - pair if node < partner else total + pair) % modulus
    real = dequantise(total, view.ranges, len(group))
    expected = sum(view.inputs[node].count for node in group)
    if abs(real[-1] - expected) > 1e-3:
        raise AssertionError(
            f"the oracle's group {sorted(group)} of sum {view.sum_index} unmasks to count "
            f"{real[-1]}, not {expected}: its model of the masks is wrong"
        )
    minimum = max(view.inputs[node].minimum for node in group)
    return Exposure(view.release_id, view.sum_index, group, minimum, real)


@lru_cache(maxsize=4096)
def _combined(shares: tuple[bytes, ...]) -> bytes:
    """A seed rebuilt from its shares (the same shares come back at every step's check)."""
    return shamir.combine_shares(list(shares))


def _expand(seed: bytes, modulus: int, size: int) -> Int64Array:
    return mask_prg.expand_mask(seed, modulus, [(size,)])[0]
