"""The demo's public choices, made as `dpmtv-site select-heads` makes them (no privacy cost).

Task-agnostic (the default): the public sets are labelled examples of the domain's *other*
tasks, none of the private task (``public-<task>`` folders). From them alone
(``client.public.tasks``, ``client.public.scope``): the centre, public heads or private
selection among public candidates, k and C', by holding each public task out under the noise
this very release will add. With a single ``public`` folder (your own data without public sets
of other tasks): the heads attribution ranks first on it and C scored with the planned noise
(``client.public.clip``), uncentred.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from client.activations.chunking import make_chunks
from client.data.records import load_dataset
from client.models import LoadedModel
from client.public.clip import PlannedNoise, choose_clip_norm
from client.public.scope import HeadsMode, PlannedRelease, ScopeChoice, choose_scope
from client.public.selection import public_activations, select_heads_attribution
from client.public.tasks import public_task
from dpmtv_common.heads import HeadSet

__all__ = ["PublicChoice", "public_task_folders", "task_agnostic_choice", "single_set_choice"]


@dataclass
class PublicChoice:
    """What the run config takes from the public data, and how to say it."""

    config: dict[str, object]
    summary: str
    centre_heads: HeadSet | None = None  # heads the public-only baseline patches the centre into
    scope: ScopeChoice | None = None


def public_task_folders(data: Path) -> list[Path]:
    """The ``public-<task>`` folders of a data folder (task-agnostic public sets)."""
    return sorted(p for p in data.glob("public-*") if p.is_dir())


def _heads_text(heads: HeadSet) -> str:
    return ",".join(f"{layer}:{head}" for layer, head in heads.heads)


def task_agnostic_choice(
    loaded: LoadedModel, folders: list[Path], args: argparse.Namespace, *,
    planned: dict[HeadsMode, PlannedRelease], work: Path, step: Callable[[str], None],
) -> PublicChoice:  # fmt: skip
    """Centre, heads mode, k and C' from public sets of other tasks (module docstring)."""
    tasks = []
    for folder in folders:
        dataset = load_dataset(folder)
        step(f"public task {dataset.task!r}: its chunks and its head gains")
        tasks.append(public_task(loaded, dataset, shots=args.shots, max_chunks=30, max_queries=30))
    ks = sorted({max(1, args.heads // 2), args.heads})
    mode = None if args.heads_mode is None else HeadsMode(args.heads_mode)
    choice = choose_scope(loaded, tasks, planned=planned, ks=ks, mode=mode, progress=step)
    centre_file = work / "centre.safetensors"
    choice.centre.save(centre_file)
    config: dict[str, object] = {
        "clip-norm": choice.clip_norm,
        "centre-path": str(centre_file),
        "num-selected-heads": choice.k,
        "order": "select-first",
    }
    if choice.mode is HeadsMode.PUBLIC:
        config |= {"selection": "public", "public-heads": _heads_text(choice.heads)}
    else:  # private mode always names its candidates
        candidates = choice.candidates or choice.heads
        config |= {"selection": "private", "candidate-heads": _heads_text(candidates)}
    summary = (
        f"task-agnostic public data ({', '.join(t.name for t in tasks)}; none the private "
        f"task): centred, {choice.mode.value} heads, {choice.order} (held-out: "
        + ", ".join(f"{name} {acc:.2f}" for name, acc in choice.options_tried)
        + f"), k = {choice.k}, C' = {choice.factor:g} x {choice.scale:.3g}"
    )
    return PublicChoice(config, summary, choice.heads, choice)


def single_set_choice(
    loaded: LoadedModel, public: Path, args: argparse.Namespace, *,
    planned_noise: Callable[[HeadSet], PlannedNoise], step: Callable[[str], None],
) -> PublicChoice:  # fmt: skip
    """Candidates and C from one labelled public set (uncentred; module docstring)."""
    dataset = load_dataset(public)
    chunks = make_chunks(dataset, shots=args.shots, seed=0).chunks
    step(f"public activations of {len(chunks)} public chunks")
    acts = public_activations(loaded, chunks, progress=False, instruction=dataset.instruction)
    queries = [chunk.query for chunk in chunks]
    mean = acts.mean(0)
    carried = len(loaded.adapter.head_shape(loaded.model).layout().all_heads())
    candidates = select_heads_attribution(
        loaded, mean, queries, k=min(2 * args.heads, carried), instruction=dataset.instruction
    )
    top = select_heads_attribution(loaded, mean, queries, k=args.heads)
    step(f"C for the top {args.heads} heads, each multiple of the median scored")
    clip = choose_clip_norm(
        loaded, acts, top, list(dataset.records), instruction=dataset.instruction,
        planned=planned_noise(top),
    )  # fmt: skip
    config: dict[str, object] = {
        "clip-norm": clip.clip_norm,
        "num-selected-heads": args.heads,
        "selection": "private",
        "candidate-heads": _heads_text(candidates),
        "order": "select-first",  # C was chosen for the k selected heads, not whole layers
    }
    summary = (
        f"one labelled public set ({dataset.task!r}): uncentred, private selection among "
        f"{len(candidates)} candidates, C = {clip.clip_norm / clip.median:g} x public median"
    )
    return PublicChoice(config, summary)
