"""Fast accuracy for single-token answers: one forward per batch, inputs tokenised once.

For answers of one token, greedy generation is right exactly when the first generated token
is the answer, so a forward pass per batch measures what ``evaluate`` measures with
``generate`` — much faster, which matters when many noisy releases are scored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt
import torch
from transformers import BatchFeature

from client.hooks import PatchPolicy, patch_heads
from client.models import LoadedModel, Prompt
from client.scoring import answer_token_ids
from dpmtv_common.heads import HeadSet

__all__ = ["QuerySet"]


@dataclass
class QuerySet:
    """Prompts tokenised once (images included), with the answer's token id per prompt."""

    batches: list[BatchFeature]
    targets: list[torch.Tensor]

    @classmethod
    def build(
        cls,
        loaded: LoadedModel,
        prompts: Sequence[Prompt],
        answers: Sequence[str],
        size: int = 50,
        *,
        instruction: str | None = None,
    ) -> QuerySet:
        """Tokenise ``prompts`` in batches of ``size`` (with the dataset's ``instruction``)."""
        ids = answer_token_ids(loaded, answers)
        batches, targets = [], []
        for start in range(0, len(prompts), size):
            chunk = prompts[start : start + size]
            batches.append(
                loaded.adapter.build_batch_inputs(loaded.processor, chunk, instruction=instruction)
            )
            targets.append(ids[start : start + size])
        return cls(batches, targets)

    @torch.no_grad()
    def predictions(
        self,
        loaded: LoadedModel,
        patch: tuple[HeadSet, npt.NDArray[Any] | torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy first-token predictions and the answer tokens, optionally patched."""
        predicted = []
        for inputs in self.batches:
            batch = inputs.to(loaded.model.device)
            if patch is None:
                logits = loaded.model(**batch).logits[:, -1]
            else:
                heads, values = patch
                with patch_heads(
                    loaded.model, loaded.adapter, heads, values, policy=PatchPolicy.EVERY_CALL
                ):
                    logits = loaded.model(**batch).logits[:, -1]
            predicted.append(logits.argmax(-1).cpu())
        return torch.cat(predicted), torch.cat(self.targets)

    def accuracy(
        self,
        loaded: LoadedModel,
        patch: tuple[HeadSet, npt.NDArray[Any] | torch.Tensor] | None = None,
    ) -> float:
        """Share of prompts whose greedy first token is the answer, optionally patched."""
        guesses, answers = self.predictions(loaded, patch)
        return float((guesses == answers).float().mean())
