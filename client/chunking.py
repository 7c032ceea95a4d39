"""Cut a site's dataset into disjoint chunks of K demonstrations and one query (design §1 step 1).

One chunk is one K-shot forward pass and one clipped contribution to the secure sum, so the
chunk is what the DP sensitivity bound counts. The cut is built so that one neighbouring
change moves exactly one chunk.

**Example level** (``privacy_unit == "example"``): draw a permutation of the n record
*positions*, take m = floor(n / (K+1)) consecutive blocks of K+1, and make the last record of
each block its query. No record is in two chunks. The permutation depends only on n and the
seed, never on record contents, so replacing the record at one position (n public) changes
exactly one chunk and leaves the others identical: Δ₂ of the chunk sum is one chunk's.

**Group level** (``privacy_unit == "group"``, user-level DP, notes/mtv.md §7 item 9): a
group's records always share ONE chunk. Groups are ordered by group id, then permuted; whole
groups are packed greedily in that order ("next fit"): a group that does not fit in the
current chunk's remaining room closes it, the unfilled chunk's records are dropped (unused),
and the group starts the next chunk. A group larger than K+1 keeps only its first K+1 records
(in file order) and is counted in ``truncated_groups``. The layout depends only on the seed
and the sequence of group sizes, which are treated as public. Neighbouring relation: replace
one group by another group of the same size; exactly one chunk changes.

**The seed is secret.** Production callers pass :func:`dpmtv_common.rng.secret_seed` (a
128-bit CSPRNG draw) and the site never shares it. For a fixed seed the bounds above hold
when the replacing unit takes the replaced unit's position. A secret, uniform shuffle also
covers replacements that move a unit (a new group id sorts elsewhere): pairing each
permutation for one dataset with the permutation that puts the new unit where the old one
was is a measure-preserving bijection under which exactly one chunk differs, and (ε, δ)-DP
survives such equal-weight mixtures (joint convexity of the hockey-stick divergence). Anyone
who knows the seed can also tell which records shared a chunk; others must not reproduce it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from client.data import Record, SiteDataset
from dpmtv_common.errors import ConfigError, DataError
from dpmtv_common.rng import make_rng

__all__ = ["Chunk", "ChunkPlan", "make_chunks", "num_chunks"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Chunk:
    """K demonstrations and the query that follows them in one prompt.

    Attributes:
        demonstrations: The K records shown with their primary answers.
        query: The record asked without its answer; never among ``demonstrations``.
    """

    demonstrations: tuple[Record, ...]
    query: Record

    @property
    def records(self) -> tuple[Record, ...]:
        """All K+1 records, demonstrations first."""
        return (*self.demonstrations, self.query)


@dataclass(frozen=True)
class ChunkPlan:
    """The chunks of one site and what was left out.

    Attributes:
        chunks: Disjoint chunks, m of them (the site's m_i).
        num_unused: Records in no chunk: the remainder, dropped partial chunks, records cut
            from truncated groups, and everything past ``max_chunks``.
        truncated_groups: Groups larger than K+1 that were cut to K+1 records (group level).
    """

    chunks: tuple[Chunk, ...]
    num_unused: int
    truncated_groups: int = 0

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


def make_chunks(
    dataset: SiteDataset, *, shots: int, seed: int, max_chunks: int | None = None
) -> ChunkPlan:
    """Shuffle the records with ``seed`` and cut disjoint chunks of ``shots`` + 1 records.

    Args:
        dataset: The site's records and privacy unit.
        shots: K, demonstrations per chunk; each chunk also holds one query.
        seed: The shuffle seed. In production pass :func:`dpmtv_common.rng.secret_seed` and
            keep it at the site: the shuffle must not be reproducible by anyone else.
        max_chunks: Keep at most this many chunks (the rest of the records are unused).

    Raises:
        ConfigError: ``shots`` < 1, ``max_chunks`` < 1, or ``seed`` < 0.
        DataError: Fewer than K+1 records, or (group level) no chunk could be filled.
    """
    _check_shots(shots)
    if max_chunks is not None and max_chunks < 1:
        raise ConfigError(f"max_chunks must be >= 1 or None, got {max_chunks!r}.")
    if seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}.")
    size = shots + 1
    n = len(dataset.records)
    if n < size:
        raise DataError(
            f"one chunk needs shots + 1 = {size} records, got n = {n}; lower shots or add data."
        )
    rng = make_rng(seed)
    if dataset.privacy_unit == "group":
        blocks, truncated = _pack_groups(dataset.records, size, rng, max_chunks)
    else:
        blocks, truncated = _cut_examples(dataset.records, size, rng, max_chunks), 0
    chunks = tuple(Chunk(demonstrations=block[:-1], query=block[-1]) for block in blocks)
    return ChunkPlan(chunks, num_unused=n - len(chunks) * size, truncated_groups=truncated)


def _check_shots(shots: int) -> None:
    if shots < 1:
        raise ConfigError(f"shots must be >= 1, got {shots!r}.")


def _cut_examples(
    records: Sequence[Record], size: int, rng: np.random.Generator, limit: int | None
) -> list[tuple[Record, ...]]:
    # The permutation is drawn over positions 0..n-1 before any record is looked at.
    order = rng.permutation(len(records))
    count = len(records) // size if limit is None else min(len(records) // size, limit)
    return [tuple(records[i] for i in order[c * size : (c + 1) * size]) for c in range(count)]


def _pack_groups(
    records: Sequence[Record], size: int, rng: np.random.Generator, limit: int | None
) -> tuple[list[tuple[Record, ...]], int]:
    groups = _group_records(records)
    # Sorting the ids first makes the layout a function of the seed and the group sizes only,
    # not of file or dict order.
    ids = sorted(groups)
    blocks: list[tuple[Record, ...]] = []
    current: list[Record] = []
    truncated = 0
    for index in rng.permutation(len(ids)):
        members = groups[ids[index]]
        if len(members) > size:
            members, truncated = members[:size], truncated + 1
        if len(current) + len(members) > size:
            current = []  # next fit: never split a group; the unfilled chunk is dropped
        current.extend(members)
        if len(current) == size:
            blocks.append(tuple(current))
            current = []
            if len(blocks) == limit:
                break
    if truncated:
        _log.warning("truncated %d groups larger than shots + 1 = %d records", truncated, size)
    if not blocks:
        sizes = sorted((len(g) for g in groups.values()), reverse=True)
        raise DataError(
            f"no chunk of exactly {size} records can be packed from whole groups of sizes "
            f"{sizes[:10]}{'...' if len(sizes) > 10 else ''}; lower shots or merge data."
        )
    return blocks, truncated


def _group_records(records: Sequence[Record]) -> dict[str, list[Record]]:
    groups: dict[str, list[Record]] = {}
    for record in records:
        if record.group is None:
            # SiteDataset already refuses this; checked again because a chunk that mixed an
            # ungrouped record into a group's chunk would break the group-level bound.
            raise DataError(f"group-level chunking needs a group on record {record.id!r}.")
        groups.setdefault(record.group, []).append(record)
    return groups
