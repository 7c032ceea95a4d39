"""Property: replacing one privacy unit changes at most one chunk and never m (chunking).

Over random datasets (``tests.strategies.unit_replacements``): at example level the record at
one position is replaced by another record; at group level one whole group is replaced by a
group of any size under the same id, its records placed anywhere in the file. For a fixed
secret seed, the two chunk plans must have the same m, equal to ``planned_num_chunks`` (a
function of public counts), and differ in at most one chunk.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings

from client.activations.chunking import make_chunks, planned_num_chunks
from client.data.records import Record, SiteDataset
from tests.strategies import unit_replacements


def _record(name: str, group: str | None) -> Record:
    # Chunking never opens an image: the paths need not exist.
    return Record(name, Path(f"/data/{name}.png"), f"question {name}", (f"answer {name}",), group)


def _units(sizes: list[int], unit: str) -> list[list[Record]]:
    def group(u: int) -> str | None:
        return None if unit == "example" else f"g{u:03d}"

    return [[_record(f"u{u}r{i}", group(u)) for i in range(size)] for u, size in enumerate(sizes)]


def _interleaved(units: list[list[Record]]) -> list[Record]:
    """Records in a file order that mixes units (round robin), as real exports do."""
    longest = max(len(u) for u in units)
    return [u[i] for i in range(longest) for u in units if i < len(u)]


@settings(max_examples=300, deadline=None)
@given(case=unit_replacements())
def test_replacing_one_unit_changes_at_most_one_chunk_and_never_m(case):
    # Arrange
    unit = case["privacy_unit"]
    units = _units(case["sizes"], unit)
    original = _interleaved(units)
    replaced = case["replaced"]
    old_ids = {r.id for r in units[replaced]}
    group = units[replaced][0].group
    newcomers = [_record(f"new{i}", group) for i in range(case["new_size"])]
    if unit == "example":
        neighbour = [newcomers[0] if r.id in old_ids else r for r in original]
    else:
        rest = [r for r in original if r.id not in old_ids]
        cut = int(case["insert_at"] * len(rest))
        neighbour = rest[:cut] + newcomers + rest[cut:]
    datasets = [
        SiteDataset(tuple(records), task="t", privacy_unit=unit)
        for records in (original, neighbour)
    ]
    shots, max_chunks, seed = case["shots"], case["max_chunks"], case["seed"]

    # Act
    plans = [make_chunks(d, shots=shots, seed=seed, max_chunks=max_chunks) for d in datasets]

    # Assert
    planned = [planned_num_chunks(d, shots, max_chunks) for d in datasets]
    assert len(plans[0]) == len(plans[1]) == planned[0] == planned[1] >= 1
    differing = sum(a != b for a, b in zip(plans[0].chunks, plans[1].chunks, strict=True))
    assert differing <= 1
    # Every chunk that differs is the one that held the replaced unit.
    for before, after in zip(plans[0].chunks, plans[1].chunks, strict=True):
        if before != after:
            assert old_ids & {r.id for r in before.records}
