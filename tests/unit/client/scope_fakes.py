"""Fakes for the task-agnostic choice tests: a held-out task's queries scored by its heads."""

from __future__ import annotations

from typing import Any


class ShareOf:
    """Queries whose accuracy is the share of ``favourites`` among the patched heads.

    0.0 unpatched; a patch is (HeadSet, values), as ``QuerySet.accuracy`` takes it.
    """

    def __init__(self, favourites: set[tuple[int, int]]) -> None:
        self.favourites = favourites

    def accuracy(self, loaded: Any, patch: Any = None) -> float:
        if patch is None:
            return 0.0
        return len(self.favourites & set(patch[0].heads)) / len(self.favourites)
