"""Scoring answers: VQA accuracy for open answers, exact match for classification."""

from __future__ import annotations

from client.evaluation.metrics import (
    exact_match,
    normalize_answer,
    vqa_accuracy,
)
from client.evaluation.run import EvaluationMode, EvaluationResult, evaluate, icl_prompts

__all__ = [
    "EvaluationMode",
    "EvaluationResult",
    "evaluate",
    "exact_match",
    "icl_prompts",
    "normalize_answer",
    "vqa_accuracy",
]
