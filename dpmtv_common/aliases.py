"""Type aliases shared by every package (named ``aliases`` so as not to shadow ``types``)."""

from __future__ import annotations

from typing import TypeAlias

import numpy as np
import numpy.typing as npt

__all__ = ["Float64Array", "Int64Array", "LayerHead", "NodeId"]

Float64Array: TypeAlias = npt.NDArray[np.float64]
Int64Array: TypeAlias = npt.NDArray[np.int64]
LayerHead: TypeAlias = tuple[int, int]
"""One attention head, as ``(decoder layer index, head index within the layer)``."""
NodeId: TypeAlias = int
"""A Flower node id."""
