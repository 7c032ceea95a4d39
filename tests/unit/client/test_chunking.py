import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client.activations.chunking import ChunkPlan, make_chunks, num_chunks, planned_num_chunks
from client.data.records import Record, SiteDataset
from dpmtv_common.errors import ConfigError, DataError
from dpmtv_common.rng import secret_seed

SEED = 20240611


def _records(n: int, groups: list[str] | None = None) -> tuple[Record, ...]:
    # Chunking never opens an image, so the paths need not exist.
    return tuple(
        Record(
            id=f"r{i}",
            image_path=Path(f"/data/{i}.png"),
            question=f"question {i}",
            answers=(f"answer {i}",),
            group=None if groups is None else groups[i],
        )
        for i in range(n)
    )


def _examples(n: int) -> SiteDataset:
    return SiteDataset(_records(n), task="t")


def _grouped(sizes: list[int]) -> SiteDataset:
    labels = [f"g{g:03d}" for g, size in enumerate(sizes) for _ in range(size)]
    return SiteDataset(_records(len(labels), labels), task="t", privacy_unit="group")


def _ids(plan: ChunkPlan) -> list[list[str]]:
    return [[r.id for r in chunk.records] for chunk in plan.chunks]


def _assert_disjoint(plan: ChunkPlan) -> None:
    used = [record_id for chunk in _ids(plan) for record_id in chunk]
    assert len(used) == len(set(used))


def test_example_chunks_are_disjoint_and_cover_m_times_k_plus_one_records():
    # Arrange
    dataset, shots = _examples(23), 4

    # Act
    plan = make_chunks(dataset, shots=shots, seed=SEED)

    # Assert
    assert len(plan) == num_chunks(23, shots) == 4
    assert all(len(chunk.demonstrations) == shots for chunk in plan.chunks)
    _assert_disjoint(plan)
    assert plan.num_unused == 23 - 4 * 5
    assert (plan.truncated_groups, plan.padded_groups) == (0, 0)


def test_query_is_never_among_its_demonstrations():
    plan = make_chunks(_examples(40), shots=3, seed=SEED)

    assert all(chunk.query not in chunk.demonstrations for chunk in plan.chunks)
    assert all(chunk.records[-1] == chunk.query for chunk in plan.chunks)


def test_chunks_are_deterministic_for_a_seed_and_differ_for_another():
    dataset = _examples(50)

    first = make_chunks(dataset, shots=4, seed=SEED)
    again = make_chunks(dataset, shots=4, seed=SEED)
    other = make_chunks(dataset, shots=4, seed=SEED + 1)

    assert first == again
    assert _ids(first) != _ids(other)


def test_a_secret_256_bit_seed_is_accepted():
    plan = make_chunks(_examples(10), shots=1, seed=secret_seed())

    assert len(plan) == 5


@pytest.mark.parametrize("position", [0, 7, 19, 24])
def test_replacing_one_record_changes_exactly_one_chunk(position):
    # Arrange: same position, entirely different content.
    records = list(_records(25))
    original = make_chunks(SiteDataset(tuple(records), task="t"), shots=3, seed=SEED)
    records[position] = Record("intruder", Path("/other.png"), "other?", ("other",))

    # Act
    changed = make_chunks(SiteDataset(tuple(records), task="t"), shots=3, seed=SEED)

    # Assert
    differing = [a != b for a, b in zip(original.chunks, changed.chunks, strict=True)]
    was_used = any(f"r{position}" in chunk for chunk in _ids(original))
    assert sum(differing) == (1 if was_used else 0)


def test_max_chunks_caps_the_plan_and_counts_the_rest_unused():
    plan = make_chunks(_examples(30), shots=2, seed=SEED, max_chunks=4)

    assert len(plan) == 4
    assert plan.num_unused == 30 - 4 * 3


def test_invalid_arguments_are_refused_with_the_numbers():
    dataset = _examples(4)

    with pytest.raises(ConfigError, match=r"shots must be >= 1, got 0"):
        make_chunks(dataset, shots=0, seed=SEED)
    with pytest.raises(DataError, match=r"shots \+ 1 = 5 records, got n = 4"):
        make_chunks(dataset, shots=4, seed=SEED)
    with pytest.raises(ConfigError, match=r"max_chunks must be >= 1"):
        make_chunks(dataset, shots=1, seed=SEED, max_chunks=0)
    with pytest.raises(ConfigError, match=r"seed must be"):
        make_chunks(dataset, shots=1, seed=-1)


def test_num_chunks_is_floor_of_n_over_k_plus_one():
    assert [num_chunks(n, 4) for n in (0, 4, 5, 9, 10, 401)] == [0, 0, 1, 1, 2, 80]
    with pytest.raises(ConfigError, match=r"shots must be >= 1"):
        num_chunks(10, 0)
    with pytest.raises(ConfigError, match=r"n must be >= 0"):
        num_chunks(-1, 2)


def _group_of(plan: ChunkPlan) -> dict[str, set[int]]:
    chunks_of: dict[str, set[int]] = {}
    for index, chunk in enumerate(plan.chunks):
        for record in chunk.records:
            chunks_of.setdefault(str(record.group), set()).add(index)
    return chunks_of


