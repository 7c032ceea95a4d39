"""Hypothesis strategies shared by the property tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp


@st.composite
def layered_activations(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """An (n_heads, d_head) float array and the layer of each row."""
    num_heads = draw(st.integers(1, 12))
    d_head = draw(st.integers(1, 8))
    layers = np.array(
        sorted(draw(st.lists(st.integers(0, 5), min_size=num_heads, max_size=num_heads)))
    )
    values = draw(
        hnp.arrays(
            np.float64,
            (num_heads, d_head),
            elements=st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False),
        )
    )
    return values, layers


clip_norms = st.floats(1e-3, 1e3, allow_nan=False, allow_infinity=False)
