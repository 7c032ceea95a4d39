"""Batch invariance of extraction on a CUDA device (marked ``gpu``; skipped without CUDA).

The CPU tests (``test_data_independence.py``) show that a chunk's contribution does not move
by a single bit with its batch-mates or with another record's prompt length. GPU kernels
choose their algorithms by shape, and bfloat16 is the GPU default, where left-padded batches
moved batch-mates by ~2e-3: this repeats both checks there. Run with
``pytest tests/unit/client/test_data_independence_gpu.py -m gpu`` on a GPU machine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from client.activations.chunking import make_chunks
from client.activations.extraction import chunk_contributions
from client.data.records import load_dataset
from client.models import TINY_ARCHITECTURES, LoadedModel, adapter_for, build_tiny_model
from dpmtv_common.heads import HeadSet
from tests.site_data import QUESTION, write_site

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SEED = 2**255 + 12345
HEADS = HeadSet.of([(0, 0), (0, 3), (1, 1), (1, 2)])


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 12-record site and its neighbour whose record r5 has a much longer question."""
    site = tmp_path_factory.mktemp("gpu-site")
    write_site(site, 12)
    neighbour = tmp_path_factory.mktemp("gpu-neighbour") / "site"
    shutil.copytree(site, neighbour)
    lines = (neighbour / "manifest.jsonl").read_text(encoding="utf-8").splitlines()
    row = json.loads(lines[5])
    row["question"] = QUESTION + " Please look closely." * 10
    lines[5] = json.dumps(row)
    (neighbour / "manifest.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return site, neighbour


@pytest.fixture(params=[(a, d) for a in TINY_ARCHITECTURES for d in ("bfloat16", "float32")])
def on_gpu(request) -> LoadedModel:
    arch, dtype = request.param
    built, processor = build_tiny_model(arch, seed=1234)
    model: Any = built  # transformers types .to() through a decorator mypy cannot follow
    model = model.to(device="cuda", dtype=getattr(torch, dtype)).eval()
    return LoadedModel(model, processor, adapter_for(model), f"sha256:gpu-{arch}")


def contributions(loaded: LoadedModel, chunks, batch_size: int = 4) -> list[np.ndarray]:
    return list(
        chunk_contributions(loaded, chunks, heads=HEADS, clip_norm=0.3, batch_size=batch_size)
    )


def test_on_cuda_one_records_prompt_length_moves_no_other_chunk(on_gpu, sites):
    original, changed = (
        make_chunks(load_dataset(root), shots=2, seed=SEED).chunks for root in sites
    )

    before, after = contributions(on_gpu, original), contributions(on_gpu, changed)

    hit = next(i for i, c in enumerate(original) if "r5" in {r.id for r in c.records})
    moved = [
        i for i, (a, b) in enumerate(zip(before, after, strict=True)) if not np.array_equal(a, b)
    ]
    assert moved == [hit]


def test_on_cuda_a_chunk_keeps_its_bits_whoever_its_batch_mate_is(on_gpu, sites):
    c0, c1, _c2, c3 = make_chunks(load_dataset(sites[0]), shots=2, seed=SEED).chunks

    first = contributions(on_gpu, [c0, c1], batch_size=2)
    mate_changed = contributions(on_gpu, [c0, c3], batch_size=2)

    assert np.array_equal(first[0], mate_changed[0])
    assert not np.array_equal(first[0], first[1])
