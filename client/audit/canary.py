"""The canary of an empirical privacy audit: which record to plant, where, and in what scope.

``client.audit.empirical`` audits a release configuration on a neighbouring pair: the site's data,
and the same data with ONE record replaced by a canary (:func:`plant_canary`, a replace-one
neighbour). :func:`canary_candidates` writes extreme candidate records (noise, black, white,
an inverted record; a frequent and a rare answer); :func:`choose_canary` keeps the candidate
and position that move their chunk's clipped contribution most, measured with the production
extraction code over the heads the plan's Gaussian covers (:func:`audited_heads`). Canary
content is public and fixed (seeded), never DP noise.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from client.activations.chunking import Chunk, make_chunks
from client.activations.extraction import chunk_contributions
from client.data.records import Record, SiteDataset
from client.models import LoadedModel
from dpmtv_common.aliases import Float64Array
from dpmtv_common.errors import ConfigError
from dpmtv_common.heads import HeadLayout, HeadSet
from protocol import ReleaseOrder, ReleasePlan, SelectionMode, gaussian_heads

__all__ = [
    "audited_heads",
    "canary_candidates",
    "changed_chunks",
    "choose_canary",
    "plant_canary",
    "releases_whole_scope",
]


def releases_whole_scope(plan: ReleasePlan) -> bool:
    """Whether run_release's output is exactly the Gaussian's scope (no heads dropped after)."""
    if plan.selection is SelectionMode.ALL:
        return True
    return plan.selection is SelectionMode.PUBLIC and plan.order is ReleaseOrder.SELECT_FIRST


def audited_heads(plan: ReleasePlan, layout: HeadLayout) -> HeadSet:
    """The scope of the Gaussian draw the plan fixes; every carried head where picks decide it."""
    return gaussian_heads(plan, layout) or layout.all_heads()


def plant_canary(dataset: SiteDataset, canary: Record, *, index: int) -> SiteDataset:
    """``dataset`` with record ``index`` replaced by ``canary`` (a replace-one neighbour)."""
    if not 0 <= index < len(dataset.records):
        raise ConfigError(
            f"index must lie in [0, {len(dataset.records)}), got {index!r} (the canary replaces "
            "one existing record)."
        )
    if dataset.privacy_unit == "group":
        canary = replace(canary, group=dataset.records[index].group)
    records = list(dataset.records)
    records[index] = replace(canary, id=records[index].id)
    return replace(dataset, records=tuple(records))


def changed_chunks(first: Sequence[Chunk], second: Sequence[Chunk]) -> int:
    """How many chunks differ between two cuts of a neighbouring pair (1 for replace-one)."""
    return sum(a != b for a, b in zip(first, second, strict=True))


def canary_candidates(dataset: SiteDataset, folder: Path) -> list[Record]:
    """Canary records to try, their images written to ``folder``.

    Extreme images (noise, black, white, an inverted record), each with a frequent and a rare
    answer of ``dataset``: the audit keeps the one that moves its chunk most.
    """
    folder.mkdir(parents=True, exist_ok=True)
    first = dataset.records[0]
    size = first.load_image().size
    rng = np.random.default_rng(0)  # public canary content, not DP noise
    images = {
        "noise": Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)),
        "black": Image.new("RGB", size, (0, 0, 0)),
        "white": Image.new("RGB", size, (255, 255, 255)),
        "inverted": ImageOps.invert(first.load_image()),
    }
    counts = Counter(r.answer for r in dataset.records)
    answers = dict.fromkeys([counts.most_common()[0][0], counts.most_common()[-1][0]])
    candidates = []
    for name, image in images.items():
        path = folder / f"canary-{name}.png"
        image.save(path)
        for answer in answers:
            candidates.append(Record(f"canary-{name}", path, first.question, (answer,)))
    return candidates


def choose_canary(
    loaded: LoadedModel,
    dataset: SiteDataset,
    candidates: Sequence[Record],
    plan: ReleasePlan,
    *,
    chunk_seed: int,
) -> tuple[Record, int, float]:
    """The canary and position that move their chunk's clipped contribution most.

    Positions tried: the query and the first demonstration of the first chunk. Returns the
    canary, the index of the record it replaces and ‖Δ‖ of that chunk's contribution.
    """
    heads = audited_heads(plan, loaded.adapter.head_shape(loaded.model).layout())

    def first_chunk(data: SiteDataset) -> Chunk:
        cut = make_chunks(
            data, shots=plan.shots, seed=chunk_seed, max_chunks=plan.max_chunks_per_site
        )
        return cut.chunks[0]

    target = first_chunk(dataset)
    index_of = {record.id: i for i, record in enumerate(dataset.records)}
    positions = [index_of[target.query.id], index_of[target.demonstrations[0].id]]

    def contribution(chunk: Chunk) -> Float64Array:
        (rows,) = chunk_contributions(loaded, [chunk], heads=heads, clip_norm=plan.clip_norm)
        return rows

    base = contribution(target)
    best: tuple[Record, int, float] | None = None
    for index in positions:
        for candidate in candidates:
            planted = plant_canary(dataset, candidate, index=index)
            distance = float(np.linalg.norm(contribution(first_chunk(planted)) - base))
            if best is None or distance > best[2]:
                best = (candidate, index, distance)
    if best is None:
        raise ConfigError("candidates must hold at least one canary record, got none.")
    return best
