"""One record moves one chunk and nothing else, on the real extraction path (issue 9).

Every check runs the real pipeline: a dataset on disk, ``load_dataset``, ``make_chunks``
with a secret-style seed, the tiny random model's forward passes through the hooks, per-layer
clipping, and ``LocalSums`` (what the single-holder release and the federated site both
call). Contributions are compared bit for bit (``np.array_equal``), never with a tolerance:
the sensitivity argument assumes the other chunks do not move at all.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import client.activations.fixed_shape as fixed_shape
from client.activations.chunking import Chunk, make_chunks
from client.activations.extraction import chunk_contributions, chunk_prompt, extract_clipped_sum
from client.activations.scoring import chunk_votes
from client.data.records import SiteDataset, load_dataset, write_jsonl_dataset
from client.models import LoadedModel
from client.release.single_holder import LocalSums
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadSet
from protocol import PROTOCOL_VERSION, ReleaseOrder, ReleasePlan, SelectionMode
from tests.site_data import QUESTION, write_site

SEED = 0x1F2E3D4C5B6A79880000000000000000FFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF  # 256 bits
SHOTS = 2
RECORDS = 12  # 4 chunks of 2 shots + 1 query
HEADS = HeadSet.of([(0, 0), (0, 3), (1, 1), (1, 2)])
CLIP = 0.3


def contributions(loaded: LoadedModel, chunks, batch_size: int = 4) -> list[np.ndarray]:
    return list(
        chunk_contributions(loaded, chunks, heads=HEADS, clip_norm=CLIP, batch_size=batch_size)
    )


def differing_chunks(first: list[np.ndarray], second: list[np.ndarray]) -> list[int]:
    assert len(first) == len(second)
    return [
        i for i, (a, b) in enumerate(zip(first, second, strict=True)) if not np.array_equal(a, b)
    ]


def chunk_holding(chunks: tuple[Chunk, ...], record_id: str) -> int:
    return next(i for i, c in enumerate(chunks) if record_id in {r.id for r in c.records})


def copy_site(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def rewrite_row(root: Path, index: int, **changes: str) -> None:
    lines = (root / "manifest.jsonl").read_text(encoding="utf-8").splitlines()
    row = json.loads(lines[index])
    row.update(changes)
    lines[index] = json.dumps(row)
    (root / "manifest.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("independence-site")
    write_site(root, RECORDS)
    return root


@pytest.fixture(params=["float32", "bfloat16"])
def typed(request, tiny) -> LoadedModel:
    """The tiny model in float32, or a bfloat16 copy (the GPU default, where batching hurt most)."""
    model = (
        tiny.model if request.param == "float32" else copy.deepcopy(tiny.model).to(torch.bfloat16)
    )
    return LoadedModel(model, tiny.processor, tiny.adapter, f"sha256:test-{tiny.arch}")


def test_one_records_prompt_length_moves_no_other_chunk_by_a_single_bit(typed, site, tmp_path):
    # Arrange: record r5's question grows by 40 words, so its chunk's prompt is much longer
    neighbour = copy_site(site, tmp_path / "neighbour")
    rewrite_row(neighbour, 5, question=QUESTION + " Please look closely." * 10)
    original = make_chunks(load_dataset(site), shots=SHOTS, seed=SEED).chunks
    changed = make_chunks(load_dataset(neighbour), shots=SHOTS, seed=SEED).chunks

    # Act
    before, after = contributions(typed, original), contributions(typed, changed)

    # Assert: only r5's chunk moved, every other chunk is bit-identical
    assert differing_chunks(before, after) == [chunk_holding(original, "r5")]


@pytest.mark.parametrize("tiny", ["llava"], indirect=True)
@pytest.mark.parametrize("position", [0, 4, 11])
def test_replacing_one_record_changes_at_most_one_chunk_and_never_m(
    loaded, site, tmp_path, position
):
    # Arrange: the record at one position gets another image, question and answer
    neighbour = copy_site(site, tmp_path / "neighbour")
    shutil.copy(neighbour / "img3.png", neighbour / f"img{position}.png")
    rewrite_row(neighbour, position, question="Which shape is it?", answer="square")
    plan = _plan(loaded)
    original = make_chunks(load_dataset(site), shots=SHOTS, seed=SEED).chunks
    changed = make_chunks(load_dataset(neighbour), shots=SHOTS, seed=SEED).chunks

    # Act
    before, after = contributions(loaded, original), contributions(loaded, changed)
    sums = [LocalSums(loaded, chunks, plan, progress=False) for chunks in (original, changed)]

    # Assert
    assert len(differing_chunks(before, after)) <= 1
    assert {s.activation_sum(HEADS).num_chunks for s in sums} == {len(original)}
    assert {s.vote_sum(None).num_chunks for s in sums} == {len(original)}


@pytest.mark.parametrize("tiny", ["llava"], indirect=True)
def test_a_record_corrupted_after_load_zeroes_its_chunk_only_and_keeps_m(
    loaded, site, tmp_path, caplog
):
    # Arrange: the dataset is loaded (and checked), then one image is truncated on disk
    working = copy_site(site, tmp_path / "working")
    dataset = load_dataset(working)
    chunks = make_chunks(dataset, shots=SHOTS, seed=SEED).chunks
    before = contributions(loaded, chunks)
    image = working / "img7.png"
    image.write_bytes(image.read_bytes()[:60])
    plan = _plan(loaded)

    # Act
    with caplog.at_level(logging.WARNING, logger="client.activations.extraction"):
        after = contributions(loaded, chunks)
        summed = LocalSums(loaded, chunks, plan, progress=False).activation_sum(HEADS)
        votes = list(chunk_votes(loaded, chunks, top_r=2))

    # Assert
    hit = chunk_holding(chunks, "r7")
    assert differing_chunks(before, after) == [hit]
    assert not after[hit].any()
    assert not votes[hit].any()
    assert all(v.sum() == 2 for i, v in enumerate(votes) if i != hit)
    assert summed.num_chunks == len(chunks)
    np.testing.assert_array_equal(summed.total, np.sum([c for c in after], axis=0))
    assert "extract: 1 of 4 chunks failed" in caplog.text


def test_a_chunks_contribution_is_bit_identical_whoever_its_batch_mates_are(typed, site):
    # Arrange: batches of 2; each chunk keeps its position (its row) but its mate changes.
    # (The row is part of a chunk's public identity: a kernel may treat rows differently.)
    c0, c1, c2, c3 = make_chunks(load_dataset(site), shots=SHOTS, seed=SEED).chunks

    # Act
    first = contributions(typed, [c0, c1], batch_size=2)
    mate_changed = contributions(typed, [c0, c3], batch_size=2)
    other_first = contributions(typed, [c2, c1], batch_size=2)

    # Assert
    assert np.array_equal(first[0], mate_changed[0])
    assert np.array_equal(first[1], other_first[1])


def _poisoned(loaded: LoadedModel, chunk: Chunk, failure: str):
    """Hooks that make exactly the rows of ``chunk``'s prompt fail (NaN or an exception)."""
    target = fixed_shape._prompt_inputs(loaded, chunk_prompt(chunk), None)["input_ids"][0]
    hit_rows: list[int] = []

    def find_rows(module, args, kwargs):
        ids = kwargs["input_ids"]
        hit_rows[:] = [
            row for row in range(ids.shape[0]) if torch.equal(ids[row, -len(target) :], target)
        ]
        if hit_rows and failure == "raise":
            raise RuntimeError("out of memory on a long prompt")

    def poison(module, args):
        hidden = args[0].clone()
        hidden[hit_rows] = float("nan")
        return (hidden, *args[1:])

    first_projection = loaded.adapter.output_projections(loaded.model)[0]
    return [
        loaded.model.register_forward_pre_hook(find_rows, with_kwargs=True),
        first_projection.register_forward_pre_hook(poison),
    ]


