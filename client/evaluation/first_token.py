"""Fast accuracy for single-token answers: one forward per batch, inputs tokenised once.

Whether the first greedy token is the answer's first token: one forward per batch instead of
a generation, which matters when many noisy releases are scored. It bounds what ``evaluate``
measures from above, not equals it: ``evaluate`` scores the whole first answer span, and a
patched model that names the answer and then goes on ("blue square4 right" for "blue")
counts here and not there.

**Prefix cache.** A task vector is patched at the last position only, and attention is
causal: every position before the last computes the same keys and values whatever the patch.
So a query set runs its prompts but the last token once (unpatched), keeps the KV cache, and
scores each patch with a one-token step on it — on a 135M decoder about thirty times faster
than a full pass for each of the many noisy releases a benchmark or a clip choice scores.
The cached path is checked once against full passes (same greedy tokens, unpatched and with a
probe patch) and not used where it differs or where the model's cache cannot be cut back
(``DynamicCache.crop``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy.typing as npt
import torch
from transformers import BatchFeature

from client.activations.hooks import PatchPolicy, patch_heads
from client.activations.scoring import answer_token_ids
from client.models import LoadedModel, Prompt
from dpmtv_common.heads import HeadSet

__all__ = ["QuerySet"]

_Patch = tuple[HeadSet, npt.NDArray[Any] | torch.Tensor] | None


@contextmanager
def _patched(loaded: LoadedModel, patch: _Patch) -> Iterator[None]:
    if patch is None:
        yield
        return
    heads, values = patch
    with patch_heads(loaded.model, loaded.adapter, heads, values, policy=PatchPolicy.EVERY_CALL):
        yield


def _per_token(value: object, ids: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and tuple(value.shape[:2]) == tuple(ids.shape)


def _run_prefix(loaded: LoadedModel, inputs: BatchFeature) -> _Prefix:
    """Run every prompt of a left-padded batch but its last token; keep the cache."""
    batch = dict(inputs.to(loaded.model.device))
    ids = batch["input_ids"]
    # Every per-token input (ids, mask, token types) loses its last column; images stay whole.
    prefix = {
        key: value[:, :-1] if _per_token(value, ids) else value for key, value in batch.items()
    }
    out = loaded.model(**prefix, use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    length = ids.shape[1] - 1
    last = {
        "input_ids": ids[:, -1:],
        "attention_mask": batch["attention_mask"],
        "cache_position": torch.tensor([length], device=ids.device),
    }
    return _Prefix(cache, length, last)


@dataclass
class _Prefix:
    """One batch's prompts but the last token, run once: its cache and the last step's inputs."""

    cache: Any
    length: int
    last: dict[str, torch.Tensor]


@dataclass
class QuerySet:
    """Prompts tokenised once (images included), with the answer's token id per prompt."""

    batches: list[BatchFeature]
    targets: list[torch.Tensor]
    prefixes: list[_Prefix] | None = field(default=None, repr=False)
    cached: bool | None = field(default=None, repr=False)  # None: not checked yet

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
        if self.cached is None:
            self.cached = self._check_cached(loaded, patch)
        run = self._cached_logits if self.cached else self._full_logits
        predicted = [run(loaded, index, patch).argmax(-1).cpu() for index in range(len(self))]
        return torch.cat(predicted), torch.cat(self.targets)

    def __len__(self) -> int:
        return len(self.batches)

    def _full_logits(self, loaded: LoadedModel, index: int, patch: _Patch) -> torch.Tensor:
        batch = self.batches[index].to(loaded.model.device)
        with _patched(loaded, patch):
            logits: torch.Tensor = loaded.model(**batch).logits[:, -1]
        return logits

    def _cached_logits(self, loaded: LoadedModel, index: int, patch: _Patch) -> torch.Tensor:
        if self.prefixes is None:
            self.prefixes = [_run_prefix(loaded, batch) for batch in self.batches]
        prefix = self.prefixes[index]
        try:
            with _patched(loaded, patch):
                out = loaded.model(**prefix.last, cache=prefix.cache, use_cache=True)
        finally:  # back to the prompt minus its last token, whatever the step appended
            grown = int(prefix.cache.get_seq_length()) - prefix.length
            if grown > 0:
                prefix.cache.crop(-grown)
        logits: torch.Tensor = out.logits[:, -1]
        return logits

    def _check_cached(self, loaded: LoadedModel, patch: _Patch) -> bool:
        """Whether the cached step gives the full passes' greedy tokens here (module doc)."""
        try:
            probes: list[_Patch] = [None] if patch is None else [None, patch]
            for probe in probes:
                for index in range(len(self)):
                    full = self._full_logits(loaded, index, probe).argmax(-1)
                    step = self._cached_logits(loaded, index, probe).argmax(-1)
                    if not torch.equal(full, step):
                        return False
        except Exception:
            return False  # a cache without crop, or a model whose step needs more inputs
        return True

    def accuracy(
        self,
        loaded: LoadedModel,
        patch: tuple[HeadSet, npt.NDArray[Any] | torch.Tensor] | None = None,
    ) -> float:
        """Share of prompts whose greedy first token is the answer, optionally patched."""
        guesses, answers = self.predictions(loaded, patch)
        return float((guesses == answers).float().mean())
