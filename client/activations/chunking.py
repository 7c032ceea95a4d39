"""Cut a site's dataset into disjoint chunks of K demonstrations and one query (design §1 step 1).

One chunk is one K-shot forward pass and one clipped contribution to the secure sum, so the
chunk is what the DP sensitivity bound counts. The cut is built so that one neighbouring
change moves at most one chunk and never the chunk count m, which depends only on public
counts (:func:`planned_num_chunks`).

**Randomness.** Every random choice comes from :class:`dpmtv_common.rng.KeyStream`: ChaCha20
keyed by the site's 256-bit secret seed (:func:`dpmtv_common.rng.secret_seed`), read with
rejection sampling into Fisher-Yates, so each permutation is exactly uniform and only the
site can reproduce it. The same seed gives the same chunks, which is how a site recomputes
one release's chunks for each of its secure sums. Nothing here reads a record's content.

**Example level** (``privacy_unit == "example"``; neighbours replace one record, n public):
draw a uniform permutation of the n record *positions*, take m = floor(n / (K+1)) consecutive
blocks of K+1 (at most ``max_chunks``), and make the last record of each block its query. No
record is in two chunks. The permutation depends only on n and the seed, so replacing the
record at one position changes exactly the one chunk that holds it (or none) and leaves m
and every other chunk identical: Δ₂ of the chunk sum is one chunk's.

**Group level** (``privacy_unit == "group"``, user-level DP; neighbours replace one whole
group by another group of any size, the number of groups G public). The rule:

1. *Each group is exactly one chunk*, so m = min(G, ``max_chunks``), whatever the sizes.
2. The groups, sorted by id, are put in a uniform secret order; the first m get the chunk
   slots 0..m-1.
3. Slot c draws its own uniform permutation of its group's records (in file order) from an
   independent stream (label = c) and reads it cyclically until it has K+1 records: a group
   larger than K+1 contributes K+1 of its records chosen uniformly without replacement
   (counted in ``truncated_groups``); a smaller one is filled up by reading its own records
   again (counted in ``padded_groups``), so a chunk may show one record more than once — only
   ever a record of the same group. The last record read is the query.

A chunk is thus a function of the seed, its slot and its own group's records only. Replacing
one group (same position in the sorted ids) by any other group changes at most that group's
chunk and never m, at any seed. No other group's records are ever dropped for lack of room,
and no record of one group ever enters another group's chunk.

**Why a secret uniform shuffle also covers moved units.** For a fixed seed the bounds above
hold when the replacing unit takes the replaced unit's position. A replacement that moves a
unit (a new group id sorts elsewhere) is covered by the uniform secret order: pairing each
permutation for one dataset with the permutation that puts the new unit where the old one
was is a measure-preserving bijection under which at most one chunk differs, and (ε, δ)-DP
survives such equal-weight mixtures (joint convexity of the hockey-stick divergence). Anyone
who knows the seed can also tell which records shared a chunk; others must not reproduce it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from client.data.records import Record, SiteDataset
from dpmtv_common.errors import ConfigError, DataError
from dpmtv_common.rng import KeyStream

__all__ = ["Chunk", "ChunkPlan", "make_chunks", "num_chunks", "planned_num_chunks"]

_log = logging.getLogger(__name__)

# Stream labels: each random choice has its own independent stream, so the draws of one
# choice (how many records a group has) can never shift another's.
_EXAMPLE_ORDER = b"chunking/example-order"
_GROUP_ORDER = b"chunking/group-order"
_GROUP_SLOT = b"chunking/group-slot/"


@dataclass(frozen=True)
class Chunk:
    """K demonstrations and the query that follows them in one prompt.

    Attributes:
        demonstrations: The K records shown with their primary answers.
        query: The record asked without its answer. At example level it is never among
            ``demonstrations``; at group level a small group's chunk may repeat a record.
    """

    demonstrations: tuple[Record, ...]
    query: Record

    @property
    def records(self) -> tuple[Record, ...]:
        """All K+1 records, demonstrations first."""
        return (*self.demonstrations, self.query)


@dataclass(frozen=True)
class ChunkPlan:
    """The chunks of one site and what was left out (local bookkeeping, never sent).

    Attributes:
        chunks: Disjoint chunks, m of them (the site's m_i, :func:`planned_num_chunks`).
        num_unused: Records in no chunk: the remainder, records not drawn from large groups,
            and everything past ``max_chunks``.
        truncated_groups: Groups larger than K+1 of which K+1 records were drawn.
        padded_groups: Groups smaller than K+1 whose records were read again to fill a chunk.
    """

    chunks: tuple[Chunk, ...]
    num_unused: int
    truncated_groups: int = 0
    padded_groups: int = 0

    def __len__(self) -> int:
        return len(self.chunks)


def num_chunks(n: int, shots: int) -> int:
    """The example-level chunk count m = floor(n / (K+1)), without loading any image.

    Args:
        n: Number of records.
        shots: K, demonstrations per chunk.

    Raises:
        ConfigError: ``shots`` < 1 or ``n`` < 0.
    """
    _check_shots(shots)
    if n < 0:
        raise ConfigError(f"n must be >= 0, got {n!r}.")
    return n // (shots + 1)


def planned_num_chunks(dataset: SiteDataset, shots: int, max_chunks: int | None) -> int:
    """The m_i that :func:`make_chunks` will cut, from public counts only (call at plan time).

    Example level: min(floor(n / (K+1)), ``max_chunks``). Group level: min(number of groups,
    ``max_chunks``). Never reads a record's content, so a site can announce it before any
    data is touched; 0 means the site cannot take part in this plan.

    Raises:
        ConfigError: ``shots`` < 1 or ``max_chunks`` < 1.
    """
    _check_shots(shots)
    _check_max_chunks(max_chunks)
    if dataset.privacy_unit == "group":
        available = len(_group_records(dataset.records))
    else:
        available = num_chunks(len(dataset.records), shots)
    return available if max_chunks is None else min(available, max_chunks)


def make_chunks(
    dataset: SiteDataset, *, shots: int, seed: int, max_chunks: int | None = None
) -> ChunkPlan:
    """Cut ``dataset`` into :func:`planned_num_chunks` chunks of ``shots`` + 1 records.

    Args:
        dataset: The site's records and privacy unit.
        shots: K, demonstrations per chunk; each chunk also holds one query.
        seed: The 256-bit shuffle key. In production pass
            :func:`dpmtv_common.rng.secret_seed` and keep it at the site: the shuffle must not
            be reproducible by anyone else.
        max_chunks: Keep at most this many chunks (the rest of the records are unused).

    Raises:
        ConfigError: ``shots`` < 1, ``max_chunks`` < 1, or ``seed`` outside ``[0, 2**256)``.
        DataError: No chunk can be cut (example level: fewer than K+1 records).
    """
    _check_shots(shots)
    _check_max_chunks(max_chunks)
    size = shots + 1
    m = planned_num_chunks(dataset, shots, max_chunks)
    if m < 1:
        raise DataError(
            f"one chunk needs shots + 1 = {size} records, got n = {len(dataset.records)}; "
            "lower shots or add data."
        )
    if dataset.privacy_unit == "group":
        return _group_chunks(dataset.records, size, seed, m)
    order = KeyStream(seed, _EXAMPLE_ORDER).permutation(len(dataset.records))
    blocks = [tuple(dataset.records[i] for i in order[c * size : (c + 1) * size]) for c in range(m)]
    chunks = tuple(Chunk(demonstrations=block[:-1], query=block[-1]) for block in blocks)
    return ChunkPlan(chunks, num_unused=len(dataset.records) - m * size)


def _check_shots(shots: int) -> None:
    if shots < 1:
        raise ConfigError(f"shots must be >= 1, got {shots!r}.")


def _check_max_chunks(max_chunks: int | None) -> None:
    if max_chunks is not None and max_chunks < 1:
        raise ConfigError(f"max_chunks must be >= 1 or None, got {max_chunks!r}.")


def _group_chunks(records: Sequence[Record], size: int, seed: int, m: int) -> ChunkPlan:
    groups = _group_records(records)
    # Sorting the ids first makes the layout a function of the seed and the groups only,
    # not of file or dict order.
    ids = sorted(groups)
    order = KeyStream(seed, _GROUP_ORDER).permutation(len(ids))
    chunks: list[Chunk] = []
    used: set[int] = set()
    truncated = padded = 0
    for slot in range(m):
        members = groups[ids[order[slot]]]
        block = _slot_block(members, size, KeyStream(seed, _GROUP_SLOT + str(slot).encode()))
        chunks.append(
            Chunk(demonstrations=tuple(records[i] for i in block[:-1]), query=records[block[-1]])
        )
        used.update(block)
        truncated += len(members) > size
        padded += len(members) < size
    if truncated or padded:
        _log.info(
            "group chunks: %d groups larger than shots + 1 = %d sampled, %d smaller ones "
            "filled by repeating their own records",
            truncated,
            size,
            padded,
        )
    num_unused = len(records) - len(used)
    return ChunkPlan(tuple(chunks), num_unused, truncated_groups=truncated, padded_groups=padded)


def _slot_block(members: Sequence[int], size: int, stream: KeyStream) -> list[int]:
    """``size`` positions read cyclically from a uniform permutation of one group's positions."""
    order = stream.permutation(len(members))
    return [members[order[i % len(members)]] for i in range(size)]


def _group_records(records: Sequence[Record]) -> dict[str, list[int]]:
    """The positions of each group's records, in file order."""
    groups: dict[str, list[int]] = {}
    for position, record in enumerate(records):
        if record.group is None:
            # SiteDataset already refuses this; checked again because a chunk that mixed an
            # ungrouped record into a group's chunk would break the group-level bound.
            raise DataError(f"group-level chunking needs a group on record {record.id!r}.")
        groups.setdefault(record.group, []).append(position)
    return groups
