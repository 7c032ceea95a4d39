"""Fakes for the task-agnostic choice tests: a held-out task's queries scored by its heads."""

from __future__ import annotations

from typing import Any

import torch

from client.public.selection import AttributionTerms


def ranking_terms(gains: torch.Tensor, dim: int) -> AttributionTerms:
    """Attribution terms whose gain is ``gains`` (L, H) whatever reference is patched in.

    Public heads are ranked by each task's gains against the centre (``rank_heads``); a test
    that scripts the ranking gives its tasks these, and keeps its queries' own terms
    (``PublicTask.chunk_terms``) for the votes.
    """
    return AttributionTerms(torch.zeros(*gains.shape, dim), -gains)


class ShareOf:
    """Queries each answered right when their favourite head is patched.

    Query q's favourite is the q-th of ``favourites`` in order, cyclically, so over all
    ``count`` queries (a multiple of their number) the accuracy is the share of
    ``favourites`` among the patched heads; 0.0 unpatched. A patch is (HeadSet, values), as
    ``QuerySet.accuracy`` and ``QuerySet.predictions`` take it.
    """

    def __init__(self, favourites: set[tuple[int, int]], count: int) -> None:
        self.favourites = sorted(favourites)
        self.count = count

    def predictions(self, loaded: Any, patch: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        patched = set() if patch is None else set(patch[0].heads)
        right = [self.favourites[q % len(self.favourites)] in patched for q in range(self.count)]
        answers = torch.ones(self.count, dtype=torch.long)
        return torch.tensor(right, dtype=torch.long), answers

    def accuracy(self, loaded: Any, patch: Any = None) -> float:
        guesses, answers = self.predictions(loaded, patch)
        return float((guesses == answers).float().mean())