def test_each_group_is_exactly_one_chunk_of_its_own_records():
    # Arrange
    sizes = [1, 2, 3, 1, 2, 4, 1, 1, 3, 2, 2, 1, 9]
    dataset = _grouped(sizes)

    # Act
    plan = make_chunks(dataset, shots=3, seed=SEED)

    # Assert: m is the number of groups, every chunk holds one group only
    assert len(plan) == len(sizes) == planned_num_chunks(dataset, 3, None)
    assert all(len(chunk.records) == 4 for chunk in plan.chunks)
    assert all({r.group for r in chunk.records} == {chunk.query.group} for chunk in plan.chunks)
    assert all(len(indices) == 1 for indices in _group_of(plan).values())
    assert len(_group_of(plan)) == len(sizes)


def test_large_groups_are_sampled_without_replacement_and_small_ones_repeat_their_own():
    # Arrange
    dataset = _grouped([7, 4, 9, 2, 1])

    # Act
    plan = make_chunks(dataset, shots=3, seed=SEED)

    # Assert
    assert (plan.truncated_groups, plan.padded_groups) == (2, 2)
    for chunk in plan.chunks:
        ids = [r.id for r in chunk.records]
        group_size = sum(r.group == chunk.query.group for r in dataset.records)
        # every record of a small group appears; a large group's four are distinct
        assert len(set(ids)) == min(group_size, 4)
    assert plan.num_unused == (7 - 4) + (9 - 4)


def test_a_one_record_group_fills_its_chunk_with_that_record():
    plan = make_chunks(_grouped([1]), shots=3, seed=SEED)

    assert [r.id for r in plan.chunks[0].records] == ["r0"] * 4


def test_group_sampling_is_uniform_enough_to_use_every_record():
    # A group of 9 gives 4 records a draw; over seeds every record must turn up.
    dataset = _grouped([9])

    seen = {
        r.id
        for seed in range(40)
        for r in make_chunks(dataset, shots=3, seed=seed).chunks[0].records
    }

    assert seen == {f"r{i}" for i in range(9)}


@pytest.mark.parametrize("new_size", [1, 2, 4, 9])
def test_replacing_one_group_by_a_group_of_any_size_changes_one_chunk_and_not_m(new_size):
    # Arrange: group g004 (size 2) is replaced by new records under the same group id.
    sizes = [1, 2, 3, 1, 2, 1, 3, 2, 1, 2]
    dataset = _grouped(sizes)
    kept = tuple(r for r in dataset.records if r.group != "g004")
    newcomers = tuple(
        Record(f"new{i}", Path(f"/new/{i}.png"), "other?", ("x",), group="g004")
        for i in range(new_size)
    )
    neighbour = dataclasses.replace(dataset, records=kept + newcomers)

    # Act
    original = make_chunks(dataset, shots=3, seed=SEED)
    changed = make_chunks(neighbour, shots=3, seed=SEED)

    # Assert
    assert len(original) == len(changed) == len(sizes)
    differing = [a != b for a, b in zip(original.chunks, changed.chunks, strict=True)]
    assert sum(differing) == 1
    assert original.chunks[differing.index(True)].query.group == "g004"


def test_group_max_chunks_is_respected():
    dataset = _grouped([2] * 20)

    plan = make_chunks(dataset, shots=3, seed=SEED, max_chunks=3)

    assert len(plan) == 3 == planned_num_chunks(dataset, 3, 3)
    assert plan.num_unused == 40 - 6


def test_planned_num_chunks_reads_only_public_counts():
    assert planned_num_chunks(_examples(23), 4, None) == 4
    assert planned_num_chunks(_examples(23), 4, 2) == 2
    assert planned_num_chunks(_examples(3), 4, None) == 0
    assert planned_num_chunks(_grouped([5, 1, 1]), 4, None) == 3
    with pytest.raises(ConfigError, match=r"max_chunks must be >= 1"):
        planned_num_chunks(_examples(3), 1, 0)


def test_a_256_bit_seed_is_used_in_full():
    # Seeds that differ only above bit 128 must give different chunks.
    dataset = _examples(40)
    low = make_chunks(dataset, shots=3, seed=5)
    high = make_chunks(dataset, shots=3, seed=5 + 2**200)

    assert _ids(low) != _ids(high)
    with pytest.raises(ConfigError, match=r"seed must be an integer in \[0, 2\*\*256\)"):
        make_chunks(dataset, shots=3, seed=2**256)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 80), shots=st.integers(1, 12), seed=st.integers(0, 2**256 - 1))
def test_example_chunks_property_disjoint_and_counted(n, shots, seed):
    dataset = SiteDataset(_records(n), task="t")
    if n < shots + 1:
        with pytest.raises(DataError):
            make_chunks(dataset, shots=shots, seed=seed)
        return

    plan = make_chunks(dataset, shots=shots, seed=seed)

    assert len(plan) == num_chunks(n, shots)
    assert plan.num_unused == n - len(plan) * (shots + 1)
    _assert_disjoint(plan)


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(1, 8), min_size=1, max_size=25), shots=st.integers(1, 6))
def test_group_chunks_property_one_group_a_chunk(sizes, shots):
    dataset = _grouped(sizes)

    plan = make_chunks(dataset, shots=shots, seed=SEED)

    assert len(plan) == len(sizes)
    assert all(len(chunk.records) == shots + 1 for chunk in plan.chunks)
    assert all(len(indices) == 1 for indices in _group_of(plan).values())
    assert plan.truncated_groups == sum(size > shots + 1 for size in sizes)
    assert plan.padded_groups == sum(size < shots + 1 for size in sizes)
