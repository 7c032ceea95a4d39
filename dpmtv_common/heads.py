"""Sets of attention heads: the scope of a task-vector release."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from dpmtv_common.aliases import Int64Array, LayerHead
from dpmtv_common.errors import ConfigError

__all__ = ["HeadSet"]


@dataclass(frozen=True)
class HeadSet:
    """A sorted, duplicate-free set of ``(layer, head)`` pairs.

    Row ``i`` of every activation array in a release belongs to ``heads[i]``; keeping one
    canonical order means sites, coordinator and artifact agree on the layout without
    sending it twice.
    """

    heads: tuple[LayerHead, ...]

    def __post_init__(self) -> None:
        canonical = tuple(sorted(set(self.heads)))
        if canonical != self.heads:
            raise ConfigError(f"heads must be sorted and unique, got {self.heads!r}.")
        for layer, head in self.heads:
            if layer < 0 or head < 0:
                raise ConfigError(f"layer and head indices must be >= 0, got {(layer, head)!r}.")

    @classmethod
    def of(cls, heads: Iterable[tuple[int, int]]) -> HeadSet:
        """Build a head set from pairs in any order (duplicates collapse)."""
        return cls(tuple(sorted({(int(layer), int(head)) for layer, head in heads})))

    @classmethod
    def all_heads(cls, *, num_layers: int, num_heads: int) -> HeadSet:
        """Every head of a model with ``num_layers`` layers of ``num_heads`` heads."""
        if num_layers < 1 or num_heads < 1:
            raise ConfigError(
                f"num_layers and num_heads must be >= 1, got {num_layers!r} and {num_heads!r}."
            )
        return cls(tuple((layer, head) for layer in range(num_layers) for head in range(num_heads)))

    def __len__(self) -> int:
        return len(self.heads)

    @property
    def layers(self) -> tuple[int, ...]:
        """The distinct layers that hold at least one head of the set, ascending."""
        return tuple(sorted({layer for layer, _ in self.heads}))

    @property
    def num_layers_in_scope(self) -> int:
        """How many layers the set touches (``L_scope``; it sets the Gaussian sensitivity)."""
        return len(self.layers)

    def row_layers(self) -> Int64Array:
        """The layer of each row, as an int64 array of length ``len(self)``."""
        return np.array([layer for layer, _ in self.heads], dtype=np.int64)

    def to_array(self) -> Int64Array:
        """The pairs as an int64 array of shape ``(len(self), 2)``."""
        return np.array(self.heads, dtype=np.int64).reshape(len(self.heads), 2)

    @classmethod
    def from_array(cls, array: Int64Array) -> HeadSet:
        """Inverse of :meth:`to_array`; rejects arrays that are not ``(n, 2)`` sorted pairs."""
        if array.ndim != 2 or array.shape[1] != 2:
            raise ConfigError(f"head array must have shape (n, 2), got {array.shape!r}.")
        return cls(tuple((int(layer), int(head)) for layer, head in array))
