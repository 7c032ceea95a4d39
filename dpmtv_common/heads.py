"""Sets of attention heads (the scope of a task-vector release) and a model's head layout.

Layers are always decoder-layer indices. A hybrid model (linear-attention or convolution
layers beside attention layers) has decoder layers that carry no heads: :class:`HeadLayout`
says which layers carry them, and every "all heads of the model" in a release means
``layout.all_heads()`` — never a head of a headless layer.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dpmtv_common.aliases import Float64Array, Int64Array, LayerHead
from dpmtv_common.errors import ConfigError

__all__ = ["HeadLayout", "HeadSet", "check_head_layers"]


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
        """Every head of ``num_layers`` layers of ``num_heads`` heads (every layer carrying heads).

        A model's own scope is :meth:`HeadLayout.all_heads`, which leaves out headless layers.
        """
        if num_layers < 1 or num_heads < 1:
            raise ConfigError(
                f"num_layers and num_heads must be >= 1, got {num_layers!r} and {num_heads!r}."
            )
        return cls(tuple((layer, head) for layer in range(num_layers) for head in range(num_heads)))

    @classmethod
    def of_layers(cls, layers: Iterable[int], *, num_heads: int) -> HeadSet:
        """Every head ``0..num_heads-1`` of each of ``layers`` (the heads a model carries)."""
        if num_heads < 1:
            raise ConfigError(f"num_heads must be >= 1, got {num_heads!r}.")
        return cls.of((layer, head) for layer in layers for head in range(num_heads))

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

    def rows_of(self, subset: HeadSet) -> list[int]:
        """The row of each head of ``subset`` among this set's rows (raises KeyError if absent)."""
        row = {head: index for index, head in enumerate(self.heads)}
        return [row[head] for head in subset.heads]

    def to_array(self) -> Int64Array:
        """The pairs as an int64 array of shape ``(len(self), 2)``."""
        return np.array(self.heads, dtype=np.int64).reshape(len(self.heads), 2)

    @classmethod
    def from_array(cls, array: Int64Array) -> HeadSet:
        """Inverse of :meth:`to_array`; rejects arrays that are not ``(n, 2)`` sorted pairs."""
        if array.ndim != 2 or array.shape[1] != 2:
            raise ConfigError(f"head array must have shape (n, 2), got {array.shape!r}.")
        return cls(tuple((int(layer), int(head)) for layer, head in array))


@dataclass(frozen=True)
class HeadLayout:
    """Where a model's heads are: L decoder layers of H heads, only ``head_layers`` carry them.

    Dense per-model arrays (vote histograms ``(L * H,)``, the noisy reference ``(L, H, D)``)
    keep one slot per (layer, head) of every decoder layer, so their layout never depends on
    the architecture; the slots of headless layers are never a candidate, never scored and
    never released.

    Attributes:
        num_layers: Decoder layers ``L``.
        num_heads: Heads ``H`` of a layer that carries heads.
        head_layers: The decoder layers that carry heads, strictly ascending, within
            ``[0, L)``; ``None`` means every layer (normalised to ``tuple(range(L))``).
    """

    num_layers: int
    num_heads: int
    head_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.num_heads < 1:
            raise ConfigError(
                f"num_layers and num_heads must be >= 1, got {self.num_layers!r} and "
                f"{self.num_heads!r}."
            )
        layers = tuple(range(self.num_layers)) if self.head_layers is None else self.head_layers
        check_head_layers(layers, self.num_layers)
        object.__setattr__(self, "head_layers", tuple(int(layer) for layer in layers))

    @property
    def carried_layers(self) -> tuple[int, ...]:
        """The layers that carry heads (``head_layers`` after normalisation)."""
        return self.head_layers or ()

    @property
    def dense_size(self) -> int:
        """``L * H``: the length of a dense per-head array (headless slots included)."""
        return self.num_layers * self.num_heads

    def all_heads(self) -> HeadSet:
        """Every head the model carries: the scope of "all heads" in a release."""
        return HeadSet.of_layers(self.carried_layers, num_heads=self.num_heads)

    def dense_indices(self, heads: HeadSet) -> list[int]:
        """Slot ``l * H + h`` of each head of ``heads``, in the set's order."""
        self.check_carried(heads.heads, "heads")
        return [layer * self.num_heads + head for layer, head in heads.heads]

    def candidates(self) -> list[int]:
        """The dense slots of every carried head, ascending: the candidates of a selection."""
        return self.dense_indices(self.all_heads())

    def heads_at(self, indices: Iterable[int]) -> HeadSet:
        """The heads of dense slots ``indices`` (inverse of :meth:`dense_indices`)."""
        heads = HeadSet.of(divmod(int(index), self.num_heads) for index in indices)
        self.check_carried(heads.heads, "dense slots")
        return heads

    def dense_rows(self, values: npt.ArrayLike, *, heads: HeadSet | None = None) -> Float64Array:
        """Rows ``(len(heads), D)`` placed into a dense ``(L, H, D)`` array.

        ``heads``: whose rows ``values`` holds, in order; None: every carried head. Every
        other slot (headless layers included) reads as zeros, as the hooks record them.
        """
        rows = np.asarray(values, dtype=np.float64)
        heads = self.all_heads() if heads is None else heads
        if rows.ndim != 2 or rows.shape[0] != len(heads):
            raise ConfigError(
                f"values must have shape ({len(heads)}, D), one row per head, got {rows.shape!r}."
            )
        dense = np.zeros((self.dense_size, rows.shape[1]), dtype=np.float64)
        dense[self.dense_indices(heads)] = rows
        return dense.reshape(self.num_layers, self.num_heads, rows.shape[1])

    def check_carried(self, heads: Iterable[LayerHead], name: str) -> None:
        """Refuse heads outside the model or in a layer that carries none.

        Raises:
            ConfigError: The first such head, with the layers that carry heads.
        """
        carried = set(self.carried_layers)
        for layer, head in heads:
            if layer not in carried or not 0 <= head < self.num_heads:
                raise ConfigError(
                    f"{name} must lie in the layers that carry heads {list(self.carried_layers)} "
                    f"(of {self.num_layers}) x {self.num_heads} heads, got {(layer, head)!r}."
                )


def check_head_layers(head_layers: tuple[int, ...], num_layers: int) -> None:
    """Refuse a head-layer list that is empty, unsorted, repeated or outside ``[0, L)``.

    Raises:
        ConfigError: With the list as given.
    """
    if not head_layers:
        raise ConfigError("head_layers must name at least one layer, got none.")
    ascending = all(a < b for a, b in itertools.pairwise(head_layers))
    inside = all(0 <= layer < num_layers for layer in head_layers)
    if not ascending or not inside:
        raise ConfigError(
            f"head_layers must be strictly ascending within [0, {num_layers}), "
            f"got {list(head_layers)!r}."
        )
