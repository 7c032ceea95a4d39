"""Accuracy of a model on a labelled set: zero-shot, K-shot ICL, or patched with an artifact."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from client.activations.extraction import record_example, zero_shot_prompt
from client.data.records import Record
from client.evaluation.metrics import vqa_accuracy
from client.inference.answers import TaskVectorPatch, generate_answers
from client.models import LoadedModel, Prompt
from dpmtv_common.errors import ConfigError
from dpmtv_common.rng import make_rng

__all__ = ["EvaluationMode", "EvaluationResult", "evaluate", "icl_prompts"]


class EvaluationMode(StrEnum):
    """What answers the queries."""

    ZERO_SHOT = "zero-shot"
    ICL = "icl"
    ARTIFACT = "artifact"


@dataclass(frozen=True)
class EvaluationResult:
    """Mean VQA accuracy (exact match when one reference) over ``len(predictions)`` queries."""

    accuracy: float
    predictions: tuple[str, ...]
    scores: tuple[float, ...]


def icl_prompts(
    queries: Sequence[Record], support: Sequence[Record], *, shots: int, seed: int
) -> list[Prompt]:
    """K-shot prompts: each query gets ``shots`` demonstrations drawn from ``support``."""
    if shots < 1 or shots > len(support):
        raise ConfigError(f"shots must lie in [1, {len(support)}] (support size), got {shots!r}.")
    rng = make_rng(seed)
    prompts = []
    for query in queries:
        chosen = rng.choice(len(support), size=shots, replace=False)
        demos = [record_example(support[int(i)]) for i in chosen]
        prompts.append(Prompt.of(demos, record_example(query, with_answer=False)))
    return prompts


def evaluate(
    loaded: LoadedModel,
    queries: Sequence[Record],
    *,
    mode: EvaluationMode,
    support: Sequence[Record] = (),
    shots: int = 4,
    patch: TaskVectorPatch | None = None,
    instruction: str | None = None,
    seed: int = 0,
    max_new_tokens: int = 10,
    batch_size: int = 8,
    progress: bool = False,
) -> EvaluationResult:
    """Answer every query in ``mode`` and score it against its reference answers."""
    mode = EvaluationMode(mode)
    if not queries:
        raise ConfigError("queries must hold at least one labelled record, got none.")
    if (mode is EvaluationMode.ARTIFACT) != (patch is not None):
        raise ConfigError(f"a patch must be given exactly in artifact mode, got mode {mode}.")
    if mode is EvaluationMode.ICL:
        prompts = icl_prompts(queries, support, shots=shots, seed=seed)
    else:
        prompts = [zero_shot_prompt(record) for record in queries]
    predictions = generate_answers(
        loaded,
        prompts,
        patch=patch,
        instruction=instruction,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        progress=progress,
    )
    scores = tuple(vqa_accuracy(p, r.answers) for p, r in zip(predictions, queries, strict=True))
    return EvaluationResult(sum(scores) / len(scores), tuple(predictions), scores)