@pytest.mark.parametrize("tiny", ["llava"], indirect=True)
@pytest.mark.parametrize("failure", ["nan", "raise"])
def test_non_finite_or_raising_forward_zeroes_that_chunk_only(loaded, site, failure):
    # Arrange: chunk 2's rows turn NaN inside the model, or its forward pass raises
    chunks = make_chunks(load_dataset(site), shots=SHOTS, seed=SEED).chunks
    before = contributions(loaded, chunks)
    handles = _poisoned(loaded, chunks[2], failure)

    # Act
    try:
        summed = extract_clipped_sum(loaded, chunks, heads=HEADS, clip_norm=CLIP, progress=False)
        after = contributions(loaded, chunks)
    finally:
        for handle in handles:
            handle.remove()

    # Assert: the batch-mates keep their exact bits, even when the shared pass raised
    assert differing_chunks(before, after) == [2]
    assert not after[2].any()
    expected = np.zeros_like(before[0])
    for i, contribution in enumerate(before):
        expected += 0 if i == 2 else contribution
    np.testing.assert_array_equal(summed.total, expected)
    assert (summed.num_chunks, summed.num_replaced) == (4, 1)


@pytest.mark.parametrize("tiny", ["llava"], indirect=True)
def test_configuration_errors_are_raised_not_turned_into_zero_chunks(loaded, site):
    chunks = make_chunks(load_dataset(site), shots=SHOTS, seed=SEED).chunks

    with pytest.raises(ConfigError, match=r"heads must lie within 2 layers x 4 heads"):
        extract_clipped_sum(
            loaded, chunks, heads=HeadSet.of([(2, 0)]), clip_norm=1.0, progress=False
        )
    with pytest.raises(ConfigError, match=r"clip_norm"):
        extract_clipped_sum(loaded, chunks, heads=HEADS, clip_norm=0.0, progress=False)


