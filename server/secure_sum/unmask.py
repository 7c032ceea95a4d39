"""The coordinator's arithmetic of one unmask: masked inputs, seeds and pair seeds to a total.

For sum j with participants P (who masked with each other) and survivors U ⊆ P (whose masked
input arrived), each survivor u sent ``x_u + PRG(b_u) + Σ_{k ∈ N(u) ∩ P} ±PRG(s_uk)`` mod M
(+ when u < k). Summed over U, the pair masks between two survivors cancel; what remains is
every survivor's self mask, rebuilt from t shares of ``b_u``, and the pair masks between a
survivor and a neighbour that dropped out, whose seeds the survivor revealed. Removing both
leaves ``Σ_{u ∈ U} x_u`` mod M, which is exact when ``|U| * Q < M``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from dpmtv_common.aliases import Int64Array
from dpmtv_common.crypto import mask_prg, shamir
from dpmtv_common.errors import InsufficientSharesError, IntegrityError
from protocol.secure_sum import UnmaskReply

__all__ = ["unmask_total"]


def unmask_total(
    *,
    masked: Mapping[int, Int64Array],
    replies: Mapping[int, UnmaskReply],
    participants: Sequence[int],
    neighbours: Mapping[int, tuple[int, ...]],
    threshold: int,
    modulus: int,
) -> Int64Array:
    """``Σ_{u ∈ U} x_u mod M`` for the survivors U (the keys of ``masked``).

    Raises:
        InsufficientSharesError: Fewer than t shares of a survivor's seed came back, or a
            survivor with a dropped neighbour did not reveal their pair seed.
        IntegrityError: The shares do not rebuild a seed.
    """
    survivors = sorted(masked)
    size = _common_size(masked)
    total = np.zeros(size, dtype=np.int64)
    for node in survivors:
        total = (total + masked[node]) % modulus
    for node in survivors:
        seed = _rebuilt_seed(node, replies, threshold)
        total = (total - _expand(seed, modulus, size)) % modulus
    dropped = [node for node in participants if node not in masked]
    for gone in dropped:
        for node in neighbours[gone]:
            if node not in masked:
                continue
            pair = _expand(_pair_seed(node, gone, replies), modulus, size)
            total = (total - pair if node < gone else total + pair) % modulus
    return total


def _common_size(masked: Mapping[int, Int64Array]) -> int:
    sizes = {int(vector.size) for vector in masked.values()}
    if len(sizes) != 1:
        raise IntegrityError(f"every masked input must have one length, got {sorted(sizes)}.")
    return sizes.pop()


def _rebuilt_seed(node: int, replies: Mapping[int, UnmaskReply], threshold: int) -> bytes:
    shares = [
        entry.value
        for reply in replies.values()
        for entry in reply.seed_shares
        if entry.node_id == node
    ]
    if len(shares) < threshold:
        raise InsufficientSharesError(
            f"node {node}'s self-mask seed needs t = {threshold} shares, got {len(shares)}: "
            "too many sites were lost at unmask."
        )
    return shamir.combine_shares(shares)


def _pair_seed(node: int, gone: int, replies: Mapping[int, UnmaskReply]) -> bytes:
    reply = replies.get(node)
    seeds = [entry.value for entry in reply.pair_seeds if entry.node_id == gone] if reply else []
    if len(seeds) != 1:
        raise InsufficientSharesError(
            f"survivor {node} must reveal its pair seed with dropped node {gone} once, got "
            f"{len(seeds)}: the sum cannot be unmasked."
        )
    return seeds[0]


def _expand(seed: bytes, modulus: int, size: int) -> Int64Array:
    return mask_prg.expand_mask(seed, modulus, [(size,)])[0]
