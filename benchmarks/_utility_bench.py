"""One task's benchmark state (content-disjoint data, public choices, the oracle) and its rows."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from _utility_lib import CachedSums, make_plan, release, score

from client.activations.chunking import make_chunks
from client.activations.extraction import extract_clipped_sum, zero_shot_prompt
from client.data.records import Record, SiteDataset, load_dataset
from client.data.synthetic import write_task_datasets
from client.evaluation.first_token import QuerySet
from client.inference.answers import rescale_heads
from client.models import LoadedModel, load_model
from client.public.selection import public_activations, select_heads_attribution
from client.release.single_holder import LocalSums
from dpmtv_common.heads import HeadSet
from dpmtv_common.privacy.noise import secure_noise
from protocol import ReleaseOrder, SelectionMode

_MODELS: dict[Path, LoadedModel] = {}


@dataclass
class Bench:
    """What every measurement of one task shares."""

    loaded: LoadedModel
    task: str
    shots: int
    heads: int
    public_heads: HeadSet
    clip_norm: float  # median per-layer norm over all heads on public data (C0)
    head_norm: float  # median per-head norm on public data (the rescaling target)
    test: QuerySet
    validation: QuerySet
    test_records: list[Record]
    validation_records: list[Record]
    public_records: list[Record]
    pooled: SiteDataset
    mtv_mean: np.ndarray  # non-private MTV: unclipped mean of the pooled chunks, (L*H, D)
    oracle_heads: HeadSet
    majority: float  # share of the most frequent answer among the test queries
    shape: tuple[int, int]
    votes: dict  # vote sums shared by every C (votes do not depend on C)
    chunk_activations: np.ndarray | None = None  # (m, L, H, D) of the pooled chunks, if kept


def _queries(loaded: LoadedModel, records: list[Record]) -> QuerySet:
    return QuerySet.build(
        loaded, [zero_shot_prompt(r) for r in records], [r.answer for r in records]
    )


def _model(path: Path) -> LoadedModel:
    if path not in _MODELS:
        _MODELS[path] = load_model(path, device="cpu")
    return _MODELS[path]


def setup(args, model: Path, root: Path, task: str, *, per_chunk: bool = False) -> Bench:
    """Write the task's content-disjoint folders and compute everything public or oracle."""
    loaded = _model(model)
    shape = loaded.adapter.head_shape(loaded.model)
    write_task_datasets(
        root,
        task=task,
        sites=1,
        per_site=args.pooled,
        public=args.public,
        test=args.test,
        validation=args.validation,
        seed=args.seed,
    )
    pooled = load_dataset(root / "site-0")
    public = load_dataset(root / "public")
    test = list(load_dataset(root / "test").records)
    validation = list(load_dataset(root / "validation").records)
    public_chunks = make_chunks(public, shots=args.shots, seed=0).chunks
    acts = public_activations(loaded, public_chunks, progress=False)
    public_heads = select_heads_attribution(
        loaded, acts.mean(0), [c.query for c in public_chunks], k=args.heads
    )
    all_heads = shape.all_heads()
    chunks = make_chunks(pooled, shots=args.shots, seed=1).chunks
    chunk_activations = None
    if per_chunk:  # one pass a chunk, kept: every later scope and draw reads it
        chunk_activations = public_activations(loaded, chunks, progress=False).double().numpy()
        mtv_mean = chunk_activations.mean(0).reshape(shape.num_layers * shape.num_heads, -1)
    else:
        unclipped = extract_clipped_sum(
            loaded, chunks, heads=all_heads, clip_norm=1e12, progress=False
        )
        mtv_mean = unclipped.total / unclipped.num_chunks
    import torch

    oracle = select_heads_attribution(
        loaded,
        torch.as_tensor(
            mtv_mean.reshape(shape.num_layers, shape.num_heads, -1), dtype=torch.float32
        ),
        validation,
        k=args.heads,
    )
    answers = Counter(r.answer for r in test)
    return Bench(
        loaded=loaded,
        task=task,
        shots=args.shots,
        heads=args.heads,
        public_heads=public_heads,
        clip_norm=float(acts.flatten(2).norm(dim=-1).median()),
        head_norm=float(acts.norm(dim=-1).median()),
        test=_queries(loaded, test),
        validation=_queries(loaded, validation),
        test_records=test,
        validation_records=validation,
        public_records=list(public.records),
        pooled=pooled,
        mtv_mean=mtv_mean,
        oracle_heads=oracle,
        majority=answers.most_common(1)[0][1] / len(test),
        shape=(shape.num_layers, shape.num_heads),
        votes={},
        chunk_activations=chunk_activations,
    )