@pytest.mark.parametrize("tiny", ["llava"], indirect=True)
@pytest.mark.parametrize("new_size", [1, 5])
def test_replacing_one_group_changes_one_chunk_and_not_m_on_the_real_path(
    loaded, tmp_path, new_size
):
    # Arrange: 4 groups of sizes 1..4; group "g2" is replaced by a group of another size
    (tmp_path / "images").mkdir()
    source = write_site(tmp_path / "images", 14)
    rows = [
        {"image": str(r.image_path.name), "question": r.question, "answer": r.answer, "group": g}
        for r, g in zip(source.records, ["g0"] + ["g1"] * 2 + ["g2"] * 3 + ["g3"] * 4, strict=False)
    ]
    replacement = [
        {
            "image": f"img{10 + i % 4}.png",
            "question": "Which shape?",
            "answer": "circle",
            "group": "g2",
        }
        for i in range(new_size)
    ]
    images = tmp_path / "images"
    original = _group_site(images, tmp_path / "original", rows)
    kept = [r for r in rows if r["group"] != "g2"]
    neighbour = _group_site(images, tmp_path / "neighbour", kept + replacement)

    # Act
    chunks = [make_chunks(d, shots=SHOTS, seed=SEED).chunks for d in (original, neighbour)]
    before, after = (contributions(loaded, c) for c in chunks)

    # Assert
    assert len(chunks[0]) == len(chunks[1]) == 4
    assert differing_chunks(before, after) == [
        next(i for i, c in enumerate(chunks[0]) if c.query.group == "g2")
    ]


def _group_site(images: Path, root: Path, rows: list[dict[str, str]]) -> SiteDataset:
    root.mkdir()
    for row in rows:
        shutil.copy(images / row["image"], root / row["image"])
    write_jsonl_dataset(root, rows, task="t", privacy_unit="group")
    return load_dataset(root)


def _plan(loaded: LoadedModel) -> ReleasePlan:
    return ReleasePlan(
        protocol_version=PROTOCOL_VERSION,
        release_id="independence",
        task="shapes",
        model_fingerprint=loaded.fingerprint,
        epsilon=1.0,
        delta=1e-5,
        shots=SHOTS,
        clip_norm=CLIP,
        selection=SelectionMode.PRIVATE,
        order=ReleaseOrder.SELECT_FIRST,
        num_selected_heads=2,
        public_heads=None,
        selection_share=0.5,
        score_top_r=2,
        min_sites=1,
        max_chunks_per_site=None,
        created="2026-01-01T00:00:00+00:00",
    )
