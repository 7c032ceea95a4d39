"""Zero-shot, K-shot ICL and (non-private) task-vector accuracy per synthetic task.

The embedded model's documented accuracies come from :func:`score_tasks` (run after
training, stored beside the weights as ``scores.json``); CI re-runs it on the shipped weights
and compares. The task vector here is MTV without privacy: the mean last-token activation of
K-shot prompts from public chunks, patched into the k heads that attribution picks on the same
public data.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from client.activations.chunking import make_chunks
from client.activations.extraction import zero_shot_prompt
from client.data.records import load_dataset
from client.data.synthetic import TRAINED_TASKS, write_task_datasets
from client.evaluation.first_token import QuerySet
from client.evaluation.run import icl_prompts
from client.models import LoadedModel
from client.public.selection import public_activations, select_heads_attribution

__all__ = ["TaskScores", "score_tasks"]


@dataclass(frozen=True)
class TaskScores:
    """Accuracies on one task's test set (first answer token, greedy)."""

    task: str
    zero_shot: float
    icl: float
    task_vector: float
    heads: list[list[int]]

    def as_dict(self) -> dict[str, object]:
        """JSON-ready."""
        return asdict(self)


def _score_task(
    loaded: LoadedModel, root: Path, task: str, *, shots: int, heads: int, sizes: tuple[int, int]
) -> TaskScores:
    write_task_datasets(
        root, task=task, sites=0, per_site=1, public=sizes[0], test=sizes[1], seed=7
    )
    public = load_dataset(root / "public")
    test = list(load_dataset(root / "test").records)
    answers = [r.answer for r in test]
    zero = QuerySet.build(loaded, [zero_shot_prompt(r) for r in test], answers)
    icl = QuerySet.build(loaded, icl_prompts(test, public.records, shots=shots, seed=0), answers)
    chunks = make_chunks(public, shots=shots, seed=0).chunks
    mean = public_activations(loaded, chunks, progress=False).mean(0)
    chosen = select_heads_attribution(loaded, mean, [c.query for c in chunks], k=heads)
    index = chosen.to_array()
    vector = mean[index[:, 0], index[:, 1]]
    return TaskScores(
        task=task,
        zero_shot=zero.accuracy(loaded),
        icl=icl.accuracy(loaded),
        task_vector=zero.accuracy(loaded, (chosen, vector)),
        heads=[list(h) for h in chosen.heads],
    )


def score_tasks(
    loaded: LoadedModel,
    workdir: Path,
    *,
    tasks: tuple[str, ...] = TRAINED_TASKS,
    shots: int = 4,
    heads: int = 4,
    public: int = 150,
    test: int = 200,
) -> list[TaskScores]:
    """Score ``tasks`` (default: the trained ones) with fixed data seeds (deterministic here)."""
    return [
        _score_task(loaded, workdir / task, task, shots=shots, heads=heads, sizes=(public, test))
        for task in tasks
    ]