def local_sums(bench: Bench, clip: float) -> CachedSums:
    chunks = make_chunks(bench.pooled, shots=bench.shots, seed=1).chunks
    plan = make_plan(
        epsilon=1.0,
        selection=SelectionMode.ALL,
        order=ReleaseOrder.SELECT_FIRST,
        shots=bench.shots,
        clip_norm=clip,
        heads=bench.heads,
        public_heads=None,
        fingerprint=bench.loaded.fingerprint,
    )
    return CachedSums(LocalSums(bench.loaded, chunks, plan, progress=False), votes=bench.votes)


def _rows_of(bench: Bench, heads: HeadSet) -> np.ndarray:
    index = heads.to_array()
    return bench.mtv_mean[index[:, 0] * bench.shape[1] + index[:, 1]]


def mtv_row(bench: Bench, heads: HeadSet, name: str, queries: QuerySet | None = None) -> dict:
    """Non-private MTV (unclipped mean of the same chunks) patched into ``heads``."""
    scored = score(bench.loaded, queries or bench.test, (heads, _rows_of(bench, heads)))
    return {
        "name": name,
        "accuracy": scored.accuracy,
        "modal_share": scored.modal_share,
        "|S|": len(heads),
        "L": heads.num_layers_in_scope,
    }


def dp_row(
    bench: Bench,
    sums: CachedSums,
    *,
    epsilon: float,
    selection: SelectionMode,
    order: ReleaseOrder,
    rescale: bool,
    queries: QuerySet,
    draws: int,
    name: str,
    clip: float | None = None,
) -> dict:
    """Mean over ``draws`` releases, with MTV on the same heads and the collapse share."""
    clip = clip or bench.clip_norm
    plan = make_plan(
        epsilon=epsilon,
        selection=selection,
        order=order,
        shots=bench.shots,
        clip_norm=clip,
        heads=bench.heads,
        public_heads=bench.public_heads,
        fingerprint=bench.loaded.fingerprint,
    )
    noise = secure_noise()
    accuracy, modal, same, snr, recall = [], [], [], [], []
    same_cache: dict[HeadSet, float] = {}
    for _ in range(draws):
        outcome = release(plan, sums, bench.loaded, noise)
        values = outcome.values
        if rescale:  # post-processing to the public typical norm: no privacy cost
            values = rescale_heads(values, target_norm=bench.head_norm)
        scored = score(bench.loaded, queries, (outcome.heads, values))
        accuracy.append(scored.accuracy)
        modal.append(scored.modal_share)
        if outcome.heads not in same_cache:
            same_cache[outcome.heads] = score(
                bench.loaded, queries, (outcome.heads, _rows_of(bench, outcome.heads))
            ).accuracy
        same.append(same_cache[outcome.heads])
        snr.append(outcome.signal_to_noise)
        oracle = set(bench.oracle_heads.heads)
        recall.append(len(oracle & set(outcome.heads.heads)) / len(oracle))
    row = {
        "name": name,
        "accuracy": statistics.mean(accuracy),
        "spread": statistics.pstdev(accuracy),
        "same_heads_mtv": statistics.mean(same),
        "modal_share": statistics.mean(modal),
        "SNR": statistics.mean(snr),
        "m": outcome.num_chunks,
        "C": clip,
        "|S|": len(outcome.heads),
        "L": outcome.gaussian_heads.num_layers_in_scope,
        "sigma": outcome.noise_std,
        "epsilon": epsilon,
        "selection": selection.value,
        "order": order.value,
    }
    if selection is SelectionMode.PRIVATE:
        row["recall"] = statistics.mean(recall)
    return row


def private_plan(bench: Bench, k: int):
    """An eps = 1 private select-first plan with ``k`` picks at the task's public clip norm."""
    return make_plan(
        epsilon=1.0,
        selection=SelectionMode.PRIVATE,
        order=ReleaseOrder.SELECT_FIRST,
        shots=bench.shots,
        clip_norm=bench.clip_norm,
        heads=k,
        public_heads=None,
        fingerprint=bench.loaded.fingerprint,
    )
